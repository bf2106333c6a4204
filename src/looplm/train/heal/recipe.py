"""`looplm heal` from top to bottom: check everything, open the run directory (or resume it), cache the original's
states, plan the budget, then the stages in order, each skipped when a resumed run is past it; save the healed
model, its plot and a summary.

Under torchrun or `accelerate launch` every process runs this, on its share of each step's rows (``HealInputs.share``):
the cache is built by rows and every stage averages its gradients (train/distributed.py). Launched with an FSDP
config, the student's layers are sharded over the processes instead, and the original's once the cache is built:
each layer's backward averages its gradients, every process runs every forward of
the model (the plan's timed steps too), and all gather the full weights for each checkpoint. The main process writes
the run directory; the others wait for it where they read it."""

from __future__ import annotations

from dataclasses import fields
from functools import partial
from pathlib import Path

import torch

from ...errors import UsageError
from ...util import keep_freed_host_memory, with_this_machine, write_json_atomic
from ..distributed import shard_layers, start_processes
from ..plot import plot_heal
from ..run_dir import RunDir, check_resume_settings
from . import plan, stages
from .config import HealConfig, check_config
from .inputs import load_inputs, open_cache
from .run import HealRun, logged_by


def prepare(cfg: HealConfig, log=print) -> HealRun:
    """A run whose every input was read and checked; nothing written yet. Anything wrong is refused here, before
    the run directory is touched."""
    c = cfg
    exit_spec = check_config(c)
    processes = start_processes("heal")
    out = Path(c.out)
    settings = RunDir(out).settings()
    if settings is not None:
        if not c.resume:
            raise UsageError(f"{out} already holds a healing run; add --resume to continue it or choose a new --out")
        check_resume_settings(settings["config"], c, HealConfig.FIXED, HealConfig.FORMER_DEFAULTS)
        c.model = c.model or settings["config"]["model"]
    elif c.resume and out.exists() and any(out.iterdir()):
        raise UsageError(f"{out} is not a healing run (no run.json); drop --resume and choose an empty --out")
    inputs = load_inputs(c, processes)
    if inputs.student.config.num_loops < 2 or not c.exit_share:
        exit_spec = None  # no intermediate exit to train (or no budget for it)
    return HealRun(c, inputs, exit_spec, settings, log, processes)


def start(run: HealRun) -> None:
    """Open the run directory and put the models on the device; a resumed run continues from its latest checkpoint
    (or, killed before the first one, from the end of its plan)."""
    c, inputs, progress = run.cfg, run.inputs, run.progress
    run.processes.wait_for_everyone()  # every process has read the run directory before the main one changes it
    if run.main:
        run.run_dir.open()
    torch.manual_seed(c.seed)
    if inputs.device.type == "cpu":
        keep_freed_host_memory()  # far fewer page faults an end-to-end step
    out = run.run_dir.out
    if run.run_dir.latest():
        run.load(run.run_dir.latest_dir())
        run.log(f"resumed {out} at stage {run.progress.stage} ({run.progress.time / 60:.1f} min done)")
    elif run.settings is not None and "plan_clock" in run.settings:
        # killed before the first checkpoint: the cache and the plan it kept were paid from the budget
        progress.time = run.settings["plan_clock"]
        run.log(f"resumed {out} after its plan ({progress.time / 60:.1f} min done)")
    # the records up to the checkpoint (by their time, rounded as they hold it): a resumed run writes those after
    # it again
    if run.main:
        run.run_dir.truncate(lambda r: logged_by(r, run.progress.time))
    if inputs.sharded:  # sharded before the move: the whole layers never sit on the device
        shard_layers(inputs.student)
        run.log(f"FSDP2: the layers sharded over {inputs.world} processes (the original's once its cache is built)")
    inputs.student.to(inputs.device)
    inputs.teacher.to(inputs.device)


def heal(cfg: HealConfig, log=print) -> dict:
    run = prepare(cfg, log)
    start(run)
    resumed = run.run_dir.latest() is not None
    cache_original(run)
    if "plan" not in run.settings:
        plan_budget(run)
    if run.cfg.base_weights != "fp32" and not resumed:
        stages.round_base(run)  # a resumed run's checkpoint holds the rounded weights already
    if not run.evals("converted"):
        run.log_eval(tag="converted")
    run_stages(run)
    return finish(run)


