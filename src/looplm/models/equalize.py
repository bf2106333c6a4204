"""Equalising input channels before rounding (AWQ, Lin et al. 2023; SmoothQuant's migration, Xiao et al. 2022),
for ``looplm quantize --calib-data DATA --equalize``.

A linear's output is unchanged when input channel j is divided by s_j and weight column j multiplied by s_j:
y = (W diag(s)) (diag(1/s) x). Its rounding is not. A per-output-channel int8 scale is set by each row's largest
weight, so a column of large weights costs every other weight in its rows precision; an input channel that is
large multiplies its column's rounding error. Choosing s trades the two.

The division by s must land in a float part that computes the input, so that serving costs nothing more:

* q|k|v read the attention norm's output: every depth's norm weight (and bias) is divided, and the per-depth
  prefix vectors, which enter k and v without the norm;
* gate|up read the MLP norm's output: the same;
* down reads act(gate x) * up x, linear in up x: the up projection's rows (weight, biases, LoRA B) are divided;
* o reads the attention output, linear in the values: the value projection's rows are divided. With grouped KV
  heads a value channel feeds one o column per query head of its group, so those columns share one scale.

The LM head is left alone: its input's norm is the embedding table's too when they are tied. A shared weight
serves every depth tied to it, so its s is one for all of them; each depth's LoRA A gets the same columns scaled.

s is searched per group of linears that read one input, as AWQ does: s_j = a_j^alpha / w_j^beta, with a_j the
channel's RMS over the calibration rows (from the input moments GPTQ uses, models/gptq.py) and w_j the largest
|weight| of column j in the group, normalised to a geometric mean of 1. Every (alpha, beta) of a small grid is
rounded in the serving format and scored by the output error tr(E H E^T), E = Q(W diag(s)) diag(1/s) - W, H
the group's input moments summed over its depths; the grid includes (0, 0), no scaling, so equalising never
raises that error on the calibration rows.
"""

from __future__ import annotations

import torch
from torch import nn

from . import grids as Q
from .layers import DepthNorm, LoopLinear

ALPHAS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0)  # the input RMS's exponent
BETAS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0)  # the column maximum's


def scaled_rounding_error(w: torch.Tensor, s: torch.Tensor, h: torch.Tensor, fmt: str, group: int) -> float:
    """tr(E H E^T) of ``w`` [out, in] rounded in ``fmt`` after its columns were scaled by ``s``, in the
    original input space."""
    q = Q.dequantize(Q.portable(w * s, fmt, group)) / s
    e = q - w
    return float(((e @ h) * e).sum())


def search_scales(
    w: torch.Tensor, h: torch.Tensor, fmt: str, group: int = Q.DEFAULT_GROUP, tie=None
) -> tuple[torch.Tensor, dict]:
    """The column scales s [in] of the grid that round ``w`` [out, in] (a group's stacked weights) with the least
    output error on inputs of moments ``h`` [in, in]; ``tie(s)`` makes a candidate respect shared channels.
    Returns s and {"alpha", "beta", "error", "error_before"}."""
    w, h = w.detach().float().cpu(), h.float().cpu()
    rms = (torch.diag(h).clamp_min(0) / max(float(torch.diag(h).mean()), 1e-30)).sqrt().clamp_min(1e-5)
    wmax = w.abs().amax(0).clamp_min(1e-8)
    best = None
    for alpha in ALPHAS:
        for beta in BETAS:
            s = rms.pow(alpha) / wmax.pow(beta)
            s = tie(s) if tie else s
            s = s / s.log().mean().exp()
            err = scaled_rounding_error(w, s, h, fmt, group)
            if best is None or err < best[0]:
                best = (err, s, alpha, beta)
            if alpha == beta == 0:
                before = err
    err, s, alpha, beta = best
    return s, {"alpha": alpha, "beta": beta, "error": err, "error_before": before}


def _tie_heads(num_heads: int, num_kv_heads: int, head_dim: int):
    """o's input channels (h, d) read value channel (h // rep, d): one scale per value channel, the geometric
    mean of its query heads' candidates."""
    rep = num_heads // num_kv_heads

    def tie(s):
        g = s.view(num_kv_heads, rep, head_dim).log().mean(1, keepdim=True).exp()
        return g.expand(num_kv_heads, rep, head_dim).reshape(-1)

    return tie


