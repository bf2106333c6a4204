"""The step math of healing, as plain functions: what each stage trains, its loss on one batch, and the update.

- ``local_loss``: one shared layer, at every depth tied to it, maps the original's (or, sequential, the
  student's own) input at that depth onto the original's output there; the mean per-token relative error.
- ``e2e_loss``: forward KL of the final output from the original's, plus ``hidden_weight`` x the mean per-depth
  hidden-state error, plus ``exit_weight`` x forward KL of every intermediate loop exit against its target.
- ``exit_loss``: every intermediate exit learns the model's own final output, the body frozen.

Every step is ``update(opt, loss, params, lr, clip)`` after its loss. On several processes each computes the loss
on its share of the step's rows and the gradients are averaged before the update (train/distributed.py: as in
`looplm train`).
"""

from __future__ import annotations

import numpy as np
import torch

from ...models.exit_adapter import add_exit_adapters, freeze_all_but_exit_adapter
from ...models.quantized import linears
from ..distributed import average_gradients, clip_gradients
from ..losses import HIDDEN_LOSSES, head_kd_loss, kd_loss, relative_error
from ..optim import set_lr
from ..teacher_cache import TeacherCache
from .config import HealConfig
from .inputs import step_batch


def eager():
    """Layers compiled by ``--compile`` run eagerly within this context (or a function it decorates): the
    evaluations and the exit stage, whose graphs (no autograd, float32) would each cost a compile."""
    return torch.compiler.set_stance("force_eager")


def compile_layers(*models) -> None:
    """``--compile``: each layer of ``models`` through torch.compile (regional: the layers are one class, so one
    compiled code serves every layer and depth, its parameters graph inputs). Inductor fuses the elementwise
    work around the matmuls (norms, rotary, LoRA sums, residuals, casts) in the forward and backward passes;
    the distillation loss's softmax math is compiled too (``head_kd_loss(compiled=True)``, in ``exit_kd``).
    The plan compiles a copy's layers first (``time_steps``); the code is shared, so the stages find it
    ready. The local stage's batch (4 rows) and the end-to-end stage's (2) differ: dynamo makes the batch
    dimension dynamic at the second, which runs no slower. Evaluations, the exit stage and sequential
    propagation stay eager (``eager``)."""
    for model in models:
        for layer in model.model.layers:
            if getattr(layer, "_compiled_call_impl", None) is None:
                layer.compile()


# ----- what trains


def unfreeze(module, base_weights: str) -> list[torch.nn.Parameter]:
    """``module``'s parameters made trainable and returned, except the shared weights when they were rounded
    (``--base-weights``): those stay frozen on their grid, and the LoRA, norms and biases learn around them."""
    module.requires_grad_(True)
    if base_weights != "fp32":
        for _, lin in linears(module):
            lin.weight.requires_grad_(False)
    return [p for p in module.parameters() if p.requires_grad]


def body_params(model, base_weights: str) -> list[torch.nn.Parameter]:
    """What the end-to-end stage trains: the layers (embeddings, final norm and head stay the original's)."""
    model.requires_grad_(False)
    return unfreeze(model.model.layers, base_weights)


def exit_params(model, exit_spec: dict) -> list[torch.nn.Parameter]:
    """What the exit stage trains: an adapter per intermediate exit, added, everything else frozen."""
    add_exit_adapters(model, exit_spec["kind"], exit_spec.get("rank"))
    return freeze_all_but_exit_adapter(model)


def update(opt, loss: torch.Tensor, params, lr: float, clip: float, average: bool = False) -> None:
    """One optimizer step on ``loss`` at ``lr``, the gradient of ``params`` clipped to norm ``clip``; with
    ``average``, the gradients are first averaged over the processes (``average_gradients``)."""
    params = list(params)
    set_lr(opt, lr)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if average:
        average_gradients(params)
    clip_gradients(params, clip)
    opt.step()


# ----- layer-local


