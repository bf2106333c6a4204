"""How far quantization moves a model's linear weights: the relative Frobenius error ||W - Q(W)|| / ||W||, averaged
over the linears, of each model's shared weights and (for a relaxed model) of each depth's merged W + B_s A_s, as
`looplm quantize --lora merged` stores them; with the LoRA update's size beside them (||B_s A_s|| / ||W||).

    PYTHONPATH=src .venv/bin/python scripts/quant_error.py smollm2-135m out/heal/runs/b2-r64/final --format int4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from looplm.models import load_model
from looplm.models import quantized as Q


def weight_errors(model, fmt: str, group: int) -> dict:
    shared, merged, update = [], [], []
    for _, lin in Q.linears(model):
        w = lin.weight.detach()
        shared.append(Q.relative_error(w, fmt, group))
        if lin.lora_A is not None:
            for s in range(lin.lora_A.shape[0]):
                merged.append(Q.relative_error(lin.merged_weight(s), fmt, group))
                update.append(((lin.lora_B[s] @ lin.lora_A[s]).norm() / w.norm()).item())
    mean = lambda xs: round(statistics.fmean(xs), 4) if xs else None  # noqa: E731
    return {"linears": len(shared), "shared": mean(shared), "merged_per_depth": mean(merged),
            "lora_update_over_shared": mean(update)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("models", nargs="+", help="model names or saved model directories")
    p.add_argument("--format", default="int4", choices=["int4", "int8"])
    p.add_argument("--group", type=int, default=Q.DEFAULT_GROUP, help="int4 group size")
    args = p.parse_args()
    rows = {}
    with torch.no_grad():
        for name in args.models:
            model, _ = load_model(name)
            rows[name] = weight_errors(model, args.format, args.group)
    print(f"| model | {args.format} error, shared weights | merged per depth | LoRA update / shared |\n|---|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['shared']} | {r['merged_per_depth'] or ''} | {r['lora_update_over_shared'] or ''} |")
    print(json.dumps({"format": args.format, "group": args.group, "models": rows}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
