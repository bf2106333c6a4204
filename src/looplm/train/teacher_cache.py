"""The original model's hidden states at every layer boundary, over a fixed slice of training rows,
cached on disk for healing (train/heal/).

Layer-local distillation trains each shared layer to map the input of a depth onto the original
model's output at that depth. Both come from one forward pass of the original model, run once and
kept here: boundary 0 is the embedding output, boundary d + 1 the output of layer d, boundary L the
last layer's output (before the final norm), so the pair of depth d is (states[d], states[d + 1]).

Layout of a cache directory::

    states.bin   [L + 1, rows, seq_len, hidden] bfloat16, memory-mapped (as raw 16-bit words)
    meta.json    written last (atomically): the commit marker, with the teacher's and the corpus's
                 fingerprints, the training rows used, the shape and the sha256 of states.bin

bfloat16 keeps the range of the residual stream of any model (Gemma's activations reach the
thousands) at a relative rounding error of 2^-9, far below the layer errors healing removes.
A cache whose meta.json matches the teacher, corpus and rows asked for is reused as it is; one of
another teacher or corpus, a truncated states.bin or one that fails its checksum is refused.

On several processes (torchrun, accelerate launch) the build is split by rows: every process runs the original
on every world-th batch of rows and writes its states into the one shared states.bin; the main process then
commits it (meta.json) and every process reads all of it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from ..data.corpus import PackedCorpus, sha256_file
from ..errors import UsageError
from ..models.config import architecture
from ..util import read_json, write_json_atomic

FORMAT = 1


def model_fingerprint(model) -> str:
    """sha256 (16 hex digits) of a model's architecture and every parameter's bytes."""
    h = hashlib.sha256()
    # exit adapters act only at intermediate exits, not on the states at layer boundaries
    cfg = architecture(model.config, ignore=("exit_adapter",))
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class OneProcess:
    """The processes of a run that is not distributed: the one, its own main process."""

    process_index, num_processes, is_main_process = 0, 1, True

    def wait_for_everyone(self) -> None:
        pass


class TeacherCache:
    """A finished cache: ``boundary(b, idx)`` gives float32 [len(idx), seq, hidden]."""

    def __init__(self, directory: str | Path, verify: bool = True):
        d = Path(directory)
        self.meta = read_json(d / "meta.json", "finished teacher cache", f"delete {d} and re-run to rebuild it")
        self.dir = d
        L1, n, t, hdim = self.meta["shape"]
        path = d / "states.bin"
        if not path.exists() or path.stat().st_size != L1 * n * t * hdim * 2:
            raise UsageError(f"{path} is missing or truncated; delete {d} and re-run to rebuild the cache")
        if verify and sha256_file(path) != self.meta["sha256"]:
            raise UsageError(f"{path} fails its checksum (corrupt); delete {d} and re-run to rebuild the cache")
        self.states = np.memmap(path, dtype=np.int16, mode="r", shape=(L1, n, t, hdim))
        self.rows = np.asarray(self.meta["rows"], dtype=np.int64)
        self.num_layers, self.num_rows, self.seq_len, self.hidden = L1 - 1, n, t, hdim

    def boundary(self, b: int, idx) -> torch.Tensor:
        """States at boundary ``b`` (0 = embeddings, L = last layer's output) of cache rows ``idx``, float32."""
        words = np.ascontiguousarray(self.states[b, np.asarray(idx)])
        return torch.from_numpy(words).view(torch.bfloat16).float()

    def tokens(self, corpus: PackedCorpus, idx) -> torch.Tensor:
        rows = self.rows[np.asarray(idx)]
        return torch.from_numpy(np.asarray(corpus.splits["train"][rows][:, : self.seq_len], dtype=np.int64))


@torch.no_grad()
def teacher_states(teacher, ids: torch.Tensor) -> list[torch.Tensor]:
    """The original model's states at every layer boundary for token rows ``ids``: L + 1 tensors
    [rows, seq, hidden], boundary 0 the embedding output and boundary L the last layer's output (before
    the final norm), as the cache stores them. Healing's online end-to-end stage calls it every step."""
    h = teacher.model.embed(ids)
    _, states, _ = teacher.model(inputs_embeds=h, output_depth_states=True)
    return [h, *states]


def cache_key(teacher_fp: str, corpus: PackedCorpus, rows: np.ndarray, seq_len: int) -> dict:
    return {
        "format": FORMAT,
        "teacher": teacher_fp,
        "corpus_train_sha256": corpus.meta["splits"]["train"]["sha256"],
        "tokenizer": corpus.tokenizer,
        "rows": [int(r) for r in rows],
        "seq_len": int(seq_len),
    }


@torch.no_grad()
def build_cache(
    teacher,
    corpus: PackedCorpus,
    directory: str | Path,
    rows: np.ndarray,
    seq_len: int,
    batch_size: int = 4,
    progress: bool = True,
    log=print,
    autocast=contextlib.nullcontext,
    processes=None,
) -> TeacherCache:
    """Run ``teacher`` over training rows ``rows`` of ``corpus`` and store every layer boundary in
    ``directory``; reuse the cache already there if it was built from the same teacher, corpus and rows.
    ``autocast``: the context the teacher runs in, healing's bf16 autocast where the CPU has bf16 matmuls, as
    the online end-to-end stage runs it: faster, and it moves the states by far less than the local stage's
    error at its end; the precision is recorded in meta.json but not part of the key (a cache built either way serves
    either run). ``processes``: the run's Accelerator when it has several processes (every one calls this), each
    then runs the original on its share of the batches."""
    procs = processes if processes is not None else OneProcess()
    d = Path(directory)
    key = cache_key(model_fingerprint(teacher), corpus, rows, seq_len)
    found = (d / "meta.json").exists()
    procs.wait_for_everyone()  # every process has looked before the main one writes meta.json
    if found:
        return _reuse_cache(d, key, procs, log)
    c = teacher.config
    if teacher.config.num_loops != 1:
        raise UsageError("the teacher must be the original (vanilla, one-loop) model")
    shape = (c.num_hidden_layers + 1, len(rows), seq_len, c.hidden_size)
    tmp = d / ".states.bin.tmp"
    if procs.is_main_process:
        _allocate_states(d, tmp, shape)
    procs.wait_for_everyone()
    computed = _write_states(
        teacher, corpus, rows, seq_len, batch_size, tmp, shape, procs, progress and procs.is_main_process, autocast
    )
    procs.wait_for_everyone()
    if procs.is_main_process:
        _commit(d, tmp, key, shape, computed)
    procs.wait_for_everyone()
    return TeacherCache(d, verify=False)


def _reuse_cache(d: Path, key: dict, procs, log) -> TeacherCache:
    """The finished cache in ``d``, refused unless it was built for ``key`` (the same teacher, corpus and rows)."""
    if not procs.is_main_process:
        procs.wait_for_everyone()  # the main process verifies the checksum, once
    cache = TeacherCache(d, verify=procs.is_main_process)
    if procs.is_main_process:
        procs.wait_for_everyone()
    mine = {k: cache.meta.get(k) for k in key}
    if mine != key:
        what = [k for k in key if mine[k] != key[k]]
        raise UsageError(
            f"{d} holds a teacher cache of another {'/'.join(what)}; delete it or give another cache directory"
        )
    log(f"teacher cache: reusing {d} ({cache.num_rows} rows x {cache.seq_len} tokens)")
    return cache


def _allocate_states(d: Path, tmp: Path, shape: tuple) -> None:
    """The states file ``tmp`` at its full size, for every process to fill its rows; an interrupted build's
    leftovers removed."""
    d.mkdir(parents=True, exist_ok=True)
    for stale in d.glob(".*tmp*"):
        stale.unlink()
    np.memmap(tmp, dtype=np.int16, mode="w+", shape=shape).flush()


def _commit(d: Path, tmp: Path, key: dict, shape: tuple, computed: str) -> None:
    """states.bin in place, then meta.json: written last, the mark of a finished cache."""
    os.replace(tmp, d / "states.bin")
    write_json_atomic(
        d / "meta.json",
        {
            **key,
            "shape": list(shape),
            "dtype": "bfloat16",
            "computed_in": computed,
            "sha256": sha256_file(d / "states.bin"),
        },
    )


def _write_states(teacher, corpus, rows, seq_len, batch_size, path, shape, procs, progress, autocast) -> str:
    """Run ``teacher`` on this process's batches of ``rows`` (every ``num_processes``-th, from its index) and write
    their states into the memory-mapped file ``path``; returns the dtype they were computed in."""
    from tqdm import tqdm

    states = np.memmap(path, dtype=np.int16, mode="r+", shape=shape)
    device = next(teacher.parameters()).device
    teacher.eval()
    starts = range(procs.process_index * batch_size, len(rows), batch_size * procs.num_processes)
    computed = None
    for start in tqdm(starts, desc="teacher cache", unit="batch", disable=not progress):
        sel = rows[start : start + batch_size]
        ids = torch.from_numpy(np.asarray(corpus.splits["train"][sel][:, :seq_len], dtype=np.int64)).to(device)
        with autocast():
            boundaries = teacher_states(teacher, ids)
            amp = torch.is_autocast_enabled(device.type)
            computed = str(torch.get_autocast_dtype(device.type) if amp else next(teacher.parameters()).dtype)
        for b, s in enumerate(boundaries):
            states[b, start : start + len(sel)] = s.to(torch.bfloat16).view(torch.int16).cpu().numpy()
    states.flush()
    del states
    return computed and computed.removeprefix("torch.")