def local_visits(cfg, sequential: bool) -> list[int]:
    """What the layer-local stage visits in order: the shared blocks (parallel), or the depths that run them
    (sequential). A plan's unique blocks are the original's layers: exact from the start, they get no visit. A
    model of one loop (the reduced-size baseline) is all unique blocks, and each is visited."""
    plan = cfg.plan
    if sequential:
        return [dep.index for dep in plan.depths if not plan.is_unique(dep.block)]
    return [b for b in range(plan.num_blocks) if not plan.is_unique(b)]


def run_depth(model, d: int, h: torch.Tensor) -> torch.Tensor:
    """Depth ``d`` of ``model`` alone on states ``h`` [rows, seq, hidden]."""
    return model.model.run_depths(h, [model.config.plan.depths[d]])


def local_loss(
    model, layer: int, cache: TeacherCache, spans, idx, inputs: dict, autocast, device, channels=None
) -> torch.Tensor:
    """The mean over the depths tied to shared layer ``layer`` of its relative error on cache rows ``idx``: depth d
    maps the original's states at the start of its span of layers (``spans[d]``, inputs.teacher_spans) onto those at
    its end, its error weighing the channels by ``channels`` (None: uniformly). ``inputs[d]`` holds the student's
    inputs of a depth already reached (sequential mode)."""
    depths = model.config.plan.block_depths[layer]
    loss = 0.0
    for d in depths:
        start, end = spans[d]
        x = inputs[d][idx].float() if d in inputs else cache.boundary(start, idx)
        y = cache.boundary(end, idx).to(device)
        with autocast():
            pred = run_depth(model, d, x.to(device))
        loss = loss + relative_error(pred, y, channels) / len(depths)
    return loss


def local_step(
    model,
    layer: int,
    cache,
    spans,
    idx,
    opt,
    inputs: dict,
    lr: float,
    autocast,
    device,
    clip: float,
    average=False,
    channels=None,
) -> float:
    """A step of shared layer ``layer`` on cache rows ``idx`` (this process's share of the step's rows: with
    ``average`` the gradients are averaged over the processes); returns this process's loss."""
    loss = local_loss(model, layer, cache, spans, idx, inputs, autocast, device, channels)
    update(opt, loss, model.model.layers[layer].parameters(), lr, clip, average)
    return float(loss.detach())


@torch.no_grad()
@eager()
def propagate(model, d: int, h: torch.Tensor, autocast, device) -> torch.Tensor:
    """The student's states after depth d for every cached row (in chunks), bfloat16 on the host."""
    out = torch.empty_like(h)
    for s in range(0, h.shape[0], 8):
        with autocast():
            out[s : s + 8] = run_depth(model, d, h[s : s + 8].float().to(device)).to(torch.bfloat16).cpu()
    return out


def first_inputs(cache: TeacherCache, rows: int) -> torch.Tensor:
    """Every cached row's input of depth 0 (the embeddings), bfloat16 on the host: where propagation starts."""
    return cache.boundary(0, np.arange(rows)).to(torch.bfloat16)


# ----- end to end and exits


def exit_kd(model, h: torch.Tensor, loop: int | None, target_z, target_model, autocast, compiled: bool):
    """Forward KL of ``model``'s exit after ``loop`` (None: the final output) from state ``h`` against
    ``target_model``'s plain head on its final-normed states ``target_z``. The head is fused into the
    loss (head_kd_loss: no [rows, vocab] logits kept for the backward pass) unless an adapter changes
    the exit's logits themselves."""
    softcap = model.config.final_logit_softcap
    with autocast():
        if model.exit_logits_are_head(loop):
            return head_kd_loss(
                model.exit_states(h, loop),
                model.lm_head.weight,
                target_z,
                target_model.lm_head.weight,
                softcap=softcap,
                compiled=compiled,
            )
        logits = model.exit_logits(h, loop)
    target = target_z @ target_model.lm_head.weight.t()
    target = target if softcap is None else torch.tanh(target / softcap) * softcap
    return kd_loss(logits, target)


