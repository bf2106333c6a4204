"""A healing step eager against ``--compile``, in alternating rounds in one process: the layers are compiled once
and the eager rounds run under ``torch.compiler.set_stance("force_eager")``. The learning rate is 0, so every
round sees the same weights, and step i reads the same rows in every round: the losses of the two variants are
compared step by step. Two stages (``--stage``):

- ``e2e``: `looplm heal`'s own ``_e2e_step``: the original run online on new rows, the student's forward through
  every depth, the distillation loss through the head, the per-depth hidden-state term, backward, AdamW.
- ``local``: ``_local_step`` of one shared layer (``--layer``) on 4 cached rows at both depths tied to it: the
  teacher's cached inputs through the layer, the relative error to its cached outputs, backward, AdamW on the
  layer. Needs the run's teacher cache (``--cache``).

    PYTHONPATH=src OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_heal_compile.py \
        --model out/heal/runs/b2-r128@online-log1p/local-end --teacher smollm2-135m \
        --data out/heal/corpus-smollm2-135m-512 --rounds 3 --steps 4 --json OUT.json
    # the local step, from the converted model and the run's cache:
    PYTHONPATH=src OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_heal_compile.py --stage local \
        --model out/heal/models/b2-r128 --cache out/heal/runs/b2-r128@online-log1p/cache --teacher smollm2-135m \
        --data out/heal/corpus-smollm2-135m-512 --rounds 3 --steps 10 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time

import numpy as np
import torch

from looplm.train.heal import HealConfig, Healer
from looplm.train.optim import adamw
from looplm.train.teacher_cache import TeacherCache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a converted (or partly healed) looplm directory")
    ap.add_argument("--teacher", required=True, help="the original model")
    ap.add_argument("--data", required=True, help="corpus directory (looplm data build)")
    ap.add_argument("--stage", choices=("e2e", "local"), default="e2e")
    ap.add_argument("--cache", help="the run's teacher cache directory (--stage local)")
    ap.add_argument("--layer", type=int, default=3, help="the shared layer of --stage local")
    ap.add_argument("--hidden-loss", default="log1p")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per variant and round")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if args.stage == "local" and not args.cache:
        ap.error("--stage local reads the teacher cache: give the run's cache with --cache DIR")
    with tempfile.TemporaryDirectory() as out:
        cfg = HealConfig(model=args.model, teacher=args.teacher, data=args.data, out=out, budget_minutes=60,
                         e2e_rows="online", hidden_loss=args.hidden_loss, cache_rows=4, compile=True, progress=False)
        healer = Healer(cfg, log=lambda *a: None)
        healer.prepare()
    model = healer.student
    t0 = time.perf_counter()
    if args.stage == "local":
        healer.cache = TeacherCache(args.cache, verify=False)
        model.requires_grad_(False)
        opt = adamw(healer._unfreeze(model.model.layers[args.layer]), lr=0.0)
        healer._compile_layers(model)

        def step(s: int) -> dict:  # step s reads rows 4s..4s+3 of the cache in every round
            idx = (np.arange(4) + 4 * s) % healer.cache.num_rows
            return {"loss": healer._local_step(model, args.layer, idx, opt, {}, 0.0)}
    else:
        healer._compile_layers(model, healer.teacher)
        model.train()
        opt = adamw(healer._trainable(model), lr=0.0)

        def step(s: int) -> dict:
            return healer._e2e_step(model, s, opt, 0.0)
    key = "loss" if args.stage == "local" else "kd"
    step(0)  # compiles the forward and backward graphs
    compile_s = time.perf_counter() - t0
    with torch.compiler.set_stance("force_eager"):
        step(0)  # eager warm-up
    times = {"eager": [], "compiled": []}
    losses = {"eager": {}, "compiled": {}}
    for r in range(args.rounds):
        for variant in times:
            stance = "force_eager" if variant == "eager" else "default"
            with torch.compiler.set_stance(stance):
                for s in range(args.steps):
                    t = time.perf_counter()
                    rec = step(s)
                    times[variant].append(time.perf_counter() - t)
                    losses[variant][s] = rec
                    print(f"round {r} {variant:8s} step {s}: {times[variant][-1]:.3f} s, "
                          + ", ".join(f"{k} {v:.4f}" for k, v in rec.items()), flush=True)
    med = {v: statistics.median(t) for v, t in times.items()}
    rel = max(abs(losses["compiled"][s][key] - losses["eager"][s][key]) / losses["eager"][s][key]
              for s in range(args.steps))
    result = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
              "bf16": healer.bf16, "args": vars(args), "compile_and_first_step_s": compile_s,
              "median_s": med, "times_s": times, "speedup": med["eager"] / med["compiled"],
              f"max_{key}_relative_difference": rel}
    print(f"{args.stage} step: eager {med['eager']:.3f} s, compiled {med['compiled']:.3f} s (medians of "
          f"{args.rounds * args.steps}): {result['speedup']:.2f}x; compiling and the first step took {compile_s:.0f} s; "
          f"the {'loss' if key == 'loss' else 'distillation loss'} differs by at most {rel:.1e} (relative)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
