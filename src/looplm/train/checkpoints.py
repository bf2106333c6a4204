"""Checkpoints and logs of a `looplm train` run directory: a checkpoint is complete before `latest`
names it (written to a temporary directory, then renamed), the oldest beyond --keep are removed, and a
resumed run drops metrics written after the checkpoint it starts from."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..errors import UsageError
from ..util import write_json_atomic, write_text_atomic


class Checkpoints:
    """The Trainer's checkpoint methods (a mixin: they read the Trainer's accelerator, model and config)."""

    def _save(self, out: Path, step: int, tokens: int, elapsed: float) -> None:
        acc = self.acc
        name = f"step-{step:07d}"
        tmp = out / "checkpoints" / f".{name}.tmp"
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        acc.save_state(str(tmp / "accelerate"), safe_serialization=False)
        self._export(tmp, step)
        if acc.is_main_process:
            write_json_atomic(
                tmp / "state.json",
                {
                    "step": step,
                    "tokens": tokens,
                    "time": elapsed,
                    "global_batch": self.global_batch,
                    "world": self.world,
                    "epoch": step // (len(self.corpus) // self.global_batch),
                },
            )
            final = out / "checkpoints" / name
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            write_text_atomic(out / "latest", name + "\n")
            ckpts = sorted(p for p in (out / "checkpoints").glob("step-*") if p.is_dir())
            for old in ckpts[: -self.cfg.keep] if self.cfg.keep > 0 else []:
                shutil.rmtree(old, ignore_errors=True)
        acc.wait_for_everyone()

    def _export(self, directory: Path, step: int) -> None:
        """Write the student as a looplm model directory (config.json, model.safetensors, tokenizer), its
        config recording the rows read up to ``step``. Every process must call it: under FSDP / ZeRO-3
        gathering the full weights is collective."""
        from safetensors.torch import save_file

        sd = self.acc.get_state_dict(self.module)
        if not self.acc.is_main_process:
            return
        directory.mkdir(parents=True, exist_ok=True)
        lm = self.acc.unwrap_model(self.module).lm
        sd = {k[len("lm.") :]: v for k, v in sd.items() if k.startswith("lm.")}
        if lm.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        lm.config.conversion = {
            **(lm.config.conversion or {}),
            "training": self.prior_training + [self.training_record(step)],
        }
        lm.config.save_pretrained(str(directory))
        save_file(
            {k: v.detach().cpu().contiguous() for k, v in sd.items()},
            str(directory / "model.safetensors"),
            metadata={"format": "pt"},
        )
        self.tok.save_pretrained(str(directory))

    def _load(self, ck: Path) -> tuple[int, int, float]:
        state = json.loads((ck / "state.json").read_text())
        if state["global_batch"] != self.global_batch:
            raise UsageError(
                f"checkpoint {ck} was trained with global batch {state['global_batch']}, this run has "
                f"{self.global_batch}; keep batch-size x grad-accum x processes the same"
            )
        self.acc.load_state(str(ck / "accelerate"))
        return int(state["step"]), int(state["tokens"]), float(state["time"])


def truncate_metrics(path: Path, step: int) -> None:
    """Drop the records a resumed run will write again (those after the checkpoint at ``step``)."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill
        if rec.get("step", 0) < step or (rec.get("step", 0) == step and step > 0):
            keep.append(line)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)


def append_metrics(path: Path, rec: dict, tb) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()
    if tb is not None:
        prefix = "eval" if rec.get("eval") else "train"
        for k, v in rec.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "eval"):
                tb.add_scalar(f"{prefix}/{k}", v, rec["step"])


def tensorboard_writer(out: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(out / "tb"))
