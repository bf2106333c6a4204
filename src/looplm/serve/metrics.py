"""Serving metrics: counters and gauges the worker and the handlers write, /metrics renders (Prometheus
text format)."""

from __future__ import annotations

import threading
import time
from collections import deque


class Metrics:
    """Counters and gauges, written by the worker and the handlers, read by /metrics (one lock)."""

    def __init__(self, num_loops: int, window: float = 10.0):
        self.lock = threading.Lock()
        self.num_loops, self.window = num_loops, window
        self.requests = {"done": 0, "error": 0, "cancelled": 0}  # finished in the engine, by status
        self.http_errors: dict[int, int] = {}  # rejected before the engine, by status
        self.tokens_total = 0
        self.steps_total = 0
        self.step_seconds = 0.0
        self.worker_faults = 0
        self.queue_depth = 0
        self.running = 0
        self.occupancy = [0] * num_loops  # items at each loop in the last step
        self.exits = [0] * num_loops  # tokens emitted after each loop (from the engine)
        self.recent: deque[tuple[float, int]] = deque()  # (time, tokens) per step, for tokens/s
        self.spec = {"drafted": 0, "accepted": 0, "rounds": 0, "tokens": 0}  # speculative decoding (Speculator.stats)

    def observe_step(self, items) -> None:
        counts = [0] * self.num_loops
        for it in items:
            if it.req.status == "running":
                counts[it.loop] += 1
        with self.lock:
            self.occupancy = counts

    def after_step(self, tokens: int, seconds: float, exits) -> None:
        now = time.monotonic()
        with self.lock:
            self.steps_total += 1
            self.step_seconds += seconds
            self.tokens_total += tokens
            self.exits = list(exits)
            if tokens:
                self.recent.append((now, tokens))
            while self.recent and self.recent[0][0] < now - self.window:
                self.recent.popleft()

    def speculation(self, stats: dict) -> None:
        """Speculative decoding's counts (``Speculator.stats``) after a step."""
        with self.lock:
            self.spec = {k: stats.get(k, 0) for k in self.spec}

    def set_load(self, queued: int, running: int) -> None:
        with self.lock:
            self.queue_depth, self.running = queued, running
            if not running:
                self.occupancy = [0] * self.num_loops

    def finished(self, status: str) -> None:
        with self.lock:
            self.requests[status] = self.requests.get(status, 0) + 1

    def rejected(self, status: int) -> None:
        with self.lock:
            self.http_errors[status] = self.http_errors.get(status, 0) + 1

    def render(self) -> str:
        """The Prometheus text format of every metric below."""
        with self.lock:
            families = self._serving() + self._speculation() + self._failures()
        lines = []
        for name, kind, help_, samples in families:
            lines.extend([f"# HELP looplm_{name} {help_}", f"# TYPE looplm_{name} {kind}"])
            for labels, value in samples:
                lab = ",".join(f'{k}="{v}"' for k, v in labels.items())
                lines.append(f"looplm_{name}{{{lab}}} {value}" if lab else f"looplm_{name} {value}")
        return "\n".join(lines) + "\n"

    def _serving(self) -> list[tuple]:
        """(name, kind, help, [(labels, value)]) of the queue, the batch and the throughput."""
        now = time.monotonic()
        recent = sum(n for t, n in self.recent if t >= now - self.window)

        def per_loop(counts):
            return [({"loop": str(i + 1)}, n) for i, n in enumerate(counts)]

        return [
            ("queue_depth", "gauge", "Requests waiting for a batch slot.", [({}, self.queue_depth)]),
            ("running_requests", "gauge", "Requests holding a batch slot (KV cache row).", [({}, self.running)]),
            ("batch_occupancy", "gauge", "Work items at each loop (depth) in the last engine step.",
             per_loop(self.occupancy)),
            ("exits_total", "counter", "Tokens emitted after each loop (early exits are loops < the last).",
             per_loop(self.exits)),
            ("generated_tokens_total", "counter", "Tokens generated.", [({}, self.tokens_total)]),
            ("tokens_per_second", "gauge", f"Tokens generated per second over the last {self.window:g} s.",
             [({}, round(recent / self.window, 3))]),
            ("engine_steps_total", "counter", "Engine steps (one loop over a batch).", [({}, self.steps_total)]),
            ("engine_step_seconds_total", "counter", "Seconds spent in engine steps.",
             [({}, round(self.step_seconds, 6))]),
        ]  # fmt: skip

    def _speculation(self) -> list[tuple]:
        sp = self.spec
        rate = round(sp["accepted"] / sp["drafted"], 4) if sp["drafted"] else 0
        return [
            ("speculative_drafted_tokens_total", "counter", "Tokens drafted by speculative decoding (--speculate).",
             [({}, sp["drafted"])]),
            ("speculative_accepted_tokens_total", "counter", "Drafted tokens the full model accepted.",
             [({}, sp["accepted"])]),
            ("speculative_verifications_total", "counter",
             "Speculative verifications (one per request per round); generated tokens over these is the mean "
             "accepted length.", [({}, sp["rounds"])]),
            ("speculative_acceptance_rate", "gauge",
             "Accepted over drafted tokens since the start (0 when nothing was drafted).", [({}, rate)]),
        ]  # fmt: skip

    def _failures(self) -> list[tuple]:
        errors = self.requests.get("error", 0) + sum(self.http_errors.values())
        return [
            ("requests_total", "counter", "Requests finished in the engine, by status.",
             [({"status": s}, n) for s, n in sorted(self.requests.items())]),
            ("http_errors_total", "counter", "Requests rejected before the engine, by HTTP status.",
             [({"status": str(s)}, n) for s, n in sorted(self.http_errors.items())]),
            ("errors_total", "counter", "Failed requests: engine errors plus HTTP rejections.", [({}, errors)]),
            ("worker_faults_total", "counter", "Unexpected exceptions in the worker loop.", [({}, self.worker_faults)]),
        ]  # fmt: skip


# --- the worker thread --------------------------------------------------------------------------
