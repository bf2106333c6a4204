"""`looplm train`'s checks, made before its run directory is touched: the settings alone, the run directory it
resumes, the model against that run and its checkpoint, the teacher against the student, what the student trains,
the rows it reads and whether a batch fits in memory. Each refuses in one line that names the fix."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from ..errors import UsageError
from ..models.config import architecture
from ..models.exit_adapter import parse_exit_adapter
from ..models.loading import tokenizer_fingerprint
from .budget import check_budget
from .data_order import rows_read
from .losses import EARLY_EXIT, KD_FUNCS
from .run_dir import RunDir, check_resume_settings

TRAIN_GROUPS = ("all", "lora", "prefix", "layers", "norms", "embed", "exit")
DATA_ROWS = ("all", "new")


def check_config(c) -> dict | None:
    """Refuse settings (a TrainConfig) that cannot run; returns the exit adapter asked for (None: none)."""
    if not c.out:
        raise UsageError("give the run directory with --out RUN")
    check_budget(
        {"--max-steps N": c.max_steps, "--train-tokens N": c.train_tokens, "--budget-minutes M": c.budget_minutes}
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
    return adapter_spec


def previous_run(c) -> tuple[dict | None, str | None]:
    """The run in ``c.out`` that ``c`` resumes (its run.json and latest checkpoint; None, None for a new run),
    checked against ``c``. A resumed run's model and data rows default to the run's; the data rows of a new run
    to new with --early-exit (the paper post-trains early exits on new tokens), all otherwise."""
    out = Path(c.out)
    run_dir = RunDir(out)
    prev_run = run_dir.settings()
    latest = None
    if prev_run is not None:
        if not c.resume:
            raise UsageError(f"{out} already holds a run; add --resume to continue it or choose a new --out")
        latest = run_dir.latest()
        c.model = c.model or prev_run["config"]["model"]
        c.data_rows = c.data_rows or prev_run["config"].get("data_rows", "all")  # runs from before the option
        check_resume_settings(prev_run["config"], c, type(c).FIXED, type(c).FORMER_DEFAULTS)
    elif c.resume and out.exists() and any(out.iterdir()):
        raise UsageError(
            f"{out} is not a looplm run (no run.json); resume needs a run directory written by "
            f"`looplm train`, or drop --resume and choose an empty --out"
        )
    if not c.model:
        raise UsageError("give the model to train as the first argument (`looplm train MODEL ...`)")
    # The paper post-trains early exits on new tokens: do not re-read the uptraining's batches.
    c.data_rows = c.data_rows or ("new" if c.early_exit != "none" else "all")
    return prev_run, latest


def load_teacher(c, model, fp):
    """The frozen teacher of ``c`` (None without one); it must share the student's tokenizer (fingerprint ``fp``)
    and vocabulary."""
    from ..models import load_model

    if not c.teacher:
        return None
    teacher, ttok = load_model(c.teacher)
    if ttok is None or tokenizer_fingerprint(ttok) != fp or teacher.config.vocab_size != model.config.vocab_size:
        raise UsageError(
            f"teacher {c.teacher} and student {c.model} use different tokenizers; distillation "
            f"needs the same vocabulary: pick the student's source model as --teacher"
        )
    teacher.requires_grad_(False)
    return teacher.eval()


def arch_fingerprint(config) -> dict:
    """The student's architecture as a run records it (JSON types), to refuse resuming with another model."""
    return json.loads(json.dumps(architecture(config, ignore=("id2label", "label2id")), default=str))


def _diff(a: dict, b: dict) -> list[str]:
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def check_same_model(out: Path, prev_run: dict | None, latest: str | None, model) -> None:
    """A resumed run goes on with the model it started with, from a complete checkpoint of that model."""
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


def rows_to_read(c, prior_training: list, corpus, corpus_id: str, global_batch: int) -> np.ndarray:
    """The training rows a run reads: all, or (``c.data_rows`` new) those no earlier run of the model read
    (``prior_training``, its config's conversion.training)."""
    n = len(corpus.splits["train"])
    read = rows_read(prior_training, corpus_id, n) if c.data_rows == "new" else np.zeros(n, bool)
    rows = np.flatnonzero(~read)
    if len(rows) < global_batch:
        raise UsageError(
            f"{c.model}'s earlier training read {int(read.sum())} of the {n} training sequences of "
            f"{c.data}; {len(rows)} new ones cannot fill a global batch of {global_batch}: "
            f"build a bigger corpus or pass --data-rows all"
        )
    return rows


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


def check_memory(c, model, teacher, n_params: int, seq: int, device: torch.device) -> None:
    """A batch of ``c.batch_size`` x ``seq`` tokens fits in the device's free memory (by ``estimate_memory``)."""
    exits = model.config.num_loops if c.early_exit != "none" else 1
    need = estimate_memory(
        model.config,
        n_params,
        teacher.config if teacher else None,
        sum(p.numel() for p in teacher.parameters()) if teacher else 0,
        c.batch_size,
        seq,
        exits,
        c.grad_checkpointing,
    )
    have = memory_available(device)
    if have is not None and need > have:
        raise UsageError(
            f"batch {c.batch_size} x {seq} tokens needs about {need / 2**30:.1f} GiB but "
            f"{have / 2**30:.1f} GiB is free; lower --batch-size (raise --grad-accum to keep the "
            f"global batch), lower --seq-len, or add --grad-checkpointing"
        )
