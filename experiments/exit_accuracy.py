"""Task accuracy under an exit policy: the paper's seven few-shot tasks (lm-evaluation-harness, our
task files) scored at every static exit and with each token taken at the loop an exit policy lets it
leave after (teacher-forced, as `looplm bench serve`'s held-out perplexity table does). Prints a
markdown table; `--json` also writes the numbers.

    PYTHONPATH=src .venv/bin/python scripts/exit_accuracy.py out/paper-b2/runs/rec-stepwise-exit/final \
        --policy margin:0.05 --limit 200 --json docs/exits/accuracy-b2-margin0.05.json

Only policies that decide from the exit logits (softmax, margin, entropy) apply: scoring runs every
loop in one pass and hands each loop's logits to the policy's own `decide`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from looplm.eval.fewshot import run_fewshot
from looplm.eval.tasks import PAPER7
from looplm.models import load_model
from looplm.serve.exits import parse_policy

LOGIT_POLICIES = ("softmax", "margin", "entropy")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", help="a saved looped model")
    p.add_argument("--policy", default="margin:0.05", help=f"kind:threshold, kind one of {', '.join(LOGIT_POLICIES)}")
    p.add_argument("--tasks", default="paper7", help="comma list of task names, or paper7")
    p.add_argument("--limit", type=int, default=50, help="items per task")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None, help="also write the result to this file")
    args = p.parse_args()
    policy = parse_policy(args.policy)
    if policy.kind not in LOGIT_POLICIES:
        print(f"error: --policy {args.policy!r}: only {', '.join(LOGIT_POLICIES)} decide from the logits alone",
              file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    tasks = list(PAPER7) if args.tasks == "paper7" else args.tasks.split(",")

    def rule(logits, loop):
        return policy.decide(logits, None, None)  # logit policies read neither h nor h_prev

    res = run_fewshot(model, tok, tasks, limit=args.limit, all_loops=True, batch_size=args.batch_size,
                      exit_rule=rule, exit_rule_name=args.policy, progress=False)
    dyn = res["exit_rule"]
    B = model.config.num_loops
    print(f"| exit | " + " | ".join(tasks) + " | average |")
    print("|---|" + "---:|" * (len(tasks) + 1))
    for loop, row in res["per_loop"].items():
        print(f"| static, loop {loop} | " + " | ".join(f"{row['tasks'][t]:.3f}" for t in tasks) + f" | {row['average']:.3f} |")
    print(f"| {args.policy} | " + " | ".join(f"{dyn['tasks'][t]:.3f}" for t in tasks) + f" | {dyn['average']:.3f} |")
    print(f"\n{args.policy}: exits per loop {dyn['exits_per_loop']} of {dyn['scored_tokens']} scored tokens "
          f"(mean loop {dyn['mean_exit_loop']:.2f} of {B}), agreement with loop {B} {dyn['agreement']:.3f}; "
          f"limit {args.limit} items per task, {res['seconds']:.0f} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({k: v for k, v in res.items() if k != "samples"}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
