"""Hugging Face configs and weights -> a vanilla (B = 1) looplm model, for every supported family.

Each family is a config translation plus a table of weight names. Fused weights are split here so that
LoRA groups (q, kv, out, ffn) mean the same in every family: GPT-NeoX's QKV (stored per head as
[q; k; v]) and Phi-3's qkv_proj ([q; k; v] whole) and gate_up_proj ([gate; up]).
"""

from __future__ import annotations

import torch

from .config import ConfigError, LoopLMConfig
from .decoder import LoopLMForCausalLM

# transformers model_type -> looplm family (the config translation and weight table it takes)
FAMILIES = {
    "llama": "llama",  # Llama 1-3.x, SmolLM2, TinyLlama (llama3 rope scaling included)
    "mistral": "llama",  # Llama layout with a sliding window over every layer
    "qwen2": "qwen2",  # q/k/v biases, no o bias
    "qwen3": "qwen3",  # q/k RMSNorm per head
    "smollm3": "smollm3",  # NoPE layers
    "phi3": "phi3",  # fused qkv and gate_up
    "olmo2": "olmo2",  # post-norms only, q/k norms over the whole projection
    "olmo3": "olmo2",  # OLMo-2 with sliding-window layers
    "gemma": "gemma",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
    "gpt_neox": "gpt_neox",
}
ROPE_TYPES = ("default", "linear", "llama3")

_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention"}


def refusal(hf) -> str | None:
    """The feature of ``hf`` (a transformers config) that looplm cannot convert faithfully, or None: every
    layer of a looped model must be the same kind of attention + MLP block, so that B depths can share it."""
    experts = [getattr(hf, a, None) for a in _EXPERT_COUNTS]
    if any(isinstance(n, int) and n > 1 for n in experts):
        return "mixture of experts"
    if getattr(hf, "cross_attention_layers", None):
        return "cross-attention layers"
    if getattr(hf, "is_encoder_decoder", False):
        return "an encoder-decoder layout"
    other = set(getattr(hf, "layer_types", None) or []) - _ATTENTION_LAYER_TYPES
    if other:
        return f"{', '.join(sorted(other))} layers"
    if any(t != "attention" for t in getattr(hf, "layers_block_type", None) or []):
        return "state-space (Mamba) layers"
    return None


def _rope(params: dict, partial: float = 1.0) -> dict:
    kind = params.get("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise ConfigError(
            f"rope scaling type {kind!r} is not supported (looplm reproduces {', '.join(ROPE_TYPES)}); "
            "convert a variant of the model without it (e.g. Phi-3's 4k-context models instead of the 128k ones)"
        )
    out = {
        "theta": float(params.get("rope_theta", 10000.0)),
        "type": kind,
        "partial": float(params.get("partial_rotary_factor", partial)),
    }
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        if key in params:
            out[key] = params[key]
    return out


def _attention_kinds(hf, L: int) -> tuple[list[str], int | None]:
    """Per depth "full" or "sliding", and the window. Mistral and Phi-3 slide every layer when their config
    has a window; the others name each layer in ``layer_types``. Qwen2/3 and SmolLM3 switch windows on with
    ``use_sliding_window``."""
    window = getattr(hf, "sliding_window", None)
    if not getattr(hf, "use_sliding_window", True):
        window = None
    if window is None:
        return ["full"] * L, None
    layer_types = getattr(hf, "layer_types", None) or ["sliding_attention"] * L
    return ["sliding" if t == "sliding_attention" else "full" for t in layer_types], window


def _rope_per_kind(hf) -> dict:
    """Rotary settings per attention kind: Gemma 3 and OLMo-3 key them by layer type, the others have one."""
    params = hf.rope_parameters or {}
    if "full_attention" in params:
        kinds = {"full": _rope(params["full_attention"])}
        if "sliding_attention" in params:
            kinds["sliding"] = _rope(params["sliding_attention"])
        return kinds
    return {"full": _rope(params, getattr(hf, "partial_rotary_factor", 1.0))}


def config_from_hf(hf) -> LoopLMConfig:
    """Translate a transformers config of a supported family into a LoopLMConfig."""
    hf = hf.get_text_config(decoder=True) if hasattr(hf, "get_text_config") else hf
    family = _supported_family(hf)
    common = _common_fields(hf, family)
    if family == "gpt_neox":
        return LoopLMConfig(**_neox_switches(hf), **common)
    if family.startswith("gemma"):
        return LoopLMConfig(**_gemma_switches(hf, family), **common)
    return LoopLMConfig(**_llama_switches(hf, family), **common)


def _supported_family(hf) -> str:
    """The looplm family of ``hf``, or a ConfigError naming what looplm cannot convert and what it can."""
    family = FAMILIES.get(hf.model_type)
    feature = refusal(hf)
    if feature is not None:
        raise ConfigError(
            f"model type {hf.model_type!r} has {feature}, which looplm cannot convert faithfully; "
            f"looplm converts {', '.join(sorted(FAMILIES))}"
        )
    if family is None:
        raise ConfigError(
            f"model type {hf.model_type!r} is not supported; looplm converts {', '.join(sorted(FAMILIES))}"
        )
    return family


