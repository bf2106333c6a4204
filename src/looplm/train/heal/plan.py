"""The budget of a healing run as step counts: ``local_share`` of it goes to the local stage, ``exit_share`` of the
rest to the exit stage and what is left to the end-to-end stage. A token budget is divided once; a time budget is
turned into counts after timing a few steps (``time_steps``), and fixed again as the stages run (``replan_stage``,
``replan_local``), because steps get faster once compiled and warm and a shared machine's speed moves. The plan is
stored in run.json: a resumed run follows it."""

from __future__ import annotations

import copy
import math
import time

import numpy as np

from ...errors import UsageError
from ..budget import steps_to_fill
from ..distributed import sharded_copy
from ..optim import adamw
from .config import HealConfig
from .steps import body_params, compile_layers, e2e_step, eager, exit_params, exit_step, local_step, local_visits

STAGE_NAMES = {"e2e": "end-to-end", "exit": "exit adapters"}


def plan_steps(c: HealConfig, model_config, exit_spec, seconds_left: float | None, time_steps, log) -> dict:
    """The step counts of every stage; ``seconds_left`` of a time budget (None: a token budget) are divided at
    the speeds ``time_steps()`` measures (seconds of a local, an end-to-end and an exit-adapter step)."""
    K, B = model_config.num_shared_layers, model_config.num_loops
    per_local = c.local_batch * c.seq_len
    per_e2e = c.e2e_batch * c.seq_len
    # the exit stage takes exit_share of what the local stage leaves; the end-to-end stage the rest
    exit_share = (1 - c.local_share) * c.exit_share if exit_spec else 0.0
    t_exit = 0.0
    if c.train_tokens is not None:
        local_steps = round(c.local_share * c.train_tokens / per_local)
        e2e_steps = round((1 - c.local_share - exit_share) * c.train_tokens / per_e2e)
        exit_steps = round(exit_share * c.train_tokens / per_e2e)
    else:
        left = seconds_left
        if left <= 0:
            raise UsageError(
                f"building the teacher cache used the whole --budget-minutes {c.budget_minutes}; "
                f"raise the budget or lower --cache-rows"
            )
        t_local, t_e2e, t_exit = time_steps()
        # a sequential run also propagates the student's states once per depth: about one
        # forward pass of the model over the cache, ~1/3 of a local step per row and layer
        propagate = propagation_seconds(c, model_config, t_local) if c.local_mode == "sequential" else 0.0
        local_steps = int(max(0.0, c.local_share * left - propagate) / t_local / K) if c.local_share else 0
        e2e_steps = steps_to_fill(0, (1 - c.local_share - exit_share) * left, t_e2e)
        exit_steps = steps_to_fill(0, exit_share * left, t_exit) if exit_share else 0
    visits = len(local_visits(model_config, c.local_mode == "sequential"))
    per_visit = math.ceil(local_steps / (visits // K)) if local_steps else 0
    plan = {
        "local_steps_per_layer": local_steps,
        "local_steps_per_visit": per_visit,
        "visits": visits,
        "e2e_steps": e2e_steps,
        "local_tokens_per_layer": local_steps * per_local,
        "e2e_tokens": e2e_steps * per_e2e,
        "exit_steps": exit_steps,
        "exit_step_seconds": t_exit,
        "exit_adapter": exit_spec,
        "loops": B,
        "shared_layers": K,
    }
    if c.train_tokens is None and per_visit:  # the run clock at which the local stage's share of the budget ends
        plan["local_end_seconds"] = round(c.budget_minutes * 60 - (1 - c.local_share) * left, 1)
    log(
        f"plan: {visits} local visits x {per_visit} steps ({local_steps * per_local:,} tokens per shared layer), "
        f"{e2e_steps} end-to-end steps ({e2e_steps * per_e2e:,} tokens), {exit_steps} exit-adapter steps"
    )
    if local_steps == 0 and e2e_steps == 0 and exit_steps == 0:
        log(
            "warning: the budget leaves no training step after the teacher cache; the model is saved as "
            "converted. Give a larger --budget-minutes (or --train-tokens) to heal it"
        )
    return plan


def propagation_seconds(c: HealConfig, model_config, t_local: float) -> float:
    rows_per_step = c.local_batch * model_config.num_loops
    return t_local / 3 * c.cache_rows / rows_per_step * model_config.num_hidden_layers


def time_steps(inputs, cache, c: HealConfig, exit_spec, log) -> tuple[float, float, float]:
    """Seconds of one local step (one shared layer), one end-to-end step and one exit-adapter step (0 without
    an exit stage), measured on copies of the student (nothing of the run is trained); on several processes, of a
    process's share of a step's rows, the exchange of the gradients included (every process runs them; under FSDP on a
    copy sharded as the student is)."""
    probe = sharded_copy(inputs.student, inputs.device) if inputs.sharded else copy.deepcopy(inputs.student)
    if c.compile:  # the stages run compiled: so are the steps that plan them (the copy's first one compiles)
        compile_layers(probe, inputs.teacher)
    layer = 0
    opt = adamw(probe.model.layers[layer].parameters(), lr=0.0)
    idx = np.arange(c.local_batch // inputs.world)  # a process's share of a step's rows
    times = []
    for _ in range(3):  # the first step warms up; the faster of the next two counts
        t0 = time.perf_counter()
        local_step(
            *(probe, layer, cache, inputs.spans, idx, opt, {}, 0.0, inputs.autocast, inputs.device, c.grad_clip),
            channels=inputs.channels,
        )
        times.append(time.perf_counter() - t0)
    t_local = min(times[1:])
    opt = adamw(body_params(probe, c.base_weights), lr=0.0)
    times = []
    for s in range(2):  # end-to-end steps are long: the second counts
        t0 = time.perf_counter()
        e2e_step(inputs, cache, c, probe, s, opt, 0.0)
        times.append(time.perf_counter() - t0)
    t_e2e = times[-1]
    t_exit = 0.0
    if exit_spec:
        opt = adamw(exit_params(probe, exit_spec), lr=0.0)
        times = []
        for s in range(2):
            t0 = time.perf_counter()
            with eager():  # as the exit stage runs them
                exit_step(inputs, cache, c, probe, s, opt, 0.0)
            times.append(time.perf_counter() - t0)
        t_exit = times[-1]
    log(
        f"measured: local step {t_local:.2f} s, end-to-end step {t_e2e:.2f} s"
        + (f", exit-adapter step {t_exit:.2f} s" if exit_spec else "")
    )
    return t_local, t_e2e, t_exit


def replan_stage(plan: dict, stage: str, step: int, seconds_per_step: float, now: float, c: HealConfig, log) -> int:
    """The step count of ``stage`` (e2e or exit) that fills what is left of the time budget at run clock ``now``,
    from the steps just timed (the step loop's fix, train/step_loop.py); the end-to-end stage leaves the exit stage
    the seconds the plan gave it. Kept in ``plan``."""
    left = c.budget_minutes * 60 - now
    if stage == "e2e":
        left -= plan.get("exit_steps", 0) * plan.get("exit_step_seconds", 0.0)
    total = steps_to_fill(step, left, seconds_per_step, at_least=1)
    log(
        f"{STAGE_NAMES[stage]}: {seconds_per_step:.1f} s per step, {total} steps fill the budget "
        f"(planned {plan[f'{stage}_steps']})"
    )
    plan[f"{stage}_steps"] = total
    if stage == "e2e":
        plan["e2e_tokens"] = total * c.e2e_batch * c.seq_len
    return total


def replan_local(plan: dict, visit: int, seconds_per_step: float, now: float, c: HealConfig, shared_layers: int, log):
    """The step count of each visit from ``visit`` on that ends the local stage at its share of the time
    budget, from the visit just timed (its compile and, sequential, its propagation included). The machine's
    speed moves within an hour: with the counts fixed from the plan's first steps, local steps slower than
    planned would end the local stage far past its share, leaving the end-to-end stage, which gains more per
    minute, little of the budget. Kept in ``plan``."""
    steps = plan["local_steps_by_visit"]
    left = plan["local_end_seconds"] - now
    per = steps_to_fill(0, left / (len(steps) - visit), seconds_per_step, at_least=1)
    if per != steps[visit]:
        log(
            f"local: {seconds_per_step:.2f} s per step, {per} steps a visit end the stage at its share "
            f"(planned {plan['local_steps_per_visit']})"
        )
    steps[visit:] = [per] * (len(steps) - visit)
    per_layer = sum(steps) // shared_layers  # parallel: the mean over the layers
    plan.update(local_steps_per_layer=per_layer, local_tokens_per_layer=per_layer * c.local_batch * c.seq_len)
