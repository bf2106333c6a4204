"""The training loop: uptraining (CE + online KD from a frozen teacher) and early-exit training.

One recipe for one CPU, one GPU or many (Hugging Face Accelerate: DDP, FSDP, DeepSpeed ZeRO via
`accelerate launch --config_file configs/accelerate/...`).

Run directory::

    run.json                 the run's settings (checked on --resume)
    metrics.jsonl            one JSON object per logged step / evaluation
    latest                   name of the newest complete checkpoint (replaced atomically)
    checkpoints/step-NNNNNNN looplm model dir (config.json, model.safetensors, tokenizer) + state.json +
                             accelerate/ (optimizer, scheduler, RNG states of every process)
    final/                   the trained model (looplm dir; `looplm eval`/`convert` read it)
    tb/                      TensorBoard events, when tensorboard is installed

Exact resume: the data order is a pure function of (seed, step) and everything else that changes
(weights, AdamW moments, schedule, RNG states) is in the checkpoint, so a resumed run repeats the
uninterrupted run's losses bit for bit on CPU in float32.
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
from ..models.exit_adapter import add_exit_adapters, parse_exit_adapter
from ..models.loading import tokenizer_fingerprint
from ..models.quantized import has_bf16_matmuls
from .budget import check_budget, steps_to_fill
from .checkpoints import Checkpoints, tensorboard_writer
from .data_order import batch_indices, micro_batch, rows_read
from .evaluate import perplexity
from .losses import EARLY_EXIT, KD_FUNCS, objective, token_ce
from .optim import adamw, cosine
from .run_dir import RunDir, append_record, check_resume_settings

BUDGET_TIMED = 3  # steps timed (after the first, which warms up) before a time budget becomes a step count
BUDGET_WARMUP = 20  # warm-up steps assumed until then
TRAIN_GROUPS = ("all", "lora", "prefix", "layers", "norms", "embed", "exit")
DATA_ROWS = ("all", "new")


@dataclass
class TrainConfig:
    model: str | None = None
    data: str = ""
    out: str = ""
    teacher: str | None = None
    kd: str = "fkl"
    kd_weight: float = 0.5
    kd_temperature: float = 1.0
    early_exit: str = "none"
    exit_coef: float = 0.1
    self_distill: bool = False
    self_distill_weight: float = 1.0
    exit_adapter: str | None = (
        None  # head-lora:R | affine: add an adapter per intermediate exit (models/exit_adapter.py)
    )
    freeze_body: bool = False  # train only the exit adapter (the paper's appendix-I ablation)
    max_steps: int | None = None
    max_tokens: int | None = None
    budget_minutes: float | None = None  # instead: train for this much step time (fixed after BUDGET_TIMED steps)
    batch_size: int = 2  # sequences per process per micro-step
    grad_accum: int = 1
    seq_len: int | None = None  # crop the corpus's sequences (default: their full length)
    lr: float = 2e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int | None = None
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    precision: str = "auto"  # auto | bf16 | fp32
    grad_checkpointing: bool = False
    train: str = "all"
    eval_every: int = 0
    eval_seqs: int = 16
    save_every: int = 0
    keep: int = 2
    log_every: int = 1
    seed: int = 0
    data_rows: str | None = None  # all | new (rows no earlier run of the model read); None: new for --early-exit
    resume: bool = False
    progress: bool = True

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
    """The student with its objective: forward returns (loss, parts). Going through one module's
    forward is what DDP/FSDP need to synchronise gradients."""

    def __init__(self, lm, cfg: TrainConfig):
        super().__init__()
        self.lm = lm
        self.cfg = cfg

    def forward(self, input_ids, teacher_logits=None, evaluate: bool = False):
        c = self.cfg
        all_exits = evaluate or c.early_exit != "none"
        h, states, _ = self.lm.model(input_ids, output_loop_states=all_exits)
        exits = (
            [self.lm.exit_logits(s, loop=i) for i, s in enumerate(states)] if all_exits else [self.lm.exit_logits(h)]
        )
        if evaluate:  # summed CE per exit and the count of predicted tokens
            sums = torch.stack([token_ce(lg, input_ids).sum() for lg in exits])
            return sums, torch.tensor(float(input_ids[:, 1:].numel()), device=sums.device)
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


def select_trainable(model, spec: str) -> int:
    """--train: 'all' or a comma list of lora, prefix, layers (shared weights), norms, embed (embeddings and
    head), exit (the exit adapter). Returns the count."""
    groups = {s.strip() for s in spec.split(",") if s.strip()}
    bad = groups - set(TRAIN_GROUPS)
    if bad or not groups:
        raise UsageError(
            f"unknown --train group(s) {sorted(bad) or spec!r}; use all or a comma list of "
            f"{', '.join(TRAIN_GROUPS[1:])}"
        )
    n = 0
    for name, p in model.named_parameters():
        if name.startswith("exit_adapter."):
            g = "exit"
        elif "lora_" in name:
            g = "lora"
        elif name.endswith(".attn.prefix"):
            g = "prefix"
        elif "embed_tokens" in name or "lm_head" in name:
            g = "embed"
        elif "norm" in name.split(".")[-2]:
            g = "norms"
        else:
            g = "layers"
        p.requires_grad_("all" in groups or g in groups)
        n += p.numel() if p.requires_grad else 0
    if n == 0:
        hint = (
            " (this model has no LoRA: convert with --lora-rank > 0)"
            if "lora" in groups
            else " (this model has no exit adapter: add --exit-adapter head-lora:R or affine)"
            if "exit" in groups
            else " (this model has no prefix: convert with --relax prefix)"
            if "prefix" in groups
            else ""
        )
        raise UsageError(f"--train {spec} leaves nothing to train{hint}; use --train all")
    return n


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


def memory_available(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def estimate_memory(
    config, n_params: int, teacher_cfg, teacher_params: int, bs: int, seq: int, exits: int, checkpointing: bool
) -> int:
    """A rough upper estimate of training bytes: weights + grads + AdamW (16 B/param), the teacher's
    weights, activations kept for backward (per depth ~(12 h + 4 ffn) floats per token, one depth's worth
    with checkpointing), and the float32 logits of every exit and the teacher with their softmaxes."""
    c = config
    per_depth = (12 * c.hidden_size + 4 * c.intermediate_size) * 4
    depths = 1 if checkpointing else c.num_hidden_layers
    act = bs * seq * (per_depth * depths + (c.num_hidden_layers if checkpointing else 0) * c.hidden_size * 4)
    logits = bs * seq * c.vocab_size * 4 * (3 * exits + (3 if teacher_cfg is not None else 0))
    return 16 * n_params + 4 * teacher_params + act + logits


def arch_fingerprint(config) -> dict:
    d = config.to_dict()
    for k in (
        "conversion",
        "transformers_version",
        "architectures",
        "_name_or_path",
        "dtype",
        "torch_dtype",
        "id2label",
        "label2id",
    ):
        d.pop(k, None)
    return json.loads(json.dumps(d, default=str))


def _diff(a: dict, b: dict) -> list[str]:
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


# ---------------------------------------------------------------------------------------------
# the run


class Trainer(Checkpoints):
    def __init__(self, cfg: TrainConfig, log=print):
        self.cfg, self._log = cfg, log

    def log(self, *args) -> None:
        acc = getattr(self, "acc", None)
        if acc is None or acc.is_main_process:
            self._log(*args)

    # ----- validation: everything that can be wrong is found before the run directory is touched
    def prepare(self):
        from accelerate import Accelerator

        from ..models import load_model

        c = self.cfg
        out = Path(c.out)
        if not c.out:
            raise UsageError("give the run directory with --out RUN")
        check_budget(
            {"--max-steps N": c.max_steps, "--train-tokens N": c.max_tokens, "--budget-minutes M": c.budget_minutes}
        )
        if c.kd not in KD_FUNCS:
            raise UsageError(f"unknown --kd {c.kd!r}; use one of {', '.join(KD_FUNCS)}")
        if c.early_exit not in EARLY_EXIT:
            raise UsageError(f"unknown --early-exit {c.early_exit!r}; use one of {', '.join(EARLY_EXIT)}")
        if c.self_distill and c.early_exit == "none":
            raise UsageError("--self-distill trains intermediate exits: add --early-exit aggressive (or weighted)")
        if c.batch_size < 1 or c.grad_accum < 1:
            raise UsageError("--batch-size and --grad-accum must be at least 1")
        if not 0 <= c.kd_weight <= 1:
            raise UsageError(f"--kd-weight {c.kd_weight} must be in [0, 1] (loss = (1-w) CE + w KD)")
        if c.data_rows not in (None, *DATA_ROWS):
            raise UsageError(f"unknown --data-rows {c.data_rows!r}; use all or new")
        adapter_spec = parse_exit_adapter(c.exit_adapter) if c.exit_adapter else None
        if adapter_spec and c.early_exit == "none":
            raise UsageError(
                "--exit-adapter serves the intermediate exits, which only --early-exit trains: add "
                "--early-exit aggressive (or weighted)"
            )
        if c.freeze_body and c.early_exit == "none":
            raise UsageError("--freeze-body trains only intermediate exits: add --early-exit aggressive (or weighted)")
        if c.freeze_body and c.train != "all":
            raise UsageError("--freeze-body already chooses what trains (the exit adapter); drop --train")

        run_dir = RunDir(out)
        prev_run = run_dir.settings()
        latest = None
        if prev_run is not None:
            if not c.resume:
                raise UsageError(f"{out} already holds a run; add --resume to continue it or choose a new --out")
            latest = run_dir.latest()
            c.model = c.model or prev_run["config"]["model"]
            c.data_rows = c.data_rows or prev_run["config"].get("data_rows", "all")  # runs from before the option
            check_resume_settings(prev_run["config"], c, TrainConfig.FIXED, TrainConfig.FORMER_DEFAULTS)
        elif c.resume and out.exists() and any(out.iterdir()):
            raise UsageError(
                f"{out} is not a looplm run (no run.json); resume needs a run directory written by "
                f"`looplm train`, or drop --resume and choose an empty --out"
            )
        if not c.model:
            raise UsageError("give the model to train as the first argument (`looplm train MODEL ...`)")
        # The paper post-trains early exits on new tokens: do not re-read the uptraining's batches.
        c.data_rows = c.data_rows or ("new" if c.early_exit != "none" else "all")

        self.corpus = PackedCorpus(c.data)
        seq = c.seq_len or self.corpus.seq_len
        if seq > self.corpus.seq_len or seq < 2:
            raise UsageError(f"--seq-len {seq} must be between 2 and the corpus's {self.corpus.seq_len}")
        self.seq = seq

        self.acc = Accelerator(
            mixed_precision="no", step_scheduler_with_optimizer=False, cpu=not torch.cuda.is_available()
        )
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
        # A time budget becomes a step count once the first steps are timed (stored in run.json, so that a
        # resumed run keeps it); until then the count is open.
        self.budget_open = c.budget_minutes is not None and not (prev_run or {}).get("budget_fixed")
        if c.budget_minutes is not None:
            self.max_steps = prev_run["max_steps"] if not self.budget_open else 10**9
        else:
            self.max_steps = c.max_steps if c.max_steps is not None else math.ceil(c.max_tokens / tokens_per_step)
        if self.max_steps < 1:
            raise UsageError("the budget is less than one step; raise --max-steps or --train-tokens")

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
        self._choose_rows(model)
        self.teacher = None
        if c.teacher:
            teacher, ttok = load_model(c.teacher)
            if (
                ttok is None
                or tokenizer_fingerprint(ttok) != fp
                or teacher.config.vocab_size != model.config.vocab_size
            ):
                raise UsageError(
                    f"teacher {c.teacher} and student {c.model} use different tokenizers; distillation "
                    f"needs the same vocabulary: pick the student's source model as --teacher"
                )
            teacher.requires_grad_(False)
            self.teacher = teacher.eval()

        if prev_run is not None and prev_run["arch"] != arch_fingerprint(model.config):
            diff = _diff(prev_run["arch"], arch_fingerprint(model.config))
            raise UsageError(
                f"{out} holds a run of another model (differs in {', '.join(diff[:4])}); resume with "
                f"the model {prev_run['config']['model']} or choose a new --out"
            )
        if latest:
            ck = out / "checkpoints" / latest
            if not (ck / "config.json").exists() or not (ck / "state.json").exists():
                raise UsageError(
                    f"checkpoint {ck} named by {out / 'latest'} is incomplete; delete {out / 'latest'} "
                    f"to restart from the previous one or choose a new --out"
                )
            ck_arch = json.loads((ck / "config.json").read_text())
            model_arch = arch_fingerprint(model.config)
            diff = [k for k in model_arch if k in ck_arch and ck_arch[k] != model_arch[k]]
            if diff:
                raise UsageError(
                    f"checkpoint {ck} belongs to another model (differs in {', '.join(diff[:4])}); "
                    f"resume with the run's own model or choose a new --out"
                )
        self.latest = latest

        n_train = select_trainable(model, "exit" if c.freeze_body else c.train)
        n_params = sum(p.numel() for p in model.parameters())
        if c.grad_checkpointing:
            model.model.gradient_checkpointing = True
        exits = model.config.num_loops if c.early_exit != "none" else 1
        need = estimate_memory(
            model.config,
            n_params,
            self.teacher.config if self.teacher else None,
            sum(p.numel() for p in self.teacher.parameters()) if self.teacher else 0,
            c.batch_size,
            seq,
            exits,
            c.grad_checkpointing,
        )
        have = memory_available(acc.device)
        if have is not None and need > have:
            raise UsageError(
                f"batch {c.batch_size} x {seq} tokens needs about {need / 2**30:.1f} GiB but "
                f"{have / 2**30:.1f} GiB is free; lower --batch-size (raise --grad-accum to keep the "
                f"global batch), lower --seq-len, or add --grad-checkpointing"
            )
        self.n_train, self.n_params = n_train, n_params
        self.model = model
        self.prev_run = prev_run

    def _choose_rows(self, model) -> None:
        """The training rows this run reads: all, or those no earlier run of the model read."""
        c = self.cfg
        self.prior_training = list((model.config.conversion or {}).get("training", []))
        self.corpus_id = self.corpus.meta["splits"]["train"]["sha256"]
        n = len(self.corpus.splits["train"])
        read = rows_read(self.prior_training, self.corpus_id, n) if c.data_rows == "new" else np.zeros(n, bool)
        self.rows = np.flatnonzero(~read)
        if len(self.rows) < self.global_batch:
            raise UsageError(
                f"{c.model}'s earlier training read {int(read.sum())} of the {n} training sequences of "
                f"{c.data}; {len(self.rows)} new ones cannot fill a global batch of {self.global_batch}: "
                f"build a bigger corpus or pass --data-rows all"
            )

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

    def _lr_factor(self, step: int) -> float:
        """Warm-up (5% of the steps unless --warmup-steps) and cosine decay over the run's step count; while a
        time budget is still open, warm-up over BUDGET_WARMUP steps."""
        c = self.cfg
        if self.budget_open:
            return (step + 1) / ((c.warmup_steps if c.warmup_steps is not None else BUDGET_WARMUP) + 1)
        warmup = c.warmup_steps if c.warmup_steps is not None else max(1, round(0.05 * self.max_steps))
        return lr_lambda_factory(warmup, self.max_steps, c.min_lr_ratio)(step)

    def _fix_budget(self, step: int, elapsed: float, seconds_per_step: float) -> None:
        """Turn --budget-minutes into a step count from the steps just timed; every process takes the main
        process's count, and run.json keeps it for --resume."""
        left = self.cfg.budget_minutes * 60 - elapsed
        total = torch.tensor([steps_to_fill(step, left, seconds_per_step)], device=self.acc.device)
        from accelerate.utils import broadcast

        self.max_steps = int(broadcast(total, from_process=0).item())
        self.budget_open = False
        # the scheduler already set the next step's rate under the open budget: set it under the fixed one
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs):
            group["lr"] = base * self._lr_factor(self.scheduler.last_epoch)
        if self.acc.is_main_process:
            run_dir = RunDir(self.cfg.out)
            run_dir.write_settings({**run_dir.settings(), "max_steps": self.max_steps, "budget_fixed": True})
            self.log(
                f"budget: {seconds_per_step:.2f} s per step, {self.max_steps} steps fill "
                f"{self.cfg.budget_minutes:g} minutes"
            )

    # ----- the run itself
    def run(self) -> dict:
        self.prepare()
        c, acc, out = self.cfg, self.acc, Path(self.cfg.out)
        torch.manual_seed(c.seed)
        np.random.seed(c.seed)
        module = TrainModule(self.model, c)
        optimizer = adamw(param_groups(self.model, c.weight_decay), lr=c.lr, betas=(c.beta1, c.beta2), eps=1e-8)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: self._lr_factor(s))
        module, optimizer = acc.prepare(module, optimizer)
        acc.register_for_checkpointing(scheduler)
        if self.teacher is not None:
            self.teacher.to(acc.device)
        self.module, self.optimizer, self.scheduler = module, optimizer, scheduler
        dev = acc.device
        autocast = (
            (lambda: torch.autocast(dev.type, dtype=torch.bfloat16))
            if self.precision == "bf16"
            else (lambda: torch.autocast(dev.type, enabled=False))
        )
        self.autocast = autocast

        step, tokens, elapsed = 0, 0, 0.0
        created = False
        if self.latest:
            step, tokens, elapsed = self._load(out / "checkpoints" / self.latest)
            self.log(f"resumed {out} at step {step} ({tokens:,} tokens)")
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
        acc.wait_for_everyone()
        tb = tensorboard_writer(out) if acc.is_main_process else None

        from tqdm import tqdm

        bar = tqdm(
            total=None if self.budget_open else self.max_steps,
            initial=step,
            desc="train",
            unit="step",
            disable=not (c.progress and acc.is_main_process),
        )
        if acc.is_main_process:
            self.log(
                f"training {self.n_train:,} of {self.n_params:,} parameters on {dev} ({self.precision}), "
                f"{self.world} process(es), global batch {self.global_batch} x {self.seq} tokens, "
                + (f"steps to fill {c.budget_minutes:g} minutes" if self.budget_open else f"{self.max_steps} steps")
            )
        if c.eval_every and step == 0:
            self._log_eval(out, tb, step, tokens)
        train = self.corpus.splits["train"]
        timed: list[float] = []  # step times of this process since it started, for an open time budget
        try:
            while step < self.max_steps:
                t0 = time.perf_counter()
                idx = self.rows[batch_indices(step, self.global_batch, len(self.rows), c.seed)]
                module.train()
                sums: dict[str, float] = {}
                for m in range(c.grad_accum):
                    rows = micro_batch(idx, m, self.rank, self.world, c.batch_size)
                    ids = torch.from_numpy(np.asarray(train[rows][:, : self.seq], dtype=np.int64)).to(dev)
                    teacher_logits = None
                    if self.teacher is not None:
                        with torch.no_grad(), autocast():
                            teacher_logits = self.teacher(ids).logits
                    sync = m == c.grad_accum - 1
                    ctx = acc.no_sync(module) if not sync else _null()
                    with ctx:
                        with autocast():
                            loss, parts = module(ids, teacher_logits)
                        acc.backward(loss / c.grad_accum)
                    for k, v in parts.items():
                        sums[k] = sums.get(k, 0.0) + v.float() / c.grad_accum
                grad_norm = (
                    acc.clip_grad_norm_([p for p in module.parameters() if p.requires_grad], c.grad_clip)
                    if c.grad_clip and c.grad_clip > 0
                    else None
                )
                lr = optimizer.param_groups[0]["lr"]
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                tokens += self.global_batch * self.seq
                dt = time.perf_counter() - t0
                elapsed += dt
                timed.append(dt)
                if self.budget_open and len(timed) > BUDGET_TIMED:  # the first step warms up
                    self._fix_budget(step, elapsed, sum(timed[1:]) / (len(timed) - 1))
                    bar.total = self.max_steps
                keys = sorted(sums)
                vals = acc.reduce(torch.stack([sums[k] for k in keys]).to(dev), reduction="mean")
                rec = {
                    "step": step,
                    "tokens": tokens,
                    **{k: float(v) for k, v in zip(keys, vals)},
                    "lr": lr,
                    "grad_norm": float(grad_norm) if grad_norm is not None else None,
                    "tok_per_s": self.global_batch * self.seq / dt,
                    "time": round(elapsed, 3),
                }
                bar.update(1)
                bar.set_postfix(loss=f"{rec['loss']:.4f}", tok_s=f"{rec['tok_per_s']:.0f}")
                if acc.is_main_process and (step % c.log_every == 0 or step == self.max_steps):
                    run_dir.append(rec, tb)
                if c.eval_every and (step % c.eval_every == 0 or step == self.max_steps):
                    self._log_eval(out, tb, step, tokens)
                if (c.save_every and step % c.save_every == 0) or step == self.max_steps:
                    self._save(out, step, tokens, elapsed)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if isinstance(e, torch.OutOfMemoryError) or "memory" in str(e).lower():
                if created and step == 0 and acc.is_main_process:
                    shutil.rmtree(out, ignore_errors=True)
                raise UsageError(
                    f"out of memory at batch {c.batch_size} x {self.seq} tokens; lower --batch-size "
                    f"(raise --grad-accum to keep the global batch), lower --seq-len or add "
                    f"--grad-checkpointing"
                ) from None
            raise
        finally:
            bar.close()
            if tb is not None:
                tb.close()
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
        return {"out": str(out), "steps": step, "tokens": tokens, "seconds": round(elapsed, 2)}

    # ----- evaluation
    @torch.no_grad()
    def evaluate(self) -> dict | None:
        held = self.corpus.splits["heldout"]
        n = min(len(held), self.cfg.eval_seqs)
        if n == 0:
            return None
        self.module.eval()
        dev = self.acc.device
        sums = torch.zeros(self.model.config.num_loops, device=dev)
        count = torch.zeros((), device=dev)
        # every process runs the same number of forwards (collectives inside FSDP/DDP must match);
        # a process past the end repeats row 0 with weight 0
        for j in range(math.ceil(n / self.world)):
            i = j * self.world + self.rank
            weight = 1.0 if i < n else 0.0
            i = i if i < n else 0
            ids = torch.from_numpy(np.asarray(held[i : i + 1, : self.seq], dtype=np.int64)).to(dev)
            with self.autocast():
                s, k = self.module(ids, evaluate=True)
            sums = sums + weight * s.float()
            count = count + weight * k
        sums = self.acc.reduce(sums, reduction="sum")
        count = self.acc.reduce(count, reduction="sum")
        self.module.train()
        losses = (sums / count).tolist()
        out = {"eval_tokens": int(count)}
        for i, l in enumerate(losses, start=1):
            out[f"eval_loss_{i}"] = l
            out[f"ppl_{i}"] = perplexity(l)
        return out

    def _log_eval(self, out, tb, step, tokens):
        ev = self.evaluate()
        if ev is None:
            return
        if self.acc.is_main_process:
            append_record(out / "metrics.jsonl", {"step": step, "tokens": tokens, "eval": True, **ev}, tb)
            self.log(
                f"held-out perplexity at step {step}: "
                + ", ".join(f"loop {k.split('_')[1]} {v:.2f}" for k, v in ev.items() if k.startswith("ppl_"))
            )


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def train(cfg: TrainConfig, log=print) -> dict:
    return Trainer(cfg, log).run()


__all__ = ["TrainConfig", "Trainer", "train", "batch_indices", "lr_lambda_factory", "select_trainable"]
