"""Healing runs against the paper's recipe: one markdown table and one PNG of held-out perplexity
against wall time and against training tokens, from the run directories of `looplm heal` and
`looplm train` (scripts/heal_runs.sh writes them).

    .venv/bin/python scripts/heal_report.py out/heal/runs/* --out docs/heal/smollm2

Every run is scored on the same held-out rows (the first 16 of the corpus's held-out split, 8,176
predicted tokens). Wall time is the runs' own clock: cache, local and end-to-end work for `heal`
(evaluations excluded), training steps for `train` (with its online teacher).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read_jsonl(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def heal_curves(run: Path) -> list[dict]:
    """The run's curve, and with `--e2e-average` a second one: its weight average's evaluations (tag
    "e2e-average"), beside the weights' own at the same steps."""
    recs = read_jsonl(run / "metrics.jsonl")
    info = json.loads((run / "run.json").read_text())
    curves = []
    for average in (False, True):
        evals = [r for r in recs if r.get("eval") and r["tag"].endswith("-average") == average]
        if evals:
            curves.append({"kind": "heal", "name": f"{run.name} (weight average)" if average else run.name,
                           "teacher": info["teacher_eval"]["ppl"],
                           "minutes": [r["time"] / 60 for r in evals], "tokens": [r["tokens"] for r in evals],
                           "ppl": [r["ppl"] for r in evals], "loop1": [r["ppl_per_loop"][0] for r in evals],
                           "plan": info["plan"], "done": (run / "heal.json").exists(),
                           # the average is first evaluated mid-stage: it has no score of the converted model
                           "converted": None if average else evals[0]["ppl"]})
    return curves


def train_curve(run: Path) -> dict:
    recs = read_jsonl(run / "metrics.jsonl")
    time_at = {r["step"]: r["time"] for r in recs if not r.get("eval") and "time" in r}
    evals = [r for r in recs if r.get("eval")]
    loops = max(int(k.split("_")[1]) for k in evals[0] if k.startswith("ppl_"))
    return {"kind": "train", "name": run.name, "teacher": None,
            "minutes": [time_at.get(r["step"], 0.0) / 60 for r in evals], "tokens": [r["tokens"] for r in evals],
            "ppl": [r[f"ppl_{loops}"] for r in evals], "loop1": [r["ppl_1"] for r in evals],
            "done": (run / "final").exists(), "converted": evals[0][f"ppl_{loops}"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--out", required=True, help="path prefix: writes PREFIX.md, PREFIX.png, PREFIX.json")
    ap.add_argument("--ymax", type=float, default=None,
                    help="a linear perplexity axis from the original's up to YMAX (to tell close curves apart)")
    args = ap.parse_args()
    curves = []
    for r in map(Path, args.runs):
        if (r / "run.json").exists() and "teacher_eval" in json.loads((r / "run.json").read_text()):
            curves.extend(heal_curves(r))
        elif (r / "metrics.jsonl").exists():
            curves.append(train_curve(r))
    teacher = next(c["teacher"] for c in curves if c["teacher"])
    rows = ["| run | recipe | converted | after | minutes | end-to-end tokens | ratio to original | loop-1 exit |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    for c in curves:
        recipe = "heal" if c["kind"] == "heal" else "paper (SVD + end-to-end KD)"
        status = "" if c["done"] else " (unfinished)"
        converted = "" if c["converted"] is None else f"{c['converted']:,.0f}"
        rows.append(f"| {c['name']}{status} | {recipe} | {converted} | {c['ppl'][-1]:,.2f} | "
                    f"{c['minutes'][-1]:.1f} | {c['tokens'][-1]:,} | {c['ppl'][-1] / teacher:.2f}x | "
                    f"{c['loop1'][-1]:,.1f} |")
    table = f"Original model: {teacher:.2f}\n\n" + "\n".join(rows) + "\n"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(table)
    out.with_suffix(".json").write_text(json.dumps({"teacher": teacher, "runs": curves}, indent=1))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, label in ((axes[0], "minutes", "wall time (min)"), (axes[1], "tokens", "end-to-end training tokens")):
        for c in curves:
            style = "-o" if c["kind"] == "heal" else "--s"
            ax.plot(c[key], c["ppl"], style, ms=3, label=f"{c['name']} ({'heal' if c['kind'] == 'heal' else 'paper recipe'})")
        ax.axhline(teacher, color="k", ls=":", label=f"original ({teacher:.1f})")
        ax.axhline(1.5 * teacher, color="gray", ls=":", lw=0.8, label="1.5x original")
        if args.ymax:
            ax.set_ylim(0.95 * teacher, args.ymax)
        else:
            ax.set_yscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("held-out perplexity (final exit)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    print(table)


if __name__ == "__main__":
    main()
