"""Conversion: sharing strategies, layer and norm init, SVD/zero LoRA init, parameter counts; and the recipe of
`looplm convert` (``ConvertConfig``, ``convert_model``: the command line's defaults from Python)."""

from .recipe import ConvertConfig, convert_model
from .recursive import (
    INITS,
    LORA_INITS,
    NORMS,
    convert,
    count_parameters,
    describe,
    equal_nemb_rank,
    parse_lora_ranks,
    stepwise_layers,
    svd_factors,
    tied_depths,
    unroll,
)

__all__ = [
    "ConvertConfig",
    "INITS",
    "LORA_INITS",
    "NORMS",
    "convert",
    "convert_model",
    "count_parameters",
    "describe",
    "equal_nemb_rank",
    "parse_lora_ranks",
    "stepwise_layers",
    "svd_factors",
    "tied_depths",
    "unroll",
]
