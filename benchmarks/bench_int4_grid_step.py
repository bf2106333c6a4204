"""What the grid-step candidate of ``grids.int4_portable`` (``_grid_step``: a sort per group of 32, so that weights
already on a 4-bit grid whose codes miss 0 or 15 round to themselves) costs when a model is quantized to int4:
the seconds of ``int4_portable`` over every linear of the model, and of ``_grid_step`` alone on the same groups.

    PYTHONPATH=src OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_int4_grid_step.py --model smollm2-135m
"""

from __future__ import annotations

import argparse
import time

from looplm.models import grids, load_model
from looplm.models import quantized as Q


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    model, _ = load_model(args.model)
    weights = [lin.weight.detach().float() for _, lin in Q.linears(model)]
    for r in range(args.rounds):
        t0 = time.perf_counter()
        for w in weights:
            grids.int4_portable(w)
        t1 = time.perf_counter()
        for w in weights:
            n, k = w.shape
            wg = w.reshape(n, k // grids.DEFAULT_GROUP, grids.DEFAULT_GROUP)
            grids._grid_step(wg, wg.amin(-1), wg.amax(-1))
        t2 = time.perf_counter()
        print(f"round {r}: int4_portable over {len(weights)} linears {t1 - t0:.2f} s, of which the grid step "
              f"{t2 - t1:.2f} s", flush=True)


if __name__ == "__main__":
    main()
