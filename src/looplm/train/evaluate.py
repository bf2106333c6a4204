"""Held-out perplexity at every loop exit, as the training recipes log it during a run.

Each loop's exit is the final norm and LM head (or the exit's adapter) applied after that loop; a row's tokens
after its first are scored, by the model's ``exit_losses`` as `looplm eval` (eval/perplexity.py) scores text and
whole corpora. A run scores a few rows, one at a time, shared out among its processes, and also counts how often
each exit's top token is the final exit's (what an oracle exit rule would keep)."""

from __future__ import annotations

import math

import numpy as np
import torch

MAX_NLL = 50.0  # a mean NLL above this (a model far off) is logged as exp(50) rather than overflowing


def perplexity(mean_nll: float) -> float:
    return math.exp(min(mean_nll, MAX_NLL))


def heldout_rows(corpus, n: int, seq_len: int) -> list[np.ndarray]:
    """The first ``n`` held-out rows of a packed corpus (all when it has fewer), cut to ``seq_len`` tokens."""
    held = corpus.splits["heldout"]
    return [np.asarray(held[i, :seq_len]) for i in range(min(len(held), n))]


@torch.no_grad()
def score_rows(score, rows, device, processes=None) -> list[torch.Tensor]:
    """The sums ``score(ids)`` returns (a tuple of tensors) over token ``rows`` (one [1, seq] batch each), each
    process scoring every world-th row and the sums added up over the ``processes`` (an Accelerator; None: one).
    Every process makes as many calls (collectives inside FSDP or DDP must match): one past the end scores row 0
    with weight 0."""
    world, rank = (processes.num_processes, processes.process_index) if processes is not None else (1, 0)
    sums = None
    for j in range(math.ceil(len(rows) / world)):
        i = j * world + rank
        weight = 1.0 if i < len(rows) else 0.0
        ids = torch.as_tensor(np.asarray(rows[i if weight else 0], dtype=np.int64))[None].to(device)
        parts = [weight * torch.as_tensor(x, dtype=torch.float64).to(device) for x in score(ids)]
        sums = parts if sums is None else [a + b for a, b in zip(sums, parts)]
    if world > 1:
        sums = [processes.reduce(x, reduction="sum") for x in sums]
    return [x.cpu() for x in sums]


def exit_sums(model, final_only: bool = False):
    """``score`` for ``score_rows``: every loop exit's summed NLL, its agreement with the final exit's top token,
    and the scored tokens, of ``model.exit_losses``."""

    def score(ids):
        nll, agree, tokens = model.exit_losses(ids, final_only=final_only)
        return nll.sum(1), agree, tokens.sum()

    return score
