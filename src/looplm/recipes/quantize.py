"""The quantization recipe behind `looplm quantize`: the settings (``QuantizeConfig``) and ``quantize_model``, which
rounds a float model's linears to int8 or int4 (to nearest, or by GPTQ on a corpus's first training rows with the
input channels equalized first) and writes the quantized checkpoint. It reads a corpus, so it sits above data/."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError
from ..settings import setting


def _note(message: str) -> None:
    print(f"looplm quantize: {message}", file=sys.stderr, flush=True)


@dataclass
class QuantizeConfig:
    """How `looplm quantize` (and ``quantize_model``) stores a float model with int8 or int4 weights."""

    model: str | None = setting(None, "a float model: embedded name or looplm directory", positional=True)
    out: str | None = setting(None, "directory of the quantized model", required=True)
    weights: str = setting(
        "int4",
        "int8: one scale per output channel; int4: one scale and minimum per group of inputs",
        choices=("int8", "int4"),
    )
    calib_data: str | None = setting(
        None,
        "round by GPTQ against each linear's inputs on the first rows of this corpus's training split "
        "(`looplm data build`), instead of to nearest",
        metavar="DATA",
        renamed_from=("--calibrate",),
    )
    calib_rows: int = setting(
        16,
        "training rows (x the corpus's sequence length) for --calib-data",
        metavar="N",
        renamed_from=("--calibration-rows",),
    )
    lora: str = setting(
        "shared",
        "a relaxed model's LoRA: kept in float on the shared weights, or merged into one quantized weight per depth "
        "(no LoRA matmuls when serving)",
        choices=("shared", "merged"),
    )
    group_size: int | None = setting(
        None,
        "int4 group size (default: 32, the most accurate, at about the speed of the larger ones)",
        choices=(32, 64, 128, 256),
        advanced=True,
    )
    dtype: str = setting(
        "fp32",
        "dtype of the float parameters left (LoRA, norms, biases) and of the residual stream",
        choices=("fp32", "bf16"),
        advanced=True,
    )
    act_dtype: str = setting(
        "bf16",
        "activations of the quantized matmuls (bf16: the CPU's fast integer-times-bf16 kernels)",
        choices=("fp32", "bf16"),
        advanced=True,
    )
    equalize: bool | None = setting(
        None,
        "with --calib-data: before rounding, scale each linear's input channels by the AWQ-style scales that round "
        "it with the least output error, folded into the norms and the rows that produce them (the model computes "
        "the same function; default: on with --calib-data)",
        advanced=True,
    )


def quantize_model(c: QuantizeConfig, log=_note) -> dict:
    """Quantize ``c.model`` into ``c.out`` as ``c`` says; returns the report: the format, group, LoRA layout, the
    calibration (GPTQ rows and tokens, the equalization's effect) and the float and quantized bytes. ``c`` is
    completed with the defaults taken (``equalize``)."""
    from ..models import load_model
    from ..models.checkpoint import WEIGHTS
    from ..models.loading import save_quantized
    from ..models.quantized import DEFAULT_GROUP, DTYPES, GROUPS, check_format, stored_format, weight_bytes

    dtypes = {"fp32": DTYPES["float32"], "bf16": DTYPES["bfloat16"]}
    group = c.group_size or DEFAULT_GROUP
    if group not in GROUPS:
        raise UsageError(f"--group-size must be one of {', '.join(map(str, GROUPS))}; got {group}")
    check_format(c.weights, "cpu")
    if c.calib_rows <= 0:
        raise UsageError(f"--calib-rows must be positive; got {c.calib_rows}")
    model, tok = load_model(c.model)
    if stored_format(model) != "fp32":
        raise UsageError(f"{c.model} is already quantized ({stored_format(model)}); quantize its float checkpoint")
    if c.equalize and not c.calib_data:
        raise UsageError("--equalize chooses its scales on calibration rows: add --calib-data DATA")
    if c.equalize is None:  # equalized channels, then GPTQ: the rounding that keeps the model closest
        c.equalize = bool(c.calib_data)
    moments = calibration = None
    if c.calib_data:
        moments, calibration = _calibrate(model, tok, c, log)
    if c.equalize:
        from ..models.equalize import equalize

        log("choosing each linear's equalization scales")
        moments, groups = equalize(model, moments, c.weights, group)
        plain, scaled = sum(g["error_before"] for g in groups), sum(g["error"] for g in groups)
        calibration["equalized"] = {
            "groups": len(groups),
            "scaled": sum(g["alpha"] + g["beta"] > 0 for g in groups),
            "output_error_ratio": scaled / plain if plain else 1.0,
        }
    before = weight_bytes(model)
    save_quantized(
        model,
        tok,
        c.out,
        c.weights,
        group,
        dtypes[c.dtype],
        act_dtype=dtypes[c.act_dtype],
        lora=c.lora,
        moments=moments,
        calibration=calibration,
        progress=moments is not None,
    )
    return {
        "out": c.out,
        "weights": c.weights,
        "group": group,
        "lora": c.lora,
        "calibration": calibration,
        "float_bytes": before,
        "bytes": (Path(c.out) / WEIGHTS).stat().st_size,
    }


def _calibrate(model, tok, c: QuantizeConfig, log) -> tuple[dict, dict]:
    """GPTQ's input moments from the first ``--calib-rows`` rows of the corpus's training split."""
    import numpy as np
    import torch

    from ..data.corpus import PackedCorpus
    from ..models.gptq import input_moments
    from ..models.loading import tokenizer_fingerprint

    corpus = PackedCorpus(c.calib_data)
    if tok is None or tokenizer_fingerprint(tok) != corpus.tokenizer:
        raise UsageError(
            f"the corpus {c.calib_data} was tokenised with another tokenizer ({corpus.meta['model']}) "
            f"than {c.model}'s; rebuild it with `looplm data build {c.model} --out DIR`"
        )
    rows = torch.from_numpy(np.array(corpus.splits["train"][: c.calib_rows], dtype=np.int64))
    log(f"running {rows.numel():,} calibration tokens through {c.model}")
    moments = input_moments(model.float(), rows)
    return moments, {"data": str(c.calib_data), "split": "train", "rows": len(rows), "tokens": rows.numel()}
