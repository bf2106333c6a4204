"""The optimizer and learning-rate schedule every training stage uses: AdamW, fused where PyTorch has a fused
kernel for the parameters' device, and linear warm-up into a cosine decay.

PyTorch's default AdamW on CPU runs each tensor through about ten elementwise operations, each its own
OpenMP region; the fused kernel makes one pass per tensor. On an idle CPU that is a small share of a healing
step either way; where another process keeps the cores busy, the default's many short parallel regions wait
on each other and the fused update is many times faster. CUDA has the fused kernel too.
"""

from __future__ import annotations

import contextlib
import math

import torch

FUSED_DEVICES = ("cpu", "cuda")


def adamw(params, **kwargs) -> torch.optim.AdamW:
    """``torch.optim.AdamW(params, **kwargs)``, fused when every parameter is a floating-point tensor on a
    device with the fused kernel (the update is the same up to float rounding)."""
    params = list(params)
    tensors = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    fused = bool(tensors) and all(p.is_floating_point() and p.device.type in FUSED_DEVICES for p in tensors)
    return torch.optim.AdamW(params, fused=fused, **kwargs)


def cosine(step: int, total: int, warmup: int, floor: float = 0.1) -> float:
    """The learning rate's factor at ``step`` (0-based) of ``total``: linear warm-up over ``warmup`` steps, then a
    cosine decay to ``floor``."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr


class WeightAverage:
    """An exponential moving average of ``params`` (Polyak averaging), kept in their dtype beside them: after
    each step ``avg += (1 - d) * (param - avg)``, with ``d = min(decay, (1 + n) / (10 + n))`` at the n-th update,
    so the first steps are not frozen in by a decay meant for hundreds. Small batches make each step's update
    noisy; the average follows the trajectory with less of that noise (`looplm heal --e2e-average`)."""

    def __init__(self, params, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"a weight average's decay lies in (0, 1), got {decay}")
        self.params = [p for p in params]
        self.decay = decay
        self.updates = 0
        with torch.no_grad():
            self.average = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def update(self) -> None:
        self.updates += 1
        d = min(self.decay, (1 + self.updates) / (10 + self.updates))
        torch._foreach_lerp_(self.average, [p.detach() for p in self.params], 1.0 - d)

    @torch.no_grad()
    def copy_in(self) -> None:
        """Replace the parameters' values by the average (the optimizer's state stays the parameters')."""
        torch._foreach_copy_([p.data for p in self.params], self.average)

    @contextlib.contextmanager
    def swapped_in(self):
        """The average in the parameters for the block (an evaluation), their own values restored after it."""
        with torch.no_grad():
            own = [p.detach().clone() for p in self.params]
            self.copy_in()
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_([p.data for p in self.params], own)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "updates": self.updates, "average": self.average}

    def load_state_dict(self, state: dict) -> None:
        if len(state["average"]) != len(self.average):
            raise ValueError(
                f"a weight average of {len(state['average'])} tensors cannot restore one of {len(self.average)}"
            )
        self.decay, self.updates = state["decay"], state["updates"]
        with torch.no_grad():
            torch._foreach_copy_(self.average, state["average"])