def _value_scales(s: torch.Tensor, num_kv_heads: int, num_heads: int, head_dim: int) -> torch.Tensor:
    return s.view(num_kv_heads, num_heads // num_kv_heads, head_dim)[:, 0].reshape(-1)


@torch.no_grad()
def _scale_columns(lin: LoopLinear, s: torch.Tensor) -> None:
    lin.weight.mul_(s.to(lin.weight))
    if lin.lora_A is not None:
        lin.lora_A.mul_(s.to(lin.lora_A))


@torch.no_grad()
def _divide_rows(lin: LoopLinear, s: torch.Tensor) -> None:
    lin.weight.div_(s.to(lin.weight)[:, None])
    if lin.bias is not None:
        lin.bias.div_(s.to(lin.bias))
    if lin.lora_B is not None:
        lin.lora_B.div_(s.to(lin.lora_B)[:, None])


@torch.no_grad()
def _divide_norm(norm: DepthNorm, s: torch.Tensor) -> None:
    s = s.to(norm.weight)
    if norm.kind == "rms_plus1":  # Gemma computes (1 + w) x
        norm.weight.copy_((1 + norm.weight) / s - 1)
    else:
        norm.weight.div_(s)
    if norm.bias is not None:
        norm.bias.div_(s)


def equalization_groups(model: nn.Module) -> list[dict]:
    """Each group of linears that read one input, with the float part its scale is divided into:
    {"names", "linears", "norm" | "rows" (a LoopLinear whose output rows produce the input), "prefix" (the
    attention's per-depth prefix vectors, which enter k and v without the norm), "tie"}."""
    c, groups = model.config, []
    for i, block in enumerate(model.model.layers):
        p = f"model.layers.{i}"
        attn, mlp = block.attn, block.mlp
        groups.append(
            {
                "names": [f"{p}.attn.{n}" for n in ("q_proj", "k_proj", "v_proj")],
                "linears": [attn.q_proj, attn.k_proj, attn.v_proj],
                "norm": block.attn_norm,
                "prefix": attn.prefix,
            }
        )
        gu = ("gate_proj", "up_proj") if mlp.gate_proj is not None else ("up_proj",)
        groups.append(
            {"names": [f"{p}.mlp.{n}" for n in gu], "linears": [getattr(mlp, n) for n in gu], "norm": block.mlp_norm}
        )
        if mlp.gate_proj is not None:  # act(gate x) * up x is linear in up x; act(up x) is not
            groups.append({"names": [f"{p}.mlp.down_proj"], "linears": [mlp.down_proj], "rows": mlp.up_proj})
        groups.append(
            {
                "names": [f"{p}.attn.o_proj"],
                "linears": [attn.o_proj],
                "rows": attn.v_proj,
                "tie": _tie_heads(c.num_attention_heads, c.num_key_value_heads, c.head_dim),
            }
        )
    return groups


def equalize(model: nn.Module, moments: dict, fmt: str, group: int = Q.DEFAULT_GROUP) -> tuple[dict, list[dict]]:
    """Scale every group's input channels (``equalization_groups``) by the ``search_scales`` choice, in place; the model
    computes the same function. ``moments`` are ``gptq.input_moments``'s of the unscaled model. Returns the
    moments of the scaled model's inputs (for GPTQ after it) and one record per group."""
    c = model.config
    moments = {n: dict(v) if isinstance(v, dict) else v for n, v in moments.items()}  # the head's is one tensor
    records = []
    for g in equalization_groups(model):
        w = torch.cat([lin.weight.detach() for lin in g["linears"]])
        h = sum(moments[g["names"][0]].values())
        s, rec = search_scales(w, h, fmt, group, g.get("tie"))
        records.append({"linears": g["names"], **rec})
        if rec["alpha"] == rec["beta"] == 0:
            continue
        if "norm" in g:
            _divide_norm(g["norm"], s)
            if g.get("prefix") is not None:
                with torch.no_grad():
                    g["prefix"].div_(s.to(g["prefix"]))
        else:
            rows = (
                s
                if g.get("tie") is None
                else _value_scales(s, c.num_key_value_heads, c.num_attention_heads, c.head_dim)
            )
            _divide_rows(g["rows"], rows)
        for lin in g["linears"]:
            _scale_columns(lin, s)
        inv = (1 / s).double()
        for name in g["names"]:
            moments[name] = {slot: hs * inv[:, None] * inv[None] for slot, hs in moments[name].items()}
    return moments, records
