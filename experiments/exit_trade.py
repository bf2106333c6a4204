"""What training the body for the loop-1 exit trades: held-out perplexity of the final exit against the
loop-1 exit's top-1 agreement with it, at every evaluation of one or more `looplm heal` runs (metrics.jsonl).
One PNG of three panels (final perplexity and loop-1 agreement against end-to-end tokens, then one against
the other) and a markdown table of each run's evaluations.

    PYTHONPATH=src .venv/bin/python scripts/exit_trade.py out/exitw/r128-w1 "out/heal/runs/b2-r128@exitw1" \
        --out docs/heal/exit-trade-b2-r128-amx-2026-11-28

Agreement is the share of the evaluation's 8,176 held-out tokens whose loop-1 argmax is the final one (the
oracle of scripts/exit_rules.py); the evaluations before the end-to-end stage are left out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from looplm.train.plot import read_metrics


def evaluations(run: Path) -> list[dict]:
    """The run's evaluations from its end-to-end stage on, and the starting model's (tag "converted") when the
    run has no local stage, as {tag, tokens, minutes, final, loop1, agree}."""
    if not (run / "metrics.jsonl").exists() or not (run / "run.json").exists():
        raise SystemExit(f"{run}: no metrics.jsonl and run.json there; give the directory of a `looplm heal` run")
    local = json.loads((run / "run.json").read_text())["plan"]["local_steps_per_layer"]
    tags = ("e2e", "exit", "final") if local else ("converted", "e2e", "exit", "final")
    out = []
    for r in read_metrics(run)[1]:  # its evaluations, a line cut by kill -9 skipped
        if r["tag"] in tags:
            if len(r["ppl_per_loop"]) < 2:
                raise SystemExit(f"{run} heals a model with one loop: it has no loop-1 exit to trade")
            out.append({"tag": r["tag"], "tokens": r["tokens"], "minutes": r["time"] / 60, "final": r["ppl"],
                        "loop1": r["ppl_per_loop"][0], "agree": r["agree_per_loop"][0]})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="run directories of `looplm heal`")
    p.add_argument("--labels", default=None, help="comma-separated names for the runs (default: directory names)")
    p.add_argument("--out", required=True, help="output prefix: writes OUT.png and OUT.md")
    args = p.parse_args()
    runs = [Path(r) for r in args.runs]
    labels = args.labels.split(",") if args.labels else [r.name for r in runs]
    if len(labels) != len(runs):
        raise SystemExit(f"--labels names {len(labels)} runs, {len(runs)} were given")
    curves = {name: evaluations(run) for name, run in zip(labels, runs)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for name, ev in curves.items():
        lines += [f"**{name}**", "", "| evaluation | minutes | end-to-end tokens | final perplexity | loop-1 perplexity "
                  "| loop-1 top-1 agreement |", "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {e['tag']} | {e['minutes']:.1f} | {e['tokens']:,} | {e['final']:.2f} | {e['loop1']:.1f} | "
                  f"{e['agree']:.1%} |" for e in ev] + [""]
    out.with_suffix(".md").write_text("\n".join(lines))
    plot(curves, out.with_suffix(".png"))
    print("\n".join(lines))
    return 0


def plot(curves: dict[str, list[dict]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for name, ev in curves.items():
        k = [e["tokens"] / 1e3 for e in ev]
        axes[0].plot(k, [e["final"] for e in ev], marker="o", ms=3, label=name)
        axes[1].plot(k, [100 * e["agree"] for e in ev], marker="o", ms=3, label=name)
        axes[2].plot([100 * e["agree"] for e in ev], [e["final"] for e in ev], marker="o", ms=3, label=name)
        axes[2].annotate("end", (100 * ev[-1]["agree"], ev[-1]["final"]), fontsize=7)
    axes[0].set(xlabel="end-to-end tokens (k)", ylabel="final exit, held-out perplexity")
    axes[1].set(xlabel="end-to-end tokens (k)", ylabel="loop-1 argmax = final argmax (% of tokens)")
    axes[2].set(xlabel="loop-1 argmax = final argmax (% of tokens)", ylabel="final exit, held-out perplexity")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("Training the body for the loop-1 exit: what the final exit pays", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
