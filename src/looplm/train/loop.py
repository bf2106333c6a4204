"""The training loop: uptraining (CE + online KD from a frozen teacher) and early-exit training.

One recipe for one CPU, one GPU or many: `accelerate launch --config_file configs/accelerate/ddp.yaml` (data parallel)
or fsdp.yaml (the layers sharded, FSDP2), as `looplm heal` runs; the gradients are reduced as healing's are
(distributed.py).

Run directory::

    run.json                 the run's settings (checked on --resume)
    metrics.jsonl            one JSON object per logged step / evaluation
    latest                   name of the newest complete checkpoint (replaced atomically)
    checkpoints/step-NNNNNNN looplm model dir (config.json, model.safetensors, tokenizer) + state.json +
                             training.pt (optimizer and schedule): checkpoints.py, as healing's
    final/                   the trained model (looplm dir; `looplm eval`/`convert` read it)
    tb/                      TensorBoard events, when tensorboard is installed

Exact resume: the data order is a pure function of (seed, step) and everything else that changes
(weights, AdamW moments, schedule) is in the checkpoint, so a resumed run repeats the
uninterrupted run's losses bit for bit on CPU in float32.

The settings are TrainConfig (train/settings.py makes the command line from them); the checks made before the run
directory is touched are in preflight.py.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..data.corpus import PackedCorpus
from ..errors import UsageError
from ..models.exit_adapter import add_exit_adapters
from ..models.loading import tokenizer_fingerprint
from ..models.quantized import has_bf16_matmuls
from ..settings import refine, setting
from ..util import with_this_machine
from .budget import steps_to_fill
from .checkpoints import Checkpointer, restore, tensorboard_writer
from .data_order import batch_indices, micro_batch
from .distributed import (
    apart_by_sharding,
    average_gradients,
    clip_gradients,
    launched,
    mean_values,
    shard_layers,
    start_processes,
)
from .evaluate import heldout_rows, perplexity, score_rows
from .losses import objective
from .optim import adamw, cosine
from .preflight import (
    DATA_ROWS,
    TRAIN_GROUPS,
    arch_fingerprint,
    check_config,
    check_memory,
    check_same_model,
    estimate_memory,
    load_teacher,
    memory_available,
    previous_run,
    rows_to_read,
    select_trainable,
)
from .run_dir import RunDir, append_record
from .settings import RunSettings
from .step_loop import Every, Position, RunClock, StepLoop

BUDGET_WARMUP = 20  # warm-up steps assumed until a time budget becomes a step count


@dataclass
class TrainConfig(RunSettings):
    """`looplm train`'s settings."""

    model: str | None = setting(
        None,
        "the student: embedded name, looplm/HF directory or .gguf (convert first with `looplm convert`; default with "
        "--resume: the run's)",
        positional=True,
        nargs="?",  # optional: a resumed run names its model itself
    )
    data: str = setting("", "corpus dir from `looplm data build`", required=True)
    out: str | None = refine(RunSettings, "out", required=True)
    teacher: str | None = setting(
        None, "frozen teacher for online distillation, the full-size model (default: none, cross-entropy only)"
    )
    kd: str = setting(
        "fkl",
        "distillation loss: forward KL, reverse KL, Jensen-Shannon or total variation",
        choices=("fkl", "rkl", "jsd", "tvd"),
    )
    kd_weight: float = setting(0.5, "w in (1-w) CE + w KD on the final exit")
    kd_temperature: float = setting(1.0, "softmax temperature of the distillation loss", advanced=True)
    early_exit: str = setting(
        "none",
        "a loss on every loop's exit: none, weighted (alpha_i = i / sum j) or aggressive (the final exit 1, "
        "earlier ones --exit-coef)",
        choices=("none", "weighted", "aggressive"),
    )
    exit_coef: float = setting(0.1, "c of the aggressive strategy", advanced=True)
    self_distill: bool = setting(False, "intermediate exits also learn the detached final exit", advanced=True)
    self_distill_weight: float = setting(1.0, "weight of that self-distillation term", advanced=True)
    exit_adapter: str | None = setting(
        None,
        "add an adapter per intermediate exit: a LoRA of rank R on the LM head, or a tuned-lens affine map; the "
        "final exit is untouched (default: none)",
        metavar="{head-lora:R,affine}",
        advanced=True,
    )
    freeze_body: bool = setting(
        False,
        "train only the exit adapter: body, embeddings and head frozen (the paper's appendix-I ablation); a "
        "--teacher then teaches the intermediate exits",
        advanced=True,
    )
    max_steps: int | None = setting(
        None, "optimizer steps (one budget is needed: steps, tokens or minutes)", exclusive="budget", metavar="N"
    )
    train_tokens: int | None = refine(RunSettings, "train_tokens", renamed_from=("--max-tokens",))
    budget_minutes: float | None = refine(
        RunSettings,
        "budget_minutes",
        help="instead: minutes of step time (evaluations and saves not counted): the step count is fixed after "
        "the first steps are timed, corrected once halfway, and kept on --resume",
    )
    batch_size: int = setting(2, "sequences per process per micro-step")
    grad_accum: int = setting(1, "micro-steps per optimizer step")
    seq_len: int | None = setting(
        None, "crop the corpus's sequences to this length (default: the corpus's)", advanced=True
    )
    lr: float = setting(2e-4, "peak learning rate (AdamW, cosine schedule)")
    min_lr_ratio: float = setting(0.1, "cosine floor as a fraction of --lr", advanced=True)
    warmup_steps: int | None = setting(None, "linear warmup steps (default: 5%% of the steps)", advanced=True)
    weight_decay: float = setting(0.1, "AdamW weight decay", advanced=True)
    beta1: float = 0.9  # not a flag
    beta2: float = 0.95  # not a flag
    grad_clip: float = setting(1.0, "gradient norm clip", advanced=True)
    grad_checkpointing: bool = setting(False, "recompute activations per depth", advanced=True)
    train: str = setting("all", "all, or a comma list of lora, prefix, layers, norms, embed, exit", advanced=True)
    eval_every_steps: int = setting(
        0,
        "held-out perplexity per loop exit every N steps (0: at the end only)",
        metavar="N",
        renamed_from=("--eval-every",),
    )
    eval_rows: int = refine(RunSettings, "eval_rows", renamed_from=("--eval-seqs",))
    save_every_steps: int = setting(
        0, "checkpoint every N steps (and always at the end)", metavar="N", renamed_from=("--save-every",)
    )
    keep: int = setting(2, "checkpoints to keep", advanced=True)
    log_every: int = setting(1, "a metrics record every N steps", advanced=True)
    data_rows: str | None = setting(
        None,
        "new: only training rows no earlier run of the model read (post-training on new tokens, as the paper "
        "does); default: new with --early-exit, all otherwise",
        choices=DATA_ROWS,
        advanced=True,
    )

    # Settings that must not change between a run and its resume.
    FIXED = (
        "data",
        "teacher",
        "kd",
        "kd_weight",
        "kd_temperature",
        "early_exit",
        "exit_coef",
        "self_distill",
        "self_distill_weight",
        "exit_adapter",
        "freeze_body",
        "batch_size",
        "grad_accum",
        "seq_len",
        "lr",
        "min_lr_ratio",
        "weight_decay",
        "beta1",
        "beta2",
        "train",
        "seed",
        "data_rows",
        "budget_minutes",
    )
    # settings whose default changed: a run that did not record one ran with this value
    FORMER_DEFAULTS = {"data_rows": "all"}


