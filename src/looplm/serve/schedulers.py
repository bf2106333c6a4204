"""Three schedulers over one Engine, and a driver that replays a request trace against one.

- ``static``: take up to max_batch queued requests, run them until the last one finishes, then the
  next batch (finished requests leave idle slots).
- ``sequence``: continuous sequence-wise batching (Orca/vLLM): before every iteration (a full-depth
  pass for all running tokens), free slots take queued requests, whose prompts join that iteration.
- ``depth``: continuous depth-wise batching (the paper's CDB): the unit of work is one loop; each
  step runs every live item at its own loop, and a slot freed by a finished request takes queued
  work at once, while an early-exited token's successor starts at loop 1 in the very next step.
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from collections.abc import Callable

import torch

from ..models.config import ConfigError
from ..models.quantized import DENSE_ROWS
from .engine import Engine
from .request import Item, Request
from .sampling import RequestError


class Scheduler:
    name = ""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.waiting: deque[Request] = deque()
        self.cont: list[Item] = []  # items mid-token (between loops)
        self.ready: list[Item] = []  # items starting a token (prefills, next tokens)

    def submit(self, req: Request) -> Request:
        """Queue a request; an invalid one is failed at once with a clear message (others unaffected)."""
        try:
            self.engine.validate(req)
        except RequestError as e:
            req.status, req.error = "error", str(e)
            req.finish_time = self.engine.clock()
            return req
        req.status = "queued"
        self.waiting.append(req)
        return req

    def cancel(self, req: Request) -> None:
        if req.status == "queued":
            self.waiting = deque(r for r in self.waiting if r is not req)
        self.engine.cancel(req)

    def _prune(self):
        self.cont = [it for it in self.cont if it.req.status == "running"]
        self.ready = [it for it in self.ready if it.req.status == "running"]

    def has_work(self) -> bool:
        self._prune()
        return bool(self.waiting or self.cont or self.ready)

    def _admit(self):
        cache = self.engine.cache
        while self.waiting and cache.free_rows:
            req = self.waiting.popleft()
            if req.status == "queued":
                self.ready.append(self.engine.start(req))

    def _iteration(self):
        """Every ready item through all its loops (the sequence-wise unit of work)."""
        items, produced = self.ready, []
        self.ready = []
        while items:
            items, new = self.engine.step(items)
            produced += new
        self.ready = produced

    def step(self) -> None:
        raise NotImplementedError


class StaticScheduler(Scheduler):
    name = "static"

    def step(self):
        self._prune()
        if not self.ready:
            self._admit()
        self._iteration()


class SequenceScheduler(Scheduler):
    name = "sequence"

    def step(self):
        self._prune()
        self._admit()
        self._iteration()


class DepthScheduler(Scheduler):
    name = "depth"

    def __init__(self, engine: Engine):
        if not engine.mixable:
            raise ConfigError(
                "continuous depth-wise batching needs cycle sharing (every loop runs shared layer k "
                "at step k); use the static or sequence scheduler for this model"
            )
        super().__init__(engine)

    def step(self):
        self._prune()
        self._admit()
        items = self.cont + self.ready
        self.cont, self.ready = self.engine.step(items)


class SpeculativeScheduler(Scheduler):
    """Continuous batching in speculative rounds (serve/speculative.py): free slots take queued requests, whose
    prompts run first (every loop, emitting their first token); then one round drafts for every decoding request
    and verifies all the drafts together, one step per loop, committing one to k + 1 tokens per request."""

    name = "speculative"

    def __init__(self, engine: Engine, mode: str = "both", max_draft: int = 8):
        from .speculative import Speculator

        super().__init__(engine)
        self.speculator = Speculator(engine, mode, max_draft)

    def step(self):
        self._prune()
        self._admit()
        prefills = [it for it in self.ready if it.kind == "prefill"]
        decoding = [it for it in self.ready if it.kind != "prefill"]
        produced = []
        while prefills:
            prefills, new = self.engine.step(prefills)
            produced += new
        self.ready = self.speculator.round(decoding) + produced


SCHEDULERS = {"static": StaticScheduler, "sequence": SequenceScheduler, "depth": DepthScheduler}


def scheduler_name(scheduler: str, speculate: str) -> str:
    """The scheduler that ``--scheduler`` and ``--speculate`` ask for together: speculative rounds are their own
    batching, so a speculation mode other than ``off`` takes the scheduler's place."""
    return scheduler if speculate == "off" else f"speculative:{speculate}"


def make_scheduler(name: str, engine: Engine) -> Scheduler:
    """The scheduler ``name`` on ``engine``. ``speculative:MODE`` (``speculative``: both sources) serves in
    speculative rounds, which are their own batching."""
    kind, _, mode = name.partition(":")
    if kind == "speculative":
        return SpeculativeScheduler(engine, mode or "both")
    if name not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {name!r}; use one of {', '.join(SCHEDULERS)} or speculative:MODE")
    return SCHEDULERS[name](engine)


