"""The healing recipe's defaults (`looplm heal` with only a model): what it heals from, on and for how long."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import UsageError
from ..models.checkpoint import read_config
from ..train.heal.config import COMPILE_MINUTES, COMPILE_TOKENS, DEFAULT_HEAL_MINUTES, HealConfig
from ..util import cpu_compiler
from .teacher_text import recipe_corpus


def fill_recipe_defaults(s: HealConfig) -> list[str]:
    """Fill what the settings leave out (None) with the recipe's choices: the model the student was converted from
    as the teacher, the recipe's corpus (made on first use), an output directory, the hour's budget and compiling
    where it pays. Returns what was chosen, to be said."""
    chosen = []
    if not (Path(s.model) / "config.json").exists():
        raise UsageError(f"{s.model} is not a converted model directory; make one with `looplm convert` first")
    if s.teacher is None:
        source = read_config(s.model).get("conversion", {}).get("source")
        if not source:
            raise UsageError(f"{s.model} records no model it was converted from; name it with --teacher")
        s.teacher = source
        chosen.append(f"teacher {source} (the model it was converted from)")
    if s.data is None:
        s.data = recipe_corpus(s.teacher, s.seq_len, s.progress)
        chosen.append(f"data {s.data}")
    if s.out is None:
        s.out = str(Path("out") / f"{Path(s.model).name}-healed")
        chosen.append(f"out {s.out}")
    if s.budget_minutes is None and s.train_tokens is None:
        s.budget_minutes = DEFAULT_HEAL_MINUTES
        chosen.append(f"{s.budget_minutes:g} minutes")
    if s.compile is None:
        compiler = torch.cuda.is_available() or cpu_compiler() is not None
        long = (s.budget_minutes or 0) >= COMPILE_MINUTES or (s.train_tokens or 0) >= COMPILE_TOKENS
        s.compile = bool(long and compiler)
        chosen.append("compiled" if s.compile else "not compiled")
    return chosen
