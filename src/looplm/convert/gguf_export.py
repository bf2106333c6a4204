"""`looplm export-gguf`: a looped model as a llama-architecture GGUF file that llama.cpp and ollama run.

The model is unrolled first (``unroll``: each depth's LoRA merged into its own dense weights, per-depth
norms copied), so the file is a vanilla Llama with L = K x B layers: the looped model's exact function,
without its parameter sharing (llama.cpp has no looped architecture). Tensor names and the q/k row
permutation follow llama.cpp's own converter (convert_hf_to_gguf.py, LlamaModel): GGUF stores rotary
pairs interleaved, transformers' layout stores them as halves. The tokenizer goes in as GGUF BPE
metadata (tokens, types, merges, special ids, chat template).

Tensor types: ``f32``, ``f16``, ``q8_0`` or ``q4_1`` (the quantized types through the ``gguf`` package's
numpy quantizers; norms stay f32, and with ``q4_1`` the embedding is q8_0, as in the SmolLM2 Q4_1 file).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import torch

from ..errors import UsageError
from .recursive import unroll

TYPES = ("f32", "f16", "q8_0", "q4_1")


def llama_lacks(c) -> list[str]:
    """The features of config ``c`` that llama.cpp's llama architecture cannot run (empty: exportable)."""
    rope = c.rope["full"]
    window_binds = "sliding" in c.depth_attention and c.sliding_window_size < c.max_position_embeddings
    checks = (
        (c.norm_type != "rms", f"{c.norm_type} norms"),
        (c.mlp_type != "glu" or c.hidden_act != "silu", f"a {c.mlp_type} {c.hidden_act} MLP (llama: SwiGLU)"),
        (c.parallel_residual, "parallel residuals"),
        (not c.pre_norms or c.sandwich_norms, "post-norms"),
        (c.qk_norm, "q/k norms"),
        (c.embedding_multiplier is not None, "scaled embeddings"),
        (c.attn_logit_softcap is not None or c.final_logit_softcap is not None, "logit soft-caps"),
        (window_binds, f"sliding-window attention ({c.sliding_window_size} tokens)"),
        (c.attention_bias or c.attention_out_bias, "attention biases"),
        (c.mlp_bias, "MLP biases"),
        (not all(c.depth_rope), "layers without rotary embeddings (NoPE)"),
        (rope.get("partial", 1.0) != 1.0, "partial rotary embeddings"),
        (rope.get("type", "default") != "default", f"{rope.get('type')} rope scaling"),
    )
    return [feature for lacking, feature in checks if lacking]


def _check_llama(c) -> None:
    lacks = llama_lacks(c)
    if lacks:
        raise UsageError(
            f"export-gguf writes llama-architecture files; this {c.family} model has {', '.join(lacks)}, which "
            "looplm's llama export cannot express (export Llama/SmolLM2/TinyLlama-family models)"
        )


