"""Data-aware conversion: calibration statistics, the closed-form shared weight and whitened SVD LoRA.

Plain conversion treats every weight entry alike. What matters is the error of each linear's
*output* on the inputs it actually sees, ||(W_d - W') X_d||_F^2 = tr((W_d - W') C_d (W_d - W')^T)
with C_d = X_d X_d^T the second moment of the inputs of that linear at depth d of the original model.

- ``collect_calibration``: hooks on the vanilla model record C_d for every linear at every depth
  (q/k/v share one input, gate/up another: one matrix each), summed in float64 over a calibration
  text that must come from a training split, never from held-out data.
- ``shared_weight`` (``--init aware``): W' = argmin_W sum_{d tied to k} ||(W_d - W) X_d||^2
  = (sum_d W_d C~_d)(sum_d C~_d)^{-1}.
- ``whitened_svd_factors`` (``--lora-init aware-svd``): with C~_d = S S^T (Cholesky), the truncated
  SVD of R S = U Sigma V^T gives B = U_r Sigma_r, A = V_r^T S^{-1}: the rank-r B A minimising
  ||(R - B A) X_d||^2 (SVD-LLM); at full rank B A = R exactly. Always a full float64 SVD.

Damping. C~_d = C_d / n + lambda * I with lambda = damp * the mean over the tied depths of
mean(diag(C_d / n)) (``damp`` = 0.01 by default, the GPTQ convention; one lambda per shared
linear). It makes every C~_d positive definite (a depth whose inputs span only part of the
space still gets a unique answer) and, for the shared weight, it is a ridge that pulls W' towards
the plain average of the W_d rather than towards zero: as damp -> infinity, ``aware`` -> ``average``.
The LoRA init uses the same C~_d, so the two steps minimise one objective.

Norm folding. q/k/v and gate/up read the output of a norm whose weight s_d is per depth in the
original model but tied (s', e.g. the average) after conversion, so depth d of the converted
model sees D_d X_d with D_d = diag(s' / s_d) instead of X_d. With ``fold_norms`` (the default)
the objective is written on the converted model's inputs: sum_d ||W_d X_d - W' D_d X_d||^2
= sum_d ||(W_d D_d^{-1} - W') D_d X_d||^2, i.e. targets T_d = W_d D_d^{-1} and statistics
D_d C_d D_d. Then a full-rank aware-svd LoRA restores the original model exactly even with tied
norms. (LayerNorm, which also has a bias, and channels where s_d or s' is ~0 are not folded.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..models import ConfigError, LoopLMForCausalLM

# Which recorded input each linear reads: q/k/v share the attention norm's output, gate/up the MLP norm's.
INPUT_OF = {
    "q_proj": "attn",
    "k_proj": "attn",
    "v_proj": "attn",
    "o_proj": "o",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "down",
}
# The module whose input is recorded for each input key, and the norm that produces it.
HOOKED = {"attn": "attn.q_proj", "o": "attn.o_proj", "mlp": "mlp.up_proj", "down": "mlp.down_proj"}
NORM_OF = {"attn": "attn_norm", "mlp": "mlp_norm"}
DAMP = 0.01


@dataclass
class Calibration:
    """Summed input second moments sum_t x_t x_t^T (float64) of every linear at every depth of the
    original model, the token count, and the original norm weights feeding q/k/v and gate/up."""

    sums: dict = field(default_factory=dict)  # (depth, key) -> [in, in] float64
    tokens: int = 0
    num_layers: int = 0
    norm_kind: str = "rms"
    norm_weights: dict = field(default_factory=dict)  # (depth, key) -> raw norm weight [dim]
    damp: float = DAMP
    fold_norms: bool = True
    source: str = ""
    seconds: float = 0.0

    def second_moment(self, depth: int, linear: str) -> torch.Tensor:
        """E[x x^T] of the input of ``linear`` ("q_proj", ...) at ``depth``, undamped."""
        return self.sums[(depth, INPUT_OF[linear])] / max(self.tokens, 1)

    def save(self, path: str | Path) -> None:
        torch.save({k: v for k, v in self.__dict__.items()}, str(path))

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        return cls(**torch.load(str(path), weights_only=False))

    def summary(self) -> dict:
        return {
            "tokens": self.tokens,
            "layers": self.num_layers,
            "damp": self.damp,
            "fold_norms": self.fold_norms,
            "source": self.source,
            "seconds": round(self.seconds, 2),
        }


def text_windows(
    tokenizer, texts: list[str], seq_len: int = 512, max_tokens: int = 16384, add_bos: bool = False
) -> torch.Tensor:
    """Token windows [n, seq_len] for calibration: the texts tokenised, joined and cut into full
    windows (a BOS first in each for models that need one) until ``max_tokens`` tokens."""
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
        if len(ids) >= max_tokens:
            break
    bos = tokenizer.bos_token_id if add_bos else None
    body = seq_len - (1 if bos is not None else 0)
    ids = ids[:max_tokens]
    windows = [ids[i : i + body] for i in range(0, len(ids), body)]
    if len(windows) > 1 and len(windows[-1]) < body:
        windows = windows[:-1]  # equal lengths: no padding, so every recorded input is real
    if not windows or len(windows[0]) < 2:
        raise ConfigError("the calibration text is too short: give at least a few hundred tokens")
    width = min(len(w) for w in windows)
    rows = [([bos] if bos is not None else []) + w[:width] for w in windows]
    return torch.tensor(rows, dtype=torch.long)


@torch.no_grad()
def collect_calibration(
    model: LoopLMForCausalLM,
    windows: torch.Tensor,
    batch_size: int = 4,
    damp: float = DAMP,
    fold_norms: bool = True,
    source: str = "",
) -> Calibration:
    """Run the vanilla model over ``windows`` [n, t] and sum x x^T of every linear's input per depth."""
    if model.config.num_loops != 1:
        raise ConfigError("calibrate the vanilla (num_loops = 1) model the recursive one is converted from")
    started = time.perf_counter()
    layers = model.model.layers
    calib = Calibration(
        num_layers=len(layers), damp=damp, fold_norms=fold_norms, source=source, norm_kind=layers[0].attn_norm.kind
    )
    handles = []

    def hook_for(depth: int, key: str):
        def hook(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1])
            # float32 matmul per batch, summed in float64 over batches: the per-batch Gram matrix is
            # exact to float32 rounding, the accumulation over the whole calibration set is not lossy.
            gram = (x.float().T @ x.float()).double()
            if (depth, key) in calib.sums:
                calib.sums[(depth, key)] += gram
            else:
                calib.sums[(depth, key)] = gram

        return hook

    for d, block in enumerate(layers):
        modules = dict(block.named_modules())
        for key, path in HOOKED.items():
            handles.append(modules[path].register_forward_pre_hook(hook_for(d, key)))
        for key, norm_name in NORM_OF.items():
            calib.norm_weights[(d, key)] = getattr(block, norm_name).weight[0].detach().double().clone()
    try:
        was_training = model.training
        model.eval()
        for start in range(0, windows.shape[0], batch_size):
            batch = windows[start : start + batch_size].to(next(model.parameters()).device)
            model.model(batch)
            calib.tokens += batch.numel()
        model.train(was_training)
    finally:
        for h in handles:
            h.remove()
    calib.seconds = time.perf_counter() - started
    return calib


