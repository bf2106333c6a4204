"""The serving engine: one batched forward of the shared block over work items at mixed depths.

A work item is (request, positions, loop): a whole prompt (prefill), one new token, or (``kv``
items) an early-exited token finishing the loops it skipped, only to fill its KV entries. One
``Engine.step`` runs one loop (the K shared layers) over every item given: all tokens are flattened
into one [1, N, hidden] batch, so norms, projections, per-depth LoRA (grouped by slot when loops are
mixed) and the MLP are single calls; attention reads each token's own cache row at its own depth
(single-token items: one call per loop present over that depth's rows in place, or one gather when
few rows are busy; one SDPA per prompt segment). On CPU each float32 product of a few rows runs the way
measured fastest on the machine (models/cpu_products.py).

After the loop, items at their last loop emit a token; the others either continue or, under an
exit policy, leave early. The KV entries of loops an exited token skips are filled either by
``copy`` (CALM: project its exit state through the skipped depths' k/v projections) or ``later``
(the paper's proposal: the token keeps running those loops as a ``kv`` item, batched with other
work, while its successor already starts).

Per-depth prefixes (paper appendix G) are projected once, when the engine starts, into the front of
every cache row (serve/cache.py); every attention mask gets P leading columns that all queries see.
"""

from __future__ import annotations

import itertools
import time

import torch

from ..models.config import ConfigError
from ..models.cpu_products import prepare_for_cpu, release
from ..models.layers import prefix_columns
from ..models.quantized import is_quantized
from .cache import KVCache
from .compiled import CompiledBlock
from .exits import ContextGuess, ExitPolicy
from .sampling import RequestError, SamplingParams, sample

KV_MODES = ("copy", "later")
SPECULATE_MODES = ("off", "context", "loop1", "both")  # speculative decoding's draft sources (serve/speculative.py)
STEP_PARTS = ("execute", "head", "decide", "kv_fill", "sample", "commit")  # stats["seconds"] of a step
_ids = itertools.count()


def check_speculate(mode: str, num_loops: int) -> None:
    """A usage error (ValueError) for a speculation mode this model cannot run."""
    if mode not in SPECULATE_MODES:
        raise ValueError(f"unknown speculation mode {mode!r}; use one of {', '.join(SPECULATE_MODES)}")
    if mode == "loop1" and num_loops < 2:
        raise ValueError(
            "--speculate loop1 drafts with the model's first loop, and this model has one loop (B = 1): "
            "its loop 1 is the whole model; use --speculate context"
        )


class Request:
    """A generation request and, once served, its result and timings (clock seconds)."""

    def __init__(
        self,
        prompt,
        max_tokens: int = 16,
        sampling: SamplingParams | None = None,
        arrival: float = 0.0,
        eos_token_id: int | None = None,
        on_token=None,
        request_id=None,
        full_depth: bool = False,
    ):
        self.id = next(_ids) if request_id is None else request_id
        self.prompt = list(prompt) if not isinstance(prompt, torch.Tensor) else prompt.tolist()
        self.max_tokens = max_tokens
        self.sampling = sampling or SamplingParams()
        self.arrival = arrival
        self.eos_token_id = eos_token_id
        self.on_token = on_token  # callback(request, token); an exception fails this request only
        self.full_depth = full_depth  # never exit early, whatever the engine's exit policy
        self.output: list[int] = []
        self.exit_loops: list[int] = []  # loop (1-based) each output token left at
        self.oracle_loops: list[int] = []  # oracle policy: first loop whose argmax equals the final one
        self.token_times: list[float] = []
        self.status = "new"  # new, queued, running, done, error, cancelled
        self.error: str | None = None
        self.row: int | None = None
        self.generator: torch.Generator | None = None
        self.finish_time: float | None = None
        self._context: ContextGuess | None = None  # +copy exit policies: built on first use
        self.spec = None  # speculative decoding: its state (speculative.SpecState), built on first use

    def copy_guess(self) -> int:
        """What copying this sequence's context predicts next (exits.ContextGuess), or -1."""
        if self._context is None:
            self._context = ContextGuess(self.prompt)
        self._context.extend(self.output[len(self._context.tokens) - len(self.prompt) :])
        return self._context.guess

    @property
    def finished(self) -> bool:
        return self.status in ("done", "error", "cancelled")

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None

    def __repr__(self):
        return f"Request({self.id}, {self.status}, prompt={len(self.prompt)}, out={len(self.output)})"