def permute_rotary(w: torch.Tensor, heads: int) -> torch.Tensor:
    """transformers' rotate-half row order -> GGUF's interleaved pairs, per head (llama.cpp's permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _tokenizer_fields(tokenizer) -> dict:
    """GGUF BPE tokenizer metadata from a transformers fast tokenizer (byte-level BPE, as llama.cpp's 'gpt2')."""
    tj = json.loads(tokenizer.backend_tokenizer.to_str())
    if tj["model"]["type"] != "BPE":
        raise UsageError(f"export-gguf handles byte-level BPE tokenizers; this one is {tj['model']['type']}")
    vocab = dict(tj["model"]["vocab"])
    added = {t["id"]: t for t in tj.get("added_tokens", [])}
    vocab.update({t["content"]: i for i, t in added.items()})
    size = max(vocab.values()) + 1
    tokens, types = [f"[PAD{i}]" for i in range(size)], [5] * size  # 5: unused
    for tok, i in vocab.items():
        tokens[i] = tok
        types[i] = 1  # normal
    for i, t in added.items():
        types[i] = 3 if t.get("special") else 4  # control / user-defined
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"].get("merges", [])]
    return {"tokens": tokens, "types": types, "merges": merges}


def source_pre(config) -> str:
    """llama.cpp's pre-tokenizer name for the model's tokenizer: read from the GGUF file the model was
    converted from (embedded models are GGUF files), else "default"."""
    import gguf

    from ..models.loading import EMBEDDED, embedded_gguf

    src = str(config.conversion.get("source", ""))
    path = embedded_gguf(src) if src in EMBEDDED else Path(src)
    if path.suffix != ".gguf" or not path.is_file():
        return "default"
    field = gguf.GGUFReader(str(path)).fields.get("tokenizer.ggml.pre")
    return str(field.contents()) if field is not None else "default"


def export_gguf(model, tokenizer, out: str | Path, tensor_type: str = "f32", pre: str = "default") -> dict:
    """Write ``model`` unrolled to a llama-architecture GGUF file ``out`` (``pre``: llama.cpp's pre-tokenizer name)
    and return what was written: layers, loops, tensor type and bytes."""
    import gguf

    if tensor_type not in TYPES:
        raise UsageError(f"unknown tensor type {tensor_type!r}; use one of {', '.join(TYPES)}")
    if tokenizer is None:
        raise UsageError("export-gguf needs the model's tokenizer (a directory saved with one)")
    c = model.config
    _check_llama(c)
    dense = unroll(model).float()
    dc = dense.config
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    _add_hyperparameters(w, c, dc, tensor_type)
    _add_tokenizer(w, tokenizer, dc.vocab_size, pre, bool(getattr(c, "add_bos_token", False)))
    _add_tensors(w, dense, tensor_type)
    _write_then_rename(w, tmp, out)
    return {"layers": dc.num_hidden_layers, "loops": c.num_loops, "type": tensor_type, "bytes": out.stat().st_size}


def _add_hyperparameters(w, c, dc, tensor_type: str) -> None:
    """The llama metadata of the unrolled model (config ``dc``), named after the looped one (``c``)."""
    import gguf

    file_types = {
        "f32": gguf.LlamaFileType.ALL_F32,
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
        "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
    }
    w.add_name(str(c.conversion.get("source", "looplm model")) + f" (looplm, B={c.num_loops}, unrolled)")
    w.add_context_length(dc.max_position_embeddings)
    w.add_embedding_length(dc.hidden_size)
    w.add_block_count(dc.num_hidden_layers)
    w.add_feed_forward_length(dc.intermediate_size)
    w.add_head_count(dc.num_attention_heads)
    w.add_head_count_kv(dc.num_key_value_heads)
    w.add_rope_dimension_count(dc.head_dim)
    if dc.head_dim * dc.num_attention_heads != dc.hidden_size:
        w.add_key_length(dc.head_dim)
        w.add_value_length(dc.head_dim)
    w.add_rope_freq_base(float(dc.rope["full"]["theta"]))
    w.add_layer_norm_rms_eps(float(dc.norm_eps))
    w.add_vocab_size(dc.vocab_size)
    w.add_file_type(file_types[tensor_type])


def _add_tokenizer(w, tokenizer, vocab_size: int, pre: str, add_bos: bool) -> None:
    """The tokenizer as GGUF BPE metadata, its token list padded to the model's ``vocab_size`` rows."""
    tf = _tokenizer_fields(tokenizer)
    if len(tf["tokens"]) > vocab_size:
        raise UsageError(f"the tokenizer has {len(tf['tokens'])} tokens, the model's vocabulary {vocab_size}")
    pad = vocab_size - len(tf["tokens"])  # models may have more rows than the tokenizer has tokens
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tf["tokens"] + [f"[PAD{i}]" for i in range(len(tf["tokens"]), vocab_size)])
    w.add_token_types(tf["types"] + [5] * pad)
    w.add_token_merges(tf["merges"])
    special = {
        "bos": tokenizer.bos_token_id,
        "eos": tokenizer.eos_token_id,
        "unk": tokenizer.unk_token_id,
        "pad": tokenizer.pad_token_id,
    }
    for name, tid in special.items():
        if tid is not None:
            getattr(w, f"add_{name}_token_id")(int(tid))  # add_bos_token_id, add_eos_token_id, ...
    w.add_add_bos_token(add_bos)
    w.add_add_space_prefix(False)
    if getattr(tokenizer, "chat_template", None):
        w.add_chat_template(tokenizer.chat_template)


def _add_tensor(w, name: str, t: torch.Tensor, kind: str) -> None:
    """One tensor in GGUF type ``kind``; vectors (norms) stay f32 whatever ``kind``."""
    import gguf
    from gguf.quants import quantize

    a = t.detach().float().contiguous().numpy()
    if a.ndim == 1 or kind == "f32":
        w.add_tensor(name, a.astype(np.float32))
    elif kind == "f16":
        w.add_tensor(name, a.astype(np.float16))
    else:
        qtype = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_1": gguf.GGMLQuantizationType.Q4_1}[kind]
        w.add_tensor(name, quantize(a, qtype), raw_dtype=qtype)


def _add_tensors(w, dense, tensor_type: str) -> None:
    """The unrolled model's tensors under llama.cpp's names, q and k rows in GGUF's rotary order."""
    dc, m = dense.config, dense.model
    put = functools.partial(_add_tensor, w)
    emb_kind = "q8_0" if tensor_type == "q4_1" else tensor_type  # as in the SmolLM2 Q4_1 file
    put("token_embd.weight", m.embed_tokens.weight, emb_kind)
    put("output_norm.weight", m.norm.weight[0], "f32")
    if not dc.tie_word_embeddings:
        put("output.weight", dense.lm_head.weight, emb_kind)
    H, KV = dc.num_attention_heads, dc.num_key_value_heads
    for i, layer in enumerate(m.layers):
        a, f = layer.attn, layer.mlp
        put(f"blk.{i}.attn_norm.weight", layer.attn_norm.weight[0], "f32")
        put(f"blk.{i}.attn_q.weight", permute_rotary(a.q_proj.weight, H), tensor_type)
        put(f"blk.{i}.attn_k.weight", permute_rotary(a.k_proj.weight, KV), tensor_type)
        put(f"blk.{i}.attn_v.weight", a.v_proj.weight, tensor_type)
        put(f"blk.{i}.attn_output.weight", a.o_proj.weight, tensor_type)
        put(f"blk.{i}.ffn_norm.weight", layer.mlp_norm.weight[0], "f32")
        put(f"blk.{i}.ffn_gate.weight", f.gate_proj.weight, tensor_type)
        put(f"blk.{i}.ffn_up.weight", f.up_proj.weight, tensor_type)
        put(f"blk.{i}.ffn_down.weight", f.down_proj.weight, tensor_type)


def _write_then_rename(w, tmp: Path, out: Path) -> None:
    """Write the file under ``tmp`` and rename it to ``out``: a failed export leaves no partial file at ``out``."""
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
