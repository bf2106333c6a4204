"""The settings every run has, by one name (``RunSettings``): `looplm train` (TrainConfig) and `looplm heal`
(HealConfig) share the run directory, the budget (minutes or training tokens), the held-out rows of an evaluation,
resume, progress bars, seed and precision. Their evaluation and checkpoint intervals are each counted in the recipe's
own unit, which the name says: `looplm train` counts steps (``eval_every_steps``, ``save_every_steps``: an exact
resume repeats them), `looplm heal` seconds (``eval_every_seconds``, ``save_every_seconds``: its stages are planned in
time). Each field is a ``setting`` (looplm/settings.py): its default written once, its flag made from it."""

from __future__ import annotations

from dataclasses import dataclass

from ..settings import setting

PRECISIONS = ("auto", "bf16", "fp32")


@dataclass
class RunSettings:
    """The settings every run has, by one name (the budget: one of ``budget_minutes``, ``train_tokens`` and, for a
    recipe that has it, ``max_steps``)."""

    out: str | None = setting(None, "run directory")
    budget_minutes: float | None = setting(None, "minutes of training", exclusive="budget", metavar="M")
    train_tokens: int | None = setting(None, "instead: training tokens to read", exclusive="budget", metavar="N")
    eval_rows: int = setting(16, "held-out rows scored at each evaluation", metavar="N")
    resume: bool = setting(False, "continue the run in --out from its latest checkpoint")
    progress: bool = setting(True, "progress bars on stderr")
    seed: int = setting(0, "seed of the data order and of new parameters", advanced=True)
    precision: str = setting(
        "auto",
        "auto: bf16 autocast where the hardware multiplies bf16 natively, else fp32",
        choices=PRECISIONS,
        advanced=True,
    )


__all__ = ["PRECISIONS", "RunSettings"]
