"""Exit policies, decided after each loop but the last, batched over the tokens that just finished
a loop.

- ``softmax``: exit when the largest softmax probability >= threshold
- ``margin``: exit when top-1 minus top-2 probability >= threshold
- ``entropy``: exit when the entropy (nats) of the exit distribution <= threshold
- ``cosine``: hidden-state saturation, exit when cos(h after loop i, h before loop i) >= threshold
  (needs no logits unless the token exits)
- ``probe``: a fitted logistic probe (probe.py) predicts that loop i's argmax is already the final one
  with probability >= threshold (default: the threshold calibrated at fitting); a probe on the hidden
  state needs no logits unless the token exits, one on the logits' confidence features needs them
- ``oracle``: analysis only; never exits early, records the first loop whose argmax equals the
  final one (the paper's oracle exit trajectory)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

POLICIES = ("none", "softmax", "margin", "entropy", "cosine", "probe", "oracle")
DEFAULTS = {"softmax": 0.9, "margin": 0.8, "entropy": 0.5, "cosine": 0.99, "oracle": 0.0, "none": 0.0,
            "probe": None}  # probe: the threshold saved with the fitted probe


@dataclass
class ExitPolicy:
    kind: str = "none"
    threshold: float | None = None
    probe: object | None = field(default=None, repr=False)  # probe.ExitProbe, bound by the engine

    def __post_init__(self):
        if self.kind not in POLICIES:
            raise ValueError(f"unknown exit policy {self.kind!r}; use one of {', '.join(POLICIES)}")
        if self.threshold is None:
            self.threshold = DEFAULTS[self.kind]

    @property
    def active(self) -> bool:
        return self.kind not in ("none",)

    @property
    def needs_logits(self) -> bool:  # to decide; cosine and a hidden-state probe decide from hidden states
        if self.kind == "probe":
            return self.probe is not None and self.probe.needs_logits
        return self.kind in ("softmax", "margin", "entropy", "oracle")

    @property
    def needs_hidden(self) -> bool:  # h before the loop and loop indices, to decide
        return self.kind in ("cosine", "probe")

    def bind(self, model) -> "ExitPolicy":
        """This policy ready for ``model``: the probe policy loads the probe saved with the model."""
        if self.kind != "probe" or self.probe is not None:
            return self
        from .probe import load_probe
        probe = load_probe(model)
        return ExitPolicy("probe", probe.threshold if self.threshold is None else self.threshold, probe)

    def decide(self, logits: torch.Tensor | None, h: torch.Tensor, h_prev: torch.Tensor,
               loops: torch.Tensor | None = None, model=None) -> torch.Tensor:
        """Bool [n]: which tokens leave now. logits [n, V] (None unless ``needs_logits``), h and h_prev
        [n, hidden]; the probe also needs each token's 0-based loop index and the model (its final norm)."""
        if self.kind == "cosine":
            return F.cosine_similarity(h.float(), h_prev.float(), dim=-1) >= self.threshold
        if self.kind == "probe":
            return self.probe.prob(self.probe.featurize(model, h, h_prev, logits), loops) >= self.threshold
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
