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

``+copy`` (``margin:0.19+copy``; ``copy`` alone: no other rule) also lets a token leave when the loop's argmax is
what copying the context predicts (``ContextIndex.guess``, serve/context_index.py): the token that followed the
last earlier occurrence of the sequence's final 3-gram. A small model's greedy text repeats itself, and where
loop 1 already agrees with the context the full depth almost always does too, so on a model's own greedy text it
lets many more tokens leave after loop 1 at the same agreement than the margin rule alone. It costs no model work,
only a dictionary per sequence.

``+copy:BONUS`` (``margin:0.49+copy:8``) goes further: the guess's exit logit gains ``BONUS`` before the rule
decides and before the token is drawn, so a token leaves with the guess when loop 1 ranks it within ``BONUS``
nats of its top choice (and with whatever the rule picks otherwise): loop 1 only vetoes the context's guess.
On a healed model's greedy text this lets more tokens leave after loop 1 than even an oracle that knows where
loop 1's own argmax is right, at high agreement with the full depth (docs/RESULTS.md gives the figures).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

POLICIES = ("none", "softmax", "margin", "entropy", "cosine", "probe", "oracle")
DEFAULTS = {
    "softmax": 0.9,
    "margin": 0.8,
    "entropy": 0.5,
    "cosine": 0.99,
    "oracle": 0.0,
    "none": 0.0,
    "probe": None,
}  # probe: the threshold saved with the fitted probe


def with_copy_bonus(logits: torch.Tensor, guesses: torch.Tensor, bonus: float) -> torch.Tensor:
    """``logits`` [n, V] with ``bonus`` added to each row's copy guess (``guesses`` [n], -1: none, unchanged)."""
    if not bonus:
        return logits
    has = guesses >= 0
    return logits.index_put(
        (has.nonzero()[:, 0], guesses[has]),
        torch.tensor(bonus, dtype=logits.dtype, device=logits.device),
        accumulate=True,
    )


@dataclass
class ExitPolicy:
    kind: str = "none"
    threshold: float | None = None
    probe: object | None = field(default=None, repr=False)  # probe.ExitProbe, bound by the engine
    copy: bool = False  # also exit where the loop's argmax is the context's copy guess (context_index.ContextIndex)
    copy_bonus: float = 0.0  # +copy:BONUS: added to the guess's exit logit (exit_logits)
    # oracle (analysis): each token's argmax after every loop so far, keyed by (request, position)
    _trail: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        if self.kind not in POLICIES:
            raise ValueError(f"unknown exit policy {self.kind!r}; use one of {', '.join(POLICIES)}")
        if self.copy and self.kind == "oracle":
            raise ValueError("the oracle policy never exits; +copy needs another policy (or copy alone)")
        if self.copy_bonus and not self.copy:
            raise ValueError("a copy bonus needs the +copy rule")
        if not 0 <= self.copy_bonus < float("inf"):
            raise ValueError(f"a copy bonus is added to the guess's logit: a finite number >= 0, got {self.copy_bonus}")
        if self.threshold is None:
            self.threshold = DEFAULTS[self.kind]

    @property
    def label(self) -> str:  # parse_policy's text for this policy
        copy = "copy" + (f":{self.copy_bonus:g}" if self.copy_bonus else "")
        return copy if self.kind == "none" and self.copy else f"{self.kind}:{self.threshold}" + f"+{copy}" * self.copy

    @property
    def active(self) -> bool:
        return self.kind != "none" or self.copy

    @property
    def needs_logits(self) -> bool:  # to decide; cosine and a hidden-state probe decide from hidden states
        if self.copy:
            return True  # the loop's argmax, to compare with the copy guess
        if self.kind == "probe":
            return self.probe is not None and self.probe.needs_logits
        return self.kind in ("softmax", "margin", "entropy", "oracle")

    @property
    def needs_hidden(self) -> bool:  # h before the loop and loop indices, to decide
        return self.kind in ("cosine", "probe")

    def bind(self, model) -> ExitPolicy:
        """This policy ready for ``model``: the probe policy loads the probe saved with the model."""
        if self.kind != "probe" or self.probe is not None:
            return self
        from .probe import load_probe

        probe = load_probe(model)
        return ExitPolicy(
            "probe", probe.threshold if self.threshold is None else self.threshold, probe, self.copy, self.copy_bonus
        )

    def exit_logits(self, logits: torch.Tensor, guesses: torch.Tensor | None) -> torch.Tensor:
        """The logits a token that leaves now is drawn from, and ``decide`` judges: the exit's own, with the
        copy bonus on each sequence's guess under ``+copy:BONUS``."""
        if not self.copy_bonus:
            return logits
        return with_copy_bonus(logits, guesses.to(logits.device), self.copy_bonus)

    def record_loop_argmax(self, keys: list, argmaxes: list[int]) -> None:
        """Oracle analysis: note each token's argmax after the loop it just finished (key: (request, position))."""
        for key, a in zip(keys, argmaxes):
            self._trail.setdefault(key, []).append(a)

    def oracle_loop(self, key, final: int, num_loops: int) -> int:
        """Oracle analysis: the first loop (1-based) whose argmax was the final token ``final``; forgets the key."""
        trail = self._trail.pop(key, [])
        return next((l + 1 for l, a in enumerate(trail) if a == final), num_loops)

    def decide(
        self,
        logits: torch.Tensor | None,
        h: torch.Tensor,
        h_prev: torch.Tensor,
        loops: torch.Tensor | None = None,
        model=None,
        guesses: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Bool [n]: which tokens leave now. logits [n, V] (None unless ``needs_logits``; under ``+copy:BONUS``
        those of ``exit_logits``), h and h_prev [n, hidden]; the probe also needs each token's 0-based loop
        index and the model (its final norm); ``+copy`` each sequence's copy guess [n] (-1: none)."""
        if self.copy and guesses is None:
            raise ValueError("a +copy policy decides with each sequence's copy guess (context_index.ContextIndex)")
        leave = self._decide(logits, h, h_prev, loops, model)
        return leave | (logits.argmax(-1) == guesses.to(logits.device)) if self.copy else leave

    def _decide(self, logits, h, h_prev, loops, model) -> torch.Tensor:
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
    """'softmax', 'softmax:0.95', 'margin:0.19+copy', 'margin:0.19+copy:4' (a copy bonus of 4) or 'copy' /
    'copy:4' (only the copy rule)."""
    rule, plus, extra = text.partition("+")
    if rule.partition(":")[0] == "copy" and not plus:
        rule, plus, extra = "none", "+", rule
    modifier, _, bonus = extra.partition(":")
    if plus and modifier != "copy":
        raise ValueError(f"unknown exit policy modifier {extra!r} in {text!r}; the one modifier is +copy[:BONUS]")
    try:
        bonus = float(bonus) if bonus else 0.0
    except ValueError:
        raise ValueError(f"the copy bonus in {text!r} must be a number of nats, e.g. margin:0.19+copy:4") from None
    kind, _, thr = rule.partition(":")
    return ExitPolicy(kind, float(thr) if thr else None, copy=bool(plus), copy_bonus=bonus)