def cache_original(run: HealRun) -> None:
    """Record the run's settings (first, so that a run killed while caching resumes with --resume) and the machines
    it ran on, start the run clock and cache the original's states."""
    c, inputs = run.cfg, run.inputs
    cache_dir = Path(c.cache) if c.cache else Path(c.out) / "cache"
    if run.settings is None:
        run.settings = {
            "config": {f.name: getattr(c, f.name) for f in fields(c)},
            "cache": str(cache_dir),
            "rows": len(inputs.rows),
        }
        run.write_settings()
    machines = with_this_machine(run.settings.get("machines", []))
    if machines != run.settings.get("machines"):  # the minutes are these machines' (heal.json names them)
        run.settings["machines"] = machines
        run.write_settings()
    run.start_clock()
    run.cache = open_cache(inputs, c, cache_dir, run.log, run.processes)
    if inputs.sharded:
        # the cache ran the original on each process's own batches, however many each had; from here on every
        # process runs it equally often (evaluations, online end-to-end steps), as sharded layers need
        shard_layers(inputs.teacher)
    if run.progress.stage == "cache":
        run.progress.time = run.clock()


def plan_budget(run: HealRun) -> None:
    """The steps of each stage, from the token budget or from the steps timed against the time left; kept in the
    run's settings with the original's evaluation."""
    c, inputs = run.cfg, run.inputs
    seconds_left = None if c.train_tokens is not None else c.budget_minutes * 60 - run.clock()
    timed = partial(plan.time_steps, inputs, run.cache, c, run.exit_spec, run.log)
    # the main process times the steps (of its share of the rows) and every process takes its plan; under FSDP
    # every process runs the timed steps with it (a sharded layer's forward gathers it from all)
    planned = (
        plan.plan_steps(c, inputs.student.config, run.exit_spec, seconds_left, timed, run.log)
        if run.main or inputs.sharded
        else None
    )
    run.settings.update(plan=run.agreed(planned), teacher_eval=run.evaluate(inputs.teacher))
    # what a run killed before its first checkpoint resumes at
    run.settings["plan_clock"] = run.agreed(round(run.clock(), 2))
    run.write_settings()


def run_stages(run: HealRun) -> None:
    """Layer-local, end to end, then the exit adapters: each from where a resumed run stopped, each ending on a
    checkpoint."""
    out, progress, steps_planned = Path(run.cfg.out), run.progress, run.plan
    if progress.stage == "cache":
        progress.stage = "local"
    if progress.stage == "local":
        stages.local_stage(run)
        progress.stage, progress.step = "e2e", 0
        run.save()
        run.keep_local_end()
        if steps_planned["local_steps_per_layer"]:
            run.log_eval(tag="local")
    if progress.stage == "e2e":
        if progress.step == 0 and not (out / "local-end").exists():
            run.keep_local_end()  # killed between the save above and the copy, or started at a local end
        stages.e2e_stage(run)  # not evaluated at its end: the exit adapters leave the final exit as it is, and
        # the final evaluation follows them
        progress.stage, progress.step = "exit", 0
        run.save()
    if progress.stage == "exit":
        stages.exit_stage(run)
        progress.stage = "done"
        run.save()


def finish(run: HealRun) -> dict:
    """The final evaluation, then the healed model, its plot and heal.json, written by the main process."""
    inputs, out, progress, steps_planned = run.inputs, Path(run.cfg.out), run.progress, run.plan
    after_local = run.evals("local")
    trained_after_local = steps_planned["e2e_steps"] or steps_planned.get("exit_steps")
    final = after_local[-1] if after_local and not trained_after_local else run.log_eval(tag="final")
    summary = {
        "out": str(out),
        "final": str(out / "final"),
        "minutes": round(progress.time / 60, 2),
        "machines": run.settings["machines"],
        "tokens": progress.tokens,
        "local_tokens": progress.local_tokens,
        "teacher": run.settings["teacher_eval"],
        "healed": final,
        "exit_adapter": run.exit_spec,
        "converted": (run.evals("converted") or [None])[0],
    }
    run.checkpoints.write_final(inputs.student, inputs.tok, out)  # the last checkpoint: stage done
    if run.main:
        plot_heal(out)
        write_json_atomic(out / "heal.json", summary)
    run.processes.wait_for_everyone()  # no process ends before the run directory is complete
    return summary
