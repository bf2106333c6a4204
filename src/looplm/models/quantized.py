"""Weight-only int8 and int4 weights for CPU inference (``--weights int8|int4``), and bfloat16 (``bf16``).

A decode step on CPU is bound by how fast the matmuls stream weights, so fewer bytes per weight is the
lever. The kernels are PyTorch's own CPU ops, no hand-made one:

* ``int8``: symmetric, one scale per output channel, ``torch.ops.aten._weight_int8pack_mm``. Inside a compiled
  graph a one-row product (the batch-1 token) is ``int8_gemv`` instead: a reduction inductor compiles to one
  loop over the same int8 rows in several streams, faster than the op; a product of ``DENSE_ROWS`` rows or more (a
  prompt, a batched step), compiled or not, is ``int8_dense``: the weight dequantized to a bfloat16 temporary and
  oneDNN's GEMM, faster than the op at many rows.
* ``int4``: asymmetric groups of G input columns (a scale and a minimum per group, as llama.cpp's Q4_1,
  chosen per group against the float weight among clipped ranges and least-squares fits: ``int4_portable``),
  ``torch.ops.aten._weight_int4pack_mm_for_cpu`` on the layout ``_convert_weight_to_int4pack_for_cpu``
  makes. G is 32 by default (the smallest rounding error, at about the larger groups' speed); a linear whose input
  width G does not divide takes the largest of 32/64/128/256 that does.

The ops take their activations in bfloat16 by default (``act_dtype``): with float32 activations they take a
slow fallback path, many times slower than a float32 matmul, with bfloat16 as fast or faster. Inputs are cast
to ``act_dtype`` for the matmul and its output back, so the rest of the model keeps its own dtype.

Every shared linear weight of a LoopLinear and the LM head are quantized; the per-depth LoRA, biases and
norms stay float (float32, or bfloat16 with ``dtype``) and are applied on top. The token embedding
becomes an int8 row table (a lookup reads one row per token, so only its memory matters); the LM head is
int8 by default under both formats (``head="int4"`` makes it int4), and a tied int8 head and that table
are one tensor. The float weights are dropped: no float copy, no MKL-packed copy. The linears that read one
input are stacked into one weight each (q|k|v, gate|up: ``attach``), so a step makes two kernel calls where
it made five. With ``lora="merged"`` a relaxed model's LoRA is not kept: each depth s of a shared linear gets
its own quantized W' + B_s A_s (``PerDepthWeight``), no LoRA matmul at serving time, and at SmolLM2's rank 64
fewer bytes than the float LoRA (docs/guides/quantize-export.md).

Two forms: the *portable* one (plain tensors: int8 values and scales; 4-bit values two per byte, scales
and minima) is what ``looplm quantize`` stores and what a checkpoint loads; the kernel's form (the int4
op's private packed layout) lives only in memory. Off CPU, or on a CPU whose torch lacks the op, these
formats are refused with a UsageError naming the supported ones, never silently replaced.
"""

from __future__ import annotations

import ctypes
import functools
import gc

import torch
from torch import nn

from ..errors import ConfigError, UsageError
from .cpu_products import CpuWeight
from .gptq import gptq_portable
from .grids import (  # noqa: F401
    DEFAULT_GROUP,
    GROUPS,
    INT4_CLIPS,
    dequantize,
    group_for,
    int4_portable,
    int8_portable,
    portable,
    relative_error,
    unpack4,
)
from .layers import MLP, Attention, LoopLinear

FORMATS = ("fp32", "int8", "int4", "bf16")
DEFAULT_ACT = torch.bfloat16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# --- what this platform runs ------------------------------------------------------------------


