"""How many tokens could leave at each loop exit, each exit on its own (not a cascade)?

For every intermediate loop i of a looped model: the oracle (loop i's argmax already equals the final
one, teacher-forced on held-out text) and the fraction of tokens that a confidence rule (softmax, margin)
lets leave at loop i alone at >= TARGET agreement with full depth, the other exits closed. Run on a
full-rank B-loop conversion of the original model with a tuned-lens exit adapter per loop (`looplm heal
--local-share 0 --exit-share 1`), it measures the original model itself: how much of its next-token
decision the first i/B of its layers hold, read through the best affine lens. That is the ceiling of a
loop-1 exit whose body copies the original (issue 18's 70% goal at B = 2 reads depth L/2).

    PYTHONPATH=src .venv/bin/python scripts/exit_depth.py out/ceiling/heal/final \
        --data out/heal/corpus-smollm2-135m-512 --out docs/heal/exit-depth-smollm2
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from looplm.data.corpus import PackedCorpus
from looplm.models import load_model
from looplm.serve.probe import exit_curve

_spec = importlib.util.spec_from_file_location("exit_rules", Path(__file__).with_name("exit_rules.py"))
exit_rules = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(exit_rules)

RULES = {"softmax": 0, "margin": 5}  # columns of exit_rules' confidence features


def single_exit(conf: torch.Tensor, args: torch.Tensor, loop: int, column: int, target: float) -> float:
    """Most tokens leaving at ``loop`` alone at >= target agreement, over thresholds of one score."""
    B = args.shape[0]
    scores = torch.full((B - 1, args.shape[1]), float("-inf"))
    scores[loop] = conf[loop][:, column]
    thresholds = torch.quantile(scores[loop].double(), torch.linspace(0, 1, 401, dtype=torch.float64)).tolist()
    curve = exit_curve(scores, args, thresholds + [float("inf")])
    return max((r["early_exit_fraction"] for r in curve if r["agreement"] >= target), default=0.0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", help="a saved looped model directory (B >= 2)")
    p.add_argument("--data", required=True, help="a corpus from `looplm data build` with the model's tokenizer")
    p.add_argument("--eval-rows", type=int, default=16, help="held-out rows")
    p.add_argument("--target", type=float, default=0.95)
    p.add_argument("--out", required=True, help="output prefix: writes OUT.json and OUT.png")
    args = p.parse_args()
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    model, _ = load_model(args.model)
    model.eval()
    B, K = model.config.num_loops, model.config.num_shared_layers
    if B < 2:
        raise SystemExit(f"{args.model} has B = 1: no intermediate exit")
    held = PackedCorpus(args.data).splits["heldout"]
    if len(held) < args.eval_rows:
        raise SystemExit(f"the corpus has {len(held)} held-out rows; lower --eval-rows")
    rows = [held[i].astype(np.int64).tolist() for i in np.linspace(0, len(held) - 1, args.eval_rows).round().astype(int)]
    t0 = time.time()
    ev = exit_rules.collect(model, rows, log)
    exits = []
    for i in range(B - 1):
        exits.append({"loop": i + 1, "depth": (i + 1) * K, "of_depths": B * K,
                      "oracle": round(float((ev["args"][i] == ev["args"][-1]).float().mean()), 4),
                      **{rule: single_exit(ev["conf"], ev["args"], i, col, args.target) for rule, col in RULES.items()}})
        log(f"loop {i + 1} (depth {(i + 1) * K}): oracle {exits[-1]['oracle']:.1%}, "
            + ", ".join(f"{r} {exits[-1][r]:.1%}" for r in RULES))
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": args.model, "data": args.data,
              "eval_tokens": int(ev["args"].shape[1]), "target_agreement": args.target, "exits": exits,
              "seconds": round(time.time() - t0, 1)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    plot(report, out.with_suffix(".png"))
    print(f"| exit after depth | oracle (already right) | " + " | ".join(f"{r} at >= {args.target}" for r in RULES) + " |")
    print("|---:|---:|" + "---:|" * len(RULES))
    for e in exits:
        print(f"| {e['depth']} of {e['of_depths']} | {e['oracle']:.1%} | " + " | ".join(f"{e[r]:.1%}" for r in RULES) + " |")
    return 0


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    depths = [e["depth"] for e in report["exits"]]
    ax.plot(depths, [e["oracle"] for e in report["exits"]], "o-", label="oracle (already right)")
    for rule in RULES:
        ax.plot(depths, [e[rule] for e in report["exits"]], "s--", label=f"{rule} rule at >= {report['target_agreement']}")
    ax.axhline(0.7, color="grey", ls=":", lw=1, label="issue 18's goal (70%)")
    ax.set_xlabel(f"exit after depth (of {report['exits'][0]['of_depths']})")
    ax.set_ylabel("fraction of tokens")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.set_title(f"Each exit alone, teacher-forced held-out text ({report['eval_tokens']} tokens)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
