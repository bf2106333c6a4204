"""The looped decoder and everything needed to open and save it. Imports nothing else of looplm's."""

from .checkpoint import load_checkpoint, save_checkpoint
from .config import LORA_GROUPS, ConfigError, LoopLMConfig
from .decoder import LoopLMForCausalLM, LoopLMModel
from .exit_adapter import ExitAdapter, add_exit_adapters, describe_spec, freeze_all_but_exit_adapter, parse_exit_adapter
from .hf_import import config_from_hf, from_hf_model
from .loading import EMBEDDED, load_hf_reference, load_model, save_model
from .plan import SHARING_STRATEGIES, Depth, DepthPlan

__all__ = [
    "LORA_GROUPS",
    "ConfigError",
    "LoopLMConfig",
    "LoopLMForCausalLM",
    "LoopLMModel",
    "EMBEDDED",
    "config_from_hf",
    "from_hf_model",
    "Depth",
    "DepthPlan",
    "SHARING_STRATEGIES",
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
