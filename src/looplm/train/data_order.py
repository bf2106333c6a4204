"""The data order of `looplm train`: which corpus rows each step reads, a pure function of the step (so a
resumed run reads exactly what the killed one would have), and which rows earlier runs read."""

from __future__ import annotations

import numpy as np
import torch


def batch_indices(step: int, global_batch: int, num_seqs: int, seed: int) -> np.ndarray:
    """Sequence indices of a step's global batch: epochs of seeded permutations, a pure function of step."""
    per_epoch = num_seqs // global_batch
    epoch, offset = divmod(step, per_epoch)
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(num_seqs, generator=g).numpy()
    return perm[offset * global_batch : (offset + 1) * global_batch]


def rows_read(records: list[dict], corpus: str, num_seqs: int) -> np.ndarray:
    """Which training rows of ``corpus`` the model's earlier runs read, by replaying their data order
    (each record: corpus, seed, global_batch, steps, and whether it read only new rows)."""
    read = np.zeros(num_seqs, dtype=bool)
    for r in records:
        if r["corpus"] != corpus:
            continue
        rows = np.flatnonzero(~read) if r["new_rows"] else np.arange(num_seqs)
        for step in range(r["steps"]):
            read[rows[batch_indices(step, r["global_batch"], len(rows), r["seed"])]] = True
    return read


def micro_batch(indices: np.ndarray, micro: int, rank: int, world: int, bs: int) -> np.ndarray:
    start = (micro * world + rank) * bs
    return indices[start : start + bs]