@functools.cache
def _kernel_runs(fmt: str) -> bool:
    """Whether this torch build runs the format's op on CPU (a tiny call; False if the op is missing or
    the CPU lacks what it needs)."""
    try:
        w = torch.randn(32, 64)
        for act in DTYPES.values():
            make_weight(portable(w, fmt), act).linear(torch.randn(2, 64))
        return True
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def has_bf16_matmuls(device) -> bool:
    """Whether the device multiplies bfloat16 natively: a CUDA device that supports it, a CPU with AVX-512 BF16
    or AMX. Elsewhere bfloat16 products are emulated: ``--weights bf16`` is not offered and training keeps float32."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return device.type == "cpu" and bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def supported_formats(device) -> tuple[str, ...]:
    bf16 = ("bf16",) if has_bf16_matmuls(device) else ()
    if torch.device(device).type != "cpu":
        return ("fp32",) + bf16
    return ("fp32",) + tuple(f for f in ("int8", "int4") if _kernel_runs(f)) + bf16


def check_format(fmt: str, device) -> None:
    """A one-line UsageError unless ``fmt`` is a format this device runs."""
    if fmt not in FORMATS:
        raise UsageError(f"unknown weight format {fmt!r}; use one of {', '.join(FORMATS)}")
    ok = supported_formats(device)
    if fmt not in ok:
        raise UsageError(
            f"--weights {fmt} cannot run on {torch.device(device)} with this torch build; "
            f"supported here: {', '.join(ok)}"
        )


# --- portable form: plain tensors, what a quantized checkpoint stores: grids.py ------------------

# --- kernel form: what the engine multiplies with ---------------------------------------------


class QuantWeight(nn.Module):
    """A quantized [out, in] weight: ``linear(x, bias)`` is F.linear with the dequantized weight."""

    out_features: int
    in_features: int

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":  # the module cannot be moved to a GPU and keep working
            raise UsageError(
                f"{self.fmt} weights run on CPU only; supported on {x.device.type}: "
                f"{', '.join(supported_formats(x.device))}"
            )
        return x.reshape(-1, x.shape[-1]).to(self.dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None, slot=0) -> torch.Tensor:
        """F.linear with the dequantized weight; ``slot`` (the depth) matters only to ``PerDepthWeight``."""
        y = self._mm(self._rows(x)).to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if bias is None else y + bias

    def dequantize(self, slot: int = 0) -> torch.Tensor:
        """The float weight the kernel uses, read back through the kernel itself (identity rows: the int4
        op's packed layout is private to it)."""
        return self._mm(torch.eye(self.in_features, dtype=self.dtype)).t().float().contiguous()

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())


# PyTorch's int8 op, on a CPU where it takes its AVX-512 path (a Xeon with AMX, torch 2.13), reads bfloat16
# activations and int8 weights with aligned vector loads and no tail: an operand off its 16- or 32-byte
# boundary crashes the process (a safetensors load leaves a weight wherever its file offset falls), and an
# input width that is not a multiple of 16 gives NaN or infinite outputs. So the weight lives in memory of its
# own, zero-padded to a multiple of 16 input columns, and activations enter in memory of their own
# (tests/test_quantized.py). Float32 activations and the int4 op need neither.
INT8_COLUMNS = 16
ALIGN_BYTES = 64  # what torch's CPU allocator gives every new tensor


