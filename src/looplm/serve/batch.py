"""One batched run of the core (or a plan's prelude or coda) over work items at mixed loops.

All tokens are flattened into one [1, N, hidden] batch, so norms, projections, per-depth LoRA (grouped by slot when
loops are mixed) and the MLP are single calls; attention reads each token's own cache row at its own depth: single-token
items in one call per loop present over that depth's rows in place, or through one gather when few rows are busy;
one SDPA per prompt segment. Every token's keys and values at the depths it runs are written to its cache row. A
compiled engine runs each layer's work around attention as torch.compile regions, or a whole loop as one call
(serve/compiled.py)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..models.config import ConfigError
from ..models.layers import prefix_columns
from .cache import KVCache
from .compiled import CompiledBlock


@dataclass
class Batch:
    """A run's items flattened into one batch of tokens: ``n_dec`` single tokens first, then prompt segments (their
    first token at ``seg_starts``); per token its position, cache row and loop."""

    n_dec: int
    segs: list
    seg_starts: list[int]
    pos: torch.Tensor
    row: torch.Tensor
    loop: torch.Tensor
    loops: set[int]  # the loops present (one for a prelude or coda)
    steps: int  # the depths each token runs: the core's K, or the prelude's or coda's length
    depth_at: Callable[[int, int], int]  # the depth items at a loop run at step k
    t_dec: int  # the cache length the decode tokens read
    base_mask: torch.Tensor | None  # [n_dec, t_dec]: causal
    win_mask: torch.Tensor | None  # [n_dec, t_dec]: within the sliding window
    in_place: list | None  # groups of decode tokens that read the cache in place (DepthRunner._in_place_groups)

    @property
    def loop_of_all(self) -> int:
        return next(iter(self.loops))


class DepthRunner:
    """Runs depths of the model's plan over a batch of items, reading and writing the KV cache."""

    # Gathering each decode token's cache row copies every row's keys and values once per layer, which at 64 busy
    # rows cost more than the attention itself. When at least this fraction of a depth's rows is in the step,
    # attention instead runs over all rows of that depth where they lie (a view) and keeps the outputs of the rows
    # present: idle rows cost a little arithmetic and no copy.
    in_place_min_fraction = 0.5

    def __init__(self, model, cache: KVCache, compiled: CompiledBlock | None):
        c = model.config
        self.model, self.cache, self.compiled = model, cache, compiled
        self.device = next(model.parameters()).device
        self.layers = model.model.layers
        self.plan = c.plan  # the depth lookup (models/plan.py): block, slot, attention kind and loop of each depth
        self.K, self.P = c.num_shared_layers, c.prefix_length
        self.layer_map, self.slot_map, self.kinds = c.layer_map, c.slot_map, list(c.depth_attention)
        # core[i][k]: the depth loop i runs at its k-th step; a model of one loop is one "loop" of every depth
        self.core = [[d.index for d in self.plan.loop(i)] for i in range(c.num_loops)]
        self.core_t = torch.tensor(self.core, device=self.device)
        self.slot_map_t = torch.tensor(self.slot_map, device=self.device)
        self.sliding_t = torch.tensor([k == "sliding" for k in self.kinds], device=self.device)
        self.window = c.sliding_window_size
        self.has_sliding = "sliding" in self.kinds
        self.mixable = self.plan.mixable  # loops run the same block at their k-th step (cycle cores)
        self._arange = torch.arange(cache.max_len, device=self.device)

    def run(self, items: list, depths=None) -> torch.Tensor:
        """``depths`` (models/plan.py ``Depth``s: a plan's prelude or coda) over every item, or, with None, each
        item's next loop of the core (loops mixed in one batch where the plan allows). Returns the states after
        them, [tokens, hidden], and writes every token's keys and values at those depths to its cache row."""
        b = self._batch(items, depths)
        h = torch.cat([it.h for it in items])[None]
        tables = self.model.model.rotary(b.pos[None], h.dtype)
        route = self._route(b)
        if route == "compiled-loop":
            ds = [b.depth_at(b.loop_of_all, k) for k in range(b.steps)]
            return self.compiled.decode_loop(
                [self.layers[self.layer_map[d]] for d in ds],
                [self.slot_map[d] for d in ds],
                [self.kinds[d] for d in ds],
                ds,
                h,
                tables,
                self.cache,
                b.pos,
                b.in_place[0][3],
            )[0]
        for k in range(b.steps):
            layer, slot, depth, (cos, sin), sliding_tok = self._step(b, k, tables)
            flat = depth * self.cache.num_rows + b.row

            def attend(q, kk, vv, attn, k=k, flat=flat, sliding_tok=sliding_tok):
                self.cache.write(flat, b.pos, kk[0].transpose(0, 1), vv[0].transpose(0, 1))
                return self._attend(attn, q, b, k, flat, sliding_tok)

            if route == "compiled-regions":
                h = self.compiled.forward_attend(layer, h, slot, cos, sin, attend)
            else:
                h = layer.forward_attend(h, slot, cos, sin, attend)
        return h[0]

    def _batch(self, items: list, depths) -> Batch:
        """The items' tokens flattened: single tokens first (``schedule`` order), then prompt segments; each token's
        position, cache row and loop, and the decode tokens' masks and in-place groups."""
        dev = self.device
        n_dec = sum(1 for it in items if it.length == 1)
        loops = {it.loop for it in items} if depths is None else {0}
        if len(loops) > 1 and not self.mixable:
            raise ConfigError(
                "mixing loops in one batch needs cycle sharing (every loop runs shared layer k "
                "at step k); use the static or sequence scheduler for this model"
            )
        segs = items[n_dec:]
        # prompt segments' lengths: a decode step (most steps) has none and builds no tensor for them
        lengths = torch.tensor([it.length for it in segs], dtype=torch.long, device=dev) if segs else None

        def per_token(values: list[int]) -> torch.Tensor:  # decode tokens' own, then each segment's repeated
            dec = torch.tensor(values[:n_dec], dtype=torch.long, device=dev)
            if not segs:
                return dec
            return torch.cat(
                [dec, torch.tensor(values[n_dec:], dtype=torch.long, device=dev).repeat_interleave(lengths)]
            )

        pos = torch.tensor([it.pos for it in items[:n_dec]], dtype=torch.long, device=dev)
        if segs:
            pos = torch.cat([pos] + [torch.arange(it.pos, it.pos + it.length, device=dev) for it in segs])
        pos_dec = pos[:n_dec]
        t_dec = int(pos_dec.max()) + 1 if n_dec else 0
        ar = self._arange[:t_dec]
        base_mask = (ar[None] <= pos_dec[:, None]) if n_dec else None
        win_mask = ((pos_dec[:, None] - ar[None]) < self.window) if (n_dec and self.has_sliding) else None
        return Batch(
            n_dec=n_dec,
            segs=segs,
            seg_starts=list(itertools.accumulate([n_dec] + [it.length for it in segs]))[:-1],
            pos=pos,
            row=per_token([it.req.row for it in items]),
            loop=per_token([it.loop for it in items]),
            loops=loops,
            steps=self.K if depths is None else len(depths),
            # the depth that items at ``loop`` run at step k
            depth_at=(lambda loop, k: self.core[loop][k]) if depths is None else (lambda loop, k: depths[k].index),
            t_dec=t_dec,
            base_mask=base_mask,
            win_mask=win_mask,
            in_place=self._in_place_groups(items[:n_dec], base_mask, win_mask, depths is None) if n_dec else None,
        )

    def _step(self, b: Batch, k: int, tables: dict):
        """Step k's layer, its slot (one, or each token's), each token's depth, the rotary tables and which tokens
        attend in a sliding window (None: none)."""
        if len(b.loops) == 1:
            d = b.depth_at(b.loop_of_all, k)
            kind = self.kinds[d]
            sliding_tok = None if kind == "full" else torch.ones_like(b.pos, dtype=torch.bool)
            return (
                self.layers[self.layer_map[d]],
                self.slot_map[d],
                torch.full_like(b.pos, d),
                tables[kind],
                sliding_tok,
            )
        # a cycle core: every loop runs block layer_map[core[0][k]] at step k, each token its own slot
        depth = self.core_t[b.loop, k]
        layer, slot = self.layers[self.layer_map[self.core[0][k]]], self.slot_map_t[depth][None]
        if not self.has_sliding:
            return layer, slot, depth, tables["full"], None
        sliding_tok = self.sliding_t[depth]
        sel = sliding_tok[None, :, None]
        cos = torch.where(sel, tables["sliding"][0], tables["full"][0])
        sin = torch.where(sel, tables["sliding"][1], tables["full"][1])
        return layer, slot, depth, (cos, sin), sliding_tok

    def _attend(self, attn, q, b: Batch, k: int, flat: torch.Tensor, sliding_tok) -> torch.Tensor:
        """Attention of step k over the cache: the decode tokens in place or through one gather, then one SDPA per
        prompt segment over its row's entries."""
        outs = []
        if b.n_dec:
            qd = q[0, :, : b.n_dec].transpose(0, 1).unsqueeze(2)  # [n_dec, H, 1, d]
            if b.in_place is not None:
                o = self._attend_in_place(attn, qd, b.in_place, k, b.t_dec, b.depth_at)
            else:
                kd, vd = self.cache.gather(flat[: b.n_dec], b.t_dec)
                mask = b.base_mask
                if sliding_tok is not None:
                    mask = mask & (b.win_mask | ~sliding_tok[: b.n_dec, None])
                o = attn.attend_one(qd, kd, vd, prefix_columns(mask, self.P)[:, None, None, :])
            outs.append(o.squeeze(2).transpose(0, 1).unsqueeze(0))
        for it, s in zip(b.segs, b.seg_starts):
            t, p0 = it.length, it.pos
            ks, vs = self.cache.segment(int(flat[s]), p0 + t)
            sliding = sliding_tok is not None and bool(sliding_tok[s])
            mask = None
            if p0 > 0 or (sliding and p0 + t > self.window) or self.P:
                qi = self._arange[p0 : p0 + t, None]
                ki = self._arange[None, : p0 + t]
                mask = ki <= qi
                if sliding:
                    mask = mask & (qi - ki < self.window)
                mask = prefix_columns(mask, self.P)[None, None]
            outs.append(attn.attend(q[:, :, s : s + t], ks, vs, mask))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def _route(self, b: Batch) -> str:
        """How a step runs, chosen once per step: ``compiled-loop`` (batch 1, or every row busy at one loop:
        the whole loop is one compiled call, dynamic in the cache length read; a lone first token, which reads
        one entry, stays regional), ``compiled-regions`` (each layer's work around attention compiled, one
        loop over all items), or ``eager`` (no compiling, or loops mixed in one batch)."""
        if self.compiled is None or len(b.loops) > 1:
            return "eager"
        if b.in_place is not None and b.in_place[0][1] is None and not b.segs and self.P + b.t_dec > 1:
            return "compiled-loop"
        return "compiled-regions"

    def _in_place_groups(self, dec_items, base_mask, win_mask, by_item_loop: bool = True):
        """Per loop present among the single-token items: their indices (None when the single loop's
        tokens fill rows 0..R-1 in order), cache rows and [R, 1, 1, t] masks (full and sliding; idle rows
        see position 0 only, so no softmax row is empty); None when some loop has too few rows for
        in-place reading to pay."""
        R, dev = self.cache.num_rows, self.device
        by_loop: dict[int, list[int]] = {}
        for i, it in enumerate(dec_items):  # a prelude or coda: every item at the same depths, one group
            by_loop.setdefault(it.loop if by_item_loop else 0, []).append(i)
        if any(len(ix) < self.in_place_min_fraction * R for ix in by_loop.values()):
            return None
        groups = []
        for loop, ix in by_loop.items():
            row_ids = [dec_items[i].req.row for i in ix]
            identity = len(by_loop) == 1 and row_ids == list(range(R))  # then ix is 0..R-1 too
            sel = None if identity else torch.tensor(ix, device=dev)
            rows = torch.tensor(row_ids, device=dev)
            masks = {}
            for kind, m in (("full", base_mask), ("sliding", None if win_mask is None else base_mask & win_mask)):
                if m is not None:
                    if not identity:  # spread the tokens' masks over all R rows
                        full = torch.zeros(R, m.shape[1], dtype=torch.bool, device=dev)
                        full[:, 0] = True
                        m = full.index_copy_(0, rows, m.index_select(0, sel))
                    masks[kind] = prefix_columns(m, self.P)[:, None, None, :]
            groups.append((loop, sel, rows, masks))
        return groups

    def _attend_in_place(self, attn, qd, groups, k, t_dec, depth_at):
        """Decode attention for step k of every group, reading each depth's cache rows in place."""
        R = self.cache.num_rows
        if groups[0][1] is None:  # one group, every row busy, token i in row i: no scatter needed
            loop, _, _, masks = groups[0]
            d = depth_at(loop, k)
            kf, vf = self.cache.depth_rows(d, t_dec)
            return attn.attend_one(qd, kf, vf, masks[self.kinds[d]])
        out = torch.empty_like(qd)
        for loop, sel, rows, masks in groups:
            d = depth_at(loop, k)
            kf, vf = self.cache.depth_rows(d, t_dec)
            qf = qd.new_zeros((R,) + qd.shape[1:]).index_copy_(0, rows, qd.index_select(0, sel))
            o = attn.attend_one(qf, kf, vf, masks[self.kinds[d]])
            out.index_copy_(0, sel, o.index_select(0, rows))
        return out

    @torch.no_grad()
    def fill_copy(self, loop: int, h: torch.Tensor, pos: torch.Tensor, row: torch.Tensor) -> None:
        """KV ``copy``: the cache entries of every depth after ``loop`` for tokens that left after it, their
        exit states h [1, n, hidden] projected through each skipped depth's k/v (one compiled call when the
        engine is compiled)."""
        ds = [d for later in self.core[loop + 1 :] for d in later]  # the core's later loops (the coda runs for real)
        tables = self.model.model.rotary(pos[None], h.dtype)
        layers, slots, kinds = (
            [self.layers[self.layer_map[d]] for d in ds],
            [self.slot_map[d] for d in ds],
            [self.kinds[d] for d in ds],
        )
        if self.compiled is not None:
            self.compiled.fill_kv(layers, slots, kinds, ds, h, tables, self.cache, row, pos)
            return
        for layer, slot, kind, d in zip(layers, slots, kinds, ds):
            k, v = layer.project_kv(h, slot, *tables[kind])
            self.cache.write(self.cache.flat(d, row), pos, k[0].transpose(0, 1), v[0].transpose(0, 1))
