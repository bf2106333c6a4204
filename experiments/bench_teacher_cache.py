"""The teacher cache's forward pass (`looplm heal` runs the original model over the cached rows once, before
any training step) in float32 against bf16 autocast, in alternating rounds in one process, and what bf16 does
to the states it stores: the median over tokens of ||bf16 - fp32|| / ||fp32|| at a few layer boundaries, next
to what storing the float32 states in bfloat16 (as the cache does either way) already costs.

    PYTHONPATH=src OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_teacher_cache.py --model smollm2-135m \
        --data out/heal/corpus-smollm2-135m-512 --rows 8 --rounds 3 --json OUT.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import time

import numpy as np
import torch

from looplm.data.corpus import PackedCorpus
from looplm.models import load_model
from looplm.train.teacher_cache import teacher_states


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the original model (a name or a looplm directory)")
    ap.add_argument("--data", required=True, help="corpus directory (looplm data build)")
    ap.add_argument("--rows", type=int, default=8, help="training rows per batch, as the cache's batches of 4")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    model, _ = load_model(args.model)
    model.eval().requires_grad_(False)
    train = PackedCorpus(args.data).splits["train"]
    ids = torch.from_numpy(np.asarray(train[:args.rows][:, :args.seq_len], dtype=np.int64))
    contexts = {"float32": contextlib.nullcontext, "bf16": lambda: torch.autocast("cpu", dtype=torch.bfloat16)}
    times: dict[str, list[float]] = {k: [] for k in contexts}
    states = {}
    with torch.no_grad():
        for name, ctx in contexts.items():  # warm-up
            with ctx():
                teacher_states(model, ids[:4])
        for r in range(args.rounds):
            for name, ctx in contexts.items():
                t0 = time.perf_counter()
                for s in range(0, args.rows, 4):  # the cache's batches
                    with ctx():
                        out = teacher_states(model, ids[s:s + 4])
                    if r == 0:
                        states.setdefault(name, []).append([h.float() for h in out])
                times[name].append(time.perf_counter() - t0)
                print(f"round {r} {name:8s}: {times[name][-1]:.2f} s for {args.rows} rows", flush=True)
    L = model.config.num_hidden_layers
    errors = {}
    for b in sorted({1, L // 4, L // 2, 3 * L // 4, L}):
        exact = torch.cat([s[b] for s in states["float32"]])
        rounded = torch.cat([s[b] for s in states["bf16"]])
        norm = exact.norm(dim=-1)
        errors[b] = {"bf16_compute": (rounded - exact).norm(dim=-1).div(norm).median().item(),
                     "bf16_storage": (exact.to(torch.bfloat16).float() - exact).norm(dim=-1).div(norm).median().item()}
        print(f"boundary {b:2d}: states moved by {errors[b]['bf16_compute']:.4f} of their norm in bf16 "
              f"(stored in bfloat16 alone: {errors[b]['bf16_storage']:.4f})")
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
              "args": vars(args), "median_s": med, "times_s": times, "speedup": med["float32"] / med["bf16"],
              "relative_state_error": errors}
    print(f"teacher states for {args.rows} x {args.seq_len} tokens: float32 {med['float32']:.2f} s, bf16 "
          f"{med['bf16']:.2f} s (medians of {args.rounds}): {result['speedup']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
