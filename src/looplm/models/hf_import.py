"""Hugging Face configs and weights -> a vanilla (B = 1) looplm model, for every supported family.

Each family is a config translation plus a table of weight names. GPT-NeoX's fused QKV weight is
split into q, k, v here (it is stored per head as [q; k; v]), so LoRA groups work the same for all.
"""

from __future__ import annotations

import torch

from .config import ConfigError, LoopLMConfig
from .decoder import LoopLMForCausalLM

FAMILIES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "smollm3": "llama",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
    "gpt_neox": "gpt_neox",
}


def _rope(params: dict, partial: float = 1.0) -> dict:
    out = {
        "theta": float(params.get("rope_theta", 10000.0)),
        "type": params.get("rope_type", "default"),
        "partial": float(params.get("partial_rotary_factor", partial)),
    }
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        if key in params:
            out[key] = params[key]
    return out


def config_from_hf(hf) -> LoopLMConfig:
    """Translate a transformers config of a supported family into a LoopLMConfig."""
    hf = hf.get_text_config(decoder=True) if hasattr(hf, "get_text_config") else hf
    family = FAMILIES.get(hf.model_type)
    if family is None:
        raise ConfigError(
            f"model type {hf.model_type!r} is not supported; looplm converts {', '.join(sorted(set(FAMILIES)))}"
        )
    L = hf.num_hidden_layers
    rope_params = hf.rope_parameters or {}
    layer_types = getattr(hf, "layer_types", None) or ["full_attention"] * L
    depth_attention = ["sliding" if t == "sliding_attention" else "full" for t in layer_types]
    if family == "gemma3":
        rope = {"full": _rope(rope_params["full_attention"]), "sliding": _rope(rope_params["sliding_attention"])}
    else:
        rope = {"full": _rope(rope_params)}
    common = dict(
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
        rope=rope,
        depth_attention=depth_attention,
        family=family,
    )
    if family == "llama":
        return LoopLMConfig(
            hidden_act=hf.hidden_act,
            mlp_type="glu",
            norm_type="rms",
            norm_eps=hf.rms_norm_eps,
            attention_bias=getattr(hf, "attention_bias", False),
            mlp_bias=getattr(hf, "mlp_bias", False),
            **common,
        )
    if family == "gpt_neox":
        return LoopLMConfig(
            hidden_act=hf.hidden_act,
            mlp_type="plain",
            norm_type="layer",
            norm_eps=hf.layer_norm_eps,
            attention_bias=getattr(hf, "attention_bias", True),
            mlp_bias=True,
            parallel_residual=hf.use_parallel_residual,
            **common,
        )
    # Gemma 1/2/3: GeGLU, (1 + w) RMSNorm, embeddings scaled by sqrt(hidden).
    act = getattr(hf, "hidden_activation", None) or hf.hidden_act
    gemma = dict(
        hidden_act=act,
        mlp_type="glu",
        norm_type="rms_plus1",
        norm_eps=hf.rms_norm_eps,
        attention_bias=getattr(hf, "attention_bias", False),
        embedding_multiplier=hf.hidden_size**0.5,
        add_bos_token=True,
        **common,
    )
    if family == "gemma":
        return LoopLMConfig(**gemma)
    return LoopLMConfig(
        sandwich_norms=True,
        qk_norm=family == "gemma3",
        query_pre_attn_scalar=hf.query_pre_attn_scalar,
        attn_logit_softcap=getattr(hf, "attn_logit_softcapping", None),
        final_logit_softcap=getattr(hf, "final_logit_softcapping", None),
        sliding_window_size=getattr(hf, "sliding_window", None),
        **gemma,
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


def _gemma2_names(i: int) -> dict:
    p = f"model.layers.{i}."
    names = _llama_names(i)
    names.update(
        {
            f"{p}post_attention_layernorm.weight": "attn_out_norm.weight",
            f"{p}pre_feedforward_layernorm.weight": "mlp_norm.weight",
            f"{p}post_feedforward_layernorm.weight": "mlp_out_norm.weight",
        }
    )
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
    """Rename (and for GPT-NeoX, split) a transformers state dict into looplm's layout (B = 1)."""
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
    names_of = {"gpt_neox": _neox_names, "gemma2": _gemma2_names, "gemma3": _gemma2_names}.get(fam, _llama_names)
    H, d = config.num_attention_heads, config.head_dim
    for i in range(config.num_hidden_layers):
        dst = f"model.layers.{i}."
        for src, name in names_of(i).items():
            if src in sd:
                out[dst + name] = sd[src][None] if _is_vector(name) else sd[src]
        if fam == "gpt_neox":
            qkv_w = sd[f"gpt_neox.layers.{i}.attention.query_key_value.weight"].view(H, 3, d, -1)
            qkv_b = sd[f"gpt_neox.layers.{i}.attention.query_key_value.bias"].view(H, 3, d)
            for j, n in enumerate("qkv"):
                out[f"{dst}attn.{n}_proj.weight"] = qkv_w[:, j].reshape(H * d, -1)
                out[f"{dst}attn.{n}_proj.bias"] = qkv_b[:, j].reshape(1, H * d)
    return out


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
