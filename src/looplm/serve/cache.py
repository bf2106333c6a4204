"""Preallocated KV cache: one row per running request, one entry per depth.

Layout: k, v [L * R, KV, T, d] (L depths, R rows, T max positions). A request holds one row for its
whole life; depth d of row r is flat row ``d * R + r``. Rows are handed out and taken back by a
free list (finish, cancel and failure all release). Stale contents of a released row are never
read: attention masks every position beyond the reading token's own.
"""

from __future__ import annotations

import torch


class CacheFull(RuntimeError):
    pass


class KVCache:
    def __init__(self, num_depths: int, num_rows: int, max_len: int, kv_heads: int, head_dim: int,
                 dtype=torch.float32, device=None):
        self.num_depths, self.num_rows, self.max_len = num_depths, num_rows, max_len
        shape = (num_depths * num_rows, kv_heads, max_len, head_dim)
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

    def write(self, flat_rows: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [N, KV, d] for N tokens at (flat row, position)."""
        self.k[flat_rows, :, pos] = k
        self.v[flat_rows, :, pos] = v

    def gather(self, flat_rows: torch.Tensor, length: int):
        """k, v [n, KV, length, d] of n flat rows (one copy; positions beyond a reader are masked)."""
        return (self.k[:, :, :length].index_select(0, flat_rows),
                self.v[:, :, :length].index_select(0, flat_rows))

    def depth_rows(self, depth: int, length: int):
        """k, v [R, KV, length, d] of every row at one depth (a view, no copy)."""
        a = depth * self.num_rows
        return self.k[a:a + self.num_rows, :, :length], self.v[a:a + self.num_rows, :, :length]

    def segment(self, flat_row: int, length: int):
        """k, v [1, KV, length, d] of one flat row (a view, no copy)."""
        return self.k[flat_row:flat_row + 1, :, :length], self.v[flat_row:flat_row + 1, :, :length]
