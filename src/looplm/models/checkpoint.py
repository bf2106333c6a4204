"""looplm checkpoints: config.json + model.safetensors, readable by transformers' Auto classes.

Shared layers are stored once (the module holds K layers, not L), so a B-loop model's file holds
1/B of the original's layer bytes plus its LoRAs. A tied LM head is not stored twice.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from . import quantized as q
from .config import ConfigError, LoopLMConfig
from .decoder import LoopLMForCausalLM
from .layers import Rotary

WEIGHTS = "model.safetensors"


def save_checkpoint(model: LoopLMForCausalLM, directory: str | Path, state_dict: dict | None = None) -> None:
    """``model`` as a checkpoint directory; ``state_dict``: the weights to write in place of the model's own (e.g.
    gathered whole from layers sharded over processes)."""
    if q.is_quantized(model):
        raise ConfigError(
            "this model was quantized in memory; store a quantized model with `looplm quantize` "
            "from its float checkpoint"
        )
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(str(d))
    sd = dict(model.state_dict() if state_dict is None else state_dict)
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    save_file({k: v.detach().contiguous() for k, v in sd.items()}, str(d / WEIGHTS), metadata={"format": "pt"})


def load_checkpoint(directory: str | Path, dtype=torch.float32) -> LoopLMForCausalLM:
    d = Path(directory)
    try:
        config = LoopLMConfig.from_pretrained(str(d))
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"cannot read {d / 'config.json'} ({e}); re-create the checkpoint") from e
    if not (d / WEIGHTS).exists():
        raise ConfigError(f"{d} has no {WEIGHTS}: the checkpoint is incomplete; re-run the command that wrote it")
    quantized = bool(getattr(config, "quantization", None))
    try:
        sd = load_file(str(d / WEIGHTS)) if quantized else _read_floats_as(d / WEIGHTS, dtype)
    except (SafetensorError, OSError, ValueError) as e:
        raise ConfigError(f"{d / WEIGHTS} is corrupt or truncated ({e}); re-create the checkpoint") from e
    if quantized:
        return _load_quantized(d, config, sd)
    # Built on the meta device and given the file's tensors themselves (assign): no randomly initialised copy,
    # so loading holds one copy of the weights, in ``dtype`` (a bf16 model never holds a float32 one).
    with torch.device("meta"):
        model = LoopLMForCausalLM(config)
    expected = model.state_dict()
    for name, tensor in sd.items():
        if name in expected and expected[name].shape != tensor.shape:
            raise ConfigError(
                f"{d / WEIGHTS}: {name} has shape {tuple(tensor.shape)} but config.json implies "
                f"{tuple(expected[name].shape)}; the weights and config.json do not belong together"
            )
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ConfigError(
            f"{d / WEIGHTS} does not match config.json: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}; re-create the checkpoint"
        )
    if config.tie_word_embeddings:
        model.tie_weights()
    # the rotary frequencies are not stored (non-persistent buffers, left on the meta device): computed again,
    # in float32 whatever ``dtype`` is (Rotary._apply)
    model.model.rotary = Rotary(config)
    return model.eval()


def _read_floats_as(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file in memory of its own, the floating-point ones cast to ``dtype``.
    safetensors hands out tensors backed by its mapping of the file, whose pages stay in the process while the
    file is open (and while any such tensor lives): read through one mapping, the peak is several times the
    weights' size. Each tensor is copied out of a mapping of its own instead: the peak is then what the process
    holds once loaded."""
    with safe_open(str(path), framework="pt") as f:
        keys = list(f.keys())
    out = {}
    for k in keys:
        with safe_open(str(path), framework="pt") as f:
            t = f.get_tensor(k)
            out[k] = t.to(dtype, copy=True) if t.is_floating_point() else t.clone()
    return out


def read_config(directory: str | Path) -> dict:
    return json.loads((Path(directory) / "config.json").read_text())


