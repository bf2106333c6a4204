"""A learned exit probe: after loop i, predict whether loop i's argmax already equals the final loop's
(CALM's "early-exit classifier", here a logistic regression per loop), from one of two feature sets:

- ``hidden``: the final norm of h (what the head would read) and cos(h, h before the loop). The
  confidence policies (softmax, margin, entropy) must run the LM head on every token that reaches an
  intermediate exit just to decide; this probe costs one dot product of size hidden per token, and only
  the tokens that exit pay for the head.
- ``confidence``: eight numbers read off the loop's exit logits (the five largest probabilities, the top-2
  probability margin, negated entropy, the top-2 logit gap) and the cosine. It needs the head on every
  row like the margin policy, and ranks tokens better: a probability per loop, calibrated by the fit,
  where one margin threshold means different things after different loops.

Fitted by `looplm fit-exit-probe MODEL --data CORPUS` on teacher-forced full-depth passes over the
corpus' *training* split; its threshold is calibrated on a separate slice of the training split to a
target agreement with the final loop and saved with the weights as `exit_probe.safetensors` in the
model directory, where the `probe` exit policy finds it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

PROBE_FILE = "exit_probe.safetensors"
FEATURE_SETS = ("hidden", "confidence")


class ProbeError(ValueError):
    pass


def probe_features(model, h: torch.Tensor, h_prev: torch.Tensor) -> torch.Tensor:
    """[n, hidden + 1] float32: final-normed h and cos(h, h_prev)."""
    z = model.model.norm(h).float()
    cos = F.cosine_similarity(h.float(), h_prev.float(), dim=-1)
    return torch.cat([z, cos[:, None]], -1)


def confidence_features(logits: torch.Tensor, h: torch.Tensor, h_prev: torch.Tensor) -> torch.Tensor:
    """[n, 9] float32: the five largest probabilities, top-1 minus top-2 probability, negated entropy,
    top-1 minus top-2 logit, cos(h, h_prev). Log-probabilities give the same features as logits."""
    z = logits.float()
    p = z.softmax(-1)
    top = p.topk(min(5, p.shape[-1]), dim=-1).values
    top = F.pad(top, (0, 5 - top.shape[-1]))
    gap = z.topk(min(2, z.shape[-1]), dim=-1).values
    gap = gap[:, 0] - gap[:, -1]
    ent = -(p * p.clamp_min(1e-30).log()).sum(-1)
    cos = F.cosine_similarity(h.float(), h_prev.float(), dim=-1)
    return torch.cat([top, torch.stack([top[:, 0] - top[:, 1], -ent, gap, cos], -1)], -1)


def num_features(model, kind: str) -> int:
    return model.config.hidden_size + 1 if kind == "hidden" else 9


@dataclass
class ExitProbe:
    weight: torch.Tensor  # [B - 1, features]: one probe per loop that can be exited after
    bias: torch.Tensor  # [B - 1]
    threshold: float  # calibrated default: exit when the predicted probability >= threshold
    meta: dict
    features: str = "hidden"  # FEATURE_SETS

    @property
    def needs_logits(self) -> bool:
        return self.features == "confidence"

    def featurize(self, model, h: torch.Tensor, h_prev: torch.Tensor, logits: torch.Tensor | None = None):
        """This probe's features for rows h (after the loop), h_prev (before it) and, for the confidence
        set, the loop's exit logits."""
        if self.features == "hidden":
            return probe_features(model, h, h_prev)
        return confidence_features(logits, h, h_prev)

    def prob(self, features: torch.Tensor, loops: torch.Tensor) -> torch.Tensor:
        """P(loop argmax == final argmax) for each row; loops [n] are 0-based loop indices < B - 1."""
        w, b = self.weight.to(features.device), self.bias.to(features.device)
        return torch.sigmoid((features * w[loops]).sum(-1) + b[loops])

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / PROBE_FILE
        tmp = path.with_name(f".{path.name}.tmp")
        save_file(
            {"weight": self.weight.contiguous(), "bias": self.bias.contiguous()},
            str(tmp),
            metadata={"threshold": repr(self.threshold), "meta": json.dumps(self.meta), "features": self.features},
        )
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> ExitProbe:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            md = f.metadata() or {}
        t = load_file(str(path))
        features = md.get("features", "hidden")  # files written before the confidence set existed
        if features not in FEATURE_SETS:
            raise ProbeError(
                f"{path} has features {features!r}, not one of {FEATURE_SETS}; re-fit it with `looplm fit-exit-probe`"
            )
        return cls(t["weight"], t["bias"], float(md.get("threshold", 0.5)), json.loads(md.get("meta", "{}")), features)

    def check(self, model) -> None:
        want = (model.config.num_loops - 1, num_features(model, self.features))
        if tuple(self.weight.shape) != want:
            raise ProbeError(
                f"the exit probe has shape {tuple(self.weight.shape)}, this model needs {want} "
                f"(B - 1 loops, {self.features} features): it was fitted on another model; re-fit "
                f"it with `looplm fit-exit-probe`"
            )


def load_probe(model) -> ExitProbe:
    """The probe saved beside the model's weights (the directory it was loaded from)."""
    src = getattr(model, "source_dir", None)
    path = Path(src) / PROBE_FILE if src else None
    if path is None or not path.exists():
        where = f"in {src}" if src else "(the model was not loaded from a directory)"
        raise ProbeError(
            f"the probe exit policy needs a fitted probe, and there is no {PROBE_FILE} {where}; "
            f"run `looplm fit-exit-probe MODEL_DIR --data CORPUS` first"
        )
    probe = ExitProbe.load(path)
    probe.check(model)
    return probe


