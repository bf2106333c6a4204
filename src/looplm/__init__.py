"""looplm: Relaxed Recursive Transformers (Bae et al.) -- convert, uptrain, evaluate and serve."""

from transformers import AutoConfig, AutoModelForCausalLM

from .models import ConfigError, LoopLMConfig, LoopLMForCausalLM, load_model, save_model

__version__ = "0.1.0"

# Importing looplm makes saved looplm directories open through transformers' Auto classes.
AutoConfig.register(LoopLMConfig.model_type, LoopLMConfig, exist_ok=True)
AutoModelForCausalLM.register(LoopLMConfig, LoopLMForCausalLM, exist_ok=True)

__all__ = ["ConfigError", "LoopLMConfig", "LoopLMForCausalLM", "load_model", "save_model", "__version__"]
