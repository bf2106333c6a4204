"""The one step loop of `looplm train` and of healing's end-to-end and exit stages.

A recipe gives the loop a step function (one optimizer step: its losses) and what to do around it: write a record,
save a checkpoint, evaluate, and, under a time budget, turn the seconds left into a step count. The loop owns
what the recipes share: the progress bar, the position (steps, tokens, run clock), the cadence of records,
checkpoints and evaluations, and when the step count of a time budget is fixed again.

Why the count is fixed more than once: steps get faster after the first few (compiling, first allocations), and a
shared machine's speed moves within an hour, so a count fixed from the first steps alone leaves part of the budget
unused or overruns it. The count is fixed after steps 3 and 30 and at a half, three quarters and nine tenths of
it, each time from the steps timed since the fix before (``replan_due``).

On several processes every one runs the loop; what a process would decide by its own clock (a checkpoint, an
evaluation, a new count) is the main process's decision (``agreed``), so that all take the same steps."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

REPLAN_AT = (3, 30)  # steps after which a time budget's count is fixed again (the first step warms up)
REPLAN_SHARES = (0.5, 0.75, 0.9)  # ... and these shares of the count fixed last, each used once


def replan_due(step: int, total: int | None, done: list[int]) -> bool:
    """Whether a time budget's step count is fixed again before ``step`` (``total``: the count fixed last, None
    while none is; ``done``: the steps it was fixed at)."""
    if step in done:
        return False
    if total is None:  # open: fixed as soon as steps after the first are timed
        return step >= REPLAN_AT[0]
    if step in REPLAN_AT:
        return True
    # each share once, in order; a share the count has already passed (it shrank at the last fix) is skipped
    pending = REPLAN_SHARES[sum(1 for d in done if d > REPLAN_AT[-1]) :]
    late = [share * total for share in pending if share * total > max(done, default=0)]
    return step > REPLAN_AT[-1] and bool(late) and step >= late[0]


class RunClock:
    """A run's budget clock: wall seconds since the run started, going on from a resumed run's, with the time of
    evaluations (``paused``) left out."""

    def __init__(self, seconds: float = 0.0):
        self.start(seconds)

    def start(self, seconds: float = 0.0) -> None:
        self._started = time.perf_counter() - seconds
        self._paused = 0.0

    def __call__(self) -> float:
        return time.perf_counter() - self._started - self._paused

    @contextmanager
    def paused(self):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._paused += time.perf_counter() - t0


def agreed(processes, value):
    """The main process's ``value`` (a picklable object) on every process of an Accelerator (or OneProcess)."""
    if processes is None or processes.num_processes == 1:
        return value
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([value])[0]


@dataclass
class Position:
    """Where a run is: optimizer steps done (in its stage), tokens trained on, run clock seconds."""

    step: int = 0
    tokens: int = 0
    time: float = 0.0


@dataclass
class Every:
    """A recurring action's cadence: every ``steps`` steps and every ``seconds`` of wall time (0: every step);
    None: not by that measure."""

    steps: int | None = None
    seconds: float | None = None

    @property
    def ever(self) -> bool:
        return self.steps is not None or self.seconds is not None

    def due(self, step: int, seconds_since: float, seconds_left: float | None = None) -> bool:
        """Whether the action is due after ``step``, ``seconds_since`` it last ran. By time, it is not when the loop
        ends within half a period (``seconds_left``, None: not known): the recipe ends a loop with its own."""
        by_steps = bool(self.steps) and step % self.steps == 0
        by_time = self.seconds is not None and seconds_since >= self.seconds
        return by_steps or (by_time and not (seconds_left is not None and seconds_left < self.seconds / 2))


def _nothing(*args) -> None:
    return None


@dataclass
class StepLoop:
    """Steps from ``position.step`` to ``total`` (None: a time budget not turned into a count yet).

    ``step(s, total) -> dict`` runs optimizer step ``s`` and returns its record's values (``loss`` among them).
    After it the loop moves the position (``tokens_per_step``; the time from ``clock``) and calls ``record`` with the
    step, the values, the time and the tokens every ``record_every`` steps and at the last. ``save`` and
    ``evaluate`` run on their cadences, never after the last step: the recipe ends a loop with its own. ``replan(s,
    seconds_per_step, now) -> total`` fixes a time budget's count at the ``replan_due`` steps (appended to
    ``replanned_at`` first, which the recipe keeps for a resumed run); None: the count is fixed."""

    step: Callable[[int, int | None], dict]
    total: int | None
    position: Position
    clock: Callable[[], float]
    desc: str
    tokens_per_step: int = 0
    show: bool = True
    record: Callable[[dict], None] = _nothing
    record_every: int = 1
    save: Callable[[], None] = _nothing
    save_every: Every = field(default_factory=Every)
    evaluate: Callable[[], None] = _nothing
    evaluate_every: Every = field(default_factory=Every)
    replan: Callable[[int, float, float], int] | None = None
    replanned_at: list[int] = field(default_factory=list)
    processes: object = None  # an Accelerator: decisions by the clock are the main process's

    def run(self) -> int:
        """Run the steps; returns how many this call ran."""
        from tqdm import tqdm

        p, first = self.position, self.position.step
        bar = tqdm(total=self.total, initial=p.step, desc=self.desc, unit="step", disable=not self.show)
        mark = None  # (step, clock) the next fix times from: after this process's first step, which warms up
        last_save = last_eval = time.perf_counter()
        started = self.clock()  # of this call's steps: the seconds left are timed from them
        try:
            while self.total is None or p.step < self.total:
                s = p.step
                if self.replan is not None and mark is not None and s > mark[0]:
                    if replan_due(s, self.total, self.replanned_at):
                        seconds_per_step, now = agreed(
                            self.processes, ((self.clock() - mark[1]) / (s - mark[0]), self.clock())
                        )
                        self.replanned_at.append(s)
                        self.total = bar.total = self.replan(s, seconds_per_step, now)
                        mark = (s, self.clock())
                values = self.step(s, self.total)
                if mark is None:
                    mark = (s + 1, self.clock())
                p.step, p.tokens, p.time = s + 1, p.tokens + self.tokens_per_step, self.clock()
                bar.update(1)
                bar.set_postfix(loss=f"{values['loss']:.4f}")
                last = p.step == self.total
                if p.step % self.record_every == 0 or last:
                    self.record({"step": p.step, **values, "time": round(p.time, 2), "tokens": p.tokens})
                if last:
                    break
                # a cadence that never comes asks no process (each ask is an exchange on several)
                if self.save_every.ever and agreed(
                    self.processes, self.save_every.due(p.step, time.perf_counter() - last_save)
                ):
                    self.save()
                    last_save = time.perf_counter()
                left = (self.total - p.step) * (self.clock() - started) / (p.step - first) if self.total else None
                if self.evaluate_every.ever and agreed(
                    self.processes, self.evaluate_every.due(p.step, time.perf_counter() - last_eval, left)
                ):
                    self.evaluate()
                    last_eval = time.perf_counter()
        finally:
            bar.close()
        return p.step - first
