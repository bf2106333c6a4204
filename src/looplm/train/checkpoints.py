"""Checkpoints of a training run, `looplm train`'s and healing's alike: one format, one writer, one reader.

A checkpoint is a looplm model directory (config.json, model.safetensors, tokenizer: `looplm eval` reads it as it is)
with state.json beside it (where the run is: the recipe's position) and training.pt (what the recipe's stage keeps
besides the weights: AdamW's moments, the schedule, a weight average), every tensor whole. It is written under a
temporary name and committed whole (run_dir.py): a kill never leaves a half checkpoint, and the newest ``keep``
stay. On several processes all take part in gathering what FSDP shards (``full_state``: collective) and the main
process writes; data parallel, every process holds the same state and the main one alone writes it."""

from __future__ import annotations

from pathlib import Path

import torch

from ..util import write_json_atomic
from .distributed import full_state, shard_optimizer_state
from .run_dir import RunDir

TRAINING = "training.pt"
# what checkpoints written before training.pt hold instead: Accelerate's state (`looplm train`), or the optimizer's
# and the weight average's state in files of their own (healing)
FORMER_TRAINING = {
    "optimizer": ("accelerate/optimizer.bin", "optimizer.pt"),
    "scheduler": ("accelerate/custom_checkpoint_0.pkl",),  # the one object the Trainer registered
    "average": ("average.pt",),
}


class Checkpointer:
    """Writes and reads the checkpoints of the run directory ``run_dir``; ``sharded``: the model's layers are sharded
    over ``processes`` (FSDP), so every process takes part in a save."""

    def __init__(self, run_dir: RunDir, processes, sharded: bool, keep: int):
        self.run_dir, self.processes, self.sharded, self.keep = run_dir, processes, sharded, keep
        self.main = processes.is_main_process

    def save(self, name: str, model, tok, state: dict, training: dict | None = None) -> None:
        """Checkpoint ``name``: ``model`` (a LoopLMForCausalLM, its config as it should be read back) with ``tok``,
        ``state`` (JSON) and ``training`` (state dicts), committed as the latest."""
        from ..models.checkpoint import save_checkpoint

        if not (self.main or self.sharded):
            return
        weights = full_state(model.state_dict(), keep=self.main)
        training = full_state(training, keep=self.main) if training else None
        if not self.main:
            return
        tmp = self.run_dir.staging(name)
        save_checkpoint(model, tmp, state_dict={k: v.detach().cpu() for k, v in weights.items()})
        tok.save_pretrained(str(tmp))
        if training:
            torch.save(training, tmp / TRAINING)
        write_json_atomic(tmp / "state.json", state)
        self.run_dir.commit(tmp, name, keep=self.keep)

    def training(self, ck: Path | None = None) -> dict:
        """What checkpoint ``ck`` (the latest) keeps besides the weights, read onto the host: ``restore`` puts a
        state into its optimizer or schedule."""
        ck = ck or self.run_dir.latest_dir()
        if (ck / TRAINING).exists():
            return torch.load(ck / TRAINING, map_location="cpu")
        found = {}
        for key, paths in FORMER_TRAINING.items():
            for path in (ck / p for p in paths):
                if path.exists():
                    found[key] = torch.load(path, map_location="cpu", weights_only=False)
                    break
        return found

    def write_final(self, model, tok, out: Path) -> None:
        """The trained model as OUT/final, replaced whole; where its layers are sharded, read from the last
        checkpoint, which holds them whole (the run saves one at its end)."""
        from ..models import save_model
        from ..models.checkpoint import load_checkpoint

        if self.main:
            final = load_checkpoint(self.run_dir.latest_dir()) if self.sharded else model.cpu()
            save_model(final, tok, out / "final")
        self.processes.wait_for_everyone()  # no process ends before the run directory is complete


def restore(target, state: dict) -> None:
    """An optimizer's or a schedule's ``state`` (saved whole) loaded into ``target``: an optimizer's per-parameter
    tensors sharded as their parameters are."""
    if isinstance(target, torch.optim.Optimizer):
        state = shard_optimizer_state(state, target)
    target.load_state_dict(state)


def tensorboard_writer(out: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(out / "tb"))
