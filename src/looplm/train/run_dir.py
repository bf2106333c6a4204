"""The run directory `looplm train` and `looplm heal` both write::

    run.json          the run's settings (checked on --resume) and what the run fixed once (a step plan)
    metrics.jsonl     one JSON object per logged step and evaluation
    latest            name of the newest complete checkpoint (replaced atomically)
    checkpoints/NAME  a checkpoint: complete before `latest` names it (written under a temporary name, then
                      renamed); the oldest beyond the run's keep are removed
    final/            the trained model

A run killed at any point resumes from what `latest` names: a temporary directory left by the kill is removed,
and the metrics written after that checkpoint are dropped (the resumed run writes them again).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from ..errors import UsageError
from ..util import read_jsonl, write_json_atomic, write_text_atomic


def append_record(path: Path, record: dict, tb=None) -> None:
    """One record at the end of a metrics file (and, with a TensorBoard writer, its numbers there)."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
    if tb is not None:
        prefix = "eval" if record.get("eval") else "train"
        for k, v in record.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "eval"):
                tb.add_scalar(f"{prefix}/{k}", v, record["step"])


def truncate_records(path: Path, keep: Callable[[dict], bool]) -> None:
    """Keep only the records ``keep`` accepts (those logged up to the checkpoint a resumed run starts from),
    each line as it was written; the file is replaced atomically."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill
        if keep(record):
            kept.append(line)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


# settings renamed when `looplm train` and `looplm heal` took one vocabulary (train/settings.py): a run directory
# saved before records them by the former name -> the name now
FORMER_NAMES = {
    "tokens": "train_tokens",  # heal
    "max_tokens": "train_tokens",  # train
    "eval_seqs": "eval_rows",  # train
    "eval_every": "eval_every_steps",  # train
    "save_every": "save_every_steps",  # train
}


# values renamed since: a run directory saved before records them by the former value
FORMER_VALUES = {"base_weights": {"float": "fp32"}}  # heal


def current_names(config: dict) -> dict:
    """A saved config with every setting under its current name (FORMER_NAMES) and value (FORMER_VALUES), in its
    order. A config that holds both names (never written so) keeps both, and the current one is read."""
    renamed = {}
    for name, value in config.items():
        new = FORMER_NAMES.get(name, name)
        value = FORMER_VALUES.get(new, {}).get(value, value) if isinstance(value, str) else value
        renamed[name if new in config and new != name else new] = value
    return renamed


def changed_settings(saved: dict, cfg, fixed: tuple[str, ...], former_defaults: dict) -> list[str]:
    """The settings in ``fixed`` that ``cfg`` (a dataclass) sets otherwise than the run it resumes did, as
    "name: was -> now". ``saved`` may name settings by a former name or value (FORMER_NAMES, FORMER_VALUES). A
    setting the run did not record had its default then: ``former_defaults`` names the defaults that changed since,
    the dataclass's field the others."""
    saved = current_names(saved)
    fields = type(cfg).__dataclass_fields__
    was = {k: saved.get(k, former_defaults.get(k, fields[k].default)) for k in fixed}
    settled = (
        " (no longer a setting: start the run anew in a new --out)"  # a field that is not a flag (train/settings.py)
    )
    return [
        f"{k}: {was[k]!r} -> {getattr(cfg, k)!r}" + ("" if "help" in fields[k].metadata else settled)
        for k in fixed
        if was[k] != getattr(cfg, k)
    ]


def check_resume_settings(saved: dict, cfg, fixed: tuple[str, ...], former_defaults: dict) -> None:
    changed = changed_settings(saved, cfg, fixed, former_defaults)
    if changed:
        raise UsageError(
            f"--resume with different settings ({', '.join(changed)}); use the run's settings or a new --out"
        )


class RunDir:
    """Paths and atomic writes of one run directory."""

    def __init__(self, out: str | Path):
        self.out = Path(out)
        self.run_json = self.out / "run.json"
        self.metrics = self.out / "metrics.jsonl"
        self.checkpoints = self.out / "checkpoints"

    # ----- run.json
    def settings(self) -> dict | None:
        """The saved run.json, None before the run wrote it; its config names every setting by its current name
        (a run saved before a rename still resumes: FORMER_NAMES)."""
        if not self.run_json.exists():
            return None
        run = json.loads(self.run_json.read_text())
        if isinstance(run.get("config"), dict):
            run["config"] = current_names(run["config"])
        return run

    def write_settings(self, run: dict) -> None:
        write_json_atomic(self.run_json, run)

    # ----- checkpoints
    def latest(self) -> str | None:
        """The name of the newest complete checkpoint, None before the first."""
        path = self.out / "latest"
        return (path.read_text().strip() or None) if path.exists() else None

    def latest_dir(self) -> Path:
        return self.checkpoints / self.latest()

    def open(self) -> None:
        """Make the directory and remove what a kill left half-written."""
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        for stale in self.checkpoints.glob(".*tmp*"):
            shutil.rmtree(stale, ignore_errors=True)

    def staging(self, name: str) -> Path:
        """The temporary directory checkpoint ``name`` is written in (emptied; not made)."""
        tmp = self.checkpoints / f".{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        return tmp

    def commit(self, tmp: Path, name: str, keep: int) -> None:
        """The written checkpoint ``tmp`` becomes ``name`` and the latest; the newest ``keep`` by the time they were
        written stay (0: all): names need not sort in that order (healing's are stage-visit-step)."""
        final = self.checkpoints / name
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        write_text_atomic(self.out / "latest", name + "\n")
        kept = sorted((p for p in self.checkpoints.iterdir() if not p.name.startswith(".")), key=_written)
        for old in kept[:-keep] if keep > 0 else []:
            if old.name != name:
                shutil.rmtree(old, ignore_errors=True)

    # ----- metrics
    def records(self) -> list[dict]:
        return read_jsonl(self.metrics)

    def append(self, record: dict, tb=None) -> None:
        append_record(self.metrics, record, tb)

    def truncate(self, keep: Callable[[dict], bool]) -> None:
        truncate_records(self.metrics, keep)


def _written(path: Path) -> float:
    return path.stat().st_mtime
