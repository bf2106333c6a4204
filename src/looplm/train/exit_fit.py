"""Fitting a model's exit adapter (models/exit_adapter.py) on cached hidden states, the body untouched.

A library function for code that already holds the per-loop states (healing, analysis): with the states
fixed, only the final norm, the LM head and the adapter lie between them and the exit logits, so fitting
costs a few head evaluations per step and no pass through the body. `looplm train --exit-adapter ...
--freeze-body` trains the same adapter on a corpus, running the frozen body on every batch instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import UsageError
from .losses import divergence
from .optim import adamw


def fit_exit_adapter(
    model,
    states: list[torch.Tensor],
    targets: torch.Tensor,
    steps: int = 200,
    lr: float = 1e-3,
    batch_rows: int = 256,
    weight_decay: float = 0.0,
    temperature: float = 1.0,
    seed: int = 0,
) -> list[float]:
    """Fit ``model.exit_adapter`` so that the exit after each intermediate loop i predicts ``targets``.

    states: the hidden states after loops 0..B-2, each [n, hidden] (a list of B is accepted; the last,
    the final loop's, is ignored). targets: token ids [n] (cross-entropy) or target logits [n, vocab]
    (forward KL from softmax(targets / T), e.g. the teacher's or the final loop's logits). Rows are
    sampled with replacement, ``batch_rows`` per step. Only the adapter's parameters change (their
    gradients are taken explicitly: no other parameter's .grad is touched). Returns each exit's loss on
    the last step's rows."""
    adapter = model.exit_adapter
    if adapter is None:
        raise UsageError("the model has no exit adapter to fit: add one with add_exit_adapters(model, kind, rank)")
    n_exits = adapter.num_exits
    if len(states) not in (n_exits, n_exits + 1):
        raise UsageError(
            f"give the hidden states of the {n_exits} intermediate loops (or of all {n_exits + 1}), not {len(states)}"
        )
    n = targets.shape[0]
    if any(s.shape[0] != n or s.dim() != 2 for s in states[:n_exits]):
        raise UsageError(f"every state must be [n, hidden] with the targets' n = {n} rows")
    if steps < 1 or batch_rows < 1:
        raise UsageError("steps and batch_rows must be at least 1")
    params = list(adapter.parameters())
    trainable = [p.requires_grad for p in params]
    opt = adamw(params, lr=lr, weight_decay=weight_decay)
    g = torch.Generator().manual_seed(seed)
    states = [s.detach() for s in states[:n_exits]]
    losses = []
    try:
        for p in params:
            p.requires_grad_(True)
        with torch.enable_grad():  # callers often hold states computed under no_grad
            for _ in range(steps):
                idx = torch.randint(0, n, (min(batch_rows, n),), generator=g)
                losses = []
                for i, s in enumerate(states):
                    logits = model.exit_logits(s[idx.to(s.device)], loop=i).float()
                    losses.append(_exit_loss(logits, targets[idx.to(targets.device)].to(logits.device), temperature))
                for p, grad in zip(params, torch.autograd.grad(sum(losses), params)):
                    p.grad = grad
                opt.step()
                opt.zero_grad(set_to_none=True)
    finally:
        for p, t in zip(params, trainable):
            p.requires_grad_(t)
    return [float(x.detach()) for x in losses]


def _exit_loss(logits: torch.Tensor, target: torch.Tensor, temperature: float) -> torch.Tensor:
    if not target.is_floating_point():
        return F.cross_entropy(logits, target)
    return divergence(logits, target, "fkl", temperature).mean() * temperature**2
