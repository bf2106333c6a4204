"""What a healing run reads: the corpus and which of its rows, the student and the original (checked against each
other and the corpus), the out-of-domain windows, the device; and each step's batch of rows with the original's
states for them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ...data.corpus import PackedCorpus
from ...data.ood import DOMAINS, domain_windows
from ...errors import UsageError
from ...util import check_compile_available
from ..distributed import launched
from ..loop import resolve_precision
from ..losses import read_weights
from ..teacher_cache import TeacherCache, build_cache, teacher_states
from .config import HealConfig

EXIT_STAGE_SALT = 500_009  # the exit stage's cached-row draws are seeded apart from the end-to-end stage's


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


@dataclass
class HealInputs:
    corpus: PackedCorpus
    rows: np.ndarray  # the cached training rows (cached_rows)
    stream: np.ndarray | None  # the order of --e2e-rows online (streamed_rows)
    student: torch.nn.Module
    teacher: torch.nn.Module  # frozen, in eval mode
    tok: object
    ood: dict[str, list]  # out-of-domain windows per domain (none with --ood-windows 0)
    device: torch.device
    bf16: bool
    spans: list[tuple[int, int]]  # the original's layers each depth of the student stands for (teacher_spans)
    channels: torch.Tensor  # each channel's weight in the hidden-state errors: as the original's norms read it
    rank: int = 0  # this process among ``world`` (torchrun / accelerate launch): each takes its share of a step's rows
    world: int = 1
    sharded: bool = False  # the layers sharded over the processes (FSDP2, train/distributed.py), not whole on each

    def autocast(self):
        """bf16 autocast for the training forward passes (weights, optimizer state and evaluations stay fp32)."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16)

    def share(self, rows):
        """This process's share of a step's ``rows``: the ``rank``-th of ``world`` equal slices."""
        per = len(rows) // self.world
        return rows[self.rank * per : (self.rank + 1) * per]


