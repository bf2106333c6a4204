"""looplm checkpoints: config.json + model.safetensors, readable by transformers' Auto classes.

Shared layers are stored once (the module holds K layers, not L), so a B-loop model's file holds
1/B of the original's layer bytes plus its LoRAs. A tied LM head is not stored twice.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .config import ConfigError, LoopLMConfig
from .decoder import LoopLMForCausalLM

WEIGHTS = "model.safetensors"


def save_checkpoint(model: LoopLMForCausalLM, directory: str | Path) -> None:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(str(d))
    sd = model.state_dict()
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
    try:
        sd = load_file(str(d / WEIGHTS))
    except (SafetensorError, OSError, ValueError) as e:
        raise ConfigError(f"{d / WEIGHTS} is corrupt or truncated ({e}); re-create the checkpoint") from e
    model = LoopLMForCausalLM(config)
    expected = model.state_dict()
    for name, tensor in sd.items():
        if name in expected and expected[name].shape != tensor.shape:
            raise ConfigError(
                f"{d / WEIGHTS}: {name} has shape {tuple(tensor.shape)} but config.json implies "
                f"{tuple(expected[name].shape)}; the weights and config.json do not belong together"
            )
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ConfigError(f"{d / WEIGHTS} does not match config.json: missing {missing[:3]}, "
                          f"unexpected {unexpected[:3]}; re-create the checkpoint")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.to(dtype).eval()


def read_config(directory: str | Path) -> dict:
    return json.loads((Path(directory) / "config.json").read_text())
