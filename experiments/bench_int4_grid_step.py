"""What the grid-step candidate of ``grids.int4_portable`` costs when a model is quantized to int4. That candidate
(``_grid_step``: a sort per group, so that weights already on a 4-bit grid whose codes miss 0 or 15 round to
themselves) is tried only when the weight looks rounded (``_looks_gridded``: a sample of groups with <= 16
distinct values) and only on the groups the clip ranges did not reproduce. Timed, over every linear of the model:
``int4_portable`` on the embedded weights (a Q4_1 grid, which the ranges reproduce), on the same weights moved
off the grid (float, as a converted or healed model's), and ``_grid_step`` alone over all groups (its cost
were it paid unconditionally, as before 2026-11-26 evening).

    PYTHONPATH=src OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_int4_grid_step.py --model smollm2-135m
"""

from __future__ import annotations

import argparse
import time

import torch

from looplm.models import grids, load_model
from looplm.models import quantized as Q


def _seconds(fn, weights) -> float:
    t0 = time.perf_counter()
    for w in weights:
        fn(w)
    return time.perf_counter() - t0


def _grid_step_alone(w: torch.Tensor) -> None:
    n, k = w.shape
    wg = w.reshape(n, k // grids.DEFAULT_GROUP, grids.DEFAULT_GROUP)
    grids._grid_step(wg, wg.amin(-1), wg.amax(-1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    model, _ = load_model(args.model)
    gridded = [lin.weight.detach().float() for _, lin in Q.linears(model)]
    torch.manual_seed(0)
    floats = [w + 1e-3 * w.std() * torch.randn_like(w) for w in gridded]
    for r in range(args.rounds):
        on_grid = _seconds(grids.int4_portable, gridded)
        off_grid = _seconds(grids.int4_portable, floats)
        sort_all = _seconds(_grid_step_alone, gridded)
        print(f"round {r}: int4_portable over {len(gridded)} linears: embedded (Q4_1 grid) {on_grid:.2f} s, "
              f"off the grid (float) {off_grid:.2f} s; the grid step alone over every group {sort_all:.2f} s",
              flush=True)


if __name__ == "__main__":
    main()