# --- fitting -------------------------------------------------------------------------------------


def core_states(model, x: torch.Tensor, loop_states: list[torch.Tensor]) -> tuple[list, list]:
    """The core's state after each loop and before it, as the engine's exit decision reads them (before a plan's
    coda, which only a leaving token runs): the exits' states themselves when the plan has no unique layers."""
    plan = model.config.plan
    h0 = model.model.embed(x)
    if not plan.has_ends:
        return loop_states, [h0] + loop_states[:-1]
    _, depth, _ = model.model(x, output_depth_states=True)
    after = [depth[plan.loop(i)[-1].index] for i in range(plan.num_loops)]
    before = [depth[plan.loop(i)[0].index - 1] if plan.loop(i)[0].index else h0 for i in range(plan.num_loops)]
    return after, before


@torch.no_grad()
def collect(model, rows: list[list[int]], features: str = "hidden") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher-forced full-depth passes over token rows: features [B-1, N, F], labels [B-1, N]
    (loop argmax == final argmax) and the per-loop argmaxes [B, N]."""
    B = model.config.num_loops
    dev = next(model.parameters()).device
    feats, labels, args = [], [], []
    for row in rows:
        x = torch.tensor([row], device=dev)
        _, states, _ = model.model(x, output_loop_states=True)
        logits = [model.exit_logits(h[0], loop=i) for i, h in enumerate(states)]
        arg = torch.stack([z.argmax(-1) for z in logits])  # [B, t]
        core, prev = core_states(model, x, states)
        if features == "hidden":
            feats.append(torch.stack([probe_features(model, core[i][0], prev[i][0]) for i in range(B - 1)]))
        else:
            feats.append(torch.stack([confidence_features(logits[i], core[i][0], prev[i][0]) for i in range(B - 1)]))
        labels.append(arg[:-1] == arg[-1])
        args.append(arg)
    return torch.cat(feats, 1).cpu(), torch.cat(labels, 1).cpu(), torch.cat(args, 1).cpu()


def fit_logistic(x: torch.Tensor, y: torch.Tensor, l2: float = 1e-3, steps: int = 200):
    """Weight and bias of an L2-regularised logistic regression (full-batch L-BFGS on standardised
    features, scaling folded back into the weight)."""
    x, y = x.double(), y.double()
    mu, sd = x.mean(0), x.std(0).clamp_min(1e-6)
    xs = (x - mu) / sd
    w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros((), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1, max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(xs @ w + b, y) + l2 * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    w, b = w.detach(), b.detach()
    return (w / sd).float(), (b - (w * mu / sd).sum()).float()


def exit_curve(p: torch.Tensor, args: torch.Tensor, thresholds) -> list[dict]:
    """For each threshold: the fraction of tokens leaving early and the agreement of the tokens
    chosen (a token takes the first loop whose probe says exit) with the final loop's argmax."""
    B = args.shape[0]
    rows = []
    for thr in thresholds:
        exit_loop = torch.full((args.shape[1],), B - 1)
        for i in range(B - 2, -1, -1):
            exit_loop = torch.where(p[i] >= thr, torch.full_like(exit_loop, i), exit_loop)
        chosen = args.gather(0, exit_loop[None])[0]
        rows.append(
            {
                "threshold": round(float(thr), 4),
                "early_exit_fraction": round(float((exit_loop < B - 1).float().mean()), 4),
                "per_loop": [round(float((exit_loop == i).float().mean()), 4) for i in range(B - 1)],
                "agreement": round(float((chosen == args[-1]).float().mean()), 4),
            }
        )
    return rows


def fit_probe(
    model, fit_rows, calib_rows, target_agreement: float = 0.95, l2: float = 1e-3, log=None, features: str = "hidden"
) -> tuple[ExitProbe, dict]:
    """Fit one logistic probe per exitable loop on fit_rows; pick the lowest threshold whose
    agreement on calib_rows reaches target_agreement (teacher-forced)."""
    say = log or (lambda *a: None)
    B = model.config.num_loops
    if B < 2:
        raise ProbeError("a probe needs a looped model with B >= 2 (there is no early exit at B = 1)")
    if features not in FEATURE_SETS:
        raise ProbeError(f"unknown probe features {features!r}; use one of {FEATURE_SETS}")
    say(f"collecting {features} features on {len(fit_rows)} fitting rows")
    xf, yf, _ = collect(model, fit_rows, features)
    say(f"collecting {features} features on {len(calib_rows)} calibration rows")
    xc, yc, argc = collect(model, calib_rows, features)
    ws, bs = zip(*(fit_logistic(xf[i], yf[i], l2) for i in range(B - 1)))
    probe = ExitProbe(torch.stack(ws), torch.stack(bs), 0.5, {}, features)
    pc = torch.stack([probe.prob(xc[i], torch.full((xc.shape[1],), i)) for i in range(B - 1)])
    grid = [i / 100 for i in range(1, 100)]
    curve = exit_curve(pc, argc, grid)
    ok = [r for r in curve if r["agreement"] >= target_agreement]
    best = min(ok, key=lambda r: r["threshold"]) if ok else curve[-1]
    probe.threshold = best["threshold"]
    probe.meta = {
        "features": features,
        "fit_tokens": int(xf.shape[1]),
        "calib_tokens": int(xc.shape[1]),
        "l2": l2,
        "target_agreement": target_agreement,
        "positive_rate_fit": [round(float(v), 4) for v in yf.float().mean(1)],
        "calib_at_threshold": best,
    }
    report = {**probe.meta, "threshold": probe.threshold, "curve": curve[::5] + [best]}
    return probe, report
