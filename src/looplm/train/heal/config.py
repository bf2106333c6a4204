"""`looplm heal`'s settings, and the checks that need nothing but them (made before anything is read)."""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import UsageError
from ...models.exit_adapter import parse_exit_adapter
from ...settings import refine, setting
from ..budget import check_budget
from ..losses import HIDDEN_LOSSES
from ..settings import RunSettings

LOCAL_MODES = ("parallel", "sequential")
E2E_ROWS = ("cache", "online")
EXIT_TARGETS = ("teacher", "final")
BASE_WEIGHTS = ("fp32", "int4", "int8")


DEFAULT_HEAL_MINUTES = 60.0  # the budget the healing recipe is measured at
# From these budgets on, compiling (about a minute) pays back in faster steps (experiments/INDEX.md).
COMPILE_MINUTES = 10.0
COMPILE_TOKENS = 100_000


@dataclass
class HealConfig(RunSettings):
    """`looplm heal`'s settings; a None is chosen by the recipe when the command line leaves it out
    (recipes/heal.py ``fill_recipe_defaults``)."""

    model: str = setting("", "the converted model (looplm directory from `looplm convert`)", positional=True)
    teacher: str | None = setting(
        None, "the original model it was converted from (default: the one its conversion recorded)"
    )
    data: str | None = setting(
        None,
        "corpus dir from `looplm data build` (training split is read; default: out/corpus-<teacher>-mix-<seq-len>, "
        "the teacher's own text beside as many tokens of the default sources, made once per teacher if missing)",
    )
    out: str | None = refine(
        RunSettings, "out", help="run directory, final/ holds the healed model (default: out/<model>-healed)"
    )
    budget_minutes: float | None = refine(
        RunSettings,
        "budget_minutes",
        help=f"wall time of the whole run, evaluations not counted (default: {DEFAULT_HEAL_MINUTES:g} unless "
        "--train-tokens)",
    )
    train_tokens: int | None = refine(
        RunSettings,
        "train_tokens",
        help="instead: training tokens per shared layer (local) plus end to end",
        renamed_from=("--tokens",),
    )
    base_weights: str = setting(
        "fp32",
        "int8, int4: round the shared weights to this format first (GPTQ) and keep them frozen, so that the LoRA, "
        "norms and biases learn around the rounding the served model will have (`looplm quantize --weights FMT` "
        "then rounds nothing new)",
        choices=BASE_WEIGHTS,
    )
    compile: bool | None = setting(
        None,
        "torch.compile each layer for the training stages (a C++ compiler on CPU, triton on CUDA): faster steps "
        "after about a minute of compiling (default: on for budgets of "
        f"{COMPILE_MINUTES:g} minutes or {COMPILE_TOKENS:,} tokens or more, where a compiler is found)",
    )
    seq_len: int = setting(512, "tokens per training row", advanced=True)
    local_share: float = setting(0.5, "share of the budget for layer-local distillation", advanced=True)
    local_mode: str = setting(
        "parallel",
        "inputs of the local stage: the original's (parallel) or the student's own (sequential, GPTQ's order)",
        choices=LOCAL_MODES,
        advanced=True,
    )
    cache: str | None = setting(
        None, "teacher cache directory (default: OUT/cache; reused if it matches)", advanced=True
    )
    cache_rows: int = setting(256, "training rows of the corpus cached (x --seq-len tokens)", advanced=True)
    local_batch: int = setting(4, "rows per tied depth per local step", advanced=True)
    local_lr: float = setting(2e-3, "learning rate of the local stage", advanced=True)
    e2e_batch: int = setting(2, "rows per end-to-end step", advanced=True)
    e2e_lr: float = setting(1e-4, "learning rate of the end-to-end stage", advanced=True)
    e2e_rows: str = setting(
        "online",
        "rows of the end-to-end and exit stages: online (the whole training split, the original run on each "
        "batch: new text every step) | cache (the cached rows again, the original read from the cache: a shorter "
        "step, but the rows are memorised)",
        choices=("online", "cache"),
        advanced=True,
    )
    e2e_average: float = setting(
        0.0,
        "decay of an exponential moving average of the weights the end-to-end stage trains, evaluated beside "
        "them; the stage ends on it (0: off; 0.99 averages about the last hundred steps)",
        advanced=True,
    )
    hidden_weight: float = setting(1.0, "weight of the per-depth hidden-state term", advanced=True)
    hidden_loss: str = setting(
        "log1p",
        "per-token hidden-state error: log1p (log(1 + x) of the relative one: a token far off pulls with a "
        "bounded gradient) | relative (squared, relative to the original's state)",
        choices=("log1p", "relative"),
        advanced=True,
    )
    # how the hidden-state errors weigh the residual stream's channels: as the original's norms scale each where its
    # layers read the stream, so that a few massive channels do not fill the error. Not a flag: it measured better
    # than every channel alike on both families (experiments/heal_channels_read.sh); kept here so that a run healed
    # with "uniform" is refused on resume
    hidden_channels: str = "read"
    exit_weight: float = setting(
        0.0,
        "weight of each intermediate loop exit's KD term on the body (0: exits get their own adapter stage)",
        advanced=True,
    )
    exit_target: str = setting(
        "teacher",
        "what the --exit-weight term matches: teacher (the original's output) | final (the student's own "
        "full-depth output, detached: the agreement early exits are judged by)",
        choices=EXIT_TARGETS,
        advanced=True,
    )
    exit_adapter: str = setting(
        "affine",
        "exit stage: an adapter per intermediate loop exit trained on the frozen body: affine (tuned lens), a "
        "LoRA of rank R on the LM head, or none",
        metavar="{affine,head-lora:R,none}",
        advanced=True,
    )
    exit_share: float = setting(0.1, "share of what the local stage leaves for the exit stage", advanced=True)
    exit_lr: float = setting(1e-3, "learning rate of the exit stage", advanced=True)
    ood_windows: int = setting(
        4,
        "windows of each out-of-domain domain (text no corpus holds: `looplm eval suite`) scored at "
        "each evaluation (0: none)",
        advanced=True,
    )
    eval_every_seconds: float = setting(300.0, "seconds of training between evaluations", advanced=True)
    save_every_seconds: float = setting(180.0, "seconds of training between checkpoints", advanced=True)
    seed: int = refine(RunSettings, "seed", help="seed of the cached rows, the data order and new parameters")
    grad_clip: float = 1.0  # not a flag

    FIXED = (
        "teacher",
        "data",
        "budget_minutes",
        "train_tokens",
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
        "hidden_channels",
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
    FORMER_DEFAULTS = {"hidden_loss": "relative", "e2e_rows": "cache", "hidden_channels": "uniform"}


def _choice(flag: str, value: str, choices) -> None:
    if value not in choices:
        raise UsageError(f"unknown {flag} {value!r}; use one of {', '.join(choices)}")


def check_config(c: HealConfig) -> dict | None:
    """Refuse settings that cannot run, in one line that names the flag; returns the exit adapter asked for
    (None: no exit stage)."""
    if not c.out:
        raise UsageError("give the run directory with --out DIR")
    check_budget({"--budget-minutes N": c.budget_minutes, "--train-tokens N": c.train_tokens})
    _choice("--e2e-rows", c.e2e_rows, E2E_ROWS)
    _choice("--hidden-loss", c.hidden_loss, HIDDEN_LOSSES)
    _choice("--exit-target", c.exit_target, EXIT_TARGETS)
    _choice("--local-mode", c.local_mode, LOCAL_MODES)
    for name in ("local_share", "exit_share"):
        if not 0 <= getattr(c, name) <= 1:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(c, name)} must be a fraction in [0, 1]")
    if not 0 <= c.e2e_average < 1:
        raise UsageError(f"--e2e-average {c.e2e_average} must be a decay in [0, 1) (0: no weight average)")
    exit_spec = None if c.exit_adapter == "none" else parse_exit_adapter(c.exit_adapter)
    _choice("--base-weights", c.base_weights, BASE_WEIGHTS)
    if c.ood_windows < 0:
        raise UsageError(f"--ood-windows {c.ood_windows} must be >= 0 (0: no out-of-domain evaluation)")
    if c.cache_rows < max(c.local_batch, c.e2e_batch) or c.seq_len < 2:
        raise UsageError("--cache-rows must be at least the batch size and --seq-len at least 2")
    return exit_spec