def _common_fields(hf, family: str) -> dict:
    """What every family's config states alike: sizes, heads, special tokens, rotary and attention kinds."""
    L = hf.num_hidden_layers
    depth_attention, window = _attention_kinds(hf, L)
    return dict(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_hidden_layers=L,
        num_attention_heads=hf.num_attention_heads,
        num_key_value_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        max_position_embeddings=getattr(hf, "max_position_embeddings", 8192),
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        bos_token_id=hf.bos_token_id,
        eos_token_id=hf.eos_token_id,
        pad_token_id=getattr(hf, "pad_token_id", None),
        rope=_rope_per_kind(hf),
        depth_attention=depth_attention,
        sliding_window_size=window,
        family=family,
    )


def _neox_switches(hf) -> dict:
    """GPT-NeoX: plain MLP, LayerNorm, biases everywhere, parallel residuals where its config says so."""
    return dict(
        hidden_act=hf.hidden_act,
        mlp_type="plain",
        norm_type="layer",
        norm_eps=hf.layer_norm_eps,
        attention_bias=getattr(hf, "attention_bias", True),
        mlp_bias=True,
        parallel_residual=hf.use_parallel_residual,
    )


def _llama_switches(hf, family: str) -> dict:
    """The Llama layout and its relatives: SwiGLU, RMSNorm (w * x), pre-norms."""
    return dict(
        hidden_act=hf.hidden_act,
        mlp_type="glu",
        norm_type="rms",
        norm_eps=hf.rms_norm_eps,
        attention_bias=family == "qwen2" or bool(getattr(hf, "attention_bias", False)),
        attention_out_bias=False if family == "qwen2" else None,
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        qk_norm=family in ("qwen3", "olmo2"),
        qk_norm_scope="all" if family == "olmo2" else "head",
        pre_norms=family != "olmo2",
        sandwich_norms=family == "olmo2",
        # SmolLM3 names the layers that rotate (1) and the NoPE ones (0)
        depth_rope=getattr(hf, "no_rope_layers", None) if family == "smollm3" else None,
    )


def _gemma_switches(hf, family: str) -> dict:
    """Gemma 1/2/3: GeGLU, (1 + w) RMSNorm, embeddings scaled by sqrt(hidden); 2 and 3 add sandwich norms
    and soft-caps, 3 adds q/k norms."""
    switches = dict(
        hidden_act=getattr(hf, "hidden_activation", None) or hf.hidden_act,
        mlp_type="glu",
        norm_type="rms_plus1",
        norm_eps=hf.rms_norm_eps,
        attention_bias=getattr(hf, "attention_bias", False),
        embedding_multiplier=hf.hidden_size**0.5,
        add_bos_token=True,
    )
    if family == "gemma":
        return switches
    return dict(
        switches,
        sandwich_norms=True,
        qk_norm=family == "gemma3",
        query_pre_attn_scalar=hf.query_pre_attn_scalar,
        attn_logit_softcap=getattr(hf, "attn_logit_softcapping", None),
        final_logit_softcap=getattr(hf, "final_logit_softcapping", None),
    )


