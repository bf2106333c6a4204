"""`looplm bench train-step`: seconds of one `looplm train` step (forward, loss, backward, clip, AdamW), read from
the metrics of a short run in a temporary directory: the steps a real run takes, bookkeeping included."""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

from ..train.loop import TrainConfig, train
from ..train.run_dir import RunDir
from ..util import machine
from .report import median


def train_step(cfg: TrainConfig, warmup: int, log=print) -> dict:
    """Run ``cfg`` for ``cfg.max_steps`` steps without evaluations or checkpoints in between; the first
    ``warmup`` steps are dropped from the figures."""
    with tempfile.TemporaryDirectory(prefix="looplm-bench-train-") as tmp:
        cfg = replace(
            cfg, out=str(Path(tmp) / "run"), eval_every_steps=0, save_every_steps=0, log_every=1, keep=1, resume=False
        )
        run = train(cfg, log=lambda *a: None)
        run_dir = RunDir(cfg.out)
        records, config = run_dir.records(), run_dir.settings()
    steps = [r for r in records if not r.get("eval")]
    tokens = config["global_batch"] * config["seq_len"]
    seconds = [tokens / r["tok_per_s"] for r in steps]
    timed = seconds[warmup:] or seconds[-1:]
    for i, s in enumerate(seconds):
        log(f"step {i + 1}: {s:.3f} s" + (" (warm-up)" if i < warmup and len(seconds) > warmup else ""))
    return {
        "benchmark": "train-step",
        "model": cfg.model,
        "data": cfg.data,
        "teacher": cfg.teacher,
        "global_batch": config["global_batch"],
        "seq_len": config["seq_len"],
        "precision": config["precision"],
        "steps": run["steps"],
        "warmup": len(seconds) - len(timed),
        "seconds_per_step": round(median(timed), 4),
        "tokens_per_s": round(tokens / median(timed), 1),
        "step_seconds": [round(s, 4) for s in seconds],
        "machine": machine(),
    }


def train_step_table(result: dict) -> tuple[list[str], list[list]]:
    """The benchmark's table: one row, the timed step."""
    r = result
    row = [f"{r['global_batch']} x {r['seq_len']} tokens, {r['precision']}", r["seconds_per_step"], r["tokens_per_s"]]
    return ["step", "seconds", "tokens/s", "steps timed"], [row + [r["steps"] - r["warmup"]]]
