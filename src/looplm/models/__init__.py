"""The looped decoder and everything needed to open and save it. Imports nothing else of looplm's."""

from .checkpoint import load_checkpoint, save_checkpoint
from .config import LORA_GROUPS, ConfigError, LoopLMConfig, layer_map, slot_map
from .decoder import LoopLMForCausalLM, LoopLMModel
from .exit_adapter import ExitAdapter, add_exit_adapters, describe_spec, freeze_all_but_exit_adapter, parse_exit_adapter
from .hf_import import config_from_hf, from_hf_model
from .loading import EMBEDDED, load_hf_reference, load_model, save_model

__all__ = [
    "LORA_GROUPS",
    "ConfigError",
    "LoopLMConfig",
    "LoopLMForCausalLM",
    "LoopLMModel",
    "EMBEDDED",
    "config_from_hf",
    "from_hf_model",
    "layer_map",
    "slot_map",
    "load_checkpoint",
    "save_checkpoint",
    "load_hf_reference",
    "load_model",
    "save_model",
    "ExitAdapter",
    "add_exit_adapters",
    "describe_spec",
    "freeze_all_but_exit_adapter",
    "parse_exit_adapter",
]
