"""Conversion: sharing strategies, layer and norm init, SVD/zero LoRA init, parameter counts. The command line's
choices around them (plan, rank, calibration) are recipes/convert.py's."""

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
    "INITS",
    "LORA_INITS",
    "NORMS",
    "convert",
    "count_parameters",
    "describe",
    "equal_nemb_rank",
    "parse_lora_ranks",
    "stepwise_layers",
    "svd_factors",
    "tied_depths",
    "unroll",
]
