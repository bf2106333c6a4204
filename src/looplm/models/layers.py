"""Building blocks of the looped decoder: per-depth norms and linears, rotary embeddings, attention,
MLP and the block.

Every parametrised piece takes a ``slot`` argument: the index, among the depths that run a block (B for a
shared block, one for a unique one; models/plan.py), of the depth being computed. It is an ``int`` when all
tokens are at the same depth (training, evaluation) or a LongTensor with one entry per token when a batch mixes depths
(continuous depth-wise batching). Slots select per-depth LoRA matrices and per-depth vectors.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_products
from .config import ConfigError, LoopLMConfig

Slot = int | torch.Tensor


def _select(stack: torch.Tensor, slot: Slot) -> torch.Tensor:
    """Row ``slot`` of a per-depth stack [S, ...]; a stack of one row is shared by every depth."""
    if stack.shape[0] == 1:
        return stack[0]
    return stack[slot]


class DepthNorm(nn.Module):
    """RMSNorm (w * x), Gemma's RMSNorm ((1 + w) * x), LayerNorm or a plain scale (w * x, no normalising:
    the pre-norms' place in a block without pre-norms, OLMo-2), with one weight row per slot."""

    def __init__(self, dim: int, kind: str, eps: float, num_slots: int = 1):
        super().__init__()
        self.kind, self.eps = kind, eps
        init = torch.zeros if kind == "rms_plus1" else torch.ones
        self.weight = nn.Parameter(init(num_slots, dim))
        self.bias = nn.Parameter(torch.zeros(num_slots, dim)) if kind == "layer" else None

    def forward(self, x: torch.Tensor, slot: Slot = 0) -> torch.Tensor:
        w = _select(self.weight, slot)
        if self.kind == "layer":
            b = _select(self.bias, slot)
            if w.dim() == 1:
                return F.layer_norm(x, (x.shape[-1],), w, b, self.eps)
            return F.layer_norm(x, (x.shape[-1],), None, None, self.eps) * w + b
        if self.kind == "scale":
            return w * x
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.kind == "rms_plus1":  # Gemma: scale in float32, then cast
            return (xf * (1.0 + w.float())).type_as(x)
        return w * xf.to(x.dtype)


