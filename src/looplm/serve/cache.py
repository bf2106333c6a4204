"""Preallocated KV cache: one row per running request, one entry per depth.

Layout: k, v [L * R, KV, T, d] (L depths, R rows, T max positions). A request holds one row for its
whole life; depth d of row r is flat row ``d * R + r``. Rows are handed out and taken back by a
free list (finish, cancel and failure all release). Stale contents of a released row are never
read: attention masks every position beyond the reading token's own.

A model with per-depth prefixes (paper appendix G) keeps them at the front of every row: entries
0..P-1 of depth d hold depth d's prefix keys/values (``set_prefix``, the same for every row and never
overwritten), token position p lives at entry P + p, and every read returns the prefix with the tokens.
"""

from __future__ import annotations

import torch


class CacheFull(RuntimeError):
    pass


class KVCache:
    def __init__(
        self,
        num_depths: int,
        num_rows: int,
        max_len: int,
        kv_heads: int,
        head_dim: int,
        dtype=torch.float32,
        device=None,
        prefix_len: int = 0,
    ):
        self.num_depths, self.num_rows, self.max_len, self.prefix_len = num_depths, num_rows, max_len, prefix_len
        shape = (num_depths * num_rows, kv_heads, prefix_len + max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._free = list(range(num_rows - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    @property
    def free_rows(self) -> int:
        return len(self._free)

    @property
    def used_rows(self) -> set[int]:
        return set(self._used)

    def allocate(self) -> int:
        if not self._free:
            raise CacheFull("no free KV cache row")
        row = self._free.pop()
        self._used.add(row)
        return row

    def release(self, row: int) -> None:
        if row in self._used:
            self._used.remove(row)
            self._free.append(row)

    def flat(self, depth: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        return depth * self.num_rows + row

    def set_prefix(self, depth: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [KV, P, d]: depth ``depth``'s prefix keys/values, in front of every row."""
        a = depth * self.num_rows
        self.k[a : a + self.num_rows, :, : self.prefix_len] = k
        self.v[a : a + self.num_rows, :, : self.prefix_len] = v

    def write(self, flat_rows: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [N, KV, d] for N tokens at (flat row, position)."""
        pos = pos + self.prefix_len
        self.k[flat_rows, :, pos] = k
        self.v[flat_rows, :, pos] = v

    def gather(self, flat_rows: torch.Tensor, length: int):
        """k, v [n, KV, P + length, d] of n flat rows (one copy; positions beyond a reader are masked)."""
        n = self.prefix_len + length
        return self.k[:, :, :n].index_select(0, flat_rows), self.v[:, :, :n].index_select(0, flat_rows)

    def depth_rows(self, depth: int, length: int):
        """k, v [R, KV, P + length, d] of every row at one depth (a view, no copy)."""
        a, n = depth * self.num_rows, self.prefix_len + length
        return self.k[a : a + self.num_rows, :, :n], self.v[a : a + self.num_rows, :, :n]

    def segment(self, flat_row: int, length: int):
        """k, v [1, KV, P + length, d] of one flat row (a view, no copy)."""
        n = self.prefix_len + length
        return self.k[flat_row : flat_row + 1, :, :n], self.v[flat_row : flat_row + 1, :, :n]

    def truncate(self, row: int, start: int, end: int | None = None) -> None:
        """Roll row ``row`` back to ``start`` tokens: zero token positions [start, end) (default: to the end) at
        every depth. Speculative decoding calls it for drafted positions the verifier rejected. Attention never
        reads a position beyond its reader's own, so this keeps an invariant (the row holds exactly the tokens
        committed so far) rather than the tokens themselves."""
        P = self.prefix_len
        stop = P + (self.max_len if end is None else end)
        self.k[row :: self.num_rows, :, P + start : stop] = 0
        self.v[row :: self.num_rows, :, P + start : stop] = 0
