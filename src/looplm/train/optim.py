"""The optimizer every training stage uses: AdamW, fused where PyTorch has a fused kernel for the
parameters' device.

PyTorch's default AdamW on CPU runs each tensor through about ten elementwise operations, each its own
OpenMP region; the fused kernel makes one pass per tensor. On the idle 2-core machine the fused update is
2.3-2.5x faster, a small share of a healing step (one rank-128 shared layer: 0.014 s against 0.006 s of a
0.96 s local step; all 92M trained parameters: 0.19 s against 0.08 s of a 10.4 s end-to-end step;
`benchmarks/bench_optimizer.py`). Where another process keeps the cores busy, the default's many short
parallel regions wait on each other: 0.5-1.15 s against 0.01-0.18 s fused for one layer in the same
measurement beside a second training job. CUDA has the fused kernel too.
"""

from __future__ import annotations

import torch

FUSED_DEVICES = ("cpu", "cuda")


def adamw(params, **kwargs) -> torch.optim.AdamW:
    """``torch.optim.AdamW(params, **kwargs)``, fused when every parameter is a floating-point tensor on a
    device with the fused kernel (the update is the same up to float rounding)."""
    params = list(params)
    tensors = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    fused = bool(tensors) and all(p.is_floating_point() and p.device.type in FUSED_DEVICES for p in tensors)
    return torch.optim.AdamW(params, fused=fused, **kwargs)
