"""The portable weight formats (what ``looplm quantize`` stores): int8 per output channel and int4 in groups of input
columns, as plain tensors, with their rounding to nearest and their dequantization. The kernels that multiply with
them and the model surgery are in quantized.py; GPTQ rounding onto the same grids in gptq.py.
"""

from __future__ import annotations

import torch

from ..errors import UsageError

DEFAULT_GROUP = 32
GROUPS = (32, 64, 128, 256)  # the group sizes the int4 op accepts


def int8_portable(w: torch.Tensor) -> dict:
    """Symmetric per-output-channel int8: w ~ q * scale[:, None]."""
    w = w.detach().float()
    scale = (w.abs().amax(1) / 127).clamp_min(1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return {"q": q, "scale": scale}


def group_for(in_features: int, group: int) -> int:
    """``group`` if it divides the input width, else the largest accepted size that does."""
    if in_features % group == 0:
        return group
    fits = [g for g in GROUPS if in_features % g == 0]
    if not fits:
        raise UsageError(
            f"int4 needs an input width divisible by 32; this model has a linear {in_features} wide "
            f"(use --weights int8)"
        )
    return max(fits)


# int4 ranges tried per group: the group's [min, max] shrunk toward zero by these factors (clipping outliers)
INT4_CLIPS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)


def _grid_step(wg: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Per group, the smallest gap between its distinct values: the step of the grid a group already on a
    4-bit grid lies on, whether or not its codes reach 0 and 15 (GPTQ's groups need not; heal's rounded base
    weights are such groups). On other groups the candidate it makes loses to the ranges."""
    gaps = wg.sort(-1).values.diff(dim=-1)
    gaps = torch.where(gaps > 1e-5 * (hi - lo)[..., None], gaps, torch.inf).amin(-1)
    return torch.where(torch.isfinite(gaps), gaps, ((hi - lo) / 15).clamp_min(1e-12))


def _looks_gridded(wg: torch.Tensor, sample: int = 256) -> bool:
    """Whether some of up to ``sample`` groups, spread over the weight, hold at most 16 distinct values: what a
    weight rounded to a 4-bit grid shows and a float weight (32 distinct values per group) does not. It decides
    whether ``_grid_step``'s sort over every group is worth paying: 2.2 of 8.5 s for SmolLM2's linears."""
    flat = wg.reshape(-1, wg.shape[-1])
    picked = flat[:: max(1, flat.shape[0] // sample)][:sample]
    gaps = picked.sort(-1).values.diff(dim=-1)
    span = (picked.amax(-1) - picked.amin(-1))[:, None]
    distinct = 1 + (gaps > 1e-5 * span).sum(-1)
    return bool((distinct <= 16).any())


def _fit_codes(best: list | None, wg: torch.Tensor, wm: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor) -> list:
    """Round every group to the grid (lo, scale), refit (scale, min) to those codes by least squares, and keep per
    group whichever of the two pairs, and of ``best`` so far, has the smallest squared error.
    ``best`` is [squared error, codes, scale, min] per group, or None."""
    q = torch.round((wg - lo[..., None]) / scale[..., None]).clamp(0, 15)
    qm = q.mean(-1)
    var = ((q - qm[..., None]) ** 2).sum(-1)
    s_fit = ((q - qm[..., None]) * (wg - wm[..., None])).sum(-1) / var.clamp_min(1e-12)
    ok = (var > 0) & (s_fit > 1e-12)  # groups whose codes do not vary keep the range's pair
    for sc, mn in ((scale, lo), (torch.where(ok, s_fit, scale), torch.where(ok, wm - s_fit * qm, lo))):
        err = ((q * sc[..., None] + mn[..., None] - wg) ** 2).sum(-1)
        if best is None:
            best = [err, q, sc, mn]
            continue
        better = err < best[0]
        best = [
            torch.where(better, err, best[0]),
            torch.where(better[..., None], q, best[1]),
            torch.where(better, sc, best[2]),
            torch.where(better, mn, best[3]),
        ]
    return best


def int4_portable(w: torch.Tensor, group: int = DEFAULT_GROUP) -> dict:
    """Asymmetric group-wise 4-bit: w ~ q * scale + min per group of ``group`` input columns; q in [0, 15],
    two per byte (even column in the low nibble).

    Scale and minimum are chosen against the float weight, per group: each range in ``INT4_CLIPS`` gives codes,
    a least-squares fit of (scale, min) to those codes is tried beside the range's own, and the pair with the
    smallest squared error is kept. The plain [min, max] range is among the candidates, so no group is worse
    than round-to-nearest over its range. When the weight looks already rounded to a 4-bit grid (``_looks_gridded``:
    the embedded Q4_1 model's, GPTQ's, heal's rounded base weights), the groups the ranges did not reproduce also
    try the grid of their smallest value gap (``_grid_step``), so such weights round-trip exactly even where their
    codes miss 0 or 15; float weights skip that sort (a quarter of an int4 load)."""
    w = w.detach().float()
    n, k = w.shape
    g = group_for(k, group)
    wg = w.reshape(n, k // g, g)
    lo0, hi0, wm = wg.amin(-1), wg.amax(-1), wg.mean(-1)
    best = None  # (squared error, codes, scale, min)
    for clip in INT4_CLIPS:
        best = _fit_codes(best, wg, wm, lo0 * clip, ((hi0 - lo0) * clip / 15).clamp_min(1e-12))
    if _looks_gridded(wg):
        # the groups the ranges did not reproduce (a Q4_1 model's all are) try the grid of their smallest gap
        missed = best[0] > 1e-10 * g * (hi0 - lo0) ** 2
        if missed.any():
            step = ((hi0 - lo0) / 15).clamp_min(1e-12)
            step[missed] = _grid_step(wg[missed], lo0[missed], hi0[missed])
            best = _fit_codes(best, wg, wm, lo0, step)
    _, q, scale, lo = best
    q = q.to(torch.uint8).reshape(n, k)
    return {"q4": q[:, 0::2] | (q[:, 1::2] << 4), "scale": scale, "min": lo}


def unpack4(q4: torch.Tensor) -> torch.Tensor:
    """[N, K/2] bytes -> [N, K] int32 values in [0, 15]."""
    return torch.stack((q4 & 15, q4 >> 4), -1).reshape(q4.shape[0], -1).to(torch.int32)


def dequantize(t: dict) -> torch.Tensor:
    """The float32 weight a portable tensor set stands for."""
    if "q" in t:
        return t["q"].float() * t["scale"][:, None]
    q = unpack4(t["q4"]).float()
    n, k = q.shape
    g = k // t["scale"].shape[1]
    return (q.reshape(n, k // g, g) * t["scale"][..., None] + t["min"][..., None]).reshape(n, k)


def portable(w: torch.Tensor, fmt: str, group: int = DEFAULT_GROUP) -> dict:
    return int8_portable(w) if fmt == "int8" else int4_portable(w, group)


def relative_error(w: torch.Tensor, fmt: str, group: int = DEFAULT_GROUP) -> float:
    """||W - Q(W)|| / ||W||: how far quantizing to ``fmt`` moves a weight (Frobenius norms, float32)."""
    w = w.detach().float()
    return ((w - dequantize(portable(w, fmt, group))).norm() / w.norm()).item()
