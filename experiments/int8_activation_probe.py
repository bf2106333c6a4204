"""Could the engine quantize activations to int8 too, so FBGEMM's integer kernels (3.9x faster than the int4 op at
64 tokens a step on an AVX2-only CPU, docs/BENCHMARKS.md) serve a batch? Only per row: a scale shared by the rows
of a step would make requests change each other's outputs. This probe simulates it in float32, teacher-forced on
held-out rows (greedy agreement with the float32 model, held-out perplexity): int8 weights per output channel
(rounded to nearest) and each linear's input rounded per row to 255 levels (8 bits) or 127 (7 bits, FBGEMM's
``reduce_range``, which it needs on AVX2), over [-max|x|, max|x|] of the row; with and without SmoothQuant's
per-channel migration (x / s, W * s with s = max|x_c|^alpha / max|W_c|^(1 - alpha), the input maxima from
calibration rows of the training split).

    PYTHONPATH=src OMP_NUM_THREADS=2 .venv/bin/python scripts/int8_activation_probe.py smollm2-135m \
        --data out/heal/corpus-smollm2-135m-512 --rows 4 --calibration-rows 8
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import torch

from looplm.data.corpus import PackedCorpus
from looplm.models import load_model
from looplm.models import quantized as Q

sys.path.insert(0, str(Path(__file__).parent))
from quant_agreement import score  # noqa: E402


def linears_and_head(model) -> dict:
    found = dict(Q.linears(model))
    found["lm_head"] = model.lm_head
    return found


@torch.no_grad()
def input_maxima(model, rows: torch.Tensor) -> dict:
    """Per linear, the largest |x| each input channel takes over ``rows``."""
    amax: dict = {}

    def hook_for(name):
        def hook(module, args):
            x = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(0)
            amax[name] = torch.maximum(amax[name], x) if name in amax else x
        return hook

    handles = [m.register_forward_pre_hook(hook_for(n)) for n, m in linears_and_head(model).items()]
    for start in range(0, rows.shape[0], 4):
        model(rows[start:start + 4])
    for h in handles:
        h.remove()
    return amax


@torch.no_grad()
def simulated(model, levels: int, alpha: float | None, amax: dict):
    """Every linear and the head: int8 weights (of W * s), inputs divided by s and rounded per row to ``levels``."""
    for name, lin in linears_and_head(model).items():
        w = lin.weight
        s = torch.ones(w.shape[1]) if alpha is None else \
            amax[name].clamp_min(1e-5) ** alpha / w.abs().amax(0).clamp_min(1e-5) ** (1 - alpha)
        w.copy_(Q.dequantize(Q.int8_portable(w * s)) / s)  # a tied head moves the embeddings too, as served

        def round_rows(module, args, s=s):
            x = args[0] / s
            r = x.abs().amax(-1, keepdim=True).clamp_min(1e-12)
            step = 2.0 / levels
            return (torch.round(x / r / step) * step * r * s, *args[1:])
        lin.register_forward_pre_hook(round_rows)
    return model


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--data", required=True)
    p.add_argument("--rows", type=int, default=4, help="held-out rows scored")
    p.add_argument("--calibration-rows", type=int, default=8, help="training rows for SmoothQuant's input maxima")
    p.add_argument("--alphas", default="none,0.5,0.7,0.85")
    args = p.parse_args()
    corpus = PackedCorpus(args.data)
    rows = torch.from_numpy(np.array(corpus.splits["heldout"][:args.rows], dtype=np.int64))
    calibration = torch.from_numpy(np.array(corpus.splits["train"][:args.calibration_rows], dtype=np.int64))

    def fresh():
        return load_model(args.model)[0].eval()

    reference = fresh()
    greedy, nll, n, _ = score(reference, rows, None)
    print(f"| {args.model}, {rows.numel():,} held-out positions | greedy agreement with fp32 | held-out perplexity |")
    print("|---|---:|---:|")
    print(f"| fp32 | 1.0000 | {math.exp(nll / n):.3f} |", flush=True)
    amax = input_maxima(reference, calibration)
    for alpha in args.alphas.split(","):
        a = None if alpha == "none" else float(alpha)
        for levels in (255, 127):
            _, nll, n, agree = score(simulated(fresh(), levels, a, amax), rows, greedy)
            what = "no smoothing" if a is None else f"SmoothQuant alpha {a}"
            print(f"| int8 weights, activations per row {levels} levels, {what} | {agree:.4f} | "
                  f"{math.exp(nll / n):.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