def rss_mb() -> float:
    """Current resident set size in MB (Linux /proc; falls back to the peak from getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Clock:
    """Wall clock that can skip idle gaps (waiting for the next arrival) instead of sleeping."""

    def __init__(self):
        self.start, self.offset = time.perf_counter(), 0.0

    def __call__(self) -> float:
        return time.perf_counter() - self.start + self.offset

    def skip_to(self, t: float):
        now = self()
        if t > now:
            self.offset += t - now


def replay(
    scheduler: Scheduler, requests: list[Request], max_steps: int | None = None, on_step: Callable | None = None
) -> dict:
    """Submit each request at its arrival time (seconds from the start) and run until all finish; ``on_step()``
    runs after each step (a progress bar's update). Returns {"seconds", "peak_rss_mb", "steps"}; results and
    timings are on the requests."""
    clock = Clock()
    engine = scheduler.engine
    engine.clock = clock
    pending = deque(sorted(requests, key=lambda r: r.arrival))
    peak, steps = rss_mb(), 0
    while pending or scheduler.has_work():
        now = clock()
        while pending and pending[0].arrival <= now:
            scheduler.submit(pending.popleft())
        if not scheduler.has_work():
            if pending:
                clock.skip_to(pending[0].arrival)
            continue
        scheduler.step()
        steps += 1
        if on_step is not None:
            on_step()
        if steps % 4 == 0:
            peak = max(peak, rss_mb())
        if max_steps is not None and steps >= max_steps:
            break
    peak = max(peak, rss_mb())
    return {"seconds": clock(), "peak_rss_mb": peak, "steps": steps}


def generate(engine: Engine, prompts, max_tokens: int = 16, scheduler: str = "depth", **kw) -> list[Request]:
    """Convenience: serve a list of prompts (token id lists) at once; returns the finished requests."""
    reqs = [Request(p, max_tokens, **kw) for p in prompts]
    replay(make_scheduler(scheduler, engine), reqs)
    return reqs


def warm_up(engine: Engine, prompt_lengths: tuple[int, ...] = (3, 5), max_tokens: int = 3, log=None) -> float:
    """Build a compiled engine's graphs (serve/compiled.py) before it serves, so requests pay no compile
    time: a one-token prompt, prompts of two lengths (the dynamic token count) decoded one at a time and
    together, then one prompt per cache row (the whole-loop decode graph of a full batch), and a prompt of
    ``DENSE_ROWS`` tokens (from there int8 products take another kernel, a graph of their own), at every loop;
    with exits, after each loop, the head of an exited token and (kv mode ``copy``) the KV fill of one, two and
    ``DENSE_ROWS`` exited tokens (as many as the batch holds). Returns the seconds it took; the engine's
    statistics are reset afterwards. A no-op for an eager engine. ``log``: where the line saying that compiling
    has started goes (default: stderr), since it takes a while and prints nothing else."""
    if engine.compiled is None:
        return 0.0
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    say(f"looplm: compiling the engine for {engine.max_batch} rows (a minute or more, once per process)")
    t0, clock = time.perf_counter(), engine.clock  # replay sets its own clock on the engine
    R = engine.max_batch
    groups = [[1], [prompt_lengths[0]], list(prompt_lengths)[:R]]  # [1]: a lone first token, regional
    if R > len(prompt_lengths):
        groups.append([prompt_lengths[0]] * R)
    if engine.max_seq_len > DENSE_ROWS:  # a step of that many tokens: int8 products change kernels there
        groups.append([DENSE_ROWS])
    for group in groups:
        reqs = [Request([1] * n, min(max_tokens, engine.max_seq_len - n), full_depth=True) for n in group]
        replay(make_scheduler("sequence", engine), reqs)
        bad = [r for r in reqs if r.status != "done"]
        if bad:
            raise RuntimeError(f"compiling the engine failed: {bad[0].error}")
    if engine.policy.active and engine.kv_mode == "copy":  # the KV fill of exited tokens
        for loop in range(engine.B - 1):
            for n in sorted({1, min(2, R), min(DENSE_ROWS, R)}):
                rows = [engine.cache.allocate() for _ in range(n)]  # free rows: their stale entries are never read
                h = torch.zeros(1, n, engine.config.hidden_size, dtype=engine.dtype, device=engine.device)
                engine.runner.fill_copy(
                    loop,
                    h,
                    torch.zeros(n, dtype=torch.long, device=engine.device),
                    torch.tensor(rows, device=engine.device),
                )
                for r in rows:
                    engine.cache.release(r)
    if engine.policy.active:  # an exited token's head after each earlier loop (its own graph with an exit adapter)
        h = torch.zeros(1, engine.config.hidden_size, dtype=engine.dtype, device=engine.device)
        with torch.no_grad():
            for loop in range(engine.B - 1):
                engine.exit_logits(h, [loop])
    engine.clock = clock
    engine.reset_stats()
    return time.perf_counter() - t0
