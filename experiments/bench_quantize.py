"""Seconds to quantize a model at load (`quantize_model`, what `looplm serve --weights int4` pays before its
warm-up), with the fitted int4 ranges (every range in ``INT4_CLIPS``, the default) against a single
[min, max] range per group (round to nearest, what int4 did before; either variant also tries the grid-step
candidate for weights that look already rounded, see bench_int4_grid_step.py). Variants run in turns in one process, a
fresh copy of the model each time, and each keeps its median; the relative weight error of the shared
weights is printed beside the time, so the trade is in one table.

    PYTHONPATH=src OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_quantize.py \
        --models smollm2-135m,out/heal/runs/b2-r64/final --rounds 3 --json OUT.json

A looped model is quantized twice: its LoRA kept on top of each shared weight (``shared``) and merged into
one weight per depth (``merged``).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from contextlib import contextmanager

import torch

from looplm.models import grids, load_model
from looplm.models import quantized as qz


@contextmanager
def int4_ranges(clips: tuple[float, ...]):
    """int4_portable reads grids.INT4_CLIPS at each call: set it for the block (the grid-step candidate, where a weight looks rounded, stays)."""
    saved, grids.INT4_CLIPS = grids.INT4_CLIPS, clips
    try:
        yield
    finally:
        grids.INT4_CLIPS = saved


def quantize_seconds(model, fmt: str, lora: str, clips: tuple[float, ...]) -> float:
    fresh = copy.deepcopy(model)
    with int4_ranges(clips):
        t0 = time.perf_counter()
        qz.quantize_model(fresh, fmt, lora=lora)
        return time.perf_counter() - t0


def weight_error(model, clips: tuple[float, ...]) -> float:
    """The shared int4 weights' relative error, averaged over the linears (as scripts/quant_error.py reports it)."""
    with int4_ranges(clips):
        return statistics.fmean(qz.relative_error(lin.weight, "int4") for _, lin in qz.linears(model))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m", help="comma-separated models (names or directories)")
    ap.add_argument("--format", default="int4", choices=["int4", "int8"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    variants = {"fitted": tuple(grids.INT4_CLIPS), "single": (1.0,)} if args.format == "int4" else {"int8": ()}
    rows = []
    for name in args.models.split(","):
        model, _ = load_model(name)
        model.eval()
        loras = ("shared", "merged") if model.config.num_loops > 1 else ("shared",)
        for lora in loras:
            times = {v: [] for v in variants}
            for _ in range(args.rounds):
                for v, clips in variants.items():
                    times[v].append(quantize_seconds(model, args.format, lora, clips))
            for v, clips in variants.items():
                row = {"model": name, "lora": lora, "variant": v, "clips": list(clips),
                       "median_s": statistics.median(times[v]), "times_s": times[v]}
                if args.format == "int4" and lora == "shared":
                    row["relative_weight_error"] = weight_error(model, clips)
                rows.append(row)
                err = f", weight error {row['relative_weight_error']:.4%}" if "relative_weight_error" in row else ""
                print(f"{name} lora={lora} {v}: {row['median_s']:.2f} s (median of {args.rounds}){err}", flush=True)
    result = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
              "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "format": args.format, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
