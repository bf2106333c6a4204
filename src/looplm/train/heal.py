"""Healing: bring a converted (looped) model close to the original on a small budget.

Two stages, both reading the original model's hidden states from a teacher cache (teacher_cache.py):

1. **Layer-local distillation** (block reconstruction, as BRECQ and OmniQuant do for quantisation).
   Each shared layer k is trained, alone, to map the input of every depth d tied to it onto the
   original model's output at d: loss = mean over tied depths and tokens of
   ||block_k(x_d, slot_d) - y_d||^2 / ||y_d||^2 (per-token relative error: the next layer's norm
   removes each token's scale, so this is the error the rest of the network sees). Trained: the
   shared weights, the per-depth LoRAs and the norms. Inputs x_d are
   - ``parallel``: the original model's inputs at d (layers are independent), or
   - ``sequential``: the student's own inputs at d, produced by its already-healed earlier depths
     (GPTQ's order), so that each depth also learns to correct the error that reaches it. A shared
     layer is visited once per depth it serves; a depth it serves later still uses the teacher's
     input until it is reached, one it served earlier the student input computed then.
2. **End to end**: logit distillation (forward KL) from the original model's final state, plus
   ``hidden_weight`` x the mean per-depth relative hidden-state error (``hidden_loss``: squared, or its log1p
   per token, which bounds a far-off token's pull; every depth but those that end an
   intermediate loop, which are exits and may differ from the original's mid-network state), plus ``exit_weight`` x
   forward KL of every intermediate loop exit against the original model (``exit_target`` teacher) or against
   the student's own final output, detached (``final``: the agreement early exiting is judged by), so that the
   exit after loop 1 is trained for itself (early exiting reads it).

3. **Exit adapters** (models/exit_adapter.py), for models with more than one loop: the body, head and
   final norm frozen, an adapter per intermediate loop exit (by default ``affine``, a tuned lens) is
   trained so that the exit after loop i predicts the model's own final output (forward KL from the
   final loop's logits: self-distillation, as the paper's early-exit training does). The body stays
   the original's copy, which loop 2 needs as its input, and the exit still becomes usable.

**Healing for quantized serving** (``base_weights`` int4 or int8): before the first stage the shared weights are
rounded to the serving format by GPTQ (models/gptq.py) and frozen there; the stages then train the per-depth LoRA,
the norms and the biases around the rounding. `looplm quantize --weights FMT` (LoRA shared) of the result rounds
nothing new, so what the run measures is what is served. Run it on a healed model (``--local-share 0``) to
recover what rounding costs it.

The local stage reads the teacher from the cache, never runs it: a step costs the student alone. The
end-to-end and exit stages read rows by ``e2e_rows``: ``online`` (the default) takes the next rows of a seeded
pass over the whole training split and runs the original model on them, without gradients, so that every step
reads new text; ``cache`` draws them from the cached rows again (a step a fifth shorter, but a small cache read
many times over is memorised rather than generalised from). The embeddings, final norm and LM head stay the
original model's (frozen), so the original's logits are its final state through the student's own head.

Every evaluation scores the corpus's first held-out rows and, as text the run never heals on, the first windows
of each out-of-domain domain (data/ood.py), whose geometric mean against the original's is logged as
``ood_ratio``.

Budget: ``budget_minutes`` (wall time of cache, local and end-to-end work; evaluations not
counted) or ``tokens``; ``local_share`` of it goes to the local stage, ``exit_share`` of the rest to the exit
stage and what is left to the end-to-end stage. A time budget is turned into
step counts after measuring a few steps, and stored in run.json: a resumed run follows the same plan.
The end-to-end count is fixed again after its first steps are timed (the load of a shared machine
changes in between), so that the run fills its budget. Run directory::

    run.json          settings and the step plan (checked on --resume)
    metrics.jsonl     one JSON object per logged step and evaluation (time, tokens, losses, perplexity)
    latest            name of the newest complete checkpoint (replaced atomically)
    checkpoints/NAME  looplm model dir + state.json (+ optimizer.pt in the end-to-end stage)
    final/            the healed model (looplm dir: `looplm eval`, `serve` and `generate` read it)
    heal.png          held-out and out-of-domain perplexity against wall time and against tokens
    cache/            the teacher cache (unless --cache puts it elsewhere)
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..convert.recursive import tied_depths
from ..data.corpus import PackedCorpus
from ..data.ood import DOMAINS, domain_windows, geometric_mean, geometric_ratio
from ..errors import UsageError
from ..models.decoder import attention_masks
from ..models.exit_adapter import add_exit_adapters, freeze_all_but_exit_adapter, parse_exit_adapter
from ..models.gptq import gptq_portable, input_moments, output_error
from ..models.quantized import dequantize, linears
from ..util import check_compile_available, keep_freed_host_memory, write_json_atomic, write_text_atomic
from .loop import resolve_precision
from .losses import head_kd_loss, kd_loss
from .optim import WeightAverage, adamw
from .teacher_cache import build_cache, teacher_states

LOCAL_MODES = ("parallel", "sequential")
E2E_ROWS = ("cache", "online")
EXIT_TARGETS = ("teacher", "final")
# Steps of the end-to-end and exit stages after which a time budget's step count is fixed again from the
# steps since the last fix: steps get faster after the first few (and the plan timed them before they were
# compiled or warm), so a count fixed from the first three alone leaves part of the budget unused.
REPLAN_AT = (3, 30)
# ... and at these shares of the count: the machine's speed also changes late, and a run fixed only once overruns
# its budget. The shares are of the count fixed last, each used once.
REPLAN_SHARES = (0.5, 0.75, 0.9)


BASE_WEIGHTS = ("float", "int4", "int8")
BASE_CALIBRATION_ROWS = 16  # cached rows whose inputs calibrate the rounding of --base-weights


def replan_due(step: int, total: int, done: list[int]) -> bool:
    """Whether the end-to-end step count is fixed again before ``step`` (``done``: steps already replanned)."""
    if step in done:
        return False
    if step in REPLAN_AT:
        return True
    # each share once, in order; a share the count has already passed (it shrank at the last fix) is skipped
    pending = REPLAN_SHARES[sum(1 for d in done if d > REPLAN_AT[-1]) :]
    late = [share * total for share in pending if share * total > max(done, default=0)]
    return step > REPLAN_AT[-1] and bool(late) and step >= late[0]


@dataclass
class HealConfig:
    model: str = ""  # the converted student (looplm directory)
    teacher: str = ""  # the original model it was converted from
    data: str = ""  # corpus directory (looplm data build)
    out: str = ""
    budget_minutes: float | None = None
    tokens: int | None = None  # instead of a time budget: tokens per layer (local) + end to end
    local_share: float = 0.5  # share of the budget for layer-local distillation
    local_mode: str = "parallel"
    cache: str | None = None  # teacher cache directory (default OUT/cache)
    cache_rows: int = 256  # training rows cached (x seq_len tokens)
    seq_len: int = 512
    local_batch: int = 4  # rows per tied depth per local step
    local_lr: float = 2e-3
    e2e_batch: int = 2
    e2e_lr: float = 1e-4
    e2e_rows: str = "online"  # cache (rows and states from the teacher cache) | online (any training row,
    # the original run on it each step)
    hidden_weight: float = 1.0
    hidden_loss: str = "log1p"  # log1p (each token's pull bounded: relative_error_log1p) | relative
    e2e_average: float = 0.0  # decay of a moving average of the weights the end-to-end stage trains, which
    # the stage ends on (0: off; 0.99 averages about the last hundred steps)
    exit_weight: float = 0.0  # intermediate-exit KD on the body (0: the body copies the original)
    exit_target: str = "teacher"  # what that KD matches: teacher (the original's output) | final (the student's)
    exit_adapter: str = "affine"  # exit stage: affine | head-lora:R | none
    exit_share: float = 0.1  # share of what the local stage leaves, for the exit stage
    exit_lr: float = 1e-3
    precision: str = "auto"  # auto (bf16 autocast where the hardware has bf16 matmuls) | bf16 | fp32
    base_weights: str = "float"  # float | int4 | int8: shared weights rounded to that format (GPTQ), then frozen
    compile: bool = False  # torch.compile each layer of the student (and the original) for the training stages
    grad_clip: float = 1.0
    eval_rows: int = 16
    ood_windows: int = 4  # windows of each out-of-domain domain (data/ood.py) every evaluation scores
    eval_every_seconds: float = 300.0
    save_every_seconds: float = 180.0
    seed: int = 0
    resume: bool = False
    progress: bool = True

    FIXED = (
        "teacher",
        "data",
        "budget_minutes",
        "tokens",
        "local_share",
        "local_mode",
        "cache_rows",
        "seq_len",
        "local_batch",
        "local_lr",
        "e2e_batch",
        "e2e_lr",
        "e2e_rows",
        "e2e_average",
        "hidden_weight",
        "hidden_loss",
        "exit_weight",
        "exit_target",
        "grad_clip",
        "seed",
        "precision",
        "exit_adapter",
        "exit_share",
        "exit_lr",
        "base_weights",
    )
    # settings whose default changed: a run that did not record one ran with this value
    FORMER_DEFAULTS = {"hidden_loss": "relative", "e2e_rows": "cache"}


def cached_rows(train_rows: int, cache_rows: int, seed: int) -> np.ndarray:
    """The training rows a run caches, and so the only rows its local stage (and with ``--e2e-rows cache`` its
    end-to-end stage) reads: a seeded draw without replacement, sorted, so that they can be told from rows the
    run never read."""
    return np.sort(np.random.default_rng(seed).choice(train_rows, size=cache_rows, replace=False))


def heldout_set(corpus: PackedCorpus) -> set[bytes]:
    return {bytes(np.asarray(r)) for r in corpus.splits["heldout"]}


def streamed_rows(corpus: PackedCorpus, seed: int) -> np.ndarray:
    """The order in which ``--e2e-rows online`` reads the training rows: a seeded permutation of all of them
    but those identical to a held-out row (a passage the text repeats; reading it would leak into the held-out
    score). The end-to-end stage reads it from the start, ``e2e_batch`` rows a step; the exit stage from half way."""
    train, held = np.asarray(corpus.splits["train"]), heldout_set(corpus)  # one read of the split, not a row at a time
    rows = np.array([r for r in range(len(train)) if bytes(train[r]) not in held], dtype=np.int64)
    return np.random.default_rng(seed + 2).permutation(rows)


def token_errors(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """||pred - target||^2 / ||target||^2 per token (float32)."""
    err = (pred.float() - target).pow(2).sum(-1)
    return err / target.pow(2).sum(-1).clamp_min(1e-6)


def relative_error(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of ||pred - target||^2 / ||target||^2."""
    return token_errors(pred, target).mean()


