"""`looplm plot RUN [RUN ...]`: training loss and held-out perplexity per loop exit, as PNG."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import UsageError


def read_metrics(run: Path) -> tuple[list[dict], list[dict]]:
    path = run / "metrics.jsonl"
    if not path.exists():
        raise UsageError(f"{run} has no metrics.jsonl; give a run directory written by `looplm train`")
    train, evals = [], []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        (evals if rec.get("eval") else train).append(rec)
    return train, evals


def plot_runs(runs: list[Path], out: Path | None = None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    return paths


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
