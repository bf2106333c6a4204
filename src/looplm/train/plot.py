"""The runs' curves as PNG: `looplm plot RUN [RUN ...]` draws the training loss and held-out perplexity per loop
exit of `looplm train` runs; a `looplm heal` run draws heal.png (``plot_heal``), as the run itself does at its end."""

from __future__ import annotations

from pathlib import Path

from ..data.ood import geometric_mean
from ..errors import UsageError
from .run_dir import RunDir


def read_metrics(run: Path) -> tuple[list[dict], list[dict]]:
    """A run's step records and evaluation records."""
    run_dir = RunDir(run)
    if not run_dir.metrics.exists():
        raise UsageError(f"{run} has no metrics.jsonl; give a run directory written by `looplm train` or `looplm heal`")
    records = run_dir.records()
    return [r for r in records if not r.get("eval")], [r for r in records if r.get("eval")]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_runs(runs: list[Path], out: Path | None = None) -> list[Path]:
    healed = [run for run in runs if "teacher_eval" in (RunDir(run).settings() or {})]
    drawn = [path for run in healed if (path := plot_heal(run)) is not None]
    runs = [run for run in runs if run not in healed]
    if not runs:
        if not drawn:
            raise UsageError("the healing runs have no evaluations yet; plot after their first")
        return drawn
    plt = _pyplot()
    out = out or runs[0]
    out.mkdir(parents=True, exist_ok=True)
    data = {run: read_metrics(run) for run in runs}
    if not any(t for t, _ in data.values()):
        raise UsageError("the runs have no logged steps yet; plot after training a few steps")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run, (train, _) in data.items():
        if not train:
            continue
        x = [r["tokens"] for r in train]
        ax.plot(x, [r["loss"] for r in train], label=f"{run.name} loss", lw=1)
        for key in sorted(k for k in train[-1] if k.startswith("ce") or k.startswith("sd_") or k == "kd"):
            ax.plot(x, [r.get(key) for r in train], label=f"{run.name} {key}", lw=0.8, alpha=0.7)
    paths = [_save(fig, ax, "loss", "training loss", out / "loss.png")]

    if any(e for _, e in data.values()):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for run, (_, evals) in data.items():
            if not evals:
                continue
            for key in sorted(k for k in evals[-1] if k.startswith("ppl_")):
                ax.plot(
                    [r["tokens"] for r in evals],
                    [r[key] for r in evals],
                    marker="o",
                    ms=3,
                    label=f"{run.name} exit after loop {key[4:]}",
                )
        ax.set_yscale("log")
        paths.append(_save(fig, ax, "held-out perplexity", "held-out perplexity per loop exit", out / "perplexity.png"))
    return drawn + paths


def plot_heal(run: Path) -> Path | None:
    """RUN/heal.png: held-out perplexity of every loop exit (and of the end-to-end weight average, and out of
    domain) against wall time and against training tokens, beside the original's; None before any evaluation."""
    run_dir = RunDir(run)
    settings = run_dir.settings()
    records = [r for r in run_dir.records() if r.get("eval")]
    evals = [r for r in records if not r["tag"].endswith("-average")]
    averaged = [r for r in records if r["tag"].endswith("-average")]  # --e2e-average's weights
    if not evals:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    original = settings["teacher_eval"]
    teacher = original["ppl"]
    loops = len(evals[0]["ppl_per_loop"])
    for ax, key, label in ((axes[0], "time", "wall time (min)"), (axes[1], "tokens", "training tokens")):
        for i in range(loops):
            xs = [r[key] / (60 if key == "time" else 1) for r in evals]
            ax.plot(
                xs,
                [r["ppl_per_loop"][i] for r in evals],
                marker="o",
                label=f"exit after loop {i + 1}" if i + 1 < loops else "final",
            )
        if averaged:
            ax.plot(
                [r[key] / (60 if key == "time" else 1) for r in averaged],
                [r["ppl"] for r in averaged],
                marker="x",
                ls=":",
                label="final, weight average",
            )
        ax.axhline(teacher, color="k", ls="--", label=f"original ({teacher:.1f})")
        off = [r for r in evals if "ood" in r]
        if off and "ood" in original:  # text the run never heals on: a gap that grows is overfitting
            ax.plot(
                [r[key] / (60 if key == "time" else 1) for r in off],
                [geometric_mean(r["ood"].values()) for r in off],
                marker="s",
                color="tab:red",
                label="final, out of domain (geometric mean)",
            )
            original_ood = geometric_mean(original["ood"].values())
            ax.axhline(original_ood, color="tab:red", ls=":", label=f"original out of domain ({original_ood:.1f})")
        ax.set_yscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("perplexity")
        ax.grid(alpha=0.3)
    axes[1].set_xlabel("end-to-end training tokens (local stage before 0)")
    axes[0].legend()
    config = settings["config"]
    fig.suptitle(f"healing {Path(config['model']).name} ({config['local_mode']} local, then end to end)")
    fig.tight_layout()
    path = run / "heal.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _save(fig, ax, ylabel: str, title: str, path: Path) -> Path:
    import matplotlib.pyplot as plt

    ax.set_xlabel("training tokens")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
