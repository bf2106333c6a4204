"""Exit policies, decided after each loop but the last, batched over the tokens that just finished
a loop.

- ``softmax``: exit when the largest softmax probability >= threshold
- ``margin``: exit when top-1 minus top-2 probability >= threshold
- ``entropy``: exit when the entropy (nats) of the exit distribution <= threshold
- ``cosine``: hidden-state saturation, exit when cos(h after loop i, h before loop i) >= threshold
  (needs no logits unless the token exits)
- ``oracle``: analysis only; never exits early, records the first loop whose argmax equals the
  final one (the paper's oracle exit trajectory)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

POLICIES = ("none", "softmax", "margin", "entropy", "cosine", "oracle")
DEFAULTS = {"softmax": 0.9, "margin": 0.8, "entropy": 0.5, "cosine": 0.99, "oracle": 0.0, "none": 0.0}


@dataclass
class ExitPolicy:
    kind: str = "none"
    threshold: float | None = None

    def __post_init__(self):
        if self.kind not in POLICIES:
            raise ValueError(f"unknown exit policy {self.kind!r}; use one of {', '.join(POLICIES)}")
        if self.threshold is None:
            self.threshold = DEFAULTS[self.kind]

    @property
    def active(self) -> bool:
        return self.kind not in ("none",)

    @property
    def needs_logits(self) -> bool:
        return self.kind in ("softmax", "margin", "entropy", "oracle")

    def decide(self, logits: torch.Tensor | None, h: torch.Tensor, h_prev: torch.Tensor) -> torch.Tensor:
        """Bool [n]: which tokens leave now. logits [n, V] (None for cosine), h and h_prev [n, hidden]."""
        if self.kind == "cosine":
            return F.cosine_similarity(h.float(), h_prev.float(), dim=-1) >= self.threshold
        if self.kind == "oracle" or self.kind == "none":
            return torch.zeros(h.shape[0], dtype=torch.bool, device=h.device)
        probs = logits.float().softmax(-1)
        if self.kind == "softmax":
            return probs.max(-1).values >= self.threshold
        if self.kind == "margin":
            top2 = probs.topk(2, dim=-1).values
            return (top2[:, 0] - top2[:, 1]) >= self.threshold
        ent = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
        return ent <= self.threshold


def parse_policy(text: str) -> ExitPolicy:
    """'softmax' or 'softmax:0.95'."""
    kind, _, thr = text.partition(":")
    return ExitPolicy(kind, float(thr) if thr else None)
