"""Checkpoints of a `looplm train` run: what each holds (the model directory, Accelerate's state of every
process, state.json), written into the shared run directory (run_dir.py) by every process together; and the final
model, whose config records the rows the run read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..errors import UsageError
from ..util import write_json_atomic
from .run_dir import RunDir
from .step_loop import Position


class Checkpoints:
    """The Trainer's checkpoint methods (a mixin: they read the Trainer's accelerator, model, config and corpus)."""

    def _save(self, out: Path, position: Position) -> None:
        acc, run, step = self.acc, RunDir(out), position.step
        name = f"step-{step:07d}"
        tmp = run.checkpoints / f".{name}.tmp"
        if acc.is_main_process:
            run.staging(name).mkdir(parents=True)
        acc.wait_for_everyone()
        acc.save_state(str(tmp / "accelerate"), safe_serialization=False)
        self._export(tmp, step)
        if acc.is_main_process:
            write_json_atomic(
                tmp / "state.json",
                {
                    "step": step,
                    "tokens": position.tokens,
                    "time": position.time,
                    "global_batch": self.global_batch,
                    "world": self.world,
                    "epoch": step // (len(self.corpus) // self.global_batch),
                },
            )
            run.commit(tmp, name, self.cfg.keep, order=lambda p: p.name)  # step-NNNNNNN: names sort by step
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

    def _write_final(self, out: Path, step: int) -> None:
        """The trained model as OUT/final, replaced whole (written under a temporary name, then renamed)."""
        acc = self.acc
        acc.wait_for_everyone()
        tmp = out / ".final.tmp"
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        acc.wait_for_everyone()
        self._export(tmp, step)
        if acc.is_main_process:
            old = out / ".final.old"
            if (out / "final").exists():
                (out / "final").rename(old)
            tmp.rename(out / "final")
            shutil.rmtree(old, ignore_errors=True)
        acc.wait_for_everyone()

    def training_record(self, step: int) -> dict:
        """What this run has read so far, kept in the trained model's config (conversion.training) so that
        a later run with --data-rows new skips it."""
        return {
            "corpus": self.corpus_id,
            "seed": self.cfg.seed,
            "global_batch": self.global_batch,
            "steps": step,
            "new_rows": self.cfg.data_rows == "new",
        }

    def _load(self, ck: Path) -> Position:
        state = json.loads((ck / "state.json").read_text())
        if state["global_batch"] != self.global_batch:
            raise UsageError(
                f"checkpoint {ck} was trained with global batch {state['global_batch']}, this run has "
                f"{self.global_batch}; keep batch-size x grad-accum x processes the same"
            )
        self.acc.load_state(str(ck / "accelerate"))
        return Position(int(state["step"]), int(state["tokens"]), float(state["time"]))


def tensorboard_writer(out: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(out / "tb"))
