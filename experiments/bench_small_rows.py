"""What does a float32 product of a few rows cost against one row, on this CPU? A speculative round verifies k + 1
positions in one step, which pays only if k + 1 rows cost little more than one (a decode step streaming weights).

For SmolLM2-135M's three projection shapes, F.linear and the engine's MKL-packed copy (models/packed.py) at 1, 2, 4
and 8 rows, and the rows one at a time (k + 1 one-row products), median of interleaved rounds:

    PYTHONPATH=src .venv/bin/python experiments/bench_small_rows.py
"""

import statistics
import time

import torch
import torch.nn.functional as F

from looplm.models.packed import PackedWeight
from looplm.util import cpu_model


def timed(fn, reps=200) -> float:
    for _ in range(20):
        fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e6


def main() -> None:
    torch.set_num_threads(2)
    print(f"{cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}; microseconds a product")
    print("| weight [out, in] | rows | F.linear | MKL-packed | one row at a time |")
    print("|---|---:|---:|---:|---:|")
    for out_f, in_f in ((1536, 576), (576, 1536), (576, 576)):
        w = torch.randn(out_f, in_f)
        p = PackedWeight(w)
        for rows in (1, 2, 4, 8):
            x = torch.randn(rows, in_f)
            ways = {
                "linear": lambda: F.linear(x, w),
                "packed": lambda: p.linear(x, None),
                "rowwise": lambda: [F.linear(x[i : i + 1], w) for i in range(rows)],
            }
            t = {k: [] for k in ways}
            for _ in range(5):
                for k, f in ways.items():
                    t[k].append(timed(f))
            m = {k: statistics.median(v) for k, v in t.items()}
            print(f"| [{out_f}, {in_f}] | {rows} | {m['linear']:.0f} | {m['packed']:.0f} | {m['rowwise']:.0f} |")


if __name__ == "__main__":
    main()
