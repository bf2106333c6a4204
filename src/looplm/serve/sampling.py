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


CANDIDATES = 256  # a nucleus almost always lies in the top 256 tokens; sorting all 49k-262k costs 25x more


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list) -> torch.Tensor:
    """One token per row of logits [n, V]. Greedy rows take the argmax; the others are filtered by
    their own top-k and top-p and drawn by inverse CDF with one uniform from their own generator."""
    tokens = logits.argmax(-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return tokens
    device, vocab = logits.device, logits.shape[-1]
    idx = torch.tensor(rows, device=device)
    temp = torch.tensor([params[i].temperature for i in rows], device=device)
    top_p = torch.tensor([params[i].top_p for i in rows], device=device)
    top_k = torch.tensor([params[i].top_k or vocab for i in rows], device=device)
    u = torch.stack([torch.rand((), generator=generators[i]) for i in rows]).to(device)
    probs = (logits.index_select(0, idx).float() / temp[:, None]).softmax(-1)
    # The kept tokens are a prefix of the descending order: when the top CANDIDATES hold top_p of the mass
    # (or top_k <= CANDIDATES), the prefix lies among them and a partial sort gives the same draw.
    head, order = probs.topk(min(CANDIDATES, vocab), -1)
    chosen = _draw(head, order, top_p, top_k, u)
    plain = (top_p >= 1) & (top_k >= vocab)  # no filter: draw in vocabulary order, nothing to sort
    if plain.any():
        every = torch.arange(vocab, device=device).expand(int(plain.sum()), vocab)
        chosen[plain] = _draw(probs[plain], every, top_p[plain], top_k[plain], u[plain])
    flat = (head.sum(-1) < top_p) & (top_k > head.shape[-1]) & ~plain
    if flat.any():  # the nucleus reaches past the candidates: sort the whole vocabulary for these rows
        full, full_order = probs[flat].sort(-1, descending=True)
        chosen[flat] = _draw(full, full_order, top_p[flat], top_k[flat], u[flat])
    tokens[idx] = chosen
    return tokens


def _draw(probs: torch.Tensor, order: torch.Tensor, top_p, top_k, u) -> torch.Tensor:
    """The token drawn by inverse CDF from the top-k/top-p prefix of descending ``probs`` (indices ``order``)."""
    rank = torch.arange(probs.shape[-1], device=probs.device)[None]
    before = probs.cumsum(-1) - probs  # mass strictly before each token
    keep = (rank < top_k[:, None]) & ((before < top_p[:, None]) | (rank == 0) | (top_p[:, None] >= 1))
    cdf = (probs * keep).cumsum(-1)
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None].to(cdf.dtype)).clamp_max(probs.shape[-1] - 1)
    return order.gather(1, pick).squeeze(1)


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution [n, V] (float32) ``sample`` draws each row from: softmax at the row's temperature over its
    top-k/top-p set (the kept tokens are a prefix of the descending order), zero elsewhere, renormalised; a greedy
    row is one-hot at its argmax. Speculative sampling (serve/speculative.py) accepts and corrects against it."""
    out = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    vocab = logits.shape[-1]
    for i, p in enumerate(params):
        if p.greedy:
            out[i, int(logits[i].argmax())] = 1.0
            continue
        probs = (logits[i].float() / p.temperature).softmax(-1)
        if p.top_p >= 1 and (p.top_k or vocab) >= vocab:
            out[i] = probs
            continue
        sp, order = probs.sort(descending=True)
        rank = torch.arange(vocab, device=logits.device)
        keep = (rank < (p.top_k or vocab)) & ((sp.cumsum(-1) - sp < p.top_p) | (rank == 0))
        kept = sp * keep
        out[i].index_copy_(0, order, kept / kept.sum())
    return out


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from a probability vector [V] by inverse CDF at one uniform of ``generator``."""
    cdf = probs.double().cumsum(-1)
    u = (1 - torch.rand((), generator=generator, dtype=torch.float64)) * cdf[-1]  # in (0, mass]: never a 0-prob token
    return int(torch.searchsorted(cdf, u[None].to(cdf.device)).clamp_max(probs.shape[-1] - 1))
