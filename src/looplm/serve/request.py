"""A request's life in the engine: the request itself (its result and timings), the work items it becomes (a
whole prompt, one new token, or the KV of loops an exited token skipped) and what a step decided for them."""

from __future__ import annotations

import itertools

import torch

from .context_index import ContextIndex
from .sampling import SamplingParams

_ids = itertools.count()


class Request:
    """A generation request and, once served, its result and timings (clock seconds)."""

    def __init__(
        self,
        prompt,
        max_tokens: int = 16,
        sampling: SamplingParams | None = None,
        arrival: float = 0.0,
        eos_token_id: int | None = None,
        on_token=None,
        request_id=None,
        full_depth: bool = False,
    ):
        self.id = next(_ids) if request_id is None else request_id
        self.prompt = list(prompt) if not isinstance(prompt, torch.Tensor) else prompt.tolist()
        self.max_tokens = max_tokens
        self.sampling = sampling or SamplingParams()
        self.arrival = arrival
        self.eos_token_id = eos_token_id
        self.on_token = on_token  # callback(request, token); an exception fails this request only
        self.full_depth = full_depth  # never exit early, whatever the engine's exit policy
        self.output: list[int] = []
        self.exit_loops: list[int] = []  # loop (1-based) each output token left at
        self.oracle_loops: list[int] = []  # oracle policy: first loop whose argmax equals the final one
        self.token_times: list[float] = []
        self.status = "new"  # new, queued, running, done, error, cancelled
        self.error: str | None = None
        self.row: int | None = None
        self.generator: torch.Generator | None = None
        self.finish_time: float | None = None
        self._context: ContextIndex | None = None  # +copy exit policies: built on first use

    def copy_guess(self) -> int:
        """What copying this sequence's context predicts next (``ContextIndex.guess``), or -1."""
        if self._context is None:
            self._context = ContextIndex(self.prompt)
        self._context.extend(self.output[len(self._context.tokens) - len(self.prompt) :])
        return self._context.guess

    @property
    def finished(self) -> bool:
        return self.status in ("done", "error", "cancelled")

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None

    def __repr__(self):
        return f"Request({self.id}, {self.status}, prompt={len(self.prompt)}, out={len(self.output)})"


class Item:
    """A work item: ``length`` tokens of ``req`` from position ``pos``, next at 0-based ``loop``; ``kind`` prefill,
    token or kv (an early-exited token finishing its skipped loops, for their keys and values only); ``h`` its
    hidden states (None: embed ``ids`` first)."""

    __slots__ = ("req", "pos", "length", "loop", "h", "ids", "kind")

    def __init__(self, req, pos, length, loop, kind, ids=None, h=None):
        self.req, self.pos, self.length, self.loop, self.kind = req, pos, length, loop, kind
        self.ids, self.h = ids, h


class Decision:
    """What ``Engine.decide`` found after a loop: items that continue to their next loop, and the (item, row)
    pairs that emit a token now with their logits (one row each, in order)."""

    __slots__ = ("cont", "emitters", "logits")

    def __init__(self, cont: list[Item], emitters: list, logits: torch.Tensor | None):
        self.cont, self.emitters, self.logits = cont, emitters, logits
