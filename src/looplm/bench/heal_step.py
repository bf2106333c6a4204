"""`looplm bench heal-step`: seconds of one layer-local, one end-to-end and one exit-adapter step of `looplm heal`,
timed as the run times them (``time_steps``, what a time budget is planned from) on copies of the student, so that
nothing is trained and no run directory is left behind."""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

from ..train.heal import HealConfig, prepare
from ..train.heal.inputs import open_cache
from ..train.heal.plan import time_steps
from ..util import keep_freed_host_memory, machine
from .report import median


def heal_step(cfg: HealConfig, rounds: int, log=print) -> dict:
    """Time the steps of healing ``cfg.model`` from ``cfg.teacher`` on ``cfg.data``, ``rounds`` times (each
    round warms up on a fresh copy of the student); the teacher cache of ``cfg.cache_rows`` rows is built in
    ``cfg.cache``, or in a temporary directory."""
    with tempfile.TemporaryDirectory(prefix="looplm-bench-heal-") as tmp:
        # a token budget: prepare() needs one, and nothing is planned from it here
        cfg = replace(cfg, out=str(Path(tmp) / "run"), train_tokens=1, budget_minutes=None, resume=False, ood_windows=0)
        quiet = lambda *a: None  # noqa: E731
        run = prepare(cfg, log=quiet)
        inputs, exit_spec = run.inputs, run.exit_spec
        if inputs.device.type == "cpu":
            keep_freed_host_memory()  # as a heal run does
        inputs.student.to(inputs.device)
        inputs.teacher.to(inputs.device)
        cache = open_cache(inputs, cfg, Path(cfg.cache) if cfg.cache else Path(tmp) / "cache", quiet)
        times: dict[str, list[float]] = {"local": [], "e2e": [], "exit": []}
        for r in range(rounds):
            local, e2e, exit_ = time_steps(inputs, cache, cfg, exit_spec, quiet)
            times["local"].append(local)
            times["e2e"].append(e2e)
            if exit_spec:
                times["exit"].append(exit_)
            log(
                f"round {r + 1}: local {local:.3f} s, end-to-end {e2e:.3f} s"
                + (f", exit adapter {exit_:.3f} s" if exit_spec else "")
            )
        sc = inputs.student.config
    steps = {
        "local": {
            "rows": cfg.local_batch * sc.num_loops,
            "note": f"one shared layer, {cfg.local_batch} rows at each of its {sc.num_loops} depths",
        },
        "e2e": {
            "rows": cfg.e2e_batch,
            "note": "every depth, " + ("rows read online" if cfg.e2e_rows == "online" else "cached rows"),
        },
    }
    if times["exit"]:
        steps["exit"] = {"rows": cfg.e2e_batch, "note": f"the {cfg.exit_adapter} exit adapters"}
    for name, step in steps.items():
        step.update(
            seconds=round(median(times[name]), 4),
            rounds=[round(t, 4) for t in times[name]],
            tokens_per_s=round(step["rows"] * cfg.seq_len / median(times[name]), 1),
        )
    return {
        "benchmark": "heal-step",
        "model": cfg.model,
        "teacher": cfg.teacher,
        "data": cfg.data,
        "seq_len": cfg.seq_len,
        "loops": sc.num_loops,
        "shared_layers": sc.num_shared_layers,
        "precision": "bf16" if inputs.bf16 else "fp32",
        "compile": cfg.compile,
        "steps": steps,
        "machine": machine(),
    }


def heal_step_table(result: dict) -> tuple[list[str], list[list]]:
    """The benchmark's table: a row per kind of step."""
    rows = [[name, s["seconds"], s["tokens_per_s"], s["note"]] for name, s in result["steps"].items()]
    return ["step", "seconds", "tokens/s", "what it runs"], rows
