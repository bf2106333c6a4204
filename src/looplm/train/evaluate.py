"""Held-out perplexity at every loop exit, as the training recipes log it during a run.

Each loop's exit is the final norm and LM head (or the exit's adapter) applied after that loop; a row's tokens
after its first are scored. `looplm eval` (eval/perplexity.py) scores text and whole corpora the same way, on
batches; a run scores a few rows, one at a time, and also counts how often each exit's top token is the final
exit's (what an oracle exit rule would keep)."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

MAX_NLL = 50.0  # a mean NLL above this (a model far off) is logged as exp(50) rather than overflowing


def perplexity(mean_nll: float) -> float:
    return math.exp(min(mean_nll, MAX_NLL))


def heldout_rows(corpus, n: int, seq_len: int) -> list[np.ndarray]:
    """The first ``n`` held-out rows of a packed corpus (all when it has fewer), cut to ``seq_len`` tokens."""
    held = corpus.splits["heldout"]
    return [np.asarray(held[i, :seq_len]) for i in range(min(len(held), n))]


@torch.no_grad()
def score_rows(model, rows, device, final_only: bool = False) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Summed next-token NLL of each loop's exit over token rows (float64), the count of tokens each loop's argmax
    shares with the final exit's, and the number of predicted tokens (``final_only``: the last exit alone)."""
    loops = model.config.num_loops
    nll, agree, count = torch.zeros(loops, dtype=torch.float64), torch.zeros(loops, dtype=torch.float64), 0
    for row in rows:
        ids = torch.as_tensor(np.asarray(row, dtype=np.int64))[None].to(device)
        _, states, _ = model.model(ids, output_loop_states=True)
        final = None
        for j in reversed(range(len(states) - 1 if final_only else 0, len(states))):
            logits = model.exit_logits(states[j][0, :-1], loop=j).float()
            nll[j] += F.cross_entropy(logits, ids[0, 1:], reduction="sum").double().cpu()
            final = logits.argmax(-1) if final is None else final
            agree[j] += float((logits.argmax(-1) == final).sum())
        count += ids.shape[1] - 1
    return nll, agree, count
