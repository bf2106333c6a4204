"""Sampling parameters and batched token choice (greedy, temperature, top-k, top-p; seeded)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


class RequestError(ValueError):
    """A request that cannot be served as given; the message says what to change."""


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int = 0  # 0 = off
    seed: int | None = None  # per-request generator: same seed, same tokens

    def validate(self) -> None:
        t, p, k = self.temperature, self.top_p, self.top_k
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
            raise RequestError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not math.isfinite(p) or not 0 < p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {p!r}")
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise RequestError(f"top_k must be a whole number >= 0 (0 = off), got {k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise RequestError(f"seed must be a whole number or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list) -> torch.Tensor:
    """One token per row of logits [n, V]. Greedy rows take the argmax; the others are filtered by
    their own top-k and top-p and drawn by inverse CDF with one uniform from their own generator."""
    tokens = logits.argmax(-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return tokens
    idx = torch.tensor(rows, device=logits.device)
    sub = logits.index_select(0, idx).float()
    temp = torch.tensor([params[i].temperature for i in rows], device=logits.device)
    top_p = torch.tensor([params[i].top_p for i in rows], device=logits.device)
    top_k = torch.tensor([params[i].top_k or logits.shape[-1] for i in rows], device=logits.device)
    sorted_logits, order = (sub / temp[:, None]).sort(-1, descending=True)
    rank = torch.arange(sub.shape[-1], device=logits.device)[None]
    probs = sorted_logits.softmax(-1)
    before = probs.cumsum(-1) - probs  # mass strictly before each token
    keep = (rank < top_k[:, None]) & ((before < top_p[:, None]) | (rank == 0))
    probs = probs * keep
    cdf = probs.cumsum(-1)
    u = torch.stack([torch.rand((), generator=generators[i]) for i in rows]).to(logits.device)
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None].to(cdf.dtype)).clamp_max(sub.shape[-1] - 1)
    # kept tokens are a prefix of the sorted order, so the first index with cdf >= u*mass is kept
    chosen = order.gather(1, pick).squeeze(1)
    tokens[idx] = chosen
    return tokens
