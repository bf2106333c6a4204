"""The optimizer every training stage uses: AdamW, fused where PyTorch has a fused kernel for the
parameters' device.

PyTorch's default AdamW on CPU runs one tensor at a time through about ten elementwise operations; the
fused kernel does the whole update in one pass per tensor. On a 2-core CPU a healing step's update of one
shared SmolLM2 layer with rank-128 LoRAs (6.1M parameters) took 0.52-0.75 s with the default against
0.01-0.18 s fused, and the end-to-end stage's 92M parameters 1.07 s against 0.29 s
(`benchmarks/bench_optimizer.py`): a fifth of a layer-local step. CUDA has the fused kernel too.
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