class LoopLinear(nn.Module):
    """A linear layer shared by B depths, with an optional LoRA per depth: y = W x + b + B_s A_s x.

    lora_A: [B, r, in], lora_B: [B, out, r]. Rank 0 is the plain (recursive) linear. ``magnitude`` [B, out] (DoRA's
    per-depth magnitude vector, ones at first): y = m_s * (W + B_s A_s) x + b; DoRA also divides by the rows'
    norms of W + B_s A_s, which at fixed weights only rescales m_s, so it is left out.
    """

    merge_lora = True  # False: always run the LoRA as two small matmuls (see _merge_pays)
    cpu_weight = None  # how a serving engine multiplies weight on CPU (models/cpu_products.py), never saved
    lora_plan = None  # and the LoRA's products
    # ``quant``: None, or an int8/int4 weight (models/quantized.py) that replaces ``weight`` (then None)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        num_slots: int,
        bias_slots: int,
        rank: int,
        magnitude: bool = False,
    ):
        super().__init__()
        self.in_features, self.out_features, self.rank, self.num_slots = in_features, out_features, rank, num_slots
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.quant = None  # an instance attribute: a module assigned later must shadow it (nn.Module rules)
        self.bias = nn.Parameter(torch.zeros(bias_slots, out_features)) if bias else None
        if rank:
            self.lora_A = nn.Parameter(torch.zeros(num_slots, rank, in_features))
            self.lora_B = nn.Parameter(torch.zeros(num_slots, out_features, rank))
        else:
            self.register_parameter("lora_A", None)
            self.register_parameter("lora_B", None)
        self.magnitude = nn.Parameter(torch.ones(num_slots, out_features)) if magnitude else None

    def forward(self, x: torch.Tensor, slot: Slot = 0, shared: torch.Tensor | None = None) -> torch.Tensor:
        """``shared``: W' x when the caller already has it (a fused q|k|v or gate|up matmul, see
        ``fused_inputs``); the bias and the depth's LoRA are added to it."""
        bias = None if self.bias is None else _select(self.bias, slot)
        if self.magnitude is None:
            return self._product(x, slot, shared, bias)
        y = self._product(x, slot, shared, None) * _select(self.magnitude, slot)  # the bias is not scaled
        return y if bias is None else y + bias

    def _product(self, x: torch.Tensor, slot: Slot, shared: torch.Tensor | None, bias) -> torch.Tensor:
        """(W' + B_s A_s) x + b."""
        if shared is not None:
            y = shared if bias is None else shared + bias
        elif isinstance(slot, int) and self.lora_A is not None and self.quant is None and self._merge_pays(x):
            return F.linear(x, self.weight + self.lora_B[slot] @ self.lora_A[slot], bias)
        elif bias is None or bias.dim() == 1:
            y = self._shared(x, bias, slot)
        else:  # one bias row per token (per-depth biases in a mixed-depth batch)
            y = self._shared(x, None, slot) + bias
        if self.lora_A is None:
            return y
        if isinstance(slot, int):
            return y + cpu_products.lora(x, self.lora_A[slot], self.lora_B[slot], self.lora_plan)
        return y + self._grouped_lora(x, slot)

    def _shared(self, x: torch.Tensor, bias: torch.Tensor | None, slot: Slot = 0) -> torch.Tensor:
        """W' x + b through the quantized weight (one per depth when quantized with the LoRA merged: ``slot``
        picks it), the way measured fastest on this CPU (models/cpu_products.py) or F.linear."""
        if self.quant is not None:
            return self.quant.linear(x, bias, slot)
        return cpu_products.linear(x, self.weight, bias, self.cpu_weight)

    def _merge_pays(self, x: torch.Tensor) -> bool:
        """Whether W + B_s A_s costs fewer multiply-adds than the LoRA path for this many tokens.

        The LoRA path costs n * r * (in + out) per token batch (forward, and about as much per backward
        pass), merging costs r * in * out whatever n is; training batches (n in the hundreds or more)
        are past the break-even point, decode steps are not. Merging keeps one dense weight per depth alive for
        the backward pass (the size of the shared weights, per loop), which activation checkpointing
        frees with the rest.
        """
        if not self.merge_lora:
            return False
        tokens = x.numel() // self.in_features
        return tokens * (self.in_features + self.out_features) > self.in_features * self.out_features

    def _grouped_lora(self, x: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """LoRA for a batch that mixes depths: one matmul pair per depth present (SGMV-style
        grouping), never a Python loop over tokens."""
        flat_x, flat_s = x.reshape(-1, x.shape[-1]), slot.reshape(-1)
        out = flat_x.new_zeros(flat_x.shape[0], self.out_features)
        for s in range(self.lora_A.shape[0]):
            idx = (flat_s == s).nonzero(as_tuple=True)[0]
            if idx.numel():
                out.index_copy_(0, idx, cpu_products.lora(flat_x[idx], self.lora_A[s], self.lora_B[s], self.lora_plan))
        return out.reshape(*x.shape[:-1], self.out_features)

    def merged_weight(self, slot: int) -> torch.Tensor:
        """The dense weight depth ``slot`` effectively uses: m_s * (W' + B_s A_s)."""
        w = self.weight.detach() if self.quant is None else self.quant.dequantize(slot)
        w = w.clone() if self.lora_A is None else (w + self.lora_B[slot] @ self.lora_A[slot]).detach()
        return w if self.magnitude is None else w * self.magnitude[slot].detach()[:, None]

    @property
    def per_depth(self) -> bool:
        """Whether a depth's dense weight is its own (a LoRA or a magnitude on top of the shared one)."""
        return self.lora_A is not None or self.magnitude is not None


def fused_inputs(fused: nn.Module | None, x: torch.Tensor, n: int, slot: Slot = 0) -> tuple[torch.Tensor | None, ...]:
    """The shared outputs W'x of linears that read the same input, from one matmul on their stacked
    weights (``fused.linear``, split by ``fused.sizes``; depth ``slot``'s when the LoRA is merged per depth),
    or ``n`` Nones when there is no fused weight. On CPU with int4/int8 weights one call replaces three
    (q|k|v) or two (gate|up), and each call into the kernel has a fixed cost."""
    if fused is None:
        return (None,) * n
    return fused.linear(x, slot=slot).split(fused.sizes, -1)


# --- rotary embeddings ------------------------------------------------------------------------


def rope_inv_freq(params: dict, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and cos/sin scale of one rotary setting (default, linear, llama3)."""
    dim = int(head_dim * params.get("partial", 1.0))
    inv = 1.0 / (params["theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = params.get("type", "default")
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / params["factor"], 1.0
    if kind == "llama3":
        factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        inv_l = torch.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
        is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(is_medium, smoothed, inv_l), 1.0
    raise ConfigError(f"rope type {kind!r} is not supported; looplm supports default, linear, llama3")


class Rotary(nn.Module):
    """cos/sin tables for each attention kind ("full", "sliding") present in the config."""

    def __init__(self, config: LoopLMConfig):
        super().__init__()
        self.config = config
        self.kinds = sorted(config.rope)
        self.scales = {}
        for kind in self.kinds:
            inv, scale = rope_inv_freq(config.rope[kind], config.head_dim)
            self.register_buffer(f"inv_freq_{kind}", inv, persistent=False)
            self.scales[kind] = scale

    @torch.no_grad()
    def reset(self) -> None:
        """Recompute the frequencies, in float32 (transformers builds models on the meta device, so
        non-persistent buffers must be filled in again after loading)."""
        for kind in self.kinds:
            inv, _ = rope_inv_freq(self.config.rope[kind], self.config.head_dim)
            setattr(self, f"inv_freq_{kind}", inv.to(getattr(self, f"inv_freq_{kind}").device))

    def _apply(self, fn, recurse=True):
        """Moves between devices reach the frequencies as usual; a cast of the model (``.to(torch.bfloat16)``)
        does not: they stay float32 and exact, computed again (rounded, they would turn far positions' angles,
        and widening them back would keep the rounding)."""
        super()._apply(fn, recurse)
        if any(getattr(self, f"inv_freq_{kind}").dtype != torch.float32 for kind in self.kinds):
            self.reset()
        return self

    @torch.no_grad()
    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> dict:
        tables = {}
        for kind in self.kinds:
            inv = getattr(self, f"inv_freq_{kind}")
            freqs = position_ids[..., None].float() * inv.float()
            emb = torch.cat((freqs, freqs), dim=-1)
            tables[kind] = ((emb.cos() * self.scales[kind]).to(dtype), (emb.sin() * self.scales[kind]).to(dtype))
        if "sliding" not in tables:
            tables["sliding"] = tables["full"]
        return tables


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [b, heads, t, head_dim]; cos/sin: [b, t, rot_dim]. Rotates the first rot_dim dims."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)


# --- attention and MLP ------------------------------------------------------------------------


def prefix_columns(mask: torch.Tensor, P: int) -> torch.Tensor:
    """A boolean attention mask [..., kv] with P leading True columns (a prefix every query attends to)."""
    if not P:
        return mask
    return torch.cat((mask.new_ones(*mask.shape[:-1], P), mask), dim=-1)


def rotary_off_slots(config: LoopLMConfig, layer: int) -> list[bool] | None:
    """For block ``layer``, per slot: True where that slot's depth takes no rotary embedding
    (SmolLM3's NoPE layers); None when every depth rotates."""
    if all(config.depth_rope):
        return None
    return [not config.depth_rope[d] for d in config.plan.block_depths[layer]]


def block_ranks(config: LoopLMConfig, layer: int) -> dict:
    """LoRA ranks of block ``layer``: the config's for a shared block, none for a unique one (it is the
    original's own layer, exact without one)."""
    if config.plan.is_unique(layer):
        return {g: 0 for g in config.lora_ranks}
    return config.lora_ranks


def block_magnitude(config: LoopLMConfig, layer: int) -> bool:
    """Whether block ``layer``'s linears carry a magnitude per depth: a shared block of a model converted with one
    (a unique block is the original's own layer)."""
    return config.magnitude and not config.plan.is_unique(layer) and config.plan.looped


class Attention(nn.Module):
    def __init__(self, config: LoopLMConfig, layer: int = 0):
        super().__init__()
        c = config
        B, S, r = c.block_slots(layer), c.vector_slots(layer), block_ranks(c, layer)
        m = block_magnitude(c, layer)
        H, KV, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = H, KV, d
        self.q_proj = LoopLinear(c.hidden_size, H * d, c.attention_bias, B, S, r["q"], m)
        self.k_proj = LoopLinear(c.hidden_size, KV * d, c.attention_bias, B, S, r["kv"], m)
        self.v_proj = LoopLinear(c.hidden_size, KV * d, c.attention_bias, B, S, r["kv"], m)
        self.o_proj = LoopLinear(H * d, c.hidden_size, c.attention_out_bias, B, S, r["out"], m)
        # q/k norms per head (over head_dim) or over the whole projection (OLMo-2's, before the head split)
        self.qk_norm_all = c.qk_norm and c.qk_norm_scope == "all"
        q_dim, k_dim = (H * d, KV * d) if self.qk_norm_all else (d, d)
        self.q_norm = DepthNorm(q_dim, c.norm_type, c.norm_eps, S) if c.qk_norm else None
        self.k_norm = DepthNorm(k_dim, c.norm_type, c.norm_eps, S) if c.qk_norm else None
        self.rotary_off = rotary_off_slots(c, layer)
        self.scale = (c.query_pre_attn_scalar or c.head_dim) ** -0.5
        self.softcap = c.attn_logit_softcap
        # Per-depth prefix (paper appendix G): P learned vectors per depth in the attention's input space,
        # [slots, P, hidden]; their keys and values come from that depth's k/v projections (``prefix_kv``).
        self.prefix = nn.Parameter(torch.empty(B, c.prefix_length, c.hidden_size)) if c.prefix_length else None
        self.qkv = None  # the stacked q|k|v weight of quantized serving (models/quantized.py), never saved

    def project(self, x: torch.Tensor, slot: Slot, cos: torch.Tensor, sin: torch.Tensor):
        """x [b, t, hidden] -> rotated q [b, H, t, d] and k, v [b, KV, t, d]."""
        b, t, _ = x.shape
        if not isinstance(slot, int):
            slot_h = slot.unsqueeze(-1)  # per-token slot broadcast over heads for q/k norms
        sq, sk, sv = fused_inputs(self.qkv, x, 3, slot)
        q, k = self.q_proj(x, slot, sq), self.k_proj(x, slot, sk)
        if self.qk_norm_all:
            q, k = self.q_norm(q, slot), self.k_norm(k, slot)
        q = q.view(b, t, self.num_heads, self.head_dim)
        k = k.view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x, slot, sv).view(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.qk_norm_all:
            s = slot if isinstance(slot, int) else slot_h.expand(b, t, self.num_heads)
            q = self.q_norm(q, s)
            s = slot if isinstance(slot, int) else slot_h.expand(b, t, self.num_kv_heads)
            k = self.k_norm(k, s)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        return self.rotate(q, slot, cos, sin), self.rotate(k, slot, cos, sin), v

    def rotate(self, x: torch.Tensor, slot: Slot, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [b, heads, t, d] rotated, except at the depths that take no rotary embedding (``rotary_off``)."""
        if self.rotary_off is None:
            return apply_rotary(x, cos, sin)
        if isinstance(slot, int):
            return x if self.rotary_off[slot] else apply_rotary(x, cos, sin)
        off = torch.tensor(self.rotary_off, device=x.device)[slot]  # one flag per token: [b, t]
        return torch.where(off[:, None, :, None], x, apply_rotary(x, cos, sin))

    def prefix_kv(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [1, KV, P, d] of depth ``slot``'s prefix: its P vectors through this depth's k/v
        projections (bias, LoRA and k-norm included), not rotated: a prefix has no position."""
        x = self.prefix[slot][None]
        P = x.shape[1]
        _, sk, sv = fused_inputs(self.qkv, x, 3, slot)  # with a stacked q|k|v weight: one matmul, not two full ones
        k = self.k_proj(x, slot, sk)
        if self.qk_norm_all:
            k = self.k_norm(k, slot)
        k = k.view(1, P, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x, slot, sv).view(1, P, self.num_kv_heads, self.head_dim)
        if self.k_norm is not None and not self.qk_norm_all:
            k = self.k_norm(k, slot)
        return k.transpose(1, 2), v.transpose(1, 2)

    def add_prefix(self, q_len: int, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, slot: int):
        """k, v [b, KV, t, d] with depth ``slot``'s prefix keys and values in front, and ``mask`` (as
        ``attend`` takes it; None = causal) with P leading columns that every query attends to."""
        pk, pv = self.prefix_kv(slot)
        b, P, t = k.shape[0], pk.shape[2], k.shape[2]
        k = torch.cat((pk.to(k.dtype).expand(b, -1, -1, -1), k), dim=2)
        v = torch.cat((pv.to(v.dtype).expand(b, -1, -1, -1), v), dim=2)
        if mask is None:
            if q_len == 1:  # one query attends to everything, prefix included
                return k, v, None
            mask = torch.ones(q_len, t, dtype=torch.bool, device=k.device).tril(t - q_len)[None, None]
        return k, v, prefix_columns(mask, P)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Scaled dot-product attention; mask is a bool [b|1, 1, q, kv] (True = attend) or None
        for plain causal attention over equal-length q and kv."""
        if self.softcap is None:
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                is_causal=mask is None and q.shape[2] > 1,
                scale=self.scale,
                enable_gqa=self.num_kv_heads != self.num_heads,
            )
        # Gemma 2 soft-caps the attention logits, which SDPA cannot do: compute them by hand.
        rep = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        scores = torch.tanh(scores / self.softcap) * self.softcap
        if mask is None:
            mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(k.shape[2] - q.shape[2])
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        return torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), v)

    def attend_one(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Attention of one query per sequence (a decode step): q [b, H, 1, d], k, v [b, KV, t, d] (views
        into a cache are fine), mask a bool [b, 1, 1, t]. On CPU, for four or more sequences, the query
        heads that share a KV head are one matmul against it, faster than SDPA at that size (slower below it);
        otherwise ``attend``."""
        if q.device.type != "cpu" or q.shape[0] < 4:
            return self.attend(q, k, v, mask)
        b, H, _, d = q.shape
        kv = k.shape[1]
        scores = torch.matmul(q.view(b, kv, H // kv, d) * self.scale, k.transpose(-1, -2))  # [b, KV, H/KV, t]
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        scores = scores.masked_fill(~mask.view(b, 1, 1, -1), float("-inf"))
        return torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), v).view(b, H, 1, d)


ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class MLP(nn.Module):
    """GLU (down(act(gate x) * up x)) or plain (down(act(up x))) feed-forward."""

    def __init__(self, config: LoopLMConfig, layer: int = 0):
        super().__init__()
        c = config
        if c.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"activation {c.hidden_act!r} is not supported; use one of {sorted(ACTIVATIONS)}")
        B, S, r = c.block_slots(layer), c.vector_slots(layer), block_ranks(c, layer)["ffn"]
        m = block_magnitude(c, layer)
        self.act = ACTIVATIONS[c.hidden_act]
        self.gate_proj = (
            LoopLinear(c.hidden_size, c.intermediate_size, c.mlp_bias, B, S, r, m) if c.mlp_type == "glu" else None
        )
        self.up_proj = LoopLinear(c.hidden_size, c.intermediate_size, c.mlp_bias, B, S, r, m)
        self.down_proj = LoopLinear(c.intermediate_size, c.hidden_size, c.mlp_bias, B, S, r, m)
        self.gate_up = None  # the stacked gate|up weight of quantized serving (models/quantized.py), never saved

    def forward(self, x: torch.Tensor, slot: Slot) -> torch.Tensor:
        if self.gate_proj is None:
            return self.down_proj(self.act(self.up_proj(x, slot)), slot)
        sg, su = fused_inputs(self.gate_up, x, 2, slot)
        return self.down_proj(self.act(self.gate_proj(x, slot, sg)) * self.up_proj(x, slot, su), slot)


class Block(nn.Module):
    """Transformer block ``layer`` of the plan (shared by the depths that run it, or unique). Residual layouts:
    sequential (Llama, Gemma), sandwich norms (Gemma 2/3: norms before and after each sublayer; OLMo-2: only
    after), parallel (GPT-NeoX)."""

    def __init__(self, config: LoopLMConfig, layer: int = 0):
        super().__init__()
        c, S = config, config.vector_slots(layer)
        self.parallel = c.parallel_residual
        self.attn = Attention(c, layer)
        self.mlp = MLP(c, layer)
        pre = c.norm_type if c.pre_norms else "scale"
        self.attn_norm = DepthNorm(c.hidden_size, pre, c.norm_eps, S)
        self.mlp_norm = DepthNorm(c.hidden_size, pre, c.norm_eps, S)
        self.attn_out_norm = DepthNorm(c.hidden_size, c.norm_type, c.norm_eps, S) if c.sandwich_norms else None
        self.mlp_out_norm = DepthNorm(c.hidden_size, c.norm_type, c.norm_eps, S) if c.sandwich_norms else None
        # the block that ends every loop scales its output, loop i's by row i (models/config.py ``loop_scale``)
        ends_loops = c.loop_scale and layer == c.plan.loop_end_block
        self.loop_scale = DepthNorm(c.hidden_size, "scale", c.norm_eps, c.num_loops) if ends_loops else None

    def forward(self, h, slot, cos, sin, mask, cache=None, depth: int = 0):
        """Dense attention over this call's tokens plus, with a cache, the depth's cached keys/values
        (``cache.update(k, v, depth)``, transformers' Cache interface) and, with a prefix, the depth's
        prefix keys/values (never cached: the cache holds tokens only, so its length stays the position)."""

        def attend(q, k, v, attn):
            if cache is not None:
                k, v = cache.update(k, v, depth)
            if attn.prefix is None:
                return attn.attend(q, k, v, mask)
            k, v, prefixed = attn.add_prefix(q.shape[2], k, v, mask, slot)
            return attn.attend(q, k, v, prefixed)

        return self.forward_attend(h, slot, cos, sin, attend)

    def forward_attend(self, h, slot, cos, sin, attend_fn):
        """``forward`` with the attention core supplied by the caller (serving engines that keep their
        own KV cache and mix requests, positions and depths in one flat batch).

        ``attend_fn(q, k, v, attn)`` gets the rotated q [b, H, t, d], k, v [b, KV, t, d] of this
        block and returns the attention output [b, H, t, d]; norms, projections, per-depth LoRA
        (grouped when ``slot`` is a per-token tensor), MLP and residuals are exactly ``forward``'s."""
        q, k, v = self.attention_inputs(h, slot, cos, sin)
        return self.after_attention(h, attend_fn(q, k, v, self.attn), slot)

    # The two halves of ``forward_attend``, around the attention core: a serving engine may compile them
    # (serve/compiled.py) and keep the attention core, which reads its own cache, eager.
    def attention_inputs(self, h, slot, cos, sin):
        """Rotated q [b, H, t, d] and k, v [b, KV, t, d] of input ``h``."""
        return self.attn.project(self.attn_norm(h, slot), slot, cos, sin)

    def after_attention(self, h, out, slot):
        """The block's output from its input ``h`` and the attention output ``out`` [b, H, t, d]."""
        b, _, t, _ = out.shape
        a = self.attn.o_proj(out.transpose(1, 2).reshape(b, t, -1), slot)
        if self.parallel:
            h = h + a + self.mlp(self.mlp_norm(h, slot), slot)
        else:
            if self.attn_out_norm is not None:
                a = self.attn_out_norm(a, slot)
            h = h + a
            m = self.mlp(self.mlp_norm(h, slot), slot)
            if self.mlp_out_norm is not None:
                m = self.mlp_out_norm(m, slot)
            h = h + m
        return h if self.loop_scale is None else self.loop_scale(h, slot)

    def project_kv(self, h, slot, cos, sin):
        """The rotated k, v [b, KV, t, d] this block would cache for input ``h`` (no attention, no
        MLP): used to fill the KV entries of depths an early-exited token skipped (CALM-style copy)."""
        _, k, v = self.attn.project(self.attn_norm(h, slot), slot, cos, sin)
        return k, v
