"""The worker thread that bridges HTTP and the engine: it owns the engine and the scheduler, takes
requests and cancels from a thread-safe inbox, and hands tokens to each asyncio event loop once per step."""

from __future__ import annotations

import queue
import threading
import time
from collections import deque

from .engine import Engine
from .metrics import Metrics
from .request import Request
from .schedulers import make_scheduler


class Worker:
    """Owns the engine and scheduler. Handlers call try_submit/cancel (thread-safe) and read
    ("token", id) events (if they asked for tokens) and one ("end", None) from their asyncio.Queue.
    Events are handed to each event loop once per step in one batch: waking the loop once per
    token would make it fight the worker for the GIL."""

    def __init__(self, engine: Engine, scheduler: str, metrics: Metrics, capacity: int):
        self.engine, self.metrics, self.capacity = engine, metrics, capacity
        self.scheduler = make_scheduler(scheduler, engine)
        self.inbox: queue.Queue = queue.Queue()
        self.active: dict[Request, tuple] = {}  # request -> (event loop, asyncio.Queue)
        self.outbox: list[tuple[Request, tuple]] = []  # events to deliver after this step
        self.lock = threading.Lock()
        self.inflight = 0  # submitted and not yet finished (the backpressure count)
        self.accepting = True
        self.deadline: float | None = None  # shutdown: fail whatever is still running after this
        self.stopped = False
        inner = engine.step

        def counted_step(items):  # batch occupancy by loop, seen at the engine's own entry point
            metrics.observe_step(items)
            return inner(items)

        engine.step = counted_step
        self.thread = threading.Thread(target=self._run, name="looplm-worker", daemon=True)

    def start(self):
        self.thread.start()

    def try_submit(self, req: Request, loop, events, tokens: bool) -> bool:
        """Queue a request unless the server is full or shutting down (then False, nothing queued).
        With ``tokens``, every generated token is sent as an event (streaming, stop strings)."""
        if tokens:
            req.on_token = lambda r, tok: self.outbox.append((r, ("token", tok)))
        with self.lock:  # queued under the lock: a drain/stop cannot slip between the check and the put
            if not self.accepting or self.inflight >= self.capacity:
                return False
            self.inflight += 1
            self.inbox.put(("submit", req, (loop, events)))
        return True

    def cancel(self, req: Request) -> None:
        self.inbox.put(("cancel", req, None))

    def drain(self, grace: float) -> None:
        """Stop taking requests; let in-flight ones finish for ``grace`` seconds, then fail them."""
        with self.lock:
            self.accepting = False
        self.deadline = time.monotonic() + grace
        self.inbox.put(("wake", None, None))

    def stop(self, timeout: float = 10.0) -> None:
        self.drain(0.0)
        self.stopped = True
        self.inbox.put(("wake", None, None))
        self.thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def _run(self):
        while not (self.stopped and not self.active):
            try:
                self._iteration()
            except Exception as e:  # a bug outside the engine's per-batch guard: fail the running requests
                with self.metrics.lock:  # (we cannot tell which one caused it) and keep serving the others
                    self.metrics.worker_faults += 1
                self._fail_all(f"engine fault: {type(e).__name__}: {e}", running_only=True)
                self._notify_finished()

    def _iteration(self):
        self._take_inbox(block=not self.scheduler.has_work())
        if self.deadline is not None and time.monotonic() >= self.deadline:
            self._fail_all("the server is shutting down; the request was not finished")
        if self.scheduler.has_work():
            stats = self.engine.stats
            t0, before = time.perf_counter(), sum(stats["exits_per_loop"])
            try:
                self.scheduler.step()
            finally:
                stats["stage_times"].clear()  # the engine keeps per-step timings; a server runs for ever
                self.metrics.after_step(
                    sum(stats["exits_per_loop"]) - before, time.perf_counter() - t0, stats["exits_per_loop"]
                )
                if speculator := getattr(self.scheduler, "speculator", None):
                    self.metrics.speculation(speculator.stats)
        self._notify_finished()
        self.metrics.set_load(
            sum(r.status == "queued" for r in self.scheduler.waiting),
            self.engine.cache.num_rows - self.engine.cache.free_rows,
        )

    def _take_inbox(self, block: bool):
        try:
            msg = self.inbox.get(timeout=0.1) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, req, reply_to = msg
            if kind == "submit":
                self.active[req] = reply_to
                self.scheduler.submit(req)  # an invalid request fails at once; _notify_finished reports it
            elif kind == "cancel" and req in self.active and not req.finished:
                self.scheduler.cancel(req)
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _fail_all(self, message: str, running_only: bool = False):
        for req in list(self.active):
            if not req.finished and (req.status == "running" or not running_only):
                self.engine.finish(req, "error", message)
        self.scheduler.waiting = deque(r for r in self.scheduler.waiting if not r.finished)

    def _notify_finished(self):
        ended = [r for r in self.active if r.finished]
        self.outbox += [(r, ("end", None)) for r in ended]
        by_loop: dict = {}
        for req, event in self.outbox:
            loop, events = self.active[req]
            by_loop.setdefault(loop, []).append((events, event))
        self.outbox = []
        for req in ended:
            del self.active[req]
            with self.lock:
                self.inflight -= 1
            self.metrics.finished(req.status)
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # that event loop is closed (shutdown); nobody is left to tell
                pass


# --- text out -----------------------------------------------------------------------------------


def _deliver(batch):
    for events, event in batch:
        events.put_nowait(event)