class Item:
    __slots__ = ("req", "pos", "length", "loop", "h", "ids", "kind")

    def __init__(self, req, pos, length, loop, kind, ids=None, h=None):
        self.req, self.pos, self.length, self.loop, self.kind = req, pos, length, loop, kind
        self.ids, self.h = ids, h


class Decision:
    """What ``Engine.decide`` found after a loop: items that continue to their next loop, and the (item, row)
    pairs that emit a token now with their logits (one row each, in order)."""

    __slots__ = ("cont", "emitters", "logits")

    def __init__(self, cont: list[Item], emitters: list, logits: torch.Tensor | None):
        self.cont, self.emitters, self.logits = cont, emitters, logits


class _Loop:  # an (item, row) pair's item, as far as the exit head reads it: its 0-based loop
    __slots__ = ("loop",)

    def __init__(self, loop: int):
        self.loop = loop


class Engine:
    def __init__(
        self,
        model,
        max_batch: int = 16,
        max_seq_len: int = 512,
        exit_policy: ExitPolicy | None = None,
        kv_mode: str = "copy",
        clock=None,
        tune_products: bool = True,
        compile: bool = False,
        speculate: str = "off",
    ):
        if kv_mode not in KV_MODES:
            raise ValueError(f"unknown kv mode {kv_mode!r}; use one of {KV_MODES}")
        self.model = model.eval()
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        # compile: each layer's work around attention runs as a torch.compile region (serve/compiled.py);
        # call schedulers.warm_up(engine) before serving, or the first requests pay for compiling
        self.compiled = CompiledBlock(self.device) if compile else None
        self.quantized = is_quantized(model)  # a compiled engine then runs a one-row head in a graph too
        # float32 on CPU: each product of a few rows runs the way this machine streams weights fastest,
        # measured once per process (models/cpu_products.py). Compiled regions cannot use those ways (and
        # would be guarded on each weight's copy, one graph per layer), so a compiled engine drops them.
        if compile:
            release(model)
        self.cpu_plan, self.packed_bytes = prepare_for_cpu(model) if tune_products and not compile else (None, 0)
        c = self.config = model.config
        self.K, self.B, self.L = c.num_shared_layers, c.num_loops, c.num_hidden_layers
        self.P = c.prefix_length
        self.cache = KVCache(
            self.L,
            max_batch,
            max_seq_len,
            c.num_key_value_heads,
            c.head_dim,
            self.dtype,
            self.device,
            prefix_len=self.P,
        )
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        self.layers = model.model.layers
        self.plan = c.plan  # the depth lookup (models/plan.py): block, slot, attention kind and loop of each depth
        self.layer_map, self.slot_map, self.kinds = c.layer_map, c.slot_map, list(c.depth_attention)
        # core[i][k]: the depth loop i runs at its k-th step; a model of one loop is one "loop" of every depth
        self.core = [[d.index for d in self.plan.loop(i)] for i in range(self.B)]
        self.core_t = torch.tensor(self.core, device=self.device)
        if self.P:  # the served weights are frozen: each depth's prefix keys/values are computed once
            with torch.no_grad():
                for d in range(self.L):
                    k, v = self.layers[self.layer_map[d]].attn.prefix_kv(self.slot_map[d])
                    self.cache.set_prefix(d, k[0], v[0])
        self.slot_map_t = torch.tensor(self.slot_map, device=self.device)
        self.sliding_t = torch.tensor([k == "sliding" for k in self.kinds], device=self.device)
        self.window = c.sliding_window_size
        self.has_sliding = "sliding" in self.kinds
        self.mixable = self.plan.mixable  # loops run the same block at their k-th step (cycle cores)
        self.policy = (exit_policy or ExitPolicy()).bind(model)
        # speculative decoding (serve/speculative.py): off, context, loop1 or both; schedulers.make_scheduler then
        # serves in speculative rounds
        check_speculate(speculate, self.B)
        if speculate != "off" and self.policy.active:
            raise ValueError(
                "speculative decoding gives the full model's tokens and an exit policy changes them: "
                "use one or the other"
            )
        self.speculate = speculate
        self.kv_mode = kv_mode
        self.clock = clock or time.perf_counter
        self._arange = torch.arange(max_seq_len, device=self.device)
        self.reset_stats()

    def reset_stats(self):
        self.stats = {
            "stages": 0,
            "mixed_stages": 0,
            "stage_items": 0,
            "stage_tokens": 0,
            "stage_seconds": 0.0,
            "exits_per_loop": [0] * self.B,
            "kv_copy_tokens": 0,
            "kv_later_items": 0,
            "stage_times": [],
            # where the steps' time went (host seconds; on CUDA the launches unless something synchronizes):
            # the loop itself, the LM head of emitting and exit-candidate rows, decide's own work (the exit rule,
            # routing), the KV of loops an exited token skipped (kv mode later: queuing the items that compute
            # it in later steps' execute), sampling and committing tokens to requests
            "seconds": dict.fromkeys(STEP_PARTS, 0.0),
            "spec_rounds": 0,  # speculative decoding: verifications, drafted, accepted and committed tokens
            "spec_drafted": 0,
            "spec_accepted": 0,
            "spec_tokens": 0,
        }

    # --- request life ---------------------------------------------------------------------------
    def validate(self, req: Request) -> None:
        V = self.config.vocab_size
        if not req.prompt:
            raise RequestError("the prompt is empty; give at least one token")
        if any(not isinstance(t, int) or not 0 <= t < V for t in req.prompt):
            raise RequestError(f"prompt token ids must be whole numbers in [0, {V})")
        if not isinstance(req.max_tokens, int) or isinstance(req.max_tokens, bool) or req.max_tokens <= 0:
            raise RequestError(f"max_tokens must be a whole number >= 1, got {req.max_tokens!r}")
        need = len(req.prompt) + req.max_tokens - 1
        if need > self.max_seq_len:
            raise RequestError(
                f"prompt of {len(req.prompt)} tokens + max_tokens {req.max_tokens} needs {need} positions; "
                f"this engine holds {self.max_seq_len} (shorten the prompt or lower max_tokens)"
            )
        if not isinstance(req.sampling, SamplingParams):
            raise RequestError("sampling must be a SamplingParams")
        req.sampling.validate()

    def start(self, req: Request) -> Item:
        """Give the request a cache row and return its prefill item."""
        req.row = self.cache.allocate()
        req.status = "running"
        if not req.sampling.greedy:
            seed = req.sampling.seed if req.sampling.seed is not None else int(torch.randint(2**62, ()).item())
            req.generator = torch.Generator().manual_seed(seed)
        ids = torch.tensor(req.prompt, device=self.device)
        return Item(req, 0, len(req.prompt), 0, "prefill", ids=ids)

    def finish(self, req: Request, status: str = "done", error: str | None = None) -> None:
        """Finish, cancel or fail a request: release its cache row at once."""
        if req.row is not None:
            self.cache.release(req.row)
            req.row = None
        if not req.finished:
            req.status, req.error = status, error
            req.finish_time = self.clock()

    def cancel(self, req: Request) -> None:
        self.finish(req, "cancelled")

    # --- one loop over a batch of items ----------------------------------------------------------
    # A step is four plain parts, in the spirit of vLLM's schedule / execute / update_from_output:
    #   execute(items)        -> h_out: the K shared layers once over every item (writes their KV)
    #   decide(items, h_out)  -> Decision: which items continue to their next loop, which emit a token
    #                            now (their last loop, or an early exit) and the logits they are drawn from
    #   sample_tokens(dec)    -> one token per emitter (serve/sampling.py)
    #   commit(dec, tokens)   -> each token appended to its request (callbacks, finishing), and the next
    #                            token's item of every request still running
    # Speculative decoding (serve/speculative.py) uses execute, exit_logits and commit_token directly.
    @torch.no_grad()
    def step(self, items: list[Item]) -> tuple[list[Item], list[Item]]:
        """Run one loop over ``items``. Returns (items continuing to their next loop, new items:
        the next token of each request that emitted one and is not finished)."""
        items = self.schedule(items)
        if not items:
            return [], []
        t0, mixed = time.perf_counter(), len({it.loop for it in items}) > 1  # before decide moves items on
        try:
            h_out = self.execute(items)
        except Exception as e:  # a fault in the batch fails the requests in it, not the engine
            self.fail(items, e)
            return [], []
        sec = self.stats["seconds"]
        t1, charged = time.perf_counter(), sec["head"] + sec["kv_fill"]
        dec = self.decide(items, h_out)  # charges its head and KV fill itself
        t2 = time.perf_counter()
        tokens = self.sample_tokens(dec) if dec.emitters else []
        t3 = time.perf_counter()
        produced = self.commit(dec, tokens) if dec.emitters else []
        t4 = time.perf_counter()
        sec["execute"] += t1 - t0
        sec["decide"] += (t2 - t1) - (sec["head"] + sec["kv_fill"] - charged)
        sec["sample"] += t3 - t2
        sec["commit"] += t4 - t3
        self.record_step(len(items), mixed, h_out.shape[0], t4 - t0)
        return dec.cont, produced

    @staticmethod
    def schedule(items: list[Item]) -> list[Item]:
        """The running items in execution order: single tokens first, in cache-row order (a full batch then
        reads the cache in place, unscattered), then prompt segments."""
        items = [it for it in items if it.req.status == "running"]
        items.sort(key=lambda it: (it.length > 1, it.req.row if it.length == 1 else 0))
        return items

    def fail(self, items: list[Item], e: Exception) -> None:
        """Fail every request with an item in a batch that raised (the engine itself goes on)."""
        for req in {id(it.req): it.req for it in items}.values():
            self.finish(req, "error", f"engine fault: {type(e).__name__}: {e}")

    def record_step(self, items: int, mixed: bool, tokens: int, seconds: float) -> None:
        """Count one executed loop over ``items`` items (of several loops: ``mixed``) in ``stats`` (benchmarks and
        the server's metrics read them)."""
        s = self.stats
        s["stages"] += 1
        s["mixed_stages"] += mixed
        s["stage_items"] += items
        s["stage_tokens"] += tokens
        s["stage_seconds"] += seconds
        s["stage_times"].append((items, tokens, seconds))

    def _embed_missing(self, items):
        todo = [it for it in items if it.h is None]
        if todo:
            h = self.model.model.embed(torch.cat([it.ids for it in todo]))
            for it, part in zip(todo, h.split([it.length for it in todo])):
                it.h = part

    def execute(self, items: list[Item]) -> torch.Tensor:
        """One loop of the core over ``items`` in ``schedule`` order (an item at loop 0 runs the plan's prelude
        first): their hidden states after it, [tokens, hidden], the items' tokens in order; every token's keys and
        values at the loop's depths are written to its cache row. An item without ``h`` starts from its tokens'
        embeddings."""
        self._embed_missing(items)
        first = [it for it in items if it.loop == 0 and it.kind != "kv"]
        if self.plan.prelude and first:  # once per token, before its first loop
            for it, part in zip(first, self.run_depths(first, self.plan.prelude).split([it.length for it in first])):
                it.h = part
        return self.run_depths(items)

    def run_depths(self, items: list[Item], depths=None) -> torch.Tensor:
        """``depths`` (models/plan.py ``Depth``s: a plan's prelude or coda) over every item, or, with None, each
        item's next loop of the core (loops mixed in one batch where the plan allows). Returns the states after
        them, [tokens, hidden], and writes every token's keys and values at those depths to its cache row."""
        dev, R = self.device, self.cache.num_rows
        n_dec = sum(1 for it in items if it.length == 1)
        loops = {it.loop for it in items} if depths is None else {0}
        uniform = len(loops) == 1
        K = self.K if depths is None else len(depths)
        # the depth that items at ``loop`` run at step k
        depth_at = (lambda loop, k: self.core[loop][k]) if depths is None else (lambda loop, k: depths[k].index)
        if not uniform and not self.mixable:
            raise ConfigError(
                "mixing loops in one batch needs cycle sharing (every loop runs shared layer k "
                "at step k); use the static or sequence scheduler for this model"
            )
        h = torch.cat([it.h for it in items])[None]
        L_ = torch.long
        pos = torch.tensor([it.pos for it in items[:n_dec]], dtype=L_, device=dev)
        row = torch.tensor([it.req.row for it in items[:n_dec]], dtype=L_, device=dev)
        loop = torch.tensor([it.loop for it in items[:n_dec]], dtype=L_, device=dev)
        segs = items[n_dec:]
        if segs:
            pos = torch.cat([pos] + [torch.arange(it.pos, it.pos + it.length, device=dev) for it in segs])
            row = torch.cat(
                [
                    row,
                    torch.tensor([it.req.row for it in segs], device=dev).repeat_interleave(
                        torch.tensor([it.length for it in segs], device=dev)
                    ),
                ]
            )
            loop = torch.cat(
                [
                    loop,
                    torch.tensor([it.loop for it in segs], device=dev).repeat_interleave(
                        torch.tensor([it.length for it in segs], device=dev)
                    ),
                ]
            )
        tables = self.model.model.rotary(pos[None], h.dtype)
        pos_dec = pos[:n_dec]
        t_dec = int(pos_dec.max()) + 1 if n_dec else 0
        ar = self._arange[:t_dec]
        base_mask = (ar[None] <= pos_dec[:, None]) if n_dec else None
        win_mask = ((pos_dec[:, None] - ar[None]) < self.window) if (n_dec and self.has_sliding) else None
        in_place = self._in_place_groups(items[:n_dec], base_mask, win_mask, depths is None) if n_dec else None
        seg_starts = list(itertools.accumulate([n_dec] + [it.length for it in segs]))[:-1]
        route = self._route(uniform, in_place, bool(segs), t_dec)
        if route == "compiled-loop":
            ds = [depth_at(next(iter(loops)), k) for k in range(K)]
            return self.compiled.decode_loop(
                [self.layers[self.layer_map[d]] for d in ds],
                [self.slot_map[d] for d in ds],
                [self.kinds[d] for d in ds],
                ds,
                h,
                tables,
                self.cache,
                pos,
                in_place[0][3],
            )[0]
        for k in range(K):
            if uniform:
                d = depth_at(next(iter(loops)), k)
                layer, slot, kind = self.layers[self.layer_map[d]], self.slot_map[d], self.kinds[d]
                depth = torch.full_like(pos, d)
                cos, sin = tables[kind]
                sliding_tok = None if kind == "full" else torch.ones_like(pos, dtype=torch.bool)
            else:  # a cycle core: every loop runs block layer_map[core[0][k]] at step k, each token its own slot
                depth = self.core_t[loop, k]
                layer, slot = self.layers[self.layer_map[self.core[0][k]]], self.slot_map_t[depth][None]
                if self.has_sliding:
                    sliding_tok = self.sliding_t[depth]
                    sel = sliding_tok[None, :, None]
                    cos = torch.where(sel, tables["sliding"][0], tables["full"][0])
                    sin = torch.where(sel, tables["sliding"][1], tables["full"][1])
                else:
                    sliding_tok, (cos, sin) = None, tables["full"]
            flat = depth * R + row

            def attend(q, kk, vv, attn, flat=flat, sliding_tok=sliding_tok):
                self.cache.write(flat, pos, kk[0].transpose(0, 1), vv[0].transpose(0, 1))
                outs = []
                if n_dec:
                    qd = q[0, :, :n_dec].transpose(0, 1).unsqueeze(2)  # [n_dec, H, 1, d]
                    if in_place is not None:
                        o = self._attend_in_place(attn, qd, in_place, k, t_dec, depth_at)
                    else:
                        kd, vd = self.cache.gather(flat[:n_dec], t_dec)
                        mask = base_mask
                        if sliding_tok is not None:
                            mask = mask & (win_mask | ~sliding_tok[:n_dec, None])
                        o = attn.attend_one(qd, kd, vd, prefix_columns(mask, self.P)[:, None, None, :])
                    outs.append(o.squeeze(2).transpose(0, 1).unsqueeze(0))
                for it, s in zip(segs, seg_starts):
                    t, p0 = it.length, it.pos
                    fr = int(flat[s])
                    ks, vs = self.cache.segment(fr, p0 + t)
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

            if route == "compiled-regions":
                h = self.compiled.forward_attend(layer, h, slot, cos, sin, attend)
            else:
                h = layer.forward_attend(h, slot, cos, sin, attend)
        return h[0]

    def _route(self, uniform: bool, in_place, segments: bool, t_dec: int) -> str:
        """How a step runs, chosen once per step: ``compiled-loop`` (batch 1, or every row busy at one loop:
        the whole loop is one compiled call, dynamic in the cache length read; a lone first token, which reads
        one entry, stays regional), ``compiled-regions`` (each layer's work around attention compiled, one
        loop over all items), or ``eager`` (no compiling, or loops mixed in one batch)."""
        if self.compiled is None or not uniform:
            return "eager"
        if in_place is not None and in_place[0][1] is None and not segments and self.P + t_dec > 1:
            return "compiled-loop"
        return "compiled-regions"

    # --- decode attention read in place -----------------------------------------------------------
    # Gathering each decode token's cache row copies every row's keys and values once per layer, which
    # at 64 busy rows cost more than the attention itself. When at least this fraction of a depth's
    # rows is in the step, attention instead runs over all rows of that depth where they lie (a view)
    # and keeps the outputs of the rows present: idle rows cost a little arithmetic and no copy.
    in_place_min_fraction = 0.5

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

    # --- after the loop: exits, tokens, KV of skipped loops --------------------------------------
    def decide(self, items: list[Item], h_out: torch.Tensor) -> Decision:
        """Which items continue to their next loop and which emit a token now (at their last loop, or leaving
        early under the exit policy), with the logits each emitter draws from. The KV entries of the loops an
        early-exited token skips are filled here (``kv_mode``)."""
        B, policy = self.B, self.policy
        starts = list(itertools.accumulate([0] + [it.length for it in items]))
        cont, emit, exited = [], [], []  # emit: (item, row index into h_out)
        inter, spans = [], {}
        for it, s in zip(items, starts):
            h = h_out[s : s + it.length]
            if it.kind == "kv":
                if it.loop < B - 1:
                    it.h, it.loop = h, it.loop + 1
                    cont.append(it)
                continue
            last = s + it.length - 1
            if it.loop == B - 1:
                emit.append((it, last))
            elif policy.active and not it.req.full_depth and (it.kind == "token" or policy.kind == "oracle"):
                # prompts never exit
                inter.append((it, last))
                spans[id(it)] = (s, it.length)
            else:
                it.h, it.loop = h, it.loop + 1
                cont.append(it)
        exit_mask = None
        logit_rows = emit[:]  # (item, row) pairs whose exit logits are needed
        # an exit runs the plan's coda (once per token that leaves, over all of its item's tokens: their keys and
        # values at the coda's depths are the cache's), then the head; a confidence read from logits needs it too
        span_of = {id(it): (s, it.length) for it, s in zip(items, starts)}
        h_exit = self._through_coda(h_out, [it for it, _ in emit + (inter if policy.needs_logits else [])], span_of)
        if inter:
            rows_t = torch.tensor([r for _, r in inter], device=self.device)
            h_prev = loops = None
            if policy.needs_hidden:
                h_prev = torch.cat([it.h[-1:] for it, _ in inter])  # it.h is still this loop's input
                loops = torch.tensor([it.loop for it, _ in inter], device=self.device)
            if policy.needs_logits:
                logit_rows = logit_rows + inter
            else:  # cosine, hidden-state probe: from h after this loop and h before it
                exit_mask = policy.decide(None, h_out.index_select(0, rows_t), h_prev, loops, self.model)
                leaving = [x for x, e in zip(inter, exit_mask.tolist()) if e]
                logit_rows = logit_rows + leaving
                h_exit = self._through_coda(h_exit, [it for it, _ in leaving], span_of)
        t_head = time.perf_counter()
        logits = self._exit_logits(h_exit, logit_rows) if logit_rows else None
        self._charge("head", t_head)
        n_emit = len(emit)
        if inter and policy.needs_logits:
            inter_logits = logits[n_emit:]
            guesses = (
                torch.tensor([it.req.copy_guess() for it, _ in inter], device=self.device) if policy.copy else None
            )
            if policy.copy_bonus:  # the exiting tokens are drawn from these logits too
                inter_logits = logits[n_emit:] = policy.exit_logits(inter_logits, guesses)
            exit_mask = policy.decide(inter_logits, h_out.index_select(0, rows_t), h_prev, loops, self.model, guesses)
            if policy.kind == "oracle":  # analysis state lives in the policy
                policy.record_loop_argmax([(it.req, it.pos) for it, _ in inter], inter_logits.argmax(-1).tolist())
            keep = [n_emit + i for i, e in enumerate(exit_mask.tolist()) if e]
            logits = logits[list(range(n_emit)) + keep]
        if inter:
            for (it, r), e in zip(inter, exit_mask.tolist()):
                if e:
                    exited.append((it, r))
                else:
                    s, n = spans[id(it)]
                    it.h, it.loop = h_out[s : s + n], it.loop + 1
                    cont.append(it)
        if policy.kind == "oracle" and emit:
            finals = logits[:n_emit].argmax(-1).tolist()
            for (it, _), fa in zip(emit, finals):
                it.req.oracle_loops.append(policy.oracle_loop((it.req, it.pos), fa, B))
        if exited:
            t_kv = time.perf_counter()
            self._fill_skipped(exited, h_out, cont)
            self._charge("kv_fill", t_kv)
        return Decision(cont, emit + exited, logits)

    def _through_coda(self, h_out: torch.Tensor, items: list[Item], span_of: dict) -> torch.Tensor:
        """``h_out`` with the rows of ``items`` (their spans ``span_of``) run through the plan's coda, or
        ``h_out`` itself when the plan has none (the items' continuing states stay views of ``h_out``)."""
        if not self.plan.coda or not items:
            return h_out
        items = sorted(items, key=lambda it: span_of[id(it)][0])  # schedule order: single tokens first
        parts = self.exit_states(items, [h_out[slice(s, s + n)] for s, n in (span_of[id(it)] for it in items)])
        out = h_out.clone()
        for it, part in zip(items, parts.split([it.length for it in items])):
            s, n = span_of[id(it)]
            out[s : s + n] = part
        return out

    def exit_states(self, items: list[Item], states: list[torch.Tensor]) -> torch.Tensor:
        """What the exit head reads for ``items`` (in ``schedule`` order) whose core states are ``states``: those
        states through the plan's coda (writing the coda's keys and values), [tokens, hidden]; public for
        speculative decoding."""
        if not self.plan.coda:
            return torch.cat(states)
        exiting = [Item(it.req, it.pos, it.length, it.loop, it.kind, h=h) for it, h in zip(items, states)]
        return self.run_depths(exiting, self.plan.coda)

    def _charge(self, part: str, since: float) -> None:
        self.stats["seconds"][part] += time.perf_counter() - since

    def sample_tokens(self, dec: Decision) -> list[int]:
        """One token per emitter, drawn from its logits with its request's sampling parameters and generator."""
        reqs = [it.req for it, _ in dec.emitters]
        return sample(dec.logits, [r.sampling for r in reqs], [r.generator for r in reqs]).tolist()

    def commit(self, dec: Decision, tokens: list[int]) -> list[Item]:
        """Append each emitted token to its request; returns the next token's item of each request still
        running."""
        now, produced = self.clock(), []
        for (it, _), tok in zip(dec.emitters, tokens):
            if self.commit_token(it.req, tok, it.loop + 1, now):
                pos = len(it.req.prompt) + len(it.req.output) - 1
                produced.append(Item(it.req, pos, 1, 0, "token", ids=torch.tensor([tok], device=self.device)))
        return produced

    def commit_token(self, req: Request, tok: int, exit_loop: int, now: float | None = None) -> bool:
        """Append one token to a running request (its time, the 1-based loop it left at, the ``on_token``
        callback) and finish the request at max_tokens or its EOS. Returns whether the request still runs."""
        if req.status != "running":
            return False
        req.output.append(tok)
        req.token_times.append(self.clock() if now is None else now)
        req.exit_loops.append(exit_loop)
        self.stats["exits_per_loop"][exit_loop - 1] += 1
        if req.on_token is not None:
            try:
                req.on_token(req, tok)
            except Exception as e:
                self.finish(req, "error", f"on_token callback failed: {type(e).__name__}: {e}")
                return False
        if req.status != "running":  # the callback may cancel requests
            return False
        if len(req.output) >= req.max_tokens or (req.eos_token_id is not None and tok == req.eos_token_id):
            self.finish(req, "done")
            return False
        return True

    def exit_logits(self, h: torch.Tensor, loops: list[int]) -> torch.Tensor:
        """Exit logits [n, V] of hidden states h [n, hidden], row i leaving after 0-based loop ``loops[i]``
        (its exit adapter applies); public for warm-up, benchmarks and speculative decoding."""
        pairs = [(_Loop(l), i) for i, l in enumerate(loops)]
        return self._exit_logits(h, pairs)

    def _exit_logits(self, h_out: torch.Tensor, pairs: list) -> torch.Tensor:
        """Exit logits of the rows of (item, row) pairs. With an exit adapter every row uses its own loop's
        (rows from different loops share one call, grouped by loop inside); without one, the plain exit. A compiled
        quantized engine runs a lone row's head as a graph (serve/compiled.py): the int8 head's streamed product."""
        h = h_out.index_select(0, torch.tensor([r for _, r in pairs], device=self.device))
        adapter = self.model.exit_adapter is not None
        if self.compiled is not None and self.quantized and len(pairs) == 1:
            # one row: its loop an int, so the adapter's choice of loop is made while tracing (a graph per loop)
            return self.compiled.exit_logits(self.model, h, pairs[0][0].loop if adapter else None)
        loops = torch.tensor([it.loop for it, _ in pairs], device=self.device) if adapter else None
        return self.model.exit_logits(h, loops)

    def _fill_skipped(self, exited, h_out, cont):
        """KV entries of the loops an early-exited token skipped."""
        if self.kv_mode == "later":
            for it, r in exited:
                kv = Item(it.req, it.pos, 1, it.loop + 1, "kv", h=h_out[r : r + 1])
                cont.append(kv)
                self.stats["kv_later_items"] += 1
            return
        by_loop: dict[int, list] = {}
        for it, r in exited:
            by_loop.setdefault(it.loop, []).append((it, r))
        for l, group in by_loop.items():
            h = h_out.index_select(0, torch.tensor([r for _, r in group], device=self.device))[None]
            self.fill_copy(
                l,
                h,
                torch.tensor([it.pos for it, _ in group], device=self.device),
                torch.tensor([it.req.row for it, _ in group], device=self.device),
            )
            self.stats["kv_copy_tokens"] += len(group)

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