def check_calibration(calib: Calibration | None, config, init: str, lora_init: str, lora_ranks: dict) -> None:
    """Refuse a data-aware init without statistics, or with statistics of another model."""
    relaxed = any(v not in (0, "0") for v in lora_ranks.values())
    needs = [
        what
        for what, used in (
            ("--init aware", init == "aware"),
            ("--lora-init aware-svd", lora_init == "aware-svd" and relaxed),
        )
        if used
    ]
    if needs and calib is None:
        raise ConfigError(
            f"{' and '.join(needs)} need calibration statistics: give a training-split text "
            f"(looplm convert --calib-text FILE or --calib-data DIR)"
        )
    if calib is not None and calib.num_layers != config.num_hidden_layers:
        raise ConfigError(
            f"the calibration statistics are of a {calib.num_layers}-layer model, but this model has "
            f"{config.num_hidden_layers} layers: calibrate the model you convert"
        )


def damped(cov: torch.Tensor, damp: float, scale: float | None = None) -> torch.Tensor:
    """cov + damp * scale * I, scale = mean(diag(cov)) unless given (a floor keeps an all-zero input
    positive definite)."""
    if scale is None:
        scale = float(cov.diagonal().mean()) if cov.numel() else 0.0
    lam = damp * scale if scale > 0 else 1.0
    return cov + lam * torch.eye(cov.shape[0], dtype=cov.dtype, device=cov.device)


def _scale(raw: torch.Tensor, kind: str) -> torch.Tensor:
    return 1.0 + raw if kind == "rms_plus1" else raw


def converted_norm_raw(calib: Calibration, depths: list[int], key: str, norms: str, pick: int) -> torch.Tensor | None:
    """The raw norm weight the converted model gives shared layer's ``key`` input under rule
    ``norms`` (mirrors convert's norm rules), or None where inputs are unchanged (per-depth)."""
    raws = [calib.norm_weights[(d, key)] for d in depths]
    if norms == "per-depth":
        return None
    if norms == "tied-avg":
        return torch.stack(raws).mean(0)
    if norms == "tied-choice":
        return calib.norm_weights[(pick, key)]
    if norms == "tied-zero":
        return torch.zeros_like(raws[0])
    raise ConfigError(f"unknown norms rule {norms!r}")