# --- quantized checkpoints (`looplm quantize`, models/quantized.py) ----------------------------------


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def save_quantized_checkpoint(
    model: LoopLMForCausalLM,
    directory: str | Path,
    fmt: str,
    group: int,
    dtype: torch.dtype,
    head: str = "int8",
    act_dtype: torch.dtype = q.DEFAULT_ACT,
    lora: str = "shared",
    moments: dict | None = None,
    calibration: dict | None = None,
    progress: bool = False,
) -> None:
    """config.json (with a ``quantization`` record: format, group size, float dtype, LoRA mode, rounding (GPTQ
    with ``moments``, ``calibration`` describing their data), the weights file's sha256) + model.safetensors: the
    portable quantized tensors (``NAME.q``/``.scale`` for int8,
    ``NAME.q4``/``.scale``/``.min`` for int4; with ``lora="merged"`` one per depth, and no LoRA tensors) and
    every other tensor in ``dtype``."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tensors = q.quantize_portable(model, fmt, group, head, lora, moments, progress=progress)
    merged = {
        f"{n}.{p}"
        for n, m in q.linears(model)
        if q.merges(m, lora)
        for p in ("weight", "lora_A", "lora_B", "magnitude")
    }
    sd = {
        k: v.detach().to(dtype).contiguous()
        for k, v in model.state_dict().items()
        if k not in tensors and k not in merged and k != "lm_head.weight"
    }  # lm_head: quantized, or tied
    for name, parts in tensors.items():
        sd.update({f"{name}.{part}": v.contiguous() for part, v in parts.items()})
    save_file(sd, str(d / WEIGHTS), metadata={"format": "pt"})
    config = copy.deepcopy(model.config)
    rounding = "gptq" if moments else "nearest"
    config.quantization = {
        **q.record(fmt, group, dtype, head, act_dtype, lora, rounding),
        **({"calibration": calibration} if calibration else {}),
        "sha256": _sha256(d / WEIGHTS),
    }
    config.save_pretrained(str(d))


def _load_quantized(d: Path, config: LoopLMConfig, sd: dict) -> LoopLMForCausalLM:
    """Build the model on the meta device, put the quantized weights in, then the float tensors: no float
    copy of a quantized weight is ever made."""
    rec = config.quantization
    fmt, dtype, act = rec.get("format"), q.DTYPES.get(rec.get("dtype")), q.DTYPES.get(rec.get("act_dtype"))
    lora = rec.get("lora", "shared")  # records written before the LoRA could be merged have no key
    if fmt not in ("int8", "int4") or dtype is None or act is None or "sha256" not in rec or lora not in q.LORA_MODES:
        raise ConfigError(f"{d / 'config.json'}: unreadable quantization record {rec}; re-run `looplm quantize`")
    q.check_format(fmt, "cpu")
    if _sha256(d / WEIGHTS) != rec["sha256"]:
        raise ConfigError(
            f"{d / WEIGHTS} does not match the checksum in config.json (corrupt or replaced); re-run `looplm quantize`"
        )
    with torch.device("meta"):
        model = LoopLMForCausalLM(config)
    names = [name for n, m in q.linears(model) for name in q.weight_names(n, m, lora)] + ["model.embed_tokens.weight"]
    names += ["lm_head.weight"] if any(k.startswith("lm_head.weight.") for k in sd) else []
    tensors = {}
    for name in names:
        parts = {k[len(name) + 1 :]: sd.pop(k) for k in [k for k in sd if k.startswith(name + ".")]}
        if set(parts) not in ({"q", "scale"}, {"q4", "scale", "min"}):
            raise ConfigError(f"{d / WEIGHTS}: {name} is missing or incomplete; re-run `looplm quantize`")
        tensors[name] = parts
    try:
        q.attach(model, tensors, dtype, act, lora=lora)
        # copies: tensors straight from load_file may keep the whole file's pages resident
        model.load_state_dict({k: v.clone() for k, v in sd.items()}, strict=True, assign=True)
    except (RuntimeError, KeyError, ValueError, IndexError) as e:
        first = str(e).strip().splitlines()[0]
        raise ConfigError(f"{d / WEIGHTS} does not match config.json ({first}); re-run `looplm quantize`") from e
    rotary = model.model.rotary
    rotary.to_empty(device="cpu")
    rotary.reset()
    del tensors, sd
    q.release_freed_memory()
    return model.eval()