def _llama_names(i: int) -> dict:
    p = f"model.layers.{i}."
    names = {f"{p}self_attn.{n}_proj.{w}": f"attn.{n}_proj.{w}" for n in "qkvo" for w in ("weight", "bias")}
    names.update({f"{p}mlp.{n}_proj.weight": f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")})
    names.update({f"{p}mlp.{n}_proj.bias": f"mlp.{n}_proj.bias" for n in ("gate", "up", "down")})
    names.update(
        {
            f"{p}input_layernorm.weight": "attn_norm.weight",
            f"{p}post_attention_layernorm.weight": "mlp_norm.weight",
            f"{p}self_attn.q_norm.weight": "attn.q_norm.weight",
            f"{p}self_attn.k_norm.weight": "attn.k_norm.weight",
        }
    )
    return names


def _post_norm_names(p: str) -> dict:
    """The norms of the attention's and the MLP's outputs (Gemma 2/3, OLMo-2): looplm's post-norms."""
    return {
        f"{p}post_attention_layernorm.weight": "attn_out_norm.weight",
        f"{p}post_feedforward_layernorm.weight": "mlp_out_norm.weight",
    }


def _gemma2_names(i: int) -> dict:
    p = f"model.layers.{i}."
    names = _llama_names(i)
    names[f"{p}pre_feedforward_layernorm.weight"] = "mlp_norm.weight"
    names.update(_post_norm_names(p))
    return names


def _olmo2_names(i: int) -> dict:
    """OLMo-2 normalises each sublayer's output only: its two norms are looplm's post-norms."""
    p = f"model.layers.{i}."
    names = _llama_names(i)
    del names[f"{p}input_layernorm.weight"]
    names.update(_post_norm_names(p))
    return names


def _neox_names(i: int) -> dict:
    p = f"gpt_neox.layers.{i}."
    names = {}
    for w in ("weight", "bias"):
        names.update(
            {
                f"{p}input_layernorm.{w}": f"attn_norm.{w}",
                f"{p}post_attention_layernorm.{w}": f"mlp_norm.{w}",
                f"{p}attention.dense.{w}": f"attn.o_proj.{w}",
                f"{p}mlp.dense_h_to_4h.{w}": f"mlp.up_proj.{w}",
                f"{p}mlp.dense_4h_to_h.{w}": f"mlp.down_proj.{w}",
            }
        )
    return names


def _is_vector(name: str) -> bool:
    """Norm weights/biases and linear biases: stored as [slots, dim] in looplm."""
    return name.endswith("bias") or "norm" in name


def state_dict_from_hf(config: LoopLMConfig, sd: dict) -> dict:
    """Rename (and for GPT-NeoX and Phi-3, split) a transformers state dict into looplm's layout (B = 1)."""
    fam = config.family
    out = {}
    if fam == "gpt_neox":
        out["model.embed_tokens.weight"] = sd["gpt_neox.embed_in.weight"]
        out["model.norm.weight"] = sd["gpt_neox.final_layer_norm.weight"][None]
        out["model.norm.bias"] = sd["gpt_neox.final_layer_norm.bias"][None]
        out["lm_head.weight"] = sd.get("embed_out.weight", sd.get("lm_head.weight"))
    else:
        out["model.embed_tokens.weight"] = sd["model.embed_tokens.weight"]
        out["model.norm.weight"] = sd["model.norm.weight"][None]
        out["lm_head.weight"] = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    names_of = {"gpt_neox": _neox_names, "gemma2": _gemma2_names, "gemma3": _gemma2_names, "olmo2": _olmo2_names}
    for i in range(config.num_hidden_layers):
        dst = f"model.layers.{i}."
        for src, name in names_of.get(fam, _llama_names)(i).items():
            if src in sd:
                out[dst + name] = sd[src][None] if _is_vector(name) else sd[src]
        if fam == "gpt_neox":
            out.update(_split_neox_qkv(config, sd, i))
        if fam == "phi3":
            out.update(_split_phi3(config, sd, i))
        if not config.pre_norms:  # the identity scales in the pre-norms' place (LoopLMConfig.pre_norms)
            for name in ("attn_norm", "mlp_norm"):
                out[f"{dst}{name}.weight"] = torch.ones(1, config.hidden_size, dtype=out["model.norm.weight"].dtype)
    return out


def _split_neox_qkv(config: LoopLMConfig, sd: dict, i: int) -> dict:
    """GPT-NeoX stores q, k, v interleaved per head: [H, 3, d, in]."""
    H, d = config.num_attention_heads, config.head_dim
    qkv_w = sd[f"gpt_neox.layers.{i}.attention.query_key_value.weight"].view(H, 3, d, -1)
    qkv_b = sd[f"gpt_neox.layers.{i}.attention.query_key_value.bias"].view(H, 3, d)
    dst = f"model.layers.{i}.attn."
    out = {}
    for j, n in enumerate("qkv"):
        out[f"{dst}{n}_proj.weight"] = qkv_w[:, j].reshape(H * d, -1)
        out[f"{dst}{n}_proj.bias"] = qkv_b[:, j].reshape(1, H * d)
    return out


def _split_phi3(config: LoopLMConfig, sd: dict, i: int) -> dict:
    """Phi-3 stores q, k, v one after another in qkv_proj and gate, up one after the other in gate_up_proj."""
    p, dst = f"model.layers.{i}.", f"model.layers.{i}."
    q_rows = config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    q, k, v = sd[f"{p}self_attn.qkv_proj.weight"].split([q_rows, kv_rows, kv_rows])
    gate, up = sd[f"{p}mlp.gate_up_proj.weight"].chunk(2)
    return {
        f"{dst}attn.q_proj.weight": q,
        f"{dst}attn.k_proj.weight": k,
        f"{dst}attn.v_proj.weight": v,
        f"{dst}mlp.gate_proj.weight": gate,
        f"{dst}mlp.up_proj.weight": up,
    }


def from_hf_model(hf_model) -> LoopLMForCausalLM:
    """A vanilla looplm model with the weights of a transformers causal LM (any supported family)."""
    config = config_from_hf(hf_model.config)
    sd = {k: v.detach() for k, v in hf_model.state_dict().items()}
    return from_hf_state_dict(config, sd, dtype=next(hf_model.parameters()).dtype)


def from_hf_state_dict(config: LoopLMConfig, sd: dict, dtype=torch.float32) -> LoopLMForCausalLM:
    weights = state_dict_from_hf(config, sd)
    model = LoopLMForCausalLM(config).to(dtype)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ConfigError(
            f"checkpoint does not match the {config.family} layout: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()