def depth_problem(
    calib: Calibration,
    weights: torch.Tensor,
    depths: list[int],
    linear: str,
    norms: str = "per-depth",
    pick: int | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Targets T_d [B, out, in] (float64) and damped statistics C~_d of one shared linear, such that
    the output error of depth d is tr((T_d - W) C~_d (T_d - W)^T). Without norm folding T_d = W_d."""
    key = INPUT_OF[linear]
    targets = weights.double().clone()
    covs = [calib.second_moment(d, linear) for d in depths]
    if calib.fold_norms and key in NORM_OF and calib.norm_kind != "layer":
        new_raw = converted_norm_raw(calib, depths, key, norms, depths[0] if pick is None else pick)
        if new_raw is not None:
            new = _scale(new_raw, calib.norm_kind)
            for i, d in enumerate(depths):
                old = _scale(calib.norm_weights[(d, key)], calib.norm_kind)
                ok = (old.abs() > 1e-6) & (new.abs() > 1e-6)
                ratio = torch.where(ok, new / torch.where(ok, old, torch.ones_like(old)), torch.ones_like(old))
                targets[i] = targets[i] / ratio  # W_d D_d^{-1}: columns scaled
                covs[i] = covs[i] * ratio[:, None] * ratio[None, :]  # D_d C_d D_d
    # One ridge for the whole group (the mean over its depths of the mean diagonal), so that a large
    # damping pulls the shared weight towards the plain average of the targets.
    scale = float(sum(c.diagonal().mean() for c in covs) / len(covs))
    return targets, [damped(c, calib.damp, scale) for c in covs]


def shared_weight(targets: torch.Tensor, covs: list[torch.Tensor]) -> torch.Tensor:
    """argmin_W sum_d tr((T_d - W) C_d (T_d - W)^T) = (sum_d T_d C_d)(sum_d C_d)^{-1}, in float64.
    The C_d must be positive definite (damped)."""
    c_sum = sum(covs)
    rhs = sum(t.double() @ c for t, c in zip(targets, covs))  # [out, in]
    chol = torch.linalg.cholesky(c_sum)
    # W c_sum = rhs  <=>  c_sum W^T = rhs^T (c_sum symmetric)
    return torch.cholesky_solve(rhs.T.contiguous(), chol).T


def whitened_svd_factors(residual: torch.Tensor, cov: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """B [out, r], A [r, in] minimising tr((R - B A) C (R - B A)^T) for positive definite C = S S^T:
    truncated SVD of R S, then A = V_r^T S^{-1}. Float64 throughout."""
    S = torch.linalg.cholesky(cov.double())
    # A full SVD always: the randomised SVD of svd_factors is too inexact on whitened residuals (it costs
    # the converted model a clearly worse held-out perplexity than the exact truncation).
    U, sv, Vh = torch.linalg.svd(residual.double() @ S, full_matrices=False)
    b, a_white = U[:, :rank] * sv[:rank], Vh[:rank]
    a = torch.linalg.solve_triangular(S, a_white, upper=False, left=False)  # a S = a_white
    return b, a


def output_error(weight: torch.Tensor, target: torch.Tensor, cov: torch.Tensor) -> float:
    """tr((T - W) C (T - W)^T): the mean squared output error on inputs with second moment C."""
    diff = target.detach().double() - weight.detach().double()
    return float(((diff @ cov.double()) * diff).sum())


def read_calibration_texts(files: list[str | Path] = (), dirs: list[str | Path] = ()) -> tuple[list[str], list[str]]:
    """The texts of the given files and of every *.txt under the given directories (sorted), and their paths."""
    paths = [Path(f) for f in files]
    for d in dirs:
        d = Path(d)
        if not d.is_dir():
            raise ConfigError(f"calibration directory {d} does not exist")
        found = sorted(p for p in d.rglob("*.txt") if p.is_file())
        if not found:
            raise ConfigError(f"calibration directory {d} holds no .txt files")
        paths.extend(found)
    texts = []
    for p in paths:
        if not p.exists():
            raise ConfigError(f"calibration text {p} does not exist")
        texts.append(p.read_text(encoding="utf-8", errors="replace"))
    if not any(t.strip() for t in texts):
        raise ConfigError("the calibration texts are empty")
    return texts, [str(p) for p in paths]


def shares_text(texts: list[str], heldout: str, probe: int = 200, probes: int = 100) -> bool:
    """True if any calibration text contains one of the consecutive ``probe``-character passages of
    ``heldout`` (at most ``probes`` of them, spread evenly): calibration must never see the held-out
    text it is then scored on. Whitespace is normalised first."""
    body = " ".join(heldout.split())
    if len(body) < probe:
        return False
    joined = [" ".join(t.split()) for t in texts]
    step = max(probe, (len(body) - probe) // max(probes - 1, 1))
    for start in range(0, len(body) - probe + 1, step):
        snippet = body[start : start + probe]
        if any(snippet in t for t in joined):
            return True
    return False