def teacher_spans(student_cfg, teacher_cfg, student_name: str = "the student", teacher_name: str = "the teacher"):
    """For each depth d of the student, the span [start, end) of the original's layers it stands for: it learns to
    map the original's states at layer boundary ``start`` onto those at ``end``. A converted model has the
    original's depth count, so depth d stands for layer d alone. A shallower student (the reduced-size model of
    `looplm baseline`: some of the original's layers, run once) stands for the layers
    from the one its depth was copied from up to the next copied one (the first from the embeddings, the last to
    the original's last layer); one with fresh weights for an equal share of the layers."""
    S, L = student_cfg.num_hidden_layers, teacher_cfg.num_hidden_layers
    if teacher_cfg.hidden_size != student_cfg.hidden_size or S > L:
        raise UsageError(
            f"student {student_name} ({S} depths of width {student_cfg.hidden_size}) is no conversion or reduced-size "
            f"model of teacher {teacher_name} ({L} layers of width {teacher_cfg.hidden_size}); give the model it was "
            f"made from as --teacher"
        )
    if S == L:
        return [(d, d + 1) for d in range(L)]
    conversion = student_cfg.conversion or {}
    copied = conversion.get("layers") if conversion.get("init") != "scratch" else None
    if copied is not None:
        starts = [0, *copied[1:]]
    elif L % S == 0:
        starts = [d * L // S for d in range(S)]
    else:
        raise UsageError(
            f"student {student_name} has {S} depths, teacher {teacher_name} {L} layers, and the student records no "
            f"layers it was copied from: no depth-to-layers map; give a student whose depth count divides {L}"
        )
    ends = [*starts[1:], L]
    if any(a >= b for a, b in zip(starts, ends)):
        raise UsageError(f"student {student_name}'s copied layers {copied} are not increasing layers of {L}")
    return list(zip(starts, ends))


def _models(c: HealConfig, corpus: PackedCorpus):
    """The student, the original (frozen later) and their tokenizer, refused when they and the corpus do not share
    one tokenizer or the original is looped itself."""
    from ...models import load_model
    from ...models.loading import tokenizer_fingerprint

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
    if fp != corpus.tokenizer:
        raise UsageError(
            f"the corpus {c.data} was tokenised with another tokenizer than {c.model}'s; rebuild "
            f"it with `looplm data build {c.teacher}`"
        )
    if teacher.config.num_loops != 1:
        raise UsageError(f"--teacher {c.teacher} is itself looped; give the original (vanilla) model")
    return student, teacher, tok


def _processes(c: HealConfig, processes):
    """The device, this process's rank, the number of processes and whether the layers are sharded (FSDP); the
    step batches must split evenly over the processes."""
    device = processes.device if processes is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rank, world = (processes.process_index, processes.num_processes) if processes is not None else (0, 1)
    sharded = world > 1 and launched()
    for flag, batch in (("--local-batch", c.local_batch), ("--e2e-batch", c.e2e_batch)):
        if batch % world:
            raise UsageError(
                f"{flag} {batch} (rows a step, split across the processes) is not a multiple of the {world} "
                f"processes; give a multiple of {world}"
            )
    if sharded and c.e2e_average:
        # the weight average (train/optim.py) copies with torch._foreach_copy_, which has no rule for sharded tensors
        raise UsageError(
            f"--e2e-average {c.e2e_average} keeps a weight average that sharded (FSDP) layers do not support; "
            f"heal without it under FSDP, or launch with configs/accelerate/ddp.yaml"
        )
    return device, rank, world, sharded


def load_inputs(c: HealConfig, processes=None) -> HealInputs:
    """Read and check everything a run needs; refuse, in one line, a corpus, teacher or student that do not fit.
    ``processes``: the run's Accelerator (its device, this process's rank and their number); None: one process,
    on CUDA when there is one."""
    corpus = PackedCorpus(c.data)
    if c.seq_len > corpus.seq_len:
        raise UsageError(f"--seq-len {c.seq_len} is longer than the corpus's {corpus.seq_len}-token rows")
    train = corpus.splits["train"]
    if c.cache_rows > len(train):
        raise UsageError(f"--cache-rows {c.cache_rows} is more than the corpus's {len(train)} training rows")
    rows = cached_rows(len(train), c.cache_rows, c.seed)
    stream = streamed_rows(corpus, c.seed) if c.e2e_rows == "online" else None
    # no cached row may be held-out text (streamed_rows leaves such rows out of what --e2e-rows online reads)
    held_rows = heldout_set(corpus)
    if any(bytes(np.asarray(train[r])) in held_rows for r in rows):
        raise UsageError(
            f"the training slice of {c.data} contains held-out rows; rebuild the corpus "
            f"(`looplm data build`) so that its splits are disjoint"
        )

    student, teacher, tok = _models(c, corpus)
    spans = teacher_spans(student.config, teacher.config, c.model, c.teacher)
    # text the run never heals on: each evaluation reports it too, so a run shows when it starts to overfit
    try:
        bos = bool(getattr(student.config, "add_bos_token", False))
        ood = domain_windows(tok, list(DOMAINS), c.ood_windows, c.seq_len, bos) if c.ood_windows else {}
    except UsageError as e:
        raise UsageError(f"{e} (or heal without the out-of-domain evaluation: --ood-windows 0)") from None
    device, rank, world, sharded = _processes(c, processes)
    bf16 = resolve_precision(c.precision, device) == "bf16"
    if c.compile:
        check_compile_available(device)
    teacher = teacher.eval().requires_grad_(False)
    channels = read_weights(teacher).to(device)
    return HealInputs(
        corpus, rows, stream, student, teacher, tok, ood, device, bf16, spans, channels, rank, world, sharded
    )


def open_cache(inputs: HealInputs, c: HealConfig, cache_dir: Path, log, processes=None) -> TeacherCache:
    """The original model's states at every layer boundary for the cached rows: built in ``cache_dir`` (each
    process running the original on its share of the rows), or read from there."""
    return build_cache(
        inputs.teacher,
        inputs.corpus,
        cache_dir,
        inputs.rows,
        c.seq_len,
        progress=c.progress,
        log=log,
        autocast=inputs.autocast,
        processes=processes,
    )


def step_batch(inputs: HealInputs, cache: TeacherCache, c: HealConfig, step: int, stage: str):
    """The token rows of a step of the end-to-end or exit stage, and ``boundary(b)``: the original model's
    states at layer boundary b for them. ``--e2e-rows cache``: rows drawn from the cached ones, states read
    from the cache. ``online``: the next rows of the seeded pass over the training split (``streamed_rows``),
    states from running the original model on them when first asked for (the exit stage never asks). On several
    processes, each reads its share of the step's ``e2e_batch`` rows (``HealInputs.share``)."""
    device = inputs.device
    if c.e2e_rows == "cache":
        salt = 0 if stage == "e2e" else EXIT_STAGE_SALT
        g = torch.Generator().manual_seed(c.seed * 1_000_003 + salt + step)
        idx = inputs.share(torch.randperm(len(inputs.rows), generator=g)[: c.e2e_batch].numpy())
        return cache.tokens(inputs.corpus, idx).to(device), lambda b: cache.boundary(b, idx).to(device)
    stream = inputs.stream
    first = step * c.e2e_batch + (0 if stage == "e2e" else len(stream) // 2)
    rows = inputs.share(stream[np.arange(first, first + c.e2e_batch) % len(stream)])
    ids = torch.from_numpy(np.asarray(inputs.corpus.splits["train"][rows][:, : c.seq_len], dtype=np.int64))
    ids = ids.to(device)
    states: list[torch.Tensor] = []

    def boundary(b: int) -> torch.Tensor:
        if not states:
            with inputs.autocast():
                states.extend(teacher_states(inputs.teacher, ids))
        return states[b].float()

    return ids, boundary