def _own_memory(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when it is contiguous and starts on an ``ALIGN_BYTES`` boundary, else a fresh copy."""
    if t.is_contiguous() and t.data_ptr() % ALIGN_BYTES == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


GEMV_STREAMS = 4


def int8_gemv(q: torch.Tensor, scale: torch.Tensor, x: torch.Tensor, streams: int = GEMV_STREAMS) -> torch.Tensor:
    """x [1, K] @ (q [N, K] * scale [N]).T for one row of activations, written for inductor to compile (the engine's
    batch-1 graphs): a float32 reduction over K that reads the int8 rows themselves, no copy.

    The rows are split into ``streams`` blocks far apart (the most, up to that, that divide N), each its own reduction
    over the same input. inductor fuses the blocks into one loop that reads that many weight streams at once. One
    stream, as one reduction compiles, leaves a core waiting on memory; several streams beat PyTorch's op, one
    does not."""
    (n, k), dtype = q.shape, x.dtype
    streams = next(s for s in range(streams, 0, -1) if n % s == 0)
    # realised once: without it inductor inlines the input's producer (a norm) into every output row
    x = torch.ops.prims.inductor_force_stride_order(x, x.stride()).float().reshape(k)
    blocks = q.unflatten(0, (streams, n // streams))
    y = torch.cat([(blocks[i].float() * x).sum(-1) for i in range(streams)])
    return (y * scale.float()).to(dtype).unsqueeze(0)


# PyTorch's int8 op costs about as much per row as it does for one (it dequantizes as it goes), so its cost grows
# with the rows where a bfloat16 GEMM's barely does. So from DENSE_ROWS rows a product dequantizes the int8 weight
# to a bfloat16 temporary and runs that GEMM, eager or compiled (from there it is the faster). Only where bfloat16
# products are native, and for weights whose temporary stays small (DENSE_MAX_BYTES): dequantizing a
# vocabulary-sized head every step would cost more than it saves.
DENSE_ROWS = 16
DENSE_MAX_BYTES = 8 * 2**20


def int8_dense(q: torch.Tensor, scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (q [N, K] * scale [N]).T for bfloat16 rows x, through a bfloat16 GEMM on q itself (integers up to
    127 are exact in bfloat16), the scale applied to the output; the temporary bfloat16 q lives only during the call."""
    return (x @ q.to(x.dtype).t()) * scale


class Int8Weight(QuantWeight):
    fmt = "int8"

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.dtype = dtype
        self.pad = -self.in_features % INT8_COLUMNS
        q = torch.nn.functional.pad(q, (0, self.pad)) if self.pad else _own_memory(q)
        self.register_buffer("q", q, persistent=False)
        self.register_buffer("scale", _own_memory(scale.to(dtype)), persistent=False)
        self.dense = dtype == torch.bfloat16 and q.numel() * 2 <= DENSE_MAX_BYTES and has_bf16_matmuls("cpu")

    def _mm(self, rows: torch.Tensor) -> torch.Tensor:
        if rows.shape[0] == 1 and torch.compiler.is_compiling():
            return int8_gemv(self.q[:, : self.in_features], self.scale, rows)
        if self.dense and rows.shape[0] >= DENSE_ROWS:  # compiled: a guard, such steps get graphs of their own
            return int8_dense(self.q[:, : self.in_features], self.scale, rows)
        return self._op_mm(rows)

    def _op_mm(self, rows: torch.Tensor) -> torch.Tensor:
        """The product through PyTorch's op (any row count)."""
        if self.pad:
            rows = torch.nn.functional.pad(rows, (0, self.pad))
        elif not torch.compiler.is_compiling():  # compiled graphs allocate their own aligned buffers
            rows = _own_memory(rows)
        return torch.ops.aten._weight_int8pack_mm(rows.contiguous(), self.q, self.scale)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` of the dequantized weight (an embedding lookup), in ``dtype``."""
        return self.q[ids, : self.in_features].to(dtype) * self.scale[ids].unsqueeze(-1).to(dtype)


class Int4Weight(QuantWeight):
    fmt = "int4"

    def __init__(self, t: dict, dtype: torch.dtype):
        super().__init__()
        q = unpack4(t["q4"])
        self.out_features, self.in_features = q.shape
        self.group = self.in_features // t["scale"].shape[1]
        self.dtype = dtype
        self.register_buffer(
            "packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1), persistent=False
        )
        # the op computes (q - 8) * scale + zero: zero = min + 8 * scale; layout [in/G, out, 2]
        sz = torch.stack((t["scale"], t["min"] + 8 * t["scale"]), -1).transpose(0, 1)
        self.register_buffer("scales_zeros", sz.to(dtype).contiguous(), persistent=False)

    def _mm(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows.contiguous(), self.packed, self.group, self.scales_zeros)


def make_weight(t: dict, dtype: torch.dtype) -> QuantWeight:
    return Int8Weight(t["q"], t["scale"], dtype) if "q" in t else Int4Weight(t, dtype)


class QuantSlice(nn.Module):
    """Output rows [start, stop) of a stacked weight (q|k|v or gate|up, see ``attach``): what a linear whose
    matmul was fused into its neighbours' keeps, for a call that needs it alone (a prefix's keys,
    ``merged_weight``). A view, no second copy."""

    def __init__(self, stacked: QuantWeight, start: int, stop: int):
        super().__init__()
        self.stacked, self.start, self.stop = stacked, start, stop
        self.fmt, self.dtype = stacked.fmt, stacked.dtype
        self.out_features, self.in_features = stop - start, stacked.in_features

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None, slot=0) -> torch.Tensor:
        y = self.stacked.linear(x, slot=slot)[..., self.start : self.stop]
        return y if bias is None else y + bias

    def dequantize(self, slot: int = 0) -> torch.Tensor:
        return self.stacked.dequantize(slot)[self.start : self.stop]


class PerDepthWeight(nn.Module):
    """One quantized weight per depth of a shared linear, each W' + B_s A_s merged before quantizing
    (``lora="merged"``): the depth's LoRA costs no matmul and no float bytes at serving time. A depth-s
    call multiplies with weight s; a step that mixes depths groups its rows by depth (as LoopLinear's
    grouped LoRA does)."""

    def __init__(self, weights: list[QuantWeight]):
        super().__init__()
        self.depths = nn.ModuleList(weights)
        w = weights[0]
        self.fmt, self.dtype, self.out_features, self.in_features = w.fmt, w.dtype, w.out_features, w.in_features

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None, slot=0) -> torch.Tensor:
        if isinstance(slot, int):
            return self.depths[slot].linear(x, bias)
        flat_x, flat_s = x.reshape(-1, x.shape[-1]), slot.reshape(-1)
        y = flat_x.new_empty(flat_x.shape[0], self.out_features)
        for s, w in enumerate(self.depths):
            idx = (flat_s == s).nonzero(as_tuple=True)[0]
            if idx.numel():
                y.index_copy_(0, idx, w.linear(flat_x[idx]))
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if bias is None else y + bias

    def dequantize(self, slot: int = 0) -> torch.Tensor:
        return self.depths[slot].dequantize()


class QuantEmbedding(nn.Module):
    """The token embedding as int8 rows (one per-row scale each)."""

    def __init__(self, weight: Int8Weight, dtype: torch.dtype):
        super().__init__()
        self.weight_q, self.dtype = weight, dtype  # dtype: the model's float dtype (the residual stream's)
        self.num_embeddings, self.embedding_dim = weight.out_features, weight.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight_q.rows(ids, self.dtype)


class QuantHead(nn.Module):
    """The LM head on a quantized weight (for a tied int8 head, the embedding's own table).

    The kernel returns its logits in the activation dtype; in bfloat16 a large logit moves by enough to tie or
    swap the top two tokens at a few percent of positions (more than every other bfloat16 rounding of the engine
    together). So the ``RESCORED`` largest logits of each row are
    recomputed in the input's own dtype from the int8 rows they read: the greedy token and the margins between
    the leading tokens are then those of the int8 weight in float32, for k dot products per row."""

    RESCORED = 8

    def __init__(self, weight: QuantWeight):
        super().__init__()
        self.weight_q = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.weight_q.linear(x)
        if not self.RESCORED or not isinstance(self.weight_q, Int8Weight) or self.weight_q.dtype == x.dtype:
            return logits  # an int4 head keeps its op's layout only; with float32 activations nothing was rounded
        top = logits.topk(min(self.RESCORED, logits.shape[-1]), dim=-1).indices
        exact = (self.weight_q.rows(top, x.dtype) @ x.unsqueeze(-1)).squeeze(-1)
        return logits.scatter(-1, top, exact)


# --- whole models -----------------------------------------------------------------------------


def linears(model: nn.Module) -> list[tuple[str, LoopLinear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoopLinear)]


def is_quantized(model: nn.Module) -> bool:
    return isinstance(model.model.embed_tokens, QuantEmbedding)


LORA_MODES = ("shared", "merged")


def merges(lin: LoopLinear, lora: str) -> bool:
    """Whether ``lora`` mode stores this linear as one merged weight per depth."""
    if lora not in LORA_MODES:
        raise UsageError(f"unknown LoRA mode {lora!r}; use one of {', '.join(LORA_MODES)}")
    return lora == "merged" and lin.per_depth


def weight_names(name: str, lin: LoopLinear, lora: str) -> list[str]:
    """The portable tensors' names of linear ``name``: its shared weight, or with ``lora="merged"`` one
    weight per depth (``NAME.depthS.weight``)."""
    if merges(lin, lora):
        return [f"{name}.depth{s}.weight" for s in range(lin.num_slots)]
    return [f"{name}.weight"]


def quantize_portable(
    model: nn.Module,
    fmt: str,
    group: int = DEFAULT_GROUP,
    head: str = "int8",
    lora: str = "shared",
    moments: dict | None = None,
    progress: bool = False,
) -> dict[str, dict]:
    """Portable tensors for every weight ``fmt`` replaces, by name (``weight_names``): each LoopLinear's
    weight (``lora="shared"``: the shared weight, its LoRA left in float; ``"merged"``: W' + B_s A_s per depth s),
    the embedding (int8 rows) and the LM head in ``head`` format, unless it is tied and int8 (then the
    embedding's table serves as the head: one tensor, as llama.cpp's SmolLM2 Q4_1 file keeps a Q8_0
    embedding for its tied head).

    Rounded to nearest, or with ``moments`` (``gptq.input_moments``: each linear's input moments per depth,
    and the head's) by GPTQ against them: a shared weight against its depths' moments summed, a merged one
    against its own depth's (models/gptq.py). ``progress``: a bar on stderr over the linears (GPTQ takes minutes)."""
    from tqdm import tqdm

    def rounded(w, f, h=None):
        return portable(w, f, group) if h is None else gptq_portable(w, h, f, group)

    out = {}
    for n, m in tqdm(linears(model), desc="GPTQ" if moments else "rounding", unit="linear", disable=not progress):
        names = weight_names(n, m, lora)
        if merges(m, lora):
            weights = [m.merged_weight(s) for s in range(len(names))]
            hs = [moments[n][s] for s in range(len(names))] if moments else [None] * len(names)
        else:
            weights, hs = [m.weight], [sum(moments[n].values()) if moments else None]
        out.update({name: rounded(w, fmt, h) for name, w, h in zip(names, weights, hs)})
    emb = model.model.embed_tokens.weight
    h_head = moments.get("lm_head") if moments else None
    if head == "int8" and model.lm_head.weight is emb:
        out["model.embed_tokens.weight"] = rounded(emb, "int8", h_head)  # the tied head's table: round for the head
    else:
        out["model.embed_tokens.weight"] = int8_portable(emb)
        out["lm_head.weight"] = rounded(model.lm_head.weight, head, h_head)
    return out


def _portable_shape(t: dict) -> tuple[int, int]:
    return tuple(t["q"].shape) if "q" in t else (t["q4"].shape[0], 2 * t["q4"].shape[1])


def _checked(t: dict, name: str, shape: tuple[int, int], dtype: torch.dtype) -> QuantWeight:
    w = make_weight(t, dtype)
    if (w.out_features, w.in_features) != shape:
        raise ConfigError(
            f"quantized {name} is {w.out_features} x {w.in_features}, the model needs {shape[0]} x {shape[1]}"
        )
    return w


def input_groups(model: nn.Module) -> list[tuple[nn.Module, str, list[tuple[str, LoopLinear]]]]:
    """The linears that read one input: each attention's q, k, v (stacked as its ``qkv``) and each GLU
    MLP's gate and up (its ``gate_up``), as (owner, attribute, [(name, linear)])."""
    groups = []
    for n, m in model.named_modules():
        if isinstance(m, Attention):
            groups.append((m, "qkv", [(f"{n}.{p}", getattr(m, p)) for p in ("q_proj", "k_proj", "v_proj")]))
        elif isinstance(m, MLP) and m.gate_proj is not None:
            groups.append((m, "gate_up", [(f"{n}.{p}", getattr(m, p)) for p in ("gate_proj", "up_proj")]))
    return groups


def _per_depth(weights: list[QuantWeight]) -> QuantWeight | PerDepthWeight:
    return weights[0] if len(weights) == 1 else PerDepthWeight(weights)


def _drop_float(lin: LoopLinear, merged: bool) -> None:
    """The float weight is replaced; a merged LoRA (and magnitude) lives in the per-depth weights."""
    lin.weight = None
    if merged:
        lin.lora_A = lin.lora_B = lin.magnitude = None


def attach(
    model: nn.Module,
    tensors: dict[str, dict],
    dtype: torch.dtype,
    act_dtype: torch.dtype = DEFAULT_ACT,
    fuse: bool = True,
    lora: str = "shared",
) -> None:
    """Put quantized weights built from portable ``tensors`` (``quantize_portable``'s, in ``lora`` mode) in
    place of the float ones (which are dropped, and with ``lora="merged"`` the LoRA too), multiplying in
    ``act_dtype``. The model's other parameters must already be in ``dtype``. With ``fuse`` the linears of
    each ``input_groups`` group are one stacked weight (per depth when merged), one matmul a step instead of
    three (q|k|v) or two (gate|up): fewer calls into the kernel at batch 1; each linear
    keeps a ``QuantSlice`` of it, and its bias and LoRA. The stored (portable) form is the same either way."""
    for owner, attr, members in input_groups(model) if fuse else []:
        per_member = [_portable_parts(tensors, n, m, lora) for n, m in members]
        if _stackable(per_member):  # else (mixed formats, group sizes or LoRA modes): separate matmuls
            _attach_stacked(owner, attr, members, per_member, lora, act_dtype)
    _attach_unstacked(model, tensors, lora, act_dtype)
    _attach_embedding_and_head(model, tensors, dtype, act_dtype)


def _portable_parts(tensors: dict[str, dict], name: str, lin: LoopLinear, lora: str) -> list[dict]:
    """The portable tensors of linear ``name``, one per depth when merged, their shapes checked against it."""
    parts = [tensors[w] for w in weight_names(name, lin, lora)]
    for p in parts:
        if _portable_shape(p) != (lin.out_features, lin.in_features):
            raise ConfigError(
                f"quantized {name}.weight is {_portable_shape(p)[0]} x {_portable_shape(p)[1]}, "
                f"the model needs {lin.out_features} x {lin.in_features}"
            )
    return parts


def _stackable(per_member: list[list[dict]]) -> bool:
    """Whether a group's linears stack into one weight: the same LoRA mode (weights per linear), format and group
    size for all."""
    flat = [p for parts in per_member for p in parts]
    return not (
        len({len(parts) for parts in per_member}) > 1
        or len({frozenset(p) for p in flat}) > 1
        or len({p["scale"].shape[1:] for p in flat}) > 1
    )


def _stacked_depth(per_member: list[list[dict]], d: int) -> dict:
    """Depth ``d``'s portable tensors of a group's linears, one after another along the output rows."""
    return {k: torch.cat([parts[d][k] for parts in per_member]) for k in per_member[0][0]}


def _attach_stacked(owner, attr, members, per_member, lora: str, act_dtype: torch.dtype) -> None:
    """A group's linears as one stacked weight (per depth when merged), ``owner``'s ``attr``; each linear
    keeps a ``QuantSlice`` of its rows."""
    outs = [m.out_features for _, m in members]
    name = "+".join(n for n, _ in members)
    shape = (sum(outs), members[0][1].in_features)
    stacked = _per_depth(
        [_checked(_stacked_depth(per_member, d), name, shape, act_dtype) for d in range(len(per_member[0]))]
    )
    stacked.sizes = outs
    setattr(owner, attr, stacked)
    start = 0
    for _, m in members:
        _drop_float(m, merges(m, lora))
        m.quant = QuantSlice(stacked, start, start + m.out_features)
        start += m.out_features


def _attach_unstacked(model: nn.Module, tensors: dict[str, dict], lora: str, act_dtype: torch.dtype) -> None:
    """Each linear that no stacked weight serves gets its own (one per depth when merged)."""
    for n, m in linears(model):
        if m.quant is None:
            merged = merges(m, lora)
            shape = (m.out_features, m.in_features)
            m.quant = _per_depth(
                [_checked(p, f"{n}.weight", shape, act_dtype) for p in _portable_parts(tensors, n, m, lora)]
            )
            _drop_float(m, merged)


def _attach_embedding_and_head(model: nn.Module, tensors: dict[str, dict], dtype, act_dtype) -> None:
    """The embedding as int8 rows; the head on its own weight, or on the embedding's table when it has none."""
    c = model.config
    emb = _checked(tensors["model.embed_tokens.weight"], "embedding", (c.vocab_size, c.hidden_size), act_dtype)
    if not isinstance(emb, Int8Weight):
        raise ConfigError("the quantized embedding must be int8 rows")
    model.model.embed_tokens = QuantEmbedding(emb, dtype)
    head = tensors.get("lm_head.weight")
    model.lm_head = QuantHead(
        emb if head is None else _checked(head, "lm_head", (c.vocab_size, c.hidden_size), act_dtype)
    )


def release_freed_memory() -> None:
    """Hand the memory freed while quantizing (float weights, unpacked int4 temporaries) back to the OS:
    glibc keeps freed heap pages otherwise, and the served process stays that much larger."""
    gc.collect()  # reference cycles left by building the model still hold tensors
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def quantize_model(
    model: nn.Module,
    fmt: str,
    group: int = DEFAULT_GROUP,
    dtype: torch.dtype = torch.float32,
    head: str = "int8",
    act_dtype: torch.dtype = DEFAULT_ACT,
    fuse: bool = True,
    lora: str = "shared",
    moments: dict | None = None,
):
    """Quantize ``model`` in place for CPU inference (``fmt`` int8 or int4; fp32 returns it unchanged, bf16 casts it:
    ``to_bf16``).
    ``dtype``: the float parameters left (LoRA, norms, biases); ``act_dtype``: the quantized matmuls'
    activations; ``head``: the LM head's format (int8 by default, also under int4: see quantize_portable);
    ``fuse``: stack q|k|v and gate|up (``attach``); ``lora``: "shared" keeps each shared weight once with
    its per-depth LoRA in float on top, "merged" quantizes W' + B_s A_s once per depth (``PerDepthWeight``);
    ``moments``: calibration inputs' moments (``gptq.input_moments``) to round by GPTQ, else round to nearest."""
    device = next(model.parameters()).device
    check_format(fmt, device)
    if fmt == "fp32" or is_quantized(model):
        return model
    if fmt == "bf16":
        return to_bf16(model)
    check_format(head, device)
    tensors = quantize_portable(model, fmt, group, head, lora, moments)
    keep = {id(m.weight) for _, m in linears(model)} | {id(model.model.embed_tokens.weight), id(model.lm_head.weight)}
    with torch.no_grad():
        for p in model.parameters():
            if id(p) not in keep:
                p.data = p.data.to(dtype)
    attach(model, tensors, dtype, act_dtype, fuse, lora)
    del tensors
    release_freed_memory()
    model.config.quantization = record(fmt, group, dtype, head, act_dtype, lora, "gptq" if moments else "nearest")
    return model.eval()


def record(
    fmt: str,
    group: int,
    dtype: torch.dtype,
    head: str,
    act_dtype: torch.dtype,
    lora: str = "shared",
    rounding: str = "nearest",
) -> dict:
    name = lambda t: str(t).removeprefix("torch.")  # noqa: E731
    return {
        "format": fmt,
        "group_size": group,
        "dtype": name(dtype),
        "act_dtype": name(act_dtype),
        "head": head,
        "lora": lora,
        "rounding": rounding,
    }


def stored_format(model: nn.Module) -> str:
    """The format the model holds: its quantization record's, else bf16 for bfloat16 weights, else fp32."""
    rec = getattr(model.config, "quantization", None)
    if rec:
        return rec["format"]
    return "bf16" if next(model.parameters()).dtype == torch.bfloat16 else "fp32"


def prepare(model: nn.Module, fmt: str | None, **options):
    """The model to serve with weights ``fmt`` (``--weights``): quantized now (``options``: quantize_model's),
    or as stored when ``fmt`` is None or the stored format. A quantized model is never dequantized to serve
    another format."""
    stored = stored_format(model)
    fmt = fmt or stored
    check_format(fmt, next(model.parameters()).device)
    lora = options.pop("lora", None)
    if stored != "fp32" and lora and lora != stored_lora(model):
        raise UsageError(
            f"this model is stored with {stored_lora(model)} LoRA weights; serve it with --lora "
            f"{stored_lora(model)}, or quantize its float checkpoint with --lora {lora}"
        )
    if fmt in ("fp32", "bf16") and lora == "merged":
        raise UsageError("--lora merged needs quantized weights (--weights int8 or int4)")
    if fmt == stored:
        return model
    if stored != "fp32":
        raise UsageError(
            f"this model is stored with {stored} weights; serve it with --weights {stored}, or "
            f"quantize its float checkpoint to {fmt}"
        )
    return quantize_model(model, fmt, lora=lora or "shared", **options)


def load_dtype(fmt: str | None) -> torch.dtype:
    """The dtype to read a float checkpoint in, to serve it as ``fmt``: bfloat16 for bf16, so that loading never
    holds a float32 copy of the model (the peak memory of a bf16 server), float32 for the rest (quantizing
    rounds float32 weights)."""
    return torch.bfloat16 if fmt == "bf16" else torch.float32


def to_bf16(model: nn.Module) -> nn.Module:
    """The whole float model in bfloat16 (``--weights bf16``): weights, LoRA, norms, residual stream and KV cache.
    Half the bytes of float32 and no MKL-packed copy (those are float32 only); on a CPU with AMX a batched step's
    weight products run faster than float32's and than the int4 op's."""
    model = model.to(torch.bfloat16)  # the rotary frequencies stay float32 and exact (Rotary._apply)
    release_freed_memory()
    return model.eval()


def stored_lora(model: nn.Module) -> str:
    rec = getattr(model.config, "quantization", None)
    return rec.get("lora", "shared") if rec else "shared"


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every tensor the model holds for inference: parameters, buffers, and MKL-packed copies
    (models/cpu_products.py) where attached; a tensor shared by two modules counts once."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = (t.untyped_storage().data_ptr(), t.dtype)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    for m in model.modules():
        for p in (getattr(m, "cpu_weight", None), getattr(m, "head_cpu_weight", None)):
            if isinstance(p, CpuWeight):
                total += p.nbytes
    return total
