"""`looplm heal`'s settings, and the checks that need nothing but them (made before anything is read)."""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import UsageError
from ...models.exit_adapter import parse_exit_adapter
from ..budget import check_budget
from ..losses import HIDDEN_LOSSES

LOCAL_MODES = ("parallel", "sequential")
E2E_ROWS = ("cache", "online")
EXIT_TARGETS = ("teacher", "final")
BASE_WEIGHTS = ("float", "int4", "int8")


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


def _choice(flag: str, value: str, choices) -> None:
    if value not in choices:
        raise UsageError(f"unknown {flag} {value!r}; use one of {', '.join(choices)}")


def check_config(c: HealConfig) -> dict | None:
    """Refuse settings that cannot run, in one line that names the flag; returns the exit adapter asked for
    (None: no exit stage)."""
    if not c.out:
        raise UsageError("give the run directory with --out DIR")
    check_budget({"--budget-minutes N": c.budget_minutes, "--train-tokens N": c.tokens})
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