# ---------------------------------------------------------------------------------------------
# pieces


class TrainModule(nn.Module):
    """The student with its objective: forward returns (loss, parts), or, evaluating, every exit's summed NLL."""

    def __init__(self, lm, cfg: TrainConfig):
        super().__init__()
        self.lm = lm
        self.cfg = cfg

    def forward(self, input_ids, teacher_logits=None, evaluate: bool = False):
        c = self.cfg
        if evaluate:  # every exit's summed NLL and the scored tokens (through this forward: FSDP gathers here)
            nll, _, tokens = self.lm.exit_losses(input_ids)
            return nll.sum(1), tokens.sum()
        all_exits = c.early_exit != "none"
        h, states, _ = self.lm.model(input_ids, output_loop_states=all_exits)
        exits = (
            [self.lm.exit_logits(s, loop=i) for i, s in enumerate(states)] if all_exits else [self.lm.exit_logits(h)]
        )
        # A frozen body cannot change the final exit: the teacher then teaches the intermediate exits.
        return objective(
            exits,
            input_ids,
            teacher_logits,
            kd=c.kd,
            kd_weight=c.kd_weight,
            temperature=c.kd_temperature,
            early_exit=c.early_exit,
            exit_coef=c.exit_coef,
            self_distill=c.self_distill,
            self_distill_weight=c.self_distill_weight,
            teacher_exits=c.freeze_body,
        )


