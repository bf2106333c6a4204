"""One end-to-end healing step (`looplm heal`'s own ``_e2e_step``: the original run online on new rows, the
student's forward through every depth, the distillation loss through the head, the per-depth hidden-state term,
backward, AdamW) eager against ``--compile``, in alternating rounds in one process: the layers are compiled once
and the eager rounds run under ``torch.compiler.set_stance("force_eager")``. The learning rate is 0, so every
round sees the same weights, and step i reads the same rows in every round: the losses of the two variants are
compared step by step.

    PYTHONPATH=src OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_heal_compile.py \
        --model out/heal/runs/b2-r128@online-log1p/local-end --teacher smollm2-135m \
        --data out/heal/corpus-smollm2-135m-512 --rounds 3 --steps 4 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time

import torch

from looplm.train.heal import HealConfig, Healer
from looplm.train.optim import adamw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a converted (or partly healed) looplm directory")
    ap.add_argument("--teacher", required=True, help="the original model")
    ap.add_argument("--data", required=True, help="corpus directory (looplm data build)")
    ap.add_argument("--hidden-loss", default="log1p")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per variant and round")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as out:
        cfg = HealConfig(model=args.model, teacher=args.teacher, data=args.data, out=out, budget_minutes=60,
                         e2e_rows="online", hidden_loss=args.hidden_loss, cache_rows=4, compile=True, progress=False)
        healer = Healer(cfg, log=lambda *a: None)
        healer.prepare()
    model = healer.student
    t0 = time.perf_counter()
    healer._compile_layers()
    model.train()
    opt = adamw(healer._trainable(model), lr=0.0)
    healer._e2e_step(model, 0, opt, 0.0)  # compiles the forward and backward graphs
    compile_s = time.perf_counter() - t0
    with torch.compiler.set_stance("force_eager"):
        healer._e2e_step(model, 0, opt, 0.0)  # eager warm-up
    times = {"eager": [], "compiled": []}
    losses = {"eager": {}, "compiled": {}}
    for r in range(args.rounds):
        for variant in times:
            stance = "force_eager" if variant == "eager" else "default"
            with torch.compiler.set_stance(stance):
                for s in range(args.steps):
                    t = time.perf_counter()
                    rec = healer._e2e_step(model, s, opt, 0.0)
                    times[variant].append(time.perf_counter() - t)
                    losses[variant][s] = rec
                    print(f"round {r} {variant:8s} step {s}: {times[variant][-1]:.2f} s, kd {rec['kd']:.4f}, "
                          f"hidden {rec['hidden']:.4f}", flush=True)
    med = {v: statistics.median(t) for v, t in times.items()}
    kd_rel = max(abs(losses["compiled"][s]["kd"] - losses["eager"][s]["kd"]) / losses["eager"][s]["kd"]
                 for s in range(args.steps))
    result = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
              "bf16": healer.bf16, "args": vars(args), "compile_and_first_step_s": compile_s,
              "median_s": med, "times_s": times, "speedup": med["eager"] / med["compiled"],
              "max_kd_relative_difference": kd_rel}
    print(f"eager {med['eager']:.2f} s, compiled {med['compiled']:.2f} s per step (medians of "
          f"{args.rounds * args.steps}): {result['speedup']:.2f}x; compiling and the first step took {compile_s:.0f} s; "
          f"distillation loss differs by at most {kd_rel:.1e} (relative)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