def e2e_loss(model, teacher, ids, boundary, spans, c: HealConfig, autocast, channels=None) -> tuple[torch.Tensor, dict]:
    """The end-to-end loss on rows ``ids`` (``boundary(b)``: the original's states at layer boundary b; depth d
    of the student ends where its span of the original's layers ends, ``spans[d]``; ``channels``: as in ``local_loss``)
    and its parts."""
    cfg = model.config
    plan = cfg.plan
    with torch.no_grad():
        teacher_z = teacher.exit_states(boundary(spans[-1][1]))
    with autocast():
        _, depth_states, _ = model.model(ids, output_depth_states=True)
    parts = {"kd": exit_kd(model, depth_states[-1], None, teacher_z, teacher, autocast, c.compile)}
    loss = parts["kd"]
    # the depths after which an intermediate loop's exit leaves (through the coda, if the plan has one)
    loop_ends = [plan.loop(i)[-1].index for i in range(cfg.num_loops - 1)] if plan.looped else []
    if c.hidden_weight:
        # The state after an intermediate loop is an exit too: with an exit term it is left free to
        # become predictive instead of copying the original's mid-network state.
        L = len(depth_states)
        matched = [d for d in range(L) if not (c.exit_weight and d in loop_ends)]
        error = HIDDEN_LOSSES[c.hidden_loss]
        hid = sum(error(depth_states[d], boundary(spans[d][1]), channels) for d in matched) / len(matched)
        parts["hidden"] = hid
        loss = loss + c.hidden_weight * hid
    if c.exit_weight and loop_ends:
        # "final": each exit learns the student's own full-depth output, the one its tokens must agree with
        target_z, target = (
            (teacher_z, teacher)
            if c.exit_target == "teacher"
            else (model.exit_states(depth_states[-1]).detach(), model)
        )
        for i, d in enumerate(loop_ends, start=1):
            with autocast():
                h = model.model.run_depths(depth_states[d], plan.coda) if plan.coda else depth_states[d]
            parts[f"kd_exit{i}"] = exit_kd(model, h, i - 1, target_z, target, autocast, c.compile)
            loss = loss + c.exit_weight * parts[f"kd_exit{i}"]
    return loss, parts


def exit_loss(model, ids, autocast, compiled: bool) -> tuple[torch.Tensor, dict]:
    """Every intermediate exit's forward KL from the model's own final output, the body run without gradients."""
    with torch.no_grad(), autocast():
        _, states, _ = model.model(ids, output_loop_states=True)
        target = model.exit_states(states[-1])
    parts = {
        f"exit{i + 1}": exit_kd(model, states[i], i, target, model, autocast, compiled) for i in range(len(states) - 1)
    }
    return sum(parts.values()) / len(parts), parts


def logged(loss: torch.Tensor, parts: dict) -> dict:
    """A step's record: the loss and its parts as floats."""
    return {"loss": float(loss.detach()), **{k: float(v.detach()) for k, v in parts.items()}}


def e2e_step(inputs, cache, c: HealConfig, model, step: int, opt, lr: float) -> dict:
    """End-to-end step ``step`` of ``model`` (the student, or the plan's copy of it; its rows: ``step_batch``, this
    process's share) with ``opt`` at ``lr``; returns this process's loss and its parts."""
    ids, boundary = step_batch(inputs, cache, c, step, "e2e")
    loss, parts = e2e_loss(model, inputs.teacher, ids, boundary, inputs.spans, c, inputs.autocast, inputs.channels)
    params = [p for p in model.parameters() if p.requires_grad]
    update(opt, loss, params, lr, c.grad_clip, average=inputs.world > 1)
    return logged(loss, parts)


def exit_step(inputs, cache, c: HealConfig, model, step: int, opt, lr: float) -> dict:
    """Exit-adapter step ``step``: only the adapters learn (``exit_params``)."""
    ids, _ = step_batch(inputs, cache, c, step, "exit")
    loss, parts = exit_loss(model, ids, inputs.autocast, c.compile)
    update(opt, loss, model.exit_adapter.parameters(), lr, c.grad_clip, average=inputs.world > 1)
    return logged(loss, parts)
