"""A learned exit probe: after loop i, predict from the token's hidden state alone whether loop i's
argmax already equals the final loop's (CALM's "early-exit classifier", here a logistic regression).

Why: the confidence policies (softmax, margin, entropy) must run the LM head (vocab x hidden, half
a 15-layer loop of SmolLM2 per token) on every token that reaches an intermediate exit, just to
decide. The probe costs one dot product of size hidden per token; only the tokens that exit pay for
the head. Features: the final norm of h (what the head would read) and cos(h, h before the loop).

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


class ProbeError(ValueError):
    pass


def probe_features(model, h: torch.Tensor, h_prev: torch.Tensor) -> torch.Tensor:
    """[n, hidden + 1] float32: final-normed h and cos(h, h_prev)."""
    z = model.model.norm(h).float()
    cos = F.cosine_similarity(h.float(), h_prev.float(), dim=-1)
    return torch.cat([z, cos[:, None]], -1)


@dataclass
class ExitProbe:
    weight: torch.Tensor   # [B - 1, features]: one probe per loop that can be exited after
    bias: torch.Tensor     # [B - 1]
    threshold: float       # calibrated default: exit when the predicted probability >= threshold
    meta: dict

    def prob(self, features: torch.Tensor, loops: torch.Tensor) -> torch.Tensor:
        """P(loop argmax == final argmax) for each row; loops [n] are 0-based loop indices < B - 1."""
        w, b = self.weight.to(features.device), self.bias.to(features.device)
        return torch.sigmoid((features * w[loops]).sum(-1) + b[loops])

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / PROBE_FILE
        tmp = path.with_name(f".{path.name}.tmp")
        save_file({"weight": self.weight.contiguous(), "bias": self.bias.contiguous()}, str(tmp),
                  metadata={"threshold": repr(self.threshold), "meta": json.dumps(self.meta)})
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "ExitProbe":
        from safetensors import safe_open
        with safe_open(str(path), framework="pt") as f:
            md = f.metadata() or {}
        t = load_file(str(path))
        return cls(t["weight"], t["bias"], float(md.get("threshold", 0.5)), json.loads(md.get("meta", "{}")))

    def check(self, model) -> None:
        c = model.config
        want = (c.num_loops - 1, c.hidden_size + 1)
        if tuple(self.weight.shape) != want:
            raise ProbeError(f"the exit probe has shape {tuple(self.weight.shape)}, this model needs {want} "
                             f"(B - 1 loops, hidden + 1 features): it was fitted on another model; re-fit it "
                             f"with `looplm fit-exit-probe`")


def load_probe(model) -> ExitProbe:
    """The probe saved beside the model's weights (the directory it was loaded from)."""
    src = getattr(model, "source_dir", None)
    path = Path(src) / PROBE_FILE if src else None
    if path is None or not path.exists():
        where = f"in {src}" if src else "(the model was not loaded from a directory)"
        raise ProbeError(f"the probe exit policy needs a fitted probe, and there is no {PROBE_FILE} {where}; "
                         f"run `looplm fit-exit-probe MODEL_DIR --data CORPUS` first")
    probe = ExitProbe.load(path)
    probe.check(model)
    return probe


# --- fitting -------------------------------------------------------------------------------------

@torch.no_grad()
def collect(model, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher-forced full-depth passes over token rows: features [B-1, N, F], labels [B-1, N]
    (loop argmax == final argmax) and the per-loop argmaxes [B, N]."""
    B = model.config.num_loops
    dev = next(model.parameters()).device
    feats, labels, args = [], [], []
    for row in rows:
        x = torch.tensor([row], device=dev)
        h0 = model.model.embed(x)
        _, states, _ = model.model(x, output_loop_states=True)
        arg = torch.stack([model.exit_logits(h[0]).argmax(-1) for h in states])  # [B, t]
        prev = [h0] + states[:-1]
        feats.append(torch.stack([probe_features(model, states[i][0], prev[i][0]) for i in range(B - 1)]))
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
        rows.append({"threshold": round(float(thr), 4),
                     "early_exit_fraction": round(float((exit_loop < B - 1).float().mean()), 4),
                     "agreement": round(float((chosen == args[-1]).float().mean()), 4)})
    return rows


def fit_probe(model, fit_rows, calib_rows, target_agreement: float = 0.95, l2: float = 1e-3,
              log=None) -> tuple[ExitProbe, dict]:
    """Fit one logistic probe per exitable loop on fit_rows; pick the lowest threshold whose
    agreement on calib_rows reaches target_agreement (teacher-forced)."""
    say = log or (lambda *a: None)
    B = model.config.num_loops
    if B < 2:
        raise ProbeError("a probe needs a looped model with B >= 2 (there is no early exit at B = 1)")
    say(f"collecting features on {len(fit_rows)} fitting rows")
    xf, yf, _ = collect(model, fit_rows)
    say(f"collecting features on {len(calib_rows)} calibration rows")
    xc, yc, argc = collect(model, calib_rows)
    ws, bs = zip(*(fit_logistic(xf[i], yf[i], l2) for i in range(B - 1)))
    probe = ExitProbe(torch.stack(ws), torch.stack(bs), 0.5, {})
    pc = torch.stack([probe.prob(xc[i], torch.full((xc.shape[1],), i)) for i in range(B - 1)])
    grid = [i / 100 for i in range(1, 100)]
    curve = exit_curve(pc, argc, grid)
    ok = [r for r in curve if r["agreement"] >= target_agreement]
    best = min(ok, key=lambda r: r["threshold"]) if ok else curve[-1]
    probe.threshold = best["threshold"]
    probe.meta = {"fit_tokens": int(xf.shape[1]), "calib_tokens": int(xc.shape[1]), "l2": l2,
                  "target_agreement": target_agreement, "positive_rate_fit": [round(float(v), 4) for v in yf.float().mean(1)],
                  "calib_at_threshold": best}
    report = {**probe.meta, "threshold": probe.threshold, "curve": curve[::5] + [best]}
    return probe, report
