"""Training objectives as small standalone functions (torchtune style): each takes logits (or, for the
hidden-state terms of healing, hidden states) and returns a scalar mean over the predicted positions. All math is
done in float32.

Shapes: ``logits`` [batch, seq, vocab] are the model's outputs at every position; position t
predicts token t + 1, so losses use logits[:, :-1] against labels[:, 1:] (as the model's own
``forward(labels=...)`` does). Labels equal to -100 are ignored.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

KD_FUNCS = ("fkl", "rkl", "jsd", "tvd")
EARLY_EXIT = ("none", "weighted", "aggressive")


def shift(logits: torch.Tensor) -> torch.Tensor:
    """Logits of the positions that have a next token: [b, t-1, V] flattened to [n, V]."""
    return logits[:, :-1].flatten(0, 1)


def token_ce(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Per-position next-token cross-entropy, [n] (ignored positions give 0)."""
    return F.cross_entropy(shift(logits).float(), input_ids[:, 1:].flatten(), ignore_index=-100, reduction="none")


def ce_loss(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy."""
    return F.cross_entropy(shift(logits).float(), input_ids[:, 1:].flatten(), ignore_index=-100)


def divergence(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, func: str = "fkl", temperature: float = 1.0
) -> torch.Tensor:
    """Per-row divergence between teacher p and student q = softmax(logits / T) over the last dim.

    fkl: KL(p || q) (forward, the paper's pick); rkl: KL(q || p); jsd: Jensen-Shannon with
    m = (p + q) / 2; tvd: total variation, 1/2 sum |p - q|. Returns [rows]."""
    if func not in KD_FUNCS:
        raise ValueError(f"unknown distillation loss {func!r}; use one of {', '.join(KD_FUNCS)}")
    log_q = F.log_softmax(student_logits.float() / temperature, dim=-1)
    log_p = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    if func == "fkl":
        return (log_p.exp() * (log_p - log_q)).sum(-1)
    if func == "rkl":
        return (log_q.exp() * (log_q - log_p)).sum(-1)
    if func == "jsd":
        p, q = log_p.exp(), log_q.exp()
        log_m = torch.log((p + q) / 2).clamp_min(torch.finfo(torch.float32).min)
        return 0.5 * (p * (log_p - log_m)).sum(-1) + 0.5 * (q * (log_q - log_m)).sum(-1)
    return 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)


def kd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    input_ids: torch.Tensor | None = None,
    func: str = "fkl",
    temperature: float = 1.0,
) -> torch.Tensor:
    """Mean divergence over predicted positions, scaled by T^2 (Hinton et al.) so that its gradient
    scale does not depend on the temperature. Positions whose label is -100 are ignored."""
    d = divergence(shift(student_logits), shift(teacher_logits), func, temperature)
    if input_ids is not None:
        keep = (input_ids[:, 1:].flatten() != -100).float()
        d = (d * keep).sum() / keep.sum().clamp_min(1)
    else:
        d = d.mean()
    return d * temperature**2


def _chunk_kl(
    logits: torch.Tensor,
    t_logits: torch.Tensor,
    scale: torch.Tensor,
    softcap: float | None,
    temperature: float,
    grad: bool,
    grad_dtype: torch.dtype,
):
    """One chunk of rows of ``_HeadKD``: the sum over rows of each row's forward KL times ``scale`` [rows], and
    with ``grad`` its gradient with respect to the student's logits before the soft-cap, in ``grad_dtype``.
    Float32 math whatever the logits' dtype. Written without in-place operations so that torch.compile can fuse
    it (``compiled=True``): eager, it is about 10 passes over a [rows, vocabulary] tensor."""
    logits, t_logits = logits.float(), t_logits.float()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
        t_logits = torch.tanh(t_logits / softcap) * softcap
    log_q = torch.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1)
    log_p = torch.log_softmax(t_logits / temperature if temperature != 1.0 else t_logits, dim=-1)
    p = log_p.exp()
    loss = ((p * (log_p - log_q)).sum(-1) * scale).sum()
    if not grad:
        return loss, None
    g = (log_q.exp() - p) * (temperature * scale[:, None])
    if softcap is not None:
        g = g * (1 - (logits / softcap) ** 2)  # logits / c is tanh(x / c) here
    return loss, g.to(grad_dtype)


@functools.cache
def _chunk_kl_compiled():
    return torch.compile(_chunk_kl, dynamic=True)


class _HeadKD(torch.autograd.Function):
    """Forward KL through a frozen LM head, chunked over rows: the [rows, vocab] logits of the student
    and the teacher exist one chunk at a time, and each chunk's gradient with respect to the student's
    normed states is computed in the same pass, as fused linear cross-entropy kernels do (Liger).

    d/ds T^2 KL(softmax(t/T) || softmax(s/T)) = T (softmax(s/T) - softmax(t/T)); with a logit soft-cap
    c tanh(x/c) the chain rule adds a factor 1 - tanh(x/c)^2."""

    @staticmethod
    def forward(ctx, z, weight, teacher_z, teacher_weight, keep, softcap, temperature, chunk_rows, compiled):
        ctx.z_dtype = z.dtype
        # The logits are float32 products whatever autocast is: rounded to bf16 (a coarse ulp at the top
        # logits), they would move the gradient noticeably, most on the tokens that matter most.
        # The gradient's product runs in bf16 under bf16 autocast (much faster with AMX): its rounding is relative
        # to each entry. Not in float16, whose range would flush the 1/rows-scaled gradient to zero. The softmax
        # math is float32.
        device = z.device.type
        bf16 = torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.bfloat16
        grad_dtype = torch.bfloat16 if bf16 else torch.float32
        kl = _chunk_kl_compiled() if compiled else _chunk_kl
        with torch.autocast(device, enabled=False):
            rows = z.shape[0]
            keep = torch.ones(rows, device=z.device) if keep is None else keep
            scale = keep / keep.sum().clamp_min(1)
            loss = torch.zeros((), dtype=torch.float32, device=z.device)
            grad_z = torch.empty_like(z, dtype=torch.float32) if ctx.needs_input_grad[0] else None
            w, wt, w_grad = weight.float(), teacher_weight.float(), weight.to(grad_dtype)
            for s in range(0, rows, chunk_rows):
                logits = z[s : s + chunk_rows].float() @ w.t()
                t_logits = teacher_z[s : s + chunk_rows].float() @ wt.t()
                part, g = kl(
                    logits, t_logits, scale[s : s + chunk_rows], softcap, temperature, grad_z is not None, grad_dtype
                )
                loss += part
                if g is not None:
                    grad_z[s : s + chunk_rows] = g @ w_grad
        ctx.save_for_backward(grad_z)
        return loss * temperature**2

    @staticmethod
    def backward(ctx, grad_loss):
        (grad_z,) = ctx.saved_tensors
        return (grad_z * grad_loss).to(ctx.z_dtype), None, None, None, None, None, None, None, None


def head_kd_loss(
    z: torch.Tensor,
    weight: torch.Tensor,
    teacher_z: torch.Tensor,
    teacher_weight: torch.Tensor,
    input_ids: torch.Tensor | None = None,
    softcap: float | None = None,
    temperature: float = 1.0,
    chunk_rows: int = 256,
    compiled: bool = False,
) -> torch.Tensor:
    """``kd_loss`` (forward KL) of the logits ``z W^T`` against ``teacher_z W_t^T``, without materialising
    either [batch, seq, vocab] tensor: ``z`` and ``teacher_z`` are final-normed states [batch, seq, hidden],
    the head weights frozen. Same value and gradient as ``kd_loss(head(z), head_t(teacher_z), input_ids)``,
    at a fraction of the peak memory with a large vocabulary, and no slower (the head matmuls dominate either).
    Under bf16 autocast the gradient's head product runs in bf16 (the logits stay float32);
    ``compiled`` runs each chunk's softmax math through torch.compile (``_chunk_kl``)."""
    if weight.requires_grad or teacher_weight.requires_grad:
        raise ValueError("head_kd_loss needs frozen head weights; use kd_loss on the logits to train a head")
    keep = None if input_ids is None else (input_ids[:, 1:].flatten() != -100).float()
    return _HeadKD.apply(
        z[:, :-1].flatten(0, 1),
        weight,
        teacher_z[:, :-1].flatten(0, 1).detach(),
        teacher_weight,
        keep,
        softcap,
        temperature,
        chunk_rows,
        compiled,
    )


def exit_weights(num_exits: int, mode: str, coef: float = 0.1) -> list[float]:
    """alpha_i for exits i = 1..B. weighted: i / sum_j j; aggressive: c for i < B, 1 for the last;
    none: only the final exit."""
    if mode == "weighted":
        total = num_exits * (num_exits + 1) / 2
        return [i / total for i in range(1, num_exits + 1)]
    if mode == "aggressive":
        return [coef] * (num_exits - 1) + [1.0]
    if mode == "none":
        return [0.0] * (num_exits - 1) + [1.0]
    raise ValueError(f"unknown early-exit loss {mode!r}; use one of {', '.join(EARLY_EXIT)}")


def objective(
    exit_logits: list[torch.Tensor],
    input_ids: torch.Tensor,
    teacher_logits: torch.Tensor | None = None,
    kd: str = "fkl",
    kd_weight: float = 0.5,
    temperature: float = 1.0,
    early_exit: str = "none",
    exit_coef: float = 0.1,
    self_distill: bool = False,
    self_distill_weight: float = 1.0,
    teacher_exits: bool = False,
) -> tuple[torch.Tensor, dict]:
    """The whole training loss from the logits of every loop exit (last = final output).

    Per exit i: L_i = CE_i. On the final exit with a teacher: L_B = (1 - w) CE_B + w T^2 D(teacher || final).
    With self-distillation each intermediate exit adds ``self_distill_weight`` * KL(final.detach() || exit_i).
    With ``teacher_exits`` (a frozen body, where only exit adapters train) the teacher's term applies to every
    intermediate exit too: L_i = (1 - w) CE_i + w T^2 D(teacher || exit_i) (+ the self-distillation term).
    Total: sum_i alpha_i L_i with alpha from ``exit_weights`` (only the final exit when early_exit is none).
    Returns (loss, parts) with parts holding detached values for logging: ce_i per exit (just ``ce``
    when only the final exit is given), kd (kd_i for intermediate exits with ``teacher_exits``), sd_i, loss."""
    n = len(exit_logits)
    alphas = exit_weights(n, early_exit, exit_coef)
    parts: dict[str, torch.Tensor] = {}
    total = exit_logits[-1].new_zeros((), dtype=torch.float32)
    final_detached = exit_logits[-1].detach()
    for i, (alpha, logits) in enumerate(zip(alphas, exit_logits), start=1):
        if alpha == 0.0:
            continue
        ce = ce_loss(logits, input_ids)
        parts[f"ce_{i}" if n > 1 else "ce"] = ce
        loss_i = ce
        if (i == n or teacher_exits) and teacher_logits is not None and kd_weight > 0:
            kdl = kd_loss(logits, teacher_logits, input_ids, kd, temperature)
            parts["kd" if i == n else f"kd_{i}"] = kdl
            loss_i = (1 - kd_weight) * ce + kd_weight * kdl
        if i < n and self_distill:
            sd = kd_loss(logits, final_detached, input_ids, "fkl", 1.0)
            parts[f"sd_{i}"] = sd
            loss_i = loss_i + self_distill_weight * sd
        total = total + alpha * loss_i
    parts["loss"] = total
    return total, {k: v.detach() for k, v in parts.items()}


# ----- hidden-state terms (healing): the student's states against the original's at the same depth


def token_errors(pred: torch.Tensor, target: torch.Tensor, channels: torch.Tensor | None = None) -> torch.Tensor:
    """||pred - target||^2 / ||target||^2 per token (float32); ``channels`` [hidden]: each channel scaled by its
    weight first (``read_weights``)."""
    diff, target = pred.float() - target, target.float()
    if channels is not None:
        diff, target = diff * channels, target * channels
    return diff.pow(2).sum(-1) / target.pow(2).sum(-1).clamp_min(1e-6)


def relative_error(pred: torch.Tensor, target: torch.Tensor, channels: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over tokens of ||pred - target||^2 / ||target||^2: per token, because the next layer's norm removes
    each token's scale, so this is the error the rest of the network sees."""
    return token_errors(pred, target, channels).mean()


def read_weights(model) -> torch.Tensor:
    """Each channel's weight where ``model``'s layers read the residual stream: the root mean square of its scale
    over the norms that read it (every layer's two pre-norms and the final norm). A norm removes a token's scale but
    not a channel's: where a few massive channels hold nearly all of the stream's squared norm and the norms scale
    them down (Gemma 3), an unweighted error measures those few channels and little of what the layers read."""
    readers = [n for layer in model.model.layers for n in (layer.attn_norm, layer.mlp_norm)] + [model.model.norm]
    scales = []
    for n in readers:
        w = n.weight.detach().float().reshape(-1, n.weight.shape[-1])[0]
        scales.append(1.0 + w if n.kind == "rms_plus1" else w)
    return torch.stack(scales).pow(2).mean(0).sqrt()


def relative_error_log1p(
    pred: torch.Tensor, target: torch.Tensor, channels: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean over tokens of log(1 + relative error): the same as ``relative_error`` where a token is close
    (error << 1), but a token far off pulls with a bounded gradient (at most 1/||target|| in its state). In the
    end-to-end stage the student sometimes puts a massive activation on one token, a relative error in the
    thousands at a few depths; squared, that one token sets the direction of the whole clipped step."""
    return torch.log1p(token_errors(pred, target, channels)).mean()


HIDDEN_LOSSES = {"relative": relative_error, "log1p": relative_error_log1p}
