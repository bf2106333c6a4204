"""Error-compensated rounding of the shared weights (GPTQ, Frantar et al. 2022), for ``looplm quantize --calib-data``.

Round-to-nearest rounds every weight on its own. What matters is each linear's *output* on the inputs it
sees: ||(W - Q) X||^2 = tr((W - Q) H (W - Q)^T) with H = sum_t x_t x_t^T. GPTQ rounds one input column at a
time and spreads that column's rounding error over the columns not yet rounded, weighted by the inverse of H,
so later columns absorb what earlier ones lost.

What is this project's own is H. A shared weight W serves every depth tied to it, each with its own inputs,
so the output error summed over depths is tr((W - Q) (sum_s H_s) (W - Q)^T): GPTQ on W with the depths'
moments summed (``lora="shared"``; the float per-depth LoRA on top moves no input). With ``lora="merged"``
each depth's W + B_s A_s is its own weight and is rounded against its own H_s. H comes from the float model's
own inputs (one pass over calibration rows of a training split), not re-collected layer by layer.

The quantization grid is the serving format's (models/grids.py): int4 groups of G input columns, their
(scale, min) chosen by ``int4_portable`` from the group's error-updated weights when GPTQ reaches the group;
int8 one symmetric scale per output channel, fixed from the float row. So the result is a portable tensor
set like ``portable``'s, served by the same kernels.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from . import grids as Q
from .layers import LoopLinear

DAMP = 0.01  # GPTQ's dampening: a fraction of H's mean diagonal added to it (as convert/aware.py)


@torch.no_grad()
def input_moments(model, rows: torch.Tensor, batch_size: int = 4) -> dict:
    """Run the float ``model`` over token rows [n, t] and sum x x^T (float64) of every LoopLinear's input,
    per linear name and per slot (the depth's per-depth parameter index): {name: {slot: [in, in]}}, and of
    the LM head's input at the final exit: {"lm_head": [hidden, hidden]}."""
    sums: dict = {}
    last = [None, None]  # (input, its x^T x): q/k/v and gate/up read one tensor in turn, one product for them

    def hook_for(name):
        def hook(module, args, kwargs):
            x = args[0]
            slot = args[1] if len(args) > 1 else kwargs.get("slot", 0)
            if not isinstance(slot, int):
                raise ConfigError("input_moments needs one depth per call (a training-style forward pass)")
            if x is not last[0]:
                flat = x.detach().reshape(-1, x.shape[-1]).float()
                last[:] = x, (flat.T @ flat).double().cpu()
            per_slot = sums.setdefault(name, {})
            per_slot[slot] = per_slot[slot] + last[1] if slot in per_slot else last[1].clone()

        return hook

    handles = [
        m.register_forward_pre_hook(hook_for(n), with_kwargs=True)
        for n, m in model.named_modules()
        if isinstance(m, LoopLinear)
    ]
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        for start in range(0, rows.shape[0], batch_size):
            h = model.model(rows[start : start + batch_size].to(device))[0]
            z = model.exit_states(h).reshape(-1, h.shape[-1]).float()  # what the LM head reads at the final exit
            sums["lm_head"] = sums.get("lm_head", 0) + (z.T @ z).double().cpu()
    finally:
        last[:] = None, None
        model.train(was_training)
        for h in handles:
            h.remove()
    return sums


def gptq_portable(
    w: torch.Tensor, h: torch.Tensor, fmt: str, group: int = Q.DEFAULT_GROUP, damp: float = DAMP, block: int = 128
) -> dict:
    """``portable(w, fmt, group)`` rounded by GPTQ against input moments ``h`` [in, in] (float64 sums)."""
    w = w.detach().double().cpu().clone()
    n, k = w.shape
    h = h.double().clone()
    dead = torch.diag(h) == 0  # inputs that never fire: their columns cannot matter, round them as they are
    h[dead, dead] = 1
    h += damp * torch.diag(h).mean() * torch.eye(k, dtype=h.dtype)
    # the upper Cholesky factor of H^-1: row j holds how column j's error spreads over columns j+1..
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)

    if fmt == "int8":
        g = k
        scale = (w.abs().amax(1) / 127).clamp_min(1e-12)
        lo, hi = -127, 127
        params = lambda cols: (scale, torch.zeros_like(scale))  # noqa: E731  (one pair per row, fixed)
    else:
        g = Q.group_for(k, group)
        block = g * max(1, block // g)  # a block holds whole groups
        lo, hi = 0, 15

        def params(cols):  # the serving format's (scale, min) for one group of error-updated columns
            p = Q.int4_portable(cols.float(), g)
            return p["scale"][:, 0].double(), p["min"][:, 0].double()

    codes = torch.empty(n, k, dtype=torch.int16)
    scales, minima = [], []
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        wb, err = w[:, b0:b1].clone(), torch.zeros(n, b1 - b0, dtype=w.dtype)
        for j in range(b1 - b0):
            col = b0 + j
            if col % g == 0:
                scale, mn = params(wb[:, j : j + g])
                scales.append(scale)
                minima.append(mn)
            q = torch.round((wb[:, j] - mn) / scale).clamp(lo, hi)
            codes[:, col] = q.to(torch.int16)
            e = (wb[:, j] - (q * scale + mn)) / u[col, col]
            wb[:, j:] -= e[:, None] * u[col, col:b1][None]
            err[:, j] = e
        w[:, b1:] -= err @ u[b0:b1, b1:]  # the block's errors, spread over the columns after it at once
    if fmt == "int8":
        return {"q": codes.to(torch.int8), "scale": scale.float()}
    q = codes.to(torch.uint8)
    return {
        "q4": q[:, 0::2] | (q[:, 1::2] << 4),
        "scale": torch.stack(scales, 1).float(),
        "min": torch.stack(minima, 1).float(),
    }


def output_error(w: torch.Tensor, t: dict, h: torch.Tensor) -> float:
    """sqrt(tr((W - Q) H (W - Q)^T) / tr(W H W^T)): the relative error of the linear's output on the inputs
    whose moments are ``h``."""
    w = w.detach().double().cpu()
    d = w - Q.dequantize(t).double()
    return ((d @ h.double() * d).sum() / (w @ h.double() * w).sum()).sqrt().item()
