"""A run's budget, by time or by tokens (or steps), and the step count that fills what is left of a time budget.

A time budget cannot be planned before steps are timed, and the speed of a shared machine moves during a run: both
recipes time a few steps, fix the step count from them (`looplm train` corrects it once, halfway), and keep the
count in run.json so that a resumed run follows it."""

from __future__ import annotations

from ..errors import UsageError


def check_budget(given: dict[str, float | int | None]) -> None:
    """Exactly one of the budgets in ``given`` (flag as the user types it -> value or None) is set, and it is
    positive."""
    chosen = [(flag, value) for flag, value in given.items() if value is not None]
    if len(chosen) != 1:
        flags = list(given)
        raise UsageError(f"give one budget: {', '.join(flags[:-1])} or {flags[-1]}")
    flag, value = chosen[0]
    if not value > 0:
        raise UsageError(f"{flag.split()[0]} {value} must be positive: the budget must be positive")


def steps_to_fill(step: int, seconds_left: float, seconds_per_step: float, at_least: int = 0) -> int:
    """The step count that, from ``step`` on at ``seconds_per_step``, fills ``seconds_left``; never less than
    ``step + at_least``."""
    return max(step + at_least, step + int(seconds_left / seconds_per_step))
