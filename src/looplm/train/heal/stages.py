"""The stages of a healing run, each resumable from its checkpoints: the rounding of the shared weights
(``--base-weights``), the layer-local stage, and the end-to-end and exit-adapter stages, which run on the step loop
of `looplm train` (``train_steps``, train/step_loop.py). On several processes each stage's step takes the same rows
as on one, each process its share of them, and averages the gradients (steps.py), so that the run follows one
process's at the same global batch."""

from __future__ import annotations

import time
from functools import partial

import numpy as np
import torch

from ...models.gptq import gptq_portable, input_moments, output_error
from ...models.quantized import dequantize, linears
from ..distributed import full_state, shard_as
from ..optim import WeightAverage, adamw, cosine
from ..step_loop import Every, StepLoop
from . import steps
from .plan import replan_local, replan_stage
from .run import HealRun

BASE_CALIBRATION_ROWS = 16  # cached rows whose inputs calibrate the rounding of --base-weights


def warmup_steps(total: int) -> int:
    """Warm-up steps of a stage's cosine schedule: a twentieth of its steps."""
    return max(1, total // 20)


@torch.no_grad()
def round_base(run: HealRun) -> None:
    """Round every shared weight to ``--base-weights`` by GPTQ (models/gptq.py), calibrated on the first
    cached training rows, as `looplm quantize --calib-data` would round it: serving the healed model with
    those weights then rounds nothing new (a weight on its grid rounds to itself), and the training after
    this learns around the rounding."""
    c, inputs = run.cfg, run.inputs
    model = inputs.student
    n = min(BASE_CALIBRATION_ROWS, len(inputs.rows))
    t0 = time.perf_counter()
    moments = input_moments(model, run.cache.tokens(inputs.corpus, np.arange(n)).to(inputs.device))
    errors = []
    for name, lin in linears(model):
        h = sum(moments[name].values())
        w = full_state(lin.weight)  # gathered whole when sharded, one weight at a time
        t = gptq_portable(w, h, c.base_weights)
        errors.append(output_error(w, t, h))
        lin.weight.copy_(shard_as(dequantize(t).to(w), lin.weight))
    run.log(
        f"shared weights rounded to {c.base_weights} (GPTQ on {n} cached rows, mean relative output error "
        f"{sum(errors) / len(errors):.4f}) in {time.perf_counter() - t0:.0f} s; they stay frozen"
    )


def _reach(run: HealRun, states: dict, d: int) -> None:
    """Sequential: the student's inputs of depth ``d`` into ``states``, propagated from the last depth reached."""
    inputs = run.inputs
    if not states:
        states[0] = steps.first_inputs(run.cache, len(inputs.rows))
    while max(states) < d:
        top = max(states)
        states[top + 1] = steps.propagate(inputs.student, top, states[top], inputs.autocast, inputs.device)


def _train_visit(run: HealRun, layer: int, n_steps: int, rng, states: dict, bar, depth: int):
    """Shared block ``layer`` trained alone for ``n_steps`` steps (at ``depth``'s inputs when sequential); the
    layer-local error of its first and of its last step (None, None without steps)."""
    c, inputs, model = run.cfg, run.inputs, run.inputs.student
    n_rows = len(inputs.rows)
    block = model.model.layers[layer]
    opt = adamw(steps.unfreeze(block, c.base_weights), lr=c.local_lr, weight_decay=0.0)
    first = last = None
    for s in range(n_steps):
        idx = inputs.share(rng.choice(n_rows, size=c.local_batch, replace=False))
        lr = c.local_lr * cosine(s, n_steps, warmup_steps(n_steps))
        loss = steps.local_step(
            *(model, layer, run.cache, inputs.spans, idx, opt, states, lr),
            *(inputs.autocast, inputs.device, c.grad_clip),
            average=inputs.world > 1,
            channels=inputs.channels,
        )
        first = loss if first is None else first
        last = loss
        run.progress.local_tokens += c.local_batch * c.seq_len
        bar.update(1)
        bar.set_postfix(depth=depth, layer=layer, err=f"{loss:.4f}")
    block.requires_grad_(False)
    return first, last


def local_stage(run: HealRun) -> None:
    """Each shared block alone (``--local-mode parallel``), or each depth of a shared block in order on the
    student's own inputs (``sequential``), for the planned steps of each visit; a checkpoint after every visit.
    Unique blocks (a plan's prelude and coda) are the original's layers, exact already: they get no visit. A
    resumed run draws the rows of its next steps as the uninterrupted run does (``local_rows``)."""
    from tqdm import tqdm

    c, p, inputs, progress = run.cfg, run.plan, run.inputs, run.progress
    model, n_rows = inputs.student, len(inputs.rows)
    cfg = model.config
    K = cfg.num_shared_layers
    per_visit = p["local_steps_per_visit"]
    if per_visit == 0:
        return
    sequential = c.local_mode == "sequential"
    order = steps.local_visits(cfg, sequential)
    states: dict[int, torch.Tensor] = {}  # sequential: the student's inputs of the depths reached
    if sequential and progress.visit > 0:  # resume: recompute the student's inputs of the depths already reached
        _reach(run, states, order[min(progress.visit, len(order) - 1)])
    if c.compile:
        steps.compile_layers(model)
    model.requires_grad_(False)
    counts = p.setdefault("local_steps_by_visit", [per_visit] * len(order))  # replan_local changes the rest
    bar = tqdm(
        total=sum(counts),
        initial=sum(counts[: progress.visit]),
        desc="heal: local",
        unit="step",
        disable=not (c.progress and run.main),
    )
    rng = local_rows(c, n_rows, counts[: progress.visit])
    try:
        for v in range(progress.visit, len(order)):
            started, d = run.clock(), order[v]
            layer = cfg.layer_map[d] if sequential else d
            if sequential:
                _reach(run, states, d)
            first, last = _train_visit(run, layer, counts[v], rng, states, bar, d)
            progress.visit = v + 1
            progress.time = run.clock()
            if "local_end_seconds" in p and v + 1 < len(order) and counts[v]:
                seconds_per_step, now = run.agreed(((progress.time - started) / counts[v], run.clock()))
                replan_local(p, v + 1, seconds_per_step, now, c, K, run.log)
                run.write_settings()
                bar.total = sum(counts)
            if first is not None:  # the errors over all of the steps' rows
                first, last = run.mean({"first": first, "last": last}).values()
            run.append(
                {"stage": "local", "visit": v + 1, "depth": d, "layer": layer, "err_first": first, "err_last": last}
                | {"time": round(progress.time, 2), "local_tokens": progress.local_tokens, "tokens": progress.tokens}
            )
            run.save()
            left = sum(counts[v + 1 :]) * (progress.time - started) / max(counts[v], 1)
            if v + 1 < len(order) and run.eval_due(left):  # the stage's end is evaluated by the recipe
                run.log_eval(tag="local")
    finally:
        bar.close()
    model.requires_grad_(False)


def local_rows(c, n_rows: int, done: list[int]):
    """The generator of the local stage's row draws, past the draws of the ``done`` steps of each visit before."""
    rng = np.random.default_rng(c.seed + 1)
    for _ in range(sum(done)):
        rng.choice(n_rows, size=c.local_batch, replace=False)
    return rng


def e2e_stage(run: HealRun) -> None:
    c, inputs = run.cfg, run.inputs
    total = run.plan["e2e_steps"]
    if total == 0:
        return
    if c.compile:
        steps.compile_layers(inputs.student, inputs.teacher)
    inputs.student.train()
    train_steps(
        run,
        "e2e",
        "heal: end to end",
        steps.body_params(inputs.student, c.base_weights),
        c.e2e_lr,
        partial(steps.e2e_step, inputs, run.cache, c, inputs.student),
        total,
        tokens_per_step=c.e2e_batch * c.seq_len,
        evaluate=True,
        average=c.e2e_average,
    )
    inputs.student.eval()


def exit_stage(run: HealRun) -> None:
    c, inputs = run.cfg, run.inputs
    total = run.plan.get("exit_steps", 0)
    if not total:
        return
    with steps.eager():
        params = steps.exit_params(inputs.student, run.exit_spec)
        train_steps(
            run,
            "exit",
            "heal: exit adapters",
            params,
            c.exit_lr,
            partial(steps.exit_step, inputs, run.cache, c, inputs.student),
            total,
            # its steps read the budget's tokens as the end-to-end ones do (plan.py: its share of --train-tokens)
            tokens_per_step=c.e2e_batch * c.seq_len,
        )
    inputs.student.requires_grad_(False)


def _replan(run: HealRun, stage: str, s: int, seconds_per_step: float, now: float) -> int:
    """The stage's step count fixed again from the seconds its steps took (kept in the run's settings)."""
    total = replan_stage(run.plan, stage, s, seconds_per_step, now, run.cfg, run.log)
    run.write_settings()
    return total


def _evaluate(run: HealRun, stage: str, avg: WeightAverage | None) -> None:
    """A held-out evaluation amid a stage: of the weights, and of their average beside them."""
    run.inputs.student.eval()
    run.log_eval(tag=stage)
    if avg is not None:
        with avg.swapped_in():
            run.log_eval(tag=f"{stage}-average")
    run.inputs.student.train()


def train_steps(
    run: HealRun,
    stage: str,
    desc: str,
    params,
    base_lr: float,
    step_fn,
    total: int,
    tokens_per_step: int = 0,
    evaluate: bool = False,
    average: float = 0.0,
) -> None:
    """The end-to-end and exit stages on the step loop (train/step_loop.py): AdamW on ``params`` (its state restored
    on resume), a cosine schedule over ``total`` steps, ``step_fn(step, opt, lr) -> record`` each step, a JSONL
    record per step (the losses averaged over the processes), a checkpoint every ``save_every_seconds`` and, with
    ``evaluate``, held-out evaluations every ``eval_every_seconds``. Under a time budget the count is fixed again at
    the loop's ``replan_due`` steps. With ``average`` (a decay), an exponential moving average of ``params`` is kept
    beside them (``WeightAverage``), evaluated beside them (tag ``<stage>-average``), and copied into them when the
    stage ends."""
    c, student, progress = run.cfg, run.inputs.student, run.progress
    opt = adamw(params, lr=base_lr, weight_decay=0.0)
    avg = WeightAverage(params, average) if average else None
    if progress.step > 0:
        run.load_optimizer(opt, avg)

    def step(s: int, total: int) -> dict:
        lr = base_lr * cosine(s, total, warmup_steps(total))
        values = {"lr": lr, **run.mean(step_fn(s, opt, lr))}
        if avg is not None:
            avg.update()
        return values

    loop = StepLoop(
        step,
        total,
        progress,
        run.clock,
        desc,
        tokens_per_step=tokens_per_step,
        show=c.progress and run.main,
        record=lambda r: run.append({"stage": stage, **r, "local_tokens": progress.local_tokens}),
        save=lambda: run.save(opt, avg),
        save_every=Every(seconds=c.save_every_seconds),
        evaluate=partial(_evaluate, run, stage, avg),
        evaluate_every=Every(seconds=c.eval_every_seconds) if evaluate else Every(),
        replan=partial(_replan, run, stage) if c.budget_minutes else None,
        replanned_at=run.plan.setdefault(f"{stage}_replanned_at", []),
        processes=run.processes,
    )
    if loop.run() and avg is not None:  # the weights' own end, then the average the stage ends on (a run
        # resumed from the stage's last checkpoint has both logged and the average in place)
        student.eval()
        run.log_eval(tag=stage)
        avg.copy_in()
        run.log_eval(tag=f"{stage}-average")
    run.save(opt, avg)