def lr_lambda_factory(warmup: int, total: int, min_ratio: float):
    return lambda step: cosine(step, total, warmup, min_ratio)


def param_groups(model, weight_decay: float):
    """Weight decay on matrices only: not on norms, biases (LoopLinear.bias is 2-D, [slots, out],
    so the number of dimensions alone does not tell) or per-depth prefixes (attention inputs, not weights:
    decay would pull them towards the null key rather than towards anything neutral)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            matrix = p.dim() >= 2 and "norm" not in name and not name.endswith(("bias", ".attn.prefix"))
            (decay if matrix else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def resolve_precision(precision: str, device: torch.device) -> str:
    if precision not in ("auto", "bf16", "fp32"):
        raise UsageError(f"unknown --precision {precision!r}; use auto, bf16 or fp32")
    if precision == "auto":
        # bf16 autocast where the hardware has bf16 matmuls: CUDA devices that support it, and CPUs with
        # AVX-512 BF16 or AMX, where a training step is markedly faster. Without them autocast only adds casts.
        return "bf16" if has_bf16_matmuls(device) else "fp32"
    return precision


@torch.no_grad()
def evaluate_exits(module, corpus, n_rows: int, seq: int, acc, autocast) -> dict | None:
    """Held-out loss and perplexity at every loop exit on the corpus's first ``n_rows`` held-out rows (cut to
    ``seq`` tokens), the rows shared out among the processes; None when the corpus has none."""
    rows = heldout_rows(corpus, n_rows, seq)
    if not rows:
        return None
    module.eval()

    def score(ids):
        with autocast():
            return module(ids, evaluate=True)

    sums, count = score_rows(score, rows, acc.device, acc)
    module.train()
    out = {"eval_tokens": int(count)}
    for i, loss in enumerate((sums / count).tolist(), start=1):
        out[f"eval_loss_{i}"] = loss
        out[f"ppl_{i}"] = perplexity(loss)
    return out


# ---------------------------------------------------------------------------------------------
# the run


class Trainer:
    def __init__(self, cfg: TrainConfig, log=print):
        self.cfg, self._log = cfg, log

    def log(self, *args) -> None:
        acc = getattr(self, "acc", None)
        if acc is None or acc.is_main_process:
            self._log(*args)

    # ----- validation: everything that can be wrong is found before the run directory is touched (preflight.py)
    def prepare(self):
        c = self.cfg
        adapter_spec = check_config(c)
        out = Path(c.out)
        prev_run, latest = previous_run(c)

        self.corpus = PackedCorpus(c.data)
        seq = c.seq_len or self.corpus.seq_len
        if seq > self.corpus.seq_len or seq < 2:
            raise UsageError(f"--seq-len {seq} must be between 2 and the corpus's {self.corpus.seq_len}")
        self.seq = seq

        self.acc = start_processes("train")
        acc = self.acc
        self.precision = resolve_precision(c.precision, acc.device)
        self.world, self.rank = acc.num_processes, acc.process_index
        self.global_batch = c.batch_size * c.grad_accum * self.world
        if self.global_batch > len(self.corpus):
            raise UsageError(
                f"global batch {self.global_batch} (batch-size x grad-accum x processes) is larger "
                f"than the corpus's {len(self.corpus)} training sequences; lower --batch-size or "
                f"--grad-accum, or build a bigger corpus"
            )
        tokens_per_step = self.global_batch * seq
        self._plan_steps(prev_run, tokens_per_step)
        model, fp = self._load_model(adapter_spec)
        # the training rows this run reads: all, or those no earlier run of the model read
        self.prior_training = list((model.config.conversion or {}).get("training", []))
        self.corpus_id = self.corpus.meta["splits"]["train"]["sha256"]
        self.rows = rows_to_read(c, self.prior_training, self.corpus, self.corpus_id, self.global_batch)
        self.teacher = load_teacher(c, model, fp)
        check_same_model(out, prev_run, latest, model)
        self.latest = latest

        self.n_train = select_trainable(model, "exit" if c.freeze_body else c.train)
        self.n_params = sum(p.numel() for p in model.parameters())
        if c.grad_checkpointing:
            model.model.gradient_checkpointing = True
        check_memory(c, model, self.teacher, self.n_params, seq, acc.device)
        self.model = model
        self.prev_run = prev_run

    def _plan_steps(self, prev_run: dict | None, tokens_per_step: int) -> None:
        """The run's step count. A time budget becomes one once the first steps are timed and is fixed again as the
        run goes (step_loop.py); run.json keeps the count and the steps it was fixed at, so that a resumed run
        follows them. Until the first fix the count is open (None)."""
        c = self.cfg
        self.replanned_at = list((prev_run or {}).get("replanned_at", []))
        if c.budget_minutes is not None:
            self.max_steps = (prev_run or {}).get("max_steps")
        else:
            self.max_steps = c.max_steps if c.max_steps is not None else math.ceil(c.train_tokens / tokens_per_step)
            if self.max_steps < 1:
                raise UsageError("the budget is less than one step; raise --max-steps or --train-tokens")

    def _load_model(self, adapter_spec: dict | None):
        """The model to train, with the exit adapters asked for; refused when its tokenizer is not the corpus's.
        Returns it and its tokenizer's fingerprint."""
        from ..models import load_model

        c = self.cfg
        model, tok = load_model(c.model)
        if tok is None:
            raise UsageError(
                f"model {c.model} has no tokenizer files; save it with its tokenizer (looplm convert does)"
            )
        fp = tokenizer_fingerprint(tok)
        if fp != self.corpus.tokenizer:
            raise UsageError(
                f"the corpus {c.data} was tokenised with another tokenizer ({self.corpus.meta['model']}) "
                f"than {c.model}'s; rebuild it with `looplm data build {c.model} --out DIR`"
            )
        self.tok = tok
        if adapter_spec:
            add_exit_adapters(model, adapter_spec["kind"], adapter_spec.get("rank"))
        if c.freeze_body and model.exit_adapter is None:
            raise UsageError(
                f"--freeze-body leaves nothing to train: {c.model} has no exit adapter; add "
                f"--exit-adapter head-lora:R or affine"
            )
        return model, fp

    def _lr_factor(self, step: int) -> float:
        """Warm-up (5% of the steps unless --warmup-steps) and cosine decay over the run's step count; while a
        time budget is still open, warm-up over BUDGET_WARMUP steps."""
        c = self.cfg
        if self.max_steps is None:
            return (step + 1) / ((c.warmup_steps if c.warmup_steps is not None else BUDGET_WARMUP) + 1)
        warmup = c.warmup_steps if c.warmup_steps is not None else max(1, round(0.05 * self.max_steps))
        return lr_lambda_factory(warmup, self.max_steps, c.min_lr_ratio)(step)

    def _replan(self, step: int, seconds_per_step: float, now: float) -> int:
        """The step count that fills what is left of --budget-minutes at run clock ``now`` (the step loop's fix, at
        the same step on every process); run.json keeps it for --resume."""
        first = self.max_steps is None
        self.max_steps = steps_to_fill(step, self.cfg.budget_minutes * 60 - now, seconds_per_step, at_least=1)
        # the scheduler already set the next step's rate under the open (or the last) count: set it under this one
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs):
            group["lr"] = base * self._lr_factor(self.scheduler.last_epoch)
        if self.acc.is_main_process:
            run_dir = RunDir(self.cfg.out)
            run_dir.write_settings(
                {**run_dir.settings(), "max_steps": self.max_steps, "replanned_at": self.replanned_at}
            )
            self.log(
                f"budget{'' if first else f' fixed again at step {step}'}: {seconds_per_step:.2f} s per step, "
                f"{self.max_steps} steps fill {self.cfg.budget_minutes:g} minutes"
            )
        return self.max_steps

    # ----- the run itself
    def _start(self) -> tuple[Position, bool]:
        """The model (a resumed run's weights read first), its optimizer and schedule, on the device (the layers
        sharded under FSDP), and the run directory opened (a new run's run.json written); a resumed run continues
        from its checkpoint. Returns where the run is and whether the run directory was made now."""
        c, acc, out = self.cfg, self.acc, Path(self.cfg.out)
        torch.manual_seed(c.seed)
        np.random.seed(c.seed)
        self.sharded = self.world > 1 and launched()
        self.checkpoints = Checkpointer(RunDir(out), acc, self.sharded, keep=c.keep)
        position, created = Position(), False
        ck = out / "checkpoints" / self.latest if self.latest else None
        if ck is not None:  # into the whole model, before its layers are sharded
            position = self._load(ck)
        if self.sharded:  # sharded before the move: the whole layers never sit on the device
            shard_layers(self.model)
        self.model.to(acc.device)
        self.module = TrainModule(self.model, c)
        groups = param_groups(self.model, c.weight_decay)
        groups = apart_by_sharding(groups) if self.sharded else groups
        self.optimizer = adamw(groups, lr=c.lr, betas=(c.beta1, c.beta2), eps=1e-8)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: self._lr_factor(s))
        if ck is not None:
            saved = self.checkpoints.training(ck)
            restore(self.optimizer, saved["optimizer"])
            restore(self.scheduler, saved["scheduler"])
            self.log(f"resumed {out} at step {position.step} ({position.tokens:,} tokens)")
        if self.teacher is not None:
            self.teacher.to(acc.device)
        bf16 = self.precision == "bf16"
        self.autocast = lambda: torch.autocast(acc.device.type, dtype=torch.bfloat16, enabled=bf16)

        step = position.step
        run_dir = RunDir(out)
        if acc.is_main_process:
            created = not out.exists()
            run_dir.open()
            # the records up to the checkpoint: a resumed run writes those after it again
            run_dir.truncate(lambda r: r.get("step", 0) < step or (r.get("step", 0) == step and step > 0))
            if self.prev_run is None:
                run_dir.write_settings(
                    {
                        "config": {f.name: getattr(c, f.name) for f in fields(c)},
                        "arch": arch_fingerprint(self.model.config),
                        "tokenizer": self.corpus.tokenizer,
                        "world": self.world,
                        "global_batch": self.global_batch,
                        "seq_len": self.seq,
                        "max_steps": self.max_steps,
                        "precision": self.precision,
                    },
                )
            settings = run_dir.settings()
            machines = with_this_machine(settings.get("machines", []))
            if machines != settings.get("machines"):  # the run's minutes are these machines'
                run_dir.write_settings({**settings, "machines": machines})
        acc.wait_for_everyone()
        return position, created

    def _step(self, step: int, total: int | None = None) -> dict:
        """One optimizer step over the global batch of ``step`` (this process's micro-batches, accumulated): its
        record's values, the loss parts averaged over the micro-batches and the processes, the gradient norm before
        clipping and the learning rate the step used."""
        c, acc, module, optimizer = self.cfg, self.acc, self.module, self.optimizer
        params = [p for p in module.parameters() if p.requires_grad]
        t0 = time.perf_counter()
        train = self.corpus.splits["train"]
        idx = self.rows[batch_indices(step, self.global_batch, len(self.rows), c.seed)]
        module.train()
        sums: dict[str, torch.Tensor] = {}
        for m in range(c.grad_accum):
            rows = micro_batch(idx, m, self.rank, self.world, c.batch_size)
            ids = torch.from_numpy(np.asarray(train[rows][:, : self.seq], dtype=np.int64)).to(acc.device)
            teacher_logits = None
            if self.teacher is not None:
                with torch.no_grad(), self.autocast():
                    teacher_logits = self.teacher(ids).logits
            with self.autocast():
                loss, parts = module(ids, teacher_logits)
            (loss / c.grad_accum).backward()
            for k, v in parts.items():
                sums[k] = sums.get(k, 0.0) + v.float() / c.grad_accum
        if self.world > 1:  # once per step, after the micro-batches accumulated
            average_gradients(params)
        grad_norm = clip_gradients(params, c.grad_clip) if c.grad_clip and c.grad_clip > 0 else None
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        self.scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return {
            **mean_values(acc, {k: float(v) for k, v in sorted(sums.items())}),
            "lr": lr,
            "grad_norm": float(grad_norm) if grad_norm is not None else None,
            "tok_per_s": self.global_batch * self.seq / (time.perf_counter() - t0),
        }

    def run(self) -> dict:
        self.prepare()
        c, acc, out = self.cfg, self.acc, Path(self.cfg.out)
        position, created = self._start()
        run_dir = RunDir(out)
        tb = tensorboard_writer(out) if acc.is_main_process else None
        self.clock = RunClock(position.time)
        if acc.is_main_process:
            self.log(
                f"training {self.n_train:,} of {self.n_params:,} parameters on {acc.device} ({self.precision}), "
                f"{self.world} process(es), global batch {self.global_batch} x {self.seq} tokens, "
                + (f"{self.max_steps} steps" if self.max_steps else f"steps to fill {c.budget_minutes:g} minutes")
            )
        loop = StepLoop(
            self._step,
            self.max_steps,
            position,
            self.clock,
            "train",
            tokens_per_step=self.global_batch * self.seq,
            show=c.progress and acc.is_main_process,
            record=lambda r: run_dir.append(r, tb) if acc.is_main_process else None,
            record_every=c.log_every,
            save=lambda: self._save(position),
            save_every=Every(steps=c.save_every_steps or None),
            evaluate=lambda: self._log_eval(out, tb, position),
            evaluate_every=Every(steps=c.eval_every_steps or None),
            replan=self._replan if c.budget_minutes is not None else None,
            replanned_at=self.replanned_at,
            processes=acc,
        )
        try:
            if c.eval_every_steps and position.step == 0:
                self._log_eval(out, tb, position)
            if loop.run():
                if c.eval_every_steps:
                    self._log_eval(out, tb, position)
                self._save(position)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if isinstance(e, torch.OutOfMemoryError) or "memory" in str(e).lower():
                if created and position.step == 0 and acc.is_main_process:
                    shutil.rmtree(out, ignore_errors=True)
                raise UsageError(
                    f"out of memory at batch {c.batch_size} x {self.seq} tokens; lower --batch-size "
                    f"(raise --grad-accum to keep the global batch), lower --seq-len or add "
                    f"--grad-checkpointing"
                ) from None
            raise
        finally:
            if tb is not None:
                tb.close()
        self._stamp(position.step)
        self.checkpoints.write_final(self.model, self.tok, out)
        return {"out": str(out), "steps": position.step, "tokens": position.tokens, "seconds": round(position.time, 2)}

    # ----- checkpoints (checkpoints.py)
    def _save(self, position: Position) -> None:
        self._stamp(position.step)
        state = {
            "step": position.step,
            "tokens": position.tokens,
            "time": position.time,
            "global_batch": self.global_batch,
            "world": self.world,
            "epoch": position.step // (len(self.corpus) // self.global_batch),
        }
        training = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        self.checkpoints.save(f"step-{position.step:07d}", self.model, self.tok, state, training)

    def _load(self, ck: Path) -> Position:
        """Checkpoint ``ck``'s weights, read into the whole model, and where the run was."""
        from ..models.checkpoint import load_checkpoint

        state = json.loads((ck / "state.json").read_text())
        if state["global_batch"] != self.global_batch:
            raise UsageError(
                f"checkpoint {ck} was trained with global batch {state['global_batch']}, this run has "
                f"{self.global_batch}; keep batch-size x grad-accum x processes the same"
            )
        self.model.load_state_dict(load_checkpoint(ck).state_dict())
        return Position(int(state["step"]), int(state["tokens"]), float(state["time"]))

    def _stamp(self, step: int) -> None:
        """The rows the run has read up to ``step``, kept in the model's config (conversion.training) for the
        checkpoint and the final model: a later run with --data-rows new skips them."""
        record = {
            "corpus": self.corpus_id,
            "seed": self.cfg.seed,
            "global_batch": self.global_batch,
            "steps": step,
            "new_rows": self.cfg.data_rows == "new",
        }
        config = self.model.config
        config.conversion = {**(config.conversion or {}), "training": self.prior_training + [record]}

    # ----- evaluation
    def evaluate(self) -> dict | None:
        return evaluate_exits(self.module, self.corpus, self.cfg.eval_rows, self.seq, self.acc, self.autocast)

    def _log_eval(self, out, tb, position: Position) -> None:
        with self.clock.paused():
            ev = self.evaluate()
        if ev is None:
            return
        if self.acc.is_main_process:
            record = {"step": position.step, "tokens": position.tokens, "eval": True, **ev}
            append_record(out / "metrics.jsonl", record, tb)
            self.log(
                f"held-out perplexity at step {position.step}: "
                + ", ".join(f"loop {k.split('_')[1]} {v:.2f}" for k, v in ev.items() if k.startswith("ppl_"))
            )


def train(cfg: TrainConfig, log=print) -> dict:
    return Trainer(cfg, log).run()


__all__ = [
    "DATA_ROWS",
    "TRAIN_GROUPS",
    "TrainConfig",
    "Trainer",
    "arch_fingerprint",
    "batch_indices",
    "estimate_memory",
    "evaluate_exits",
    "lr_lambda_factory",
    "memory_available",
    "param_groups",
    "resolve_precision",
    "select_trainable",
    "train",
]
