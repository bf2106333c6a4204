"""Conversion time of SmolLM2-135M to B=2, rank 64, SVD init: randomised SVD (looplm's default
below rank min/4) against exact full SVD of every residual, side by side in one run, with the
approximation error each reaches.

    python benchmarks/bench_convert.py [--model smollm2-135m] [--rank 64] [--repeats 2]
"""

import argparse
import json
import platform
import statistics
import time

import torch

import looplm.convert.recursive as R
from looplm.models import load_model


def exact_svd(residual, rank):
    U, S, Vh = torch.linalg.svd(residual.double(), full_matrices=False)
    return (U[:, :rank] * S[:rank]).to(residual.dtype), Vh[:rank].to(residual.dtype)


def lora_error(model, vanilla):
    """Sum over linears and depths of ||W_d - (W' + B_d A_d)||_F^2, relative to sum ||W_d - W'||_F^2."""
    num = den = 0.0
    for k, depths in enumerate(R.tied_depths(model.config)):
        for name, lin in R._linears(model.model.layers[k]).items():
            for slot, d in enumerate(depths):
                w_d = R._linears(vanilla.model.layers[d])[name].weight
                num += (w_d - lin.merged_weight(slot)).double().pow(2).sum().item()
                den += (w_d - lin.weight).double().pow(2).sum().item()
    return num / den


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    vanilla, _ = load_model(args.model)
    results = {}
    default = R.svd_factors
    for rep in range(args.repeats):
        for name, fn in (("randomised", default), ("exact", exact_svd)):
            R.svd_factors = fn
            t = time.perf_counter()
            model = R.convert(vanilla, loops=2, init="average", lora_ranks=args.rank, lora_init="svd")
            results.setdefault(name, {"seconds": []})["seconds"].append(time.perf_counter() - t)
            if rep == 0:
                results[name]["relative_residual_error"] = lora_error(model, vanilla)
    R.svd_factors = default
    for r in results.values():
        r["median_seconds"] = statistics.median(r["seconds"])
        r["best_seconds"] = min(r["seconds"])  # the least disturbed run on a shared machine
    out = {"model": args.model, "rank": args.rank, "threads": torch.get_num_threads(),
           "machine": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d"), "results": results}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