def relative_error_log1p(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of log(1 + relative error): the same as ``relative_error`` where a token is close
    (error << 1), but a token far off pulls with a bounded gradient (at most 1/||target|| in its state). In the
    end-to-end stage the student sometimes puts a massive activation on one token, a relative error in the
    thousands at a few depths; squared, that one token sets the direction of the whole clipped step."""
    return torch.log1p(token_errors(pred, target)).mean()


HIDDEN_LOSSES = {"relative": relative_error, "log1p": relative_error_log1p}


def logged_by(record: dict, seconds: float) -> bool:
    """Whether a metrics record was written by run time ``seconds`` (a checkpoint's): records hold their time
    rounded to 10 ms, so it is compared rounded too, or the records written at the checkpoint would be dropped."""
    return record.get("time", 0.0) <= round(seconds, 2) + 1e-6


def eager():
    """Layers compiled by ``--compile`` run eagerly within this context (or a function it decorates): the
    evaluations and the exit stage, whose graphs (no autograd, float32) would each cost a compile."""
    return torch.compiler.set_stance("force_eager")


def _cosine(step: int, total: int, warmup: int, floor: float = 0.1) -> float:
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


class Healer:
    def __init__(self, cfg: HealConfig, log=print):
        self.cfg, self.log = cfg, log

    # ----- everything that can be wrong is found before the run directory is touched
    def prepare(self) -> None:
        from ..models import load_model
        from ..models.loading import tokenizer_fingerprint

        c = self.cfg
        if not c.out:
            raise UsageError("give the run directory with --out DIR")
        if (c.budget_minutes is None) == (c.tokens is None):
            raise UsageError("give one budget: --budget-minutes N or --train-tokens N")
        if (c.budget_minutes is not None and c.budget_minutes <= 0) or (c.tokens is not None and c.tokens <= 0):
            raise UsageError("the budget must be positive: --budget-minutes N or --train-tokens N with N > 0")
        if c.e2e_rows not in E2E_ROWS:
            raise UsageError(f"unknown --e2e-rows {c.e2e_rows!r}; use one of {', '.join(E2E_ROWS)}")
        if c.hidden_loss not in HIDDEN_LOSSES:
            raise UsageError(f"unknown --hidden-loss {c.hidden_loss!r}; use one of {', '.join(HIDDEN_LOSSES)}")
        if c.exit_target not in EXIT_TARGETS:
            raise UsageError(f"unknown --exit-target {c.exit_target!r}; use one of {', '.join(EXIT_TARGETS)}")
        if c.local_mode not in LOCAL_MODES:
            raise UsageError(f"unknown --local-mode {c.local_mode!r}; use one of {', '.join(LOCAL_MODES)}")
        for name in ("local_share", "exit_share"):
            if not 0 <= getattr(c, name) <= 1:
                raise UsageError(f"--{name.replace('_', '-')} {getattr(c, name)} must be a fraction in [0, 1]")
        if not 0 <= c.e2e_average < 1:
            raise UsageError(f"--e2e-average {c.e2e_average} must be a decay in [0, 1) (0: no weight average)")
        self.exit_spec = None if c.exit_adapter == "none" else parse_exit_adapter(c.exit_adapter)
        if c.base_weights not in BASE_WEIGHTS:
            raise UsageError(f"unknown --base-weights {c.base_weights!r}; use one of {', '.join(BASE_WEIGHTS)}")
        if c.ood_windows < 0:
            raise UsageError(f"--ood-windows {c.ood_windows} must be >= 0 (0: no out-of-domain evaluation)")
        if c.cache_rows < max(c.local_batch, c.e2e_batch) or c.seq_len < 2:
            raise UsageError("--cache-rows must be at least the batch size and --seq-len at least 2")
        out = Path(c.out)
        self.prev = None
        if (out / "run.json").exists():
            self.prev = json.loads((out / "run.json").read_text())
            if not c.resume:
                raise UsageError(
                    f"{out} already holds a healing run; add --resume to continue it or choose a new --out"
                )
            # a setting added after the run started has its default there
            was = {
                k: self.prev["config"].get(
                    k, HealConfig.FORMER_DEFAULTS.get(k, HealConfig.__dataclass_fields__[k].default)
                )
                for k in HealConfig.FIXED
            }
            changed = [k for k in HealConfig.FIXED if was[k] != getattr(c, k)]
            if changed:
                raise UsageError(
                    "--resume with different settings ("
                    + ", ".join(f"{k}: {was.get(k)!r} -> {getattr(c, k)!r}" for k in changed)
                    + "); use the run's settings"
                )
            c.model = c.model or self.prev["config"]["model"]
        elif c.resume and out.exists() and any(out.iterdir()):
            raise UsageError(f"{out} is not a healing run (no run.json); drop --resume and choose an empty --out")

        self.corpus = PackedCorpus(c.data)
        if c.seq_len > self.corpus.seq_len:
            raise UsageError(f"--seq-len {c.seq_len} is longer than the corpus's {self.corpus.seq_len}-token rows")
        train = self.corpus.splits["train"]
        if c.cache_rows > len(train):
            raise UsageError(f"--cache-rows {c.cache_rows} is more than the corpus's {len(train)} training rows")
        self.rows = cached_rows(len(train), c.cache_rows, c.seed)
        self.stream = streamed_rows(self.corpus, c.seed) if c.e2e_rows == "online" else None
        self._check_not_heldout()

        student, tok = load_model(c.model)
        teacher, ttok = load_model(c.teacher)
        if tok is None or ttok is None:
            raise UsageError("the student and the teacher need their tokenizer files (looplm convert saves them)")
        fp = tokenizer_fingerprint(tok)
        if tokenizer_fingerprint(ttok) != fp or teacher.config.vocab_size != student.config.vocab_size:
            raise UsageError(
                f"teacher {c.teacher} and student {c.model} use different tokenizers or vocabularies; "
                f"heal with the model the student was converted from as --teacher"
            )
        if fp != self.corpus.tokenizer:
            raise UsageError(
                f"the corpus {c.data} was tokenised with another tokenizer than {c.model}'s; rebuild "
                f"it with `looplm data build {c.teacher}`"
            )
        if teacher.config.num_loops != 1:
            raise UsageError(f"--teacher {c.teacher} is itself looped; give the original (vanilla) model")
        if (
            teacher.config.num_hidden_layers != student.config.num_hidden_layers
            or teacher.config.hidden_size != student.config.hidden_size
        ):
            raise UsageError(
                f"student {c.model} ({student.config.num_hidden_layers} depths) was not converted "
                f"from teacher {c.teacher} ({teacher.config.num_hidden_layers} layers)"
            )
        self.student, self.teacher, self.tok = student, teacher.eval().requires_grad_(False), tok
        # text the run never heals on: each evaluation reports it too, so a run shows when it starts to overfit
        try:
            self.ood = (
                domain_windows(
                    tok, list(DOMAINS), c.ood_windows, c.seq_len, bool(getattr(student.config, "add_bos_token", False))
                )
                if c.ood_windows
                else {}
            )
        except UsageError as e:
            raise UsageError(f"{e} (or heal without the out-of-domain evaluation: --ood-windows 0)") from None
        if student.config.num_loops < 2 or not c.exit_share:
            self.exit_spec = None  # no intermediate exit to train (or no budget for it)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.bf16 = resolve_precision(c.precision, self.device) == "bf16"
        if c.compile:
            check_compile_available(self.device)

    def open_cache(self, cache_dir: Path) -> None:
        """The original model's states at every layer boundary for the cached rows: built in ``cache_dir``, or
        read (and a build cut short resumed) from there."""
        c = self.cfg
        self.cache = build_cache(
            self.teacher,
            self.corpus,
            cache_dir,
            self.rows,
            c.seq_len,
            progress=c.progress,
            log=self.log,
            autocast=self.autocast,
        )

    def autocast(self):
        """bf16 autocast for the training forward passes (weights, optimizer state and evaluations stay fp32)."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16)

    def _check_not_heldout(self) -> None:
        """The training slice must not contain held-out text: no cached row may equal a held-out row
        (``streamed_rows`` leaves such rows out of what ``--e2e-rows online`` reads)."""
        held_rows = heldout_set(self.corpus)
        train = self.corpus.splits["train"]
        if any(bytes(np.asarray(train[r])) in held_rows for r in self.rows):
            raise UsageError(
                f"the training slice of {self.cfg.data} contains held-out rows; rebuild the corpus "
                f"(`looplm data build`) so that its splits are disjoint"
            )

    # ----- the run
    def run(self) -> dict:
        self.prepare()
        c, out = self.cfg, Path(self.cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "checkpoints").mkdir(exist_ok=True)
        for stale in (out / "checkpoints").glob(".*tmp*"):
            shutil.rmtree(stale, ignore_errors=True)
        torch.manual_seed(c.seed)
        dev = self.device
        if dev.type == "cpu":
            keep_freed_host_memory()  # far fewer page faults an end-to-end step
        self.student.to(dev)
        self.teacher.to(dev)
        self.state = {"stage": "cache", "visit": 0, "step": 0, "time": 0.0, "tokens": 0, "local_tokens": 0}
        latest = (out / "latest").read_text().strip() if (out / "latest").exists() else None
        if latest:
            self._load(out / "checkpoints" / latest)
            self.log(f"resumed {out} at stage {self.state['stage']} ({self.state['time'] / 60:.1f} min done)")
        elif self.prev is not None and "plan_clock" in self.prev:
            # killed before the first checkpoint: the cache and the plan it kept were paid from the budget
            self.state["time"] = self.prev["plan_clock"]
            self.log(f"resumed {out} after its plan ({self.state['time'] / 60:.1f} min done)")
        self._truncate_metrics(out / "metrics.jsonl")

        cache_dir = Path(c.cache) if c.cache else out / "cache"
        if self.prev is None:  # written first, so that a run killed while caching resumes with --resume
            self.prev = {
                "config": {f.name: getattr(c, f.name) for f in fields(c)},
                "cache": str(cache_dir),
                "rows": len(self.rows),
            }
            write_json_atomic(out / "run.json", self.prev)
        started = time.perf_counter() - self.state["time"]
        self.eval_seconds = 0.0
        self.clock = lambda: time.perf_counter() - started - self.eval_seconds
        self.open_cache(cache_dir)
        if self.state["stage"] == "cache":
            self.state["time"] = self.clock()
        if "plan" not in self.prev:
            self.prev.update(plan=self._plan(), teacher_eval=self.evaluate(self.teacher))
            self.prev["plan_clock"] = round(self.clock(), 2)  # what a run killed before its first checkpoint resumes at
            write_json_atomic(out / "run.json", self.prev)
        if c.base_weights != "float" and not latest:
            self._round_base()  # a resumed run's checkpoint holds the rounded weights already
        if not self._evals("converted"):
            self._log_eval(tag="converted")
        self.plan = self.prev["plan"]
        if self.state["stage"] == "cache":
            self.state["stage"] = "local"
        if self.state["stage"] == "local":
            self.local_stage()
            self.state.update(stage="e2e", step=0)
            self._save(None)
            self._keep_local_end()
            if self.plan["local_steps_per_layer"]:
                self._log_eval(tag="local")
        if self.state["stage"] == "e2e":
            if self.state["step"] == 0 and not (out / "local-end").exists():
                self._keep_local_end()  # killed between the save above and the copy, or started at a local end
            self.e2e_stage()
            self.state.update(stage="exit", step=0)
            self._save(None)
            if self.plan["e2e_steps"] and self.plan.get("exit_steps") and not c.e2e_average:
                self._log_eval(tag="e2e")  # the body's final state, before the exit adapters (logged by the stage
                # itself when it ends on a weight average)
        if self.state["stage"] == "exit":
            self.exit_stage()
            self.state["stage"] = "done"
            self._save(None)
        after_local = self._evals("local")
        trained_after_local = self.plan["e2e_steps"] or self.plan.get("exit_steps")
        final = after_local[-1] if after_local and not trained_after_local else self._log_eval(tag="final")
        from ..models import save_model

        save_model(self.student.cpu(), self.tok, out / "final")
        self.plot()
        summary = {
            "out": str(out),
            "final": str(out / "final"),
            "minutes": round(self.state["time"] / 60, 2),
            "tokens": self.state["tokens"],
            "local_tokens": self.state["local_tokens"],
            "teacher": self.prev["teacher_eval"],
            "healed": final,
            "exit_adapter": self.exit_spec,
            "converted": (self._evals("converted") or [None])[0],
        }
        write_json_atomic(out / "heal.json", summary)
        return summary

    # ----- planning: a time budget becomes step counts once
    def _plan(self) -> dict:
        c = self.cfg
        K, B = self.student.config.num_shared_layers, self.student.config.num_loops
        per_local = c.local_batch * c.seq_len
        per_e2e = c.e2e_batch * c.seq_len
        # the exit stage takes exit_share of what the local stage leaves; the end-to-end stage the rest
        exit_share = (1 - c.local_share) * c.exit_share if self.exit_spec else 0.0
        t_exit = 0.0
        if c.tokens is not None:
            local_steps = round(c.local_share * c.tokens / per_local)
            e2e_steps = round((1 - c.local_share - exit_share) * c.tokens / per_e2e)
            exit_steps = round(exit_share * c.tokens / per_e2e)
        else:
            left = c.budget_minutes * 60 - self.clock()
            if left <= 0:
                raise UsageError(
                    f"building the teacher cache used the whole --budget-minutes {c.budget_minutes}; "
                    f"raise the budget or lower --cache-rows"
                )
            t_local, t_e2e, t_exit = self.time_steps()
            # a sequential run also propagates the student's states once per depth: about one
            # forward pass of the model over the cache, ~1/3 of a local step per row and layer
            propagate = self.plan_propagation_seconds(t_local) if c.local_mode == "sequential" else 0.0
            local_steps = int(max(0.0, c.local_share * left - propagate) / t_local / K) if c.local_share else 0
            e2e_steps = int((1 - c.local_share - exit_share) * left / t_e2e)
            exit_steps = int(exit_share * left / t_exit) if exit_share else 0
        visits = self.student.config.num_hidden_layers if c.local_mode == "sequential" else K
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
            "exit_adapter": self.exit_spec,
            "loops": B,
            "shared_layers": K,
        }
        if c.tokens is None and per_visit:  # the run clock at which the local stage's share of the budget ends
            plan["local_end_seconds"] = round(c.budget_minutes * 60 - (1 - c.local_share) * left, 1)
        self.log(
            f"plan: {visits} local visits x {per_visit} steps ({local_steps * per_local:,} tokens per shared layer), "
            f"{e2e_steps} end-to-end steps ({e2e_steps * per_e2e:,} tokens), {exit_steps} exit-adapter steps"
        )
        if local_steps == 0 and e2e_steps == 0 and exit_steps == 0:
            self.log(
                "warning: the budget leaves no training step after the teacher cache; the model is saved as "
                "converted. Give a larger --budget-minutes (or --train-tokens) to heal it"
            )
        return plan

    def plan_propagation_seconds(self, t_local: float) -> float:
        rows_per_step = self.cfg.local_batch * self.student.config.num_loops
        return t_local / 3 * self.cfg.cache_rows / rows_per_step * self.student.config.num_hidden_layers

    def time_steps(self) -> tuple[float, float, float]:
        """Seconds of one local step (one shared layer), one end-to-end step and one exit-adapter step (0 without
        an exit stage), measured on copies of the student. Needs the teacher cache (``open_cache``)."""
        import copy

        probe = copy.deepcopy(self.student)
        if self.cfg.compile:  # the stages run compiled: so are the steps that plan them (the copy's first one compiles)
            self._compile_layers(probe, self.teacher)
        layer = 0
        opt = adamw(probe.model.layers[layer].parameters(), lr=0.0)
        idx = np.arange(self.cfg.local_batch)
        times = []
        for _ in range(3):  # the first step warms up; the faster of the next two counts
            t0 = time.perf_counter()
            self._local_step(probe, layer, idx, opt, inputs={}, lr=0.0)
            times.append(time.perf_counter() - t0)
        t_local = min(times[1:])
        opt = adamw(self._trainable(probe), lr=0.0)
        times = []
        for s in range(2):  # end-to-end steps are long: the second counts
            t0 = time.perf_counter()
            self._e2e_step(probe, s, opt, lr=0.0)
            times.append(time.perf_counter() - t0)
        t_e2e = times[-1]
        t_exit = 0.0
        if self.exit_spec:
            opt = adamw(self._exit_trainable(probe), lr=0.0)
            times = []
            for s in range(2):
                t0 = time.perf_counter()
                with eager():  # as exit_stage runs them
                    self._exit_step(probe, s, opt, lr=0.0)
                times.append(time.perf_counter() - t0)
            t_exit = times[-1]
        self.log(
            f"measured: local step {t_local:.2f} s, end-to-end step {t_e2e:.2f} s"
            + (f", exit-adapter step {t_exit:.2f} s" if self.exit_spec else "")
        )
        return t_local, t_e2e, t_exit

    # ----- stage 1: layer-local distillation
    def _tables(self, model, rows: int):
        cfg = model.config
        pos = torch.arange(self.cfg.seq_len, device=self.device)[None].expand(rows, -1)
        tables = model.model.rotary(pos, torch.float32)
        masks = attention_masks(
            set(cfg.depth_attention), rows, self.cfg.seq_len, 0, None, cfg.sliding_window_size, self.device
        )
        return tables, masks

    def _run_depth(self, model, d: int, h: torch.Tensor) -> torch.Tensor:
        cfg = model.config
        tables, masks = self._tables(model, h.shape[0])
        kind = cfg.depth_attention[d]
        cos, sin = tables[kind]
        return model.model.layers[cfg.layer_map[d]](h, cfg.slot_map[d], cos, sin, masks[kind], None, d)

    def _local_step(self, model, layer: int, idx, opt, inputs: dict, lr: float) -> float:
        """One step of shared layer ``layer`` on cache rows ``idx`` at every depth tied to it.
        ``inputs[d]`` holds the student's inputs of a depth already reached (sequential mode)."""
        depths = tied_depths(model.config)[layer]
        for g in opt.param_groups:
            g["lr"] = lr
        loss = 0.0
        for d in depths:
            x = inputs[d][idx].float() if d in inputs else self.cache.inputs(d, idx)
            y = self.cache.outputs(d, idx).to(self.device)
            with self.autocast():
                pred = self._run_depth(model, d, x.to(self.device))
            loss = loss + relative_error(pred, y) / len(depths)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.model.layers[layer].parameters(), self.cfg.grad_clip)
        opt.step()
        return float(loss.detach())

    @torch.no_grad()
    @eager()
    def _propagate(self, model, d: int, h: torch.Tensor) -> torch.Tensor:
        """The student's states after depth d for every cached row (in chunks), bfloat16 on the host."""
        out = torch.empty_like(h)
        for s in range(0, h.shape[0], 8):
            with self.autocast():
                out[s : s + 8] = (
                    self._run_depth(model, d, h[s : s + 8].float().to(self.device)).to(torch.bfloat16).cpu()
                )
        return out

    def local_stage(self) -> None:
        from tqdm import tqdm

        c, p, model = self.cfg, self.plan, self.student
        cfg = model.config
        K, L = cfg.num_shared_layers, cfg.num_hidden_layers
        per_visit = p["local_steps_per_visit"]
        if per_visit == 0:
            return
        order = list(range(L)) if c.local_mode == "sequential" else list(range(K))
        inputs: dict[int, torch.Tensor] = {}
        if c.local_mode == "sequential" and self.state["visit"] > 0:
            # resume: recompute the student's inputs of the depths already reached
            h = self.cache.boundary(0, np.arange(len(self.rows))).to(torch.bfloat16)
            for d in range(self.state["visit"]):
                inputs[d] = h
                h = self._propagate(model, d, h)
            inputs[self.state["visit"]] = h
        if c.compile:
            self._compile_layers(model)
        model.requires_grad_(False)
        steps = p.setdefault("local_steps_by_visit", [per_visit] * len(order))  # _replan_local changes the rest
        bar = tqdm(
            total=sum(steps),
            initial=sum(steps[: self.state["visit"]]),
            desc="heal: local",
            unit="step",
            disable=not c.progress,
        )
        rng = np.random.default_rng(c.seed + 1)
        try:
            for v in range(self.state["visit"], len(order)):
                started, d = self.clock(), order[v]
                layer = cfg.layer_map[d] if c.local_mode == "sequential" else d
                if c.local_mode == "sequential":
                    if d == 0:
                        inputs[0] = self.cache.boundary(0, np.arange(len(self.rows))).to(torch.bfloat16)
                    elif d not in inputs:
                        inputs[d] = self._propagate(model, d - 1, inputs[d - 1])
                block = model.model.layers[layer]
                opt = adamw(self._unfreeze(block), lr=c.local_lr, weight_decay=0.0)
                first = last = None
                for s in range(steps[v]):
                    idx = rng.choice(len(self.rows), size=c.local_batch, replace=False)
                    lr = c.local_lr * _cosine(s, steps[v], max(1, steps[v] // 20))
                    loss = self._local_step(model, layer, idx, opt, inputs, lr)
                    first = loss if first is None else first
                    last = loss
                    self.state["local_tokens"] += c.local_batch * c.seq_len
                    bar.update(1)
                    bar.set_postfix(depth=d, layer=layer, err=f"{loss:.4f}")
                block.requires_grad_(False)
                self.state["visit"] = v + 1
                self.state["time"] = self.clock()
                if "local_end_seconds" in p and v + 1 < len(order) and steps[v]:
                    self._replan_local(v + 1, (self.state["time"] - started) / steps[v])
                    bar.total = sum(steps)
                self._append(
                    {
                        "stage": "local",
                        "visit": v + 1,
                        "depth": d,
                        "layer": layer,
                        "err_first": first,
                        "err_last": last,
                        "time": round(self.state["time"], 2),
                        "local_tokens": self.state["local_tokens"],
                        "tokens": self.state["tokens"],
                    }
                )
                self._save(None)
                if self._eval_due() and v + 1 < len(order):  # the stage's end is evaluated by run()
                    self._log_eval(tag="local")
        finally:
            bar.close()
        model.requires_grad_(False)

    def _replan_local(self, visit: int, seconds_per_step: float) -> None:
        """The step count of each visit from ``visit`` on that ends the local stage at its share of the time
        budget, from the visit just timed (its compile and, sequential, its propagation included). The machine's
        speed moves within an hour: with the counts fixed from the plan's first steps, local steps slower than
        planned would end the local stage far past its share, leaving the end-to-end stage, which gains more per
        minute, little of the budget. Stored in run.json."""
        steps = self.plan["local_steps_by_visit"]
        left = self.plan["local_end_seconds"] - self.clock()
        per = max(1, int(left / (len(steps) - visit) / seconds_per_step))
        if per != steps[visit]:
            self.log(
                f"local: {seconds_per_step:.2f} s per step, {per} steps a visit end the stage at its share "
                f"(planned {self.plan['local_steps_per_visit']})"
            )
        steps[visit:] = [per] * (len(steps) - visit)
        per_layer = sum(steps) // self.student.config.num_shared_layers  # parallel: the mean over the layers
        self.plan.update(
            local_steps_per_layer=per_layer, local_tokens_per_layer=per_layer * self.cfg.local_batch * self.cfg.seq_len
        )
        self.prev["plan"] = self.plan
        write_json_atomic(Path(self.cfg.out) / "run.json", self.prev)

    # ----- stage 2: end to end
    def _trainable(self, model) -> list[torch.nn.Parameter]:
        model.requires_grad_(False)
        return self._unfreeze(model.model.layers)

    def _unfreeze(self, module) -> list[torch.nn.Parameter]:
        """``module``'s parameters made trainable and returned, except the shared weights when they were rounded
        (``--base-weights``): those stay frozen on their grid, and the LoRA, norms and biases learn around them."""
        module.requires_grad_(True)
        if self.cfg.base_weights != "float":
            for _, lin in linears(module):
                lin.weight.requires_grad_(False)
        return [p for p in module.parameters() if p.requires_grad]

    @torch.no_grad()
    def _round_base(self) -> None:
        """Round every shared weight to ``--base-weights`` by GPTQ (models/gptq.py), calibrated on the first
        cached training rows, as `looplm quantize --calib-data` would round it: serving the healed model with
        those weights then rounds nothing new (a weight on its grid rounds to itself), and the training after
        this learns around the rounding."""
        c, model = self.cfg, self.student
        n = min(BASE_CALIBRATION_ROWS, len(self.rows))
        t0 = time.perf_counter()
        moments = input_moments(model, self.cache.tokens(self.corpus, np.arange(n)).to(self.device))
        errors = []
        for name, lin in linears(model):
            h = sum(moments[name].values())
            t = gptq_portable(lin.weight, h, c.base_weights)
            errors.append(output_error(lin.weight, t, h))
            lin.weight.copy_(dequantize(t).to(lin.weight))
        self.log(
            f"shared weights rounded to {c.base_weights} (GPTQ on {n} cached rows, mean relative output error "
            f"{sum(errors) / len(errors):.4f}) in {time.perf_counter() - t0:.0f} s; they stay frozen"
        )

    def _batch(self, step: int, stage: str):
        """The token rows of a step of the end-to-end or exit stage, and ``boundary(b)``: the original model's
        states at layer boundary b for them. ``--e2e-rows cache``: rows drawn from the cached ones, states read
        from the cache. ``online``: the next rows of the seeded pass over the training split (``streamed_rows``),
        states from running the original model on them when first asked for (the exit stage never asks)."""
        c = self.cfg
        if c.e2e_rows == "cache":
            salt = 0 if stage == "e2e" else 500_009
            g = torch.Generator().manual_seed(c.seed * 1_000_003 + salt + step)
            idx = torch.randperm(len(self.rows), generator=g)[: c.e2e_batch].numpy()
            return self.cache.tokens(self.corpus, idx).to(self.device), lambda b: self.cache.boundary(b, idx).to(
                self.device
            )
        first = step * c.e2e_batch + (0 if stage == "e2e" else len(self.stream) // 2)
        rows = self.stream[np.arange(first, first + c.e2e_batch) % len(self.stream)]
        ids = torch.from_numpy(np.asarray(self.corpus.splits["train"][rows][:, : c.seq_len], dtype=np.int64))
        ids = ids.to(self.device)
        states: list[torch.Tensor] = []

        def boundary(b: int) -> torch.Tensor:
            if not states:
                with self.autocast():
                    states.extend(teacher_states(self.teacher, ids))
            return states[b].float()

        return ids, boundary

    def _e2e_step(self, model, step: int, opt, lr: float) -> dict:
        c = self.cfg
        ids, boundary = self._batch(step, "e2e")
        cfg = model.config
        L, K = cfg.num_hidden_layers, cfg.num_shared_layers
        with torch.no_grad():
            teacher_z = self.teacher.exit_states(boundary(L))
        with self.autocast():
            _, depth_states, _ = model.model(ids, output_depth_states=True)
        parts = {"kd": self._kd(model, depth_states[-1], None, teacher_z, self.teacher)}
        loss = parts["kd"]
        if c.hidden_weight:
            # The state after an intermediate loop is an exit too: with an exit term it is left free to
            # become predictive instead of copying the original's mid-network state.
            matched = [d for d in range(L) if not (c.exit_weight and (d + 1) % K == 0 and d < L - 1)]
            error = HIDDEN_LOSSES[c.hidden_loss]
            hid = sum(error(depth_states[d], boundary(d + 1)) for d in matched) / len(matched)
            parts["hidden"] = hid
            loss = loss + c.hidden_weight * hid
        if c.exit_weight and cfg.num_loops > 1:
            # "final": each exit learns the student's own full-depth output, the one its tokens must agree with
            target_z, target = (
                (teacher_z, self.teacher)
                if c.exit_target == "teacher"
                else (model.exit_states(depth_states[-1]).detach(), model)
            )
            for i in range(1, cfg.num_loops):
                parts[f"kd_exit{i}"] = self._kd(model, depth_states[i * K - 1], i - 1, target_z, target)
                loss = loss + c.exit_weight * parts[f"kd_exit{i}"]
        for grp in opt.param_groups:
            grp["lr"] = lr
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], c.grad_clip)
        opt.step()
        return {"loss": float(loss.detach()), **{k: float(v.detach()) for k, v in parts.items()}}

    def _kd(self, model, h: torch.Tensor, loop: int | None, target_z: torch.Tensor, target_model) -> torch.Tensor:
        """Forward KL of ``model``'s exit after ``loop`` (None: the final output) from state ``h`` against
        ``target_model``'s plain head on its final-normed states ``target_z``. The head is fused into the
        loss (head_kd_loss: no [rows, vocab] logits kept for the backward pass) unless an adapter changes
        the exit's logits themselves."""
        softcap = model.config.final_logit_softcap
        with self.autocast():
            if model.exit_logits_are_head(loop):
                return head_kd_loss(
                    model.exit_states(h, loop),
                    model.lm_head.weight,
                    target_z,
                    target_model.lm_head.weight,
                    softcap=softcap,
                    compiled=self.cfg.compile,
                )
            logits = model.exit_logits(h, loop)
        target = target_z @ target_model.lm_head.weight.t()
        target = target if softcap is None else torch.tanh(target / softcap) * softcap
        return kd_loss(logits, target)

    def e2e_stage(self) -> None:
        total = self.plan["e2e_steps"]
        if total == 0:
            return
        if self.cfg.compile:
            self._compile_layers(self.student, self.teacher)
        self.student.train()
        self._train_steps(
            "e2e",
            "heal: end to end",
            self._trainable(self.student),
            self.cfg.e2e_lr,
            self._e2e_step,
            total,
            tokens_per_step=self.cfg.e2e_batch * self.cfg.seq_len,
            replan=bool(self.cfg.budget_minutes),
            evaluate=True,
            average=self.cfg.e2e_average,
        )
        self.student.eval()

    @staticmethod
    def _compile_layers(*models) -> None:
        """``--compile``: each layer of ``models`` through torch.compile (regional: the layers are one class, so one
        compiled code serves every layer and depth, its parameters graph inputs). Inductor fuses the elementwise
        work around the matmuls (norms, rotary, LoRA sums, residuals, casts) in the forward and backward passes;
        the distillation loss's softmax math is compiled too (``head_kd_loss(compiled=True)``, in ``_kd``).
        The plan compiles a copy's layers first (``time_steps``); the code is shared, so the stages find it
        ready. The local stage's batch (4 rows) and the end-to-end stage's (2) differ: dynamo makes the batch
        dimension dynamic at the second, which runs no slower. Evaluations, the exit stage and sequential
        propagation stay eager (``eager``)."""
        for model in models:
            for layer in model.model.layers:
                if getattr(layer, "_compiled_call_impl", None) is None:
                    layer.compile()

    def _train_steps(
        self,
        stage: str,
        desc: str,
        params,
        base_lr: float,
        step_fn,
        total: int,
        tokens_per_step: int = 0,
        replan: bool = False,
        evaluate: bool = False,
        average: float = 0.0,
    ) -> None:
        """The step loop of the end-to-end and exit stages: AdamW on ``params`` (its state restored on
        resume), a cosine schedule over ``total`` steps, a JSONL record per step, a checkpoint every
        ``save_every_seconds`` and, with ``evaluate``, held-out evaluations on their schedule. With
        ``replan``, the step count is fixed again at the ``replan_due`` steps (``_replan``). With
        ``average`` (a decay), an exponential moving average of ``params`` is kept beside them (``WeightAverage``),
        evaluated beside them (tag ``<stage>-average``), and copied into them when the stage ends."""
        from tqdm import tqdm

        c, model = self.cfg, self.student
        opt = adamw(params, lr=base_lr, weight_decay=0.0)
        avg = WeightAverage(params, average) if average else None
        if self.state["step"] > 0:
            opt.load_state_dict(torch.load(self._latest_dir() / "optimizer.pt", map_location=self.device))
            if avg is not None:
                avg.load_state_dict(torch.load(self._latest_dir() / "average.pt", map_location=self.device))
        first = self.state["step"]
        bar = tqdm(total=total, initial=self.state["step"], desc=desc, unit="step", disable=not c.progress)
        last_save = time.perf_counter()
        mark = (self.state["step"], self.clock())  # the steps since the last fix time the next one
        warming_up = True
        replanned_at = self.plan.setdefault(f"{stage}_replanned_at", [])  # _replan appends to it
        try:
            while self.state["step"] < total:
                s = self.state["step"]
                if replan and replan_due(s, total, replanned_at) and s > mark[0]:
                    total = self._replan(stage, s, (self.clock() - mark[1]) / (s - mark[0]))
                    mark = (s, self.clock())
                    bar.total = total
                lr = base_lr * _cosine(s, total, max(1, total // 20))
                rec = step_fn(model, s, opt, lr)
                if avg is not None:
                    avg.update()
                if warming_up:  # this process's first step (compiling, first allocations) is not timed
                    mark, warming_up = (s + 1, self.clock()), False
                self.state["step"] = s + 1
                self.state["tokens"] += tokens_per_step
                self.state["time"] = self.clock()
                bar.update(1)
                bar.set_postfix(kd=f"{rec.get('kd', rec['loss']):.3f}")
                self._append(
                    {
                        "stage": stage,
                        "step": s + 1,
                        "lr": lr,
                        **rec,
                        "time": round(self.state["time"], 2),
                        "tokens": self.state["tokens"],
                        "local_tokens": self.state["local_tokens"],
                    }
                )
                if time.perf_counter() - last_save > c.save_every_seconds and self.state["step"] < total:
                    self._save(opt, avg)
                    last_save = time.perf_counter()
                if evaluate and self._eval_due() and self.state["step"] < total:
                    model.eval()
                    self._log_eval(tag=stage)
                    if avg is not None:
                        with avg.swapped_in():
                            self._log_eval(tag=f"{stage}-average")
                    model.train()
        finally:
            bar.close()
        if avg is not None and self.state["step"] > first:  # the weights' own end, then the average the stage
            # ends on (a run resumed from the stage's last checkpoint has both logged and the average in place)
            model.eval()
            self._log_eval(tag=stage)
            avg.copy_in()
            self._log_eval(tag=f"{stage}-average")
        self._save(opt, avg)

    def _replan(self, stage: str, step: int, seconds_per_step: float) -> int:
        """The step count of ``stage`` (e2e or exit) that fills what is left of the time budget, from the steps
        just timed: the load of a shared machine changes between planning and this stage, and the plan timed
        steps that were not yet compiled or warm. The end-to-end stage leaves the exit stage the seconds the
        plan gave it. Stored in run.json."""
        left = self.cfg.budget_minutes * 60 - self.clock()
        if stage == "e2e":
            left -= self.plan.get("exit_steps", 0) * self.plan.get("exit_step_seconds", 0.0)
        total = max(step + 1, step + int(left / seconds_per_step))
        name = {"e2e": "end-to-end", "exit": "exit adapters"}[stage]
        self.log(
            f"{name}: {seconds_per_step:.1f} s per step, {total} steps fill the budget "
            f"(planned {self.plan[f'{stage}_steps']})"
        )
        self.plan[f"{stage}_replanned_at"].append(step)
        self.plan[f"{stage}_steps"] = total
        if stage == "e2e":
            self.plan["e2e_tokens"] = total * self.cfg.e2e_batch * self.cfg.seq_len
        self.prev["plan"] = self.plan
        write_json_atomic(Path(self.cfg.out) / "run.json", self.prev)
        return total

    # ----- stage 3: exit adapters on the frozen body
    def _exit_trainable(self, model) -> list[torch.nn.Parameter]:
        add_exit_adapters(model, self.exit_spec["kind"], self.exit_spec.get("rank"))
        return freeze_all_but_exit_adapter(model)

    def _exit_step(self, model, step: int, opt, lr: float) -> dict:
        """Every intermediate exit learns the model's own final output (forward KL), the body frozen."""
        c = self.cfg
        ids, _ = self._batch(step, "exit")
        with torch.no_grad(), self.autocast():
            _, states, _ = model.model(ids, output_loop_states=True)
            target = model.exit_states(states[-1])
        parts = {f"exit{i + 1}": self._kd(model, states[i], i, target, model) for i in range(len(states) - 1)}
        loss = sum(parts.values()) / len(parts)
        for grp in opt.param_groups:
            grp["lr"] = lr
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.exit_adapter.parameters(), c.grad_clip)
        opt.step()
        return {"loss": float(loss.detach()), **{k: float(v.detach()) for k, v in parts.items()}}

    def exit_stage(self) -> None:
        total = self.plan.get("exit_steps", 0)
        if not total:
            return
        with eager():
            self._train_steps(
                "exit",
                "heal: exit adapters",
                self._exit_trainable(self.student),
                self.cfg.exit_lr,
                self._exit_step,
                total,
                replan=bool(self.cfg.budget_minutes),
            )
        self.student.requires_grad_(False)

    # ----- evaluation: held-out perplexity at every loop exit
    @torch.no_grad()
    @eager()
    def evaluate(self, model) -> dict:
        t0 = time.perf_counter()
        held = self.corpus.splits["heldout"]
        n = min(len(held), self.cfg.eval_rows)
        if n == 0:
            raise UsageError(f"the corpus {self.cfg.data} has no held-out rows to evaluate on")
        model.eval()
        nll, agree, count = self._score_rows(model, [np.asarray(held[i, : self.cfg.seq_len]) for i in range(n)])
        ood = {}
        for name, windows in self.ood.items():  # the final exit on text the run never heals on
            domain_nll, _, domain_count = self._score_rows(model, windows, final_only=True)
            ood[name] = math.exp(min(float(domain_nll[-1]) / domain_count, 50.0))
        self.eval_seconds = getattr(self, "eval_seconds", 0.0) + time.perf_counter() - t0
        self._last_eval = time.perf_counter()
        ppl = [math.exp(min(float(x) / count, 50.0)) for x in nll]
        # top-1 agreement of each loop's exit with the final one (teacher-forced): what an oracle exit rule gets
        return {
            "ppl": ppl[-1],
            "ppl_per_loop": ppl,
            "agree_per_loop": [round(float(a) / count, 4) for a in agree],
            "eval_tokens": count,
            **({"ood": ood} if ood else {}),
        }

    def _score_rows(self, model, rows, final_only: bool = False) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Summed next-token NLL of each loop's exit over token rows, the count of tokens each loop's argmax
        shares with the final exit's, and the number of predicted tokens (``final_only``: the last exit alone)."""
        loops = model.config.num_loops
        nll, agree, count = torch.zeros(loops, dtype=torch.float64), torch.zeros(loops, dtype=torch.float64), 0
        for row in rows:
            ids = torch.as_tensor(np.asarray(row, dtype=np.int64))[None].to(self.device)
            _, states, _ = model.model(ids, output_loop_states=True)
            final = None
            for j in reversed(range(len(states) - 1 if final_only else 0, len(states))):
                logits = model.exit_logits(states[j][0, :-1], loop=j).float()
                nll[j] += F.cross_entropy(logits, ids[0, 1:], reduction="sum").double().cpu()
                final = logits.argmax(-1) if final is None else final
                agree[j] += float((logits.argmax(-1) == final).sum())
            count += ids.shape[1] - 1
        return nll, agree, count

    def _eval_due(self) -> bool:
        return time.perf_counter() - getattr(self, "_last_eval", 0.0) > self.cfg.eval_every_seconds

    def _log_eval(self, tag: str) -> dict:
        ev = self.evaluate(self.student)
        teacher = self.prev["teacher_eval"]
        if "ood" in ev and "ood" in teacher:
            ev["ood_ratio"] = round(geometric_ratio(ev["ood"], teacher["ood"]), 4)
        self._append(
            {
                "eval": True,
                "tag": tag,
                **ev,
                "time": round(self.state["time"], 2),
                "tokens": self.state["tokens"],
                "local_tokens": self.state["local_tokens"],
            }
        )
        self.log(
            f"held-out perplexity ({tag}, {self.state['time'] / 60:.1f} min): "
            + ", ".join(f"loop {i + 1} {p:,.2f}" for i, p in enumerate(ev["ppl_per_loop"]))
            + f" (original {teacher['ppl']:.2f})"
            + (f"; out of domain {ev['ood_ratio']:.3f}x the original" if "ood_ratio" in ev else "")
        )
        return ev

    def _evals(self, tag: str) -> list[dict]:
        return [r for r in self._records() if r.get("eval") and r.get("tag") == tag]

    # ----- logs, checkpoints, plot
    def _records(self) -> list[dict]:
        path = Path(self.cfg.out) / "metrics.jsonl"
        recs = []
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    recs.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line cut by a kill
        return recs

    def _append(self, rec: dict) -> None:
        with open(Path(self.cfg.out) / "metrics.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")

    def _truncate_metrics(self, path: Path) -> None:
        """Drop records written after the checkpoint a resumed run starts from."""
        if not path.exists():
            return
        keep = [r for r in self._records() if logged_by(r, self.state["time"])]
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
        os.replace(tmp, path)

    def _latest_dir(self) -> Path:
        out = Path(self.cfg.out)
        return out / "checkpoints" / (out / "latest").read_text().strip()

    def _save(self, opt, average: WeightAverage | None = None) -> None:
        from ..models.checkpoint import save_checkpoint

        out = Path(self.cfg.out)
        name = f"{self.state['stage']}-{self.state['visit']:03d}-{self.state['step']:06d}"
        tmp = out / "checkpoints" / f".{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        save_checkpoint(self.student, tmp)
        self.tok.save_pretrained(str(tmp))
        if opt is not None:
            torch.save(opt.state_dict(), tmp / "optimizer.pt")
        if average is not None:
            torch.save(average.state_dict(), tmp / "average.pt")
        write_json_atomic(tmp / "state.json", self.state)
        final = out / "checkpoints" / name
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        write_text_atomic(out / "latest", name + "\n")
        for old in sorted((out / "checkpoints").iterdir(), key=lambda p: p.stat().st_mtime)[:-2]:
            if old.name != name and not old.name.startswith("."):
                shutil.rmtree(old, ignore_errors=True)

    def _keep_local_end(self) -> None:
        """A copy of the checkpoint at the end of the local stage, kept as OUT/local-end (the rotation deletes
        the checkpoint itself): experiments/heal_same_local.py --from-local-end starts later stages from it."""
        out = Path(self.cfg.out)
        tmp = out / ".local-end.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(self._latest_dir(), tmp)
        shutil.rmtree(out / "local-end", ignore_errors=True)
        tmp.rename(out / "local-end")

    def _load(self, ck: Path) -> None:
        from ..models.checkpoint import load_checkpoint

        if not (ck / "state.json").exists():
            raise UsageError(f"checkpoint {ck} is incomplete; delete {Path(self.cfg.out) / 'latest'} to start over")
        loaded = load_checkpoint(ck)
        if loaded.config.exit_adapter and self.student.exit_adapter is None:  # saved in the exit stage
            add_exit_adapters(self.student, loaded.config.exit_adapter["kind"], loaded.config.exit_adapter.get("rank"))
        self.student.load_state_dict(loaded.state_dict())
        self.state = json.loads((ck / "state.json").read_text())

    def plot(self) -> Path | None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        records = [r for r in self._records() if r.get("eval")]
        evals = [r for r in records if not r["tag"].endswith("-average")]
        averaged = [r for r in records if r["tag"].endswith("-average")]  # --e2e-average's weights
        if not evals:
            return None
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        teacher = self.prev["teacher_eval"]["ppl"]
        loops = len(evals[0]["ppl_per_loop"])
        for ax, key, label in ((axes[0], "time", "wall time (min)"), (axes[1], "tokens", "training tokens")):
            for i in range(loops):
                xs = [r[key] / (60 if key == "time" else 1) for r in evals]
                ax.plot(
                    xs,
                    [r["ppl_per_loop"][i] for r in evals],
                    marker="o",
                    label=f"exit after loop {i + 1}" if i + 1 < loops else "final",
                )
            if averaged:
                ax.plot(
                    [r[key] / (60 if key == "time" else 1) for r in averaged],
                    [r["ppl"] for r in averaged],
                    marker="x",
                    ls=":",
                    label="final, weight average",
                )
            ax.axhline(teacher, color="k", ls="--", label=f"original ({teacher:.1f})")
            off = [r for r in evals if "ood" in r]
            if (
                off and "ood" in self.prev["teacher_eval"]
            ):  # text the run never heals on: a gap that grows is overfitting
                ax.plot(
                    [r[key] / (60 if key == "time" else 1) for r in off],
                    [geometric_mean(r["ood"].values()) for r in off],
                    marker="s",
                    color="tab:red",
                    label="final, out of domain (geometric mean)",
                )
                original_ood = geometric_mean(self.prev["teacher_eval"]["ood"].values())
                ax.axhline(original_ood, color="tab:red", ls=":", label=f"original out of domain ({original_ood:.1f})")
            ax.set_yscale("log")
            ax.set_xlabel(label)
            ax.set_ylabel("perplexity")
            ax.grid(alpha=0.3)
        axes[1].set_xlabel("end-to-end training tokens (local stage before 0)")
        axes[0].legend()
        fig.suptitle(f"healing {Path(self.cfg.model).name} ({self.cfg.local_mode} local, then end to end)")
        fig.tight_layout()
        path = Path(self.cfg.out) / "heal.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path


def heal(cfg: HealConfig, log=print) -> dict:
    return Healer(cfg, log).run()


__all__ = ["HealConfig", "Healer", "heal", "relative_error"]
