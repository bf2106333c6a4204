"""The serving engine: one loop of the core at a time over work items at mixed depths.

A work item (serve/request.py) is (request, positions, loop): a whole prompt (prefill), one new token, or (``kv``
items) an early-exited token finishing the loops it skipped, only to fill its KV entries. One ``Engine.step`` reads
schedule -> execute -> decide -> sample -> commit: the running items in order; one loop of the core over all of them
in one batch (serve/batch.py, which also routes each item's attention); which items leave after this loop (their
last, or an early exit under the policy, serve/exits.py) and the logits they draw from; their tokens; each token
appended to its request and the next token's item made.

The KV entries of loops an exited token skips are filled either by ``copy`` (CALM: its exit state projected through
the skipped depths' k/v projections) or ``later`` (the paper's proposal: the token keeps running those loops as a
``kv`` item, batched with other work, while its successor already starts).

Per-depth prefixes (paper appendix G) are projected once, when the engine starts, into the front of every cache row
(serve/cache.py); every attention mask gets P leading columns that all queries see.
"""

from __future__ import annotations

import itertools
import time

import torch

from ..models.cpu_products import prepare_for_cpu, release
from ..models.quantized import is_quantized
from .batch import DepthRunner
from .cache import KVCache
from .compiled import CompiledBlock
from .exits import ExitPolicy
from .request import Decision, Item, Request
from .sampling import RequestError, SamplingParams, sample

KV_MODES = ("copy", "later")
STEP_PARTS = ("execute", "head", "decide", "kv_fill", "sample", "commit")  # stats["seconds"] of a step


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
        self.runner = DepthRunner(model, self.cache, self.compiled)  # batch building and attention routing
        self.plan, self.core = c.plan, self.runner.core  # core[i][k]: the depth loop i runs at its k-th step
        self.mixable = self.plan.mixable  # loops run the same block at their k-th step (cycle cores)
        if self.P:  # the served weights are frozen: each depth's prefix keys/values are computed once
            with torch.no_grad():
                for d in range(self.L):
                    k, v = model.model.layers[c.layer_map[d]].attn.prefix_kv(c.slot_map[d])
                    self.cache.set_prefix(d, k[0], v[0])
        self.policy = (exit_policy or ExitPolicy()).bind(model)
        self.kv_mode = kv_mode
        self.clock = clock or time.perf_counter
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
            for it, part in zip(first, self.runner.run(first, self.plan.prelude).split([it.length for it in first])):
                it.h = part
        return self.runner.run(items)

    # --- after the loop: exits, tokens, KV of skipped loops --------------------------------------
    def decide(self, items: list[Item], h_out: torch.Tensor) -> Decision:
        """Which items continue to their next loop and which emit a token now (at their last loop, or leaving
        early under the exit policy), with the logits each emitter draws from. The KV entries of the loops an
        early-exited token skips are filled here (``kv_mode``)."""
        B, policy = self.B, self.policy
        starts = list(itertools.accumulate([0] + [it.length for it in items]))
        span_of = {id(it): (s, it.length) for it, s in zip(items, starts)}
        cont, emit, inter = self._sort_by_loop(items, h_out, starts)  # emit, inter: (item, row index into h_out)
        exited = []
        exit_mask = None
        logit_rows = emit[:]  # (item, row) pairs whose exit logits are needed
        # an exit runs the plan's coda (once per token that leaves, over all of its item's tokens: their keys and
        # values at the coda's depths are the cache's), then the head; a confidence read from logits needs it too
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
                    s, n = span_of[id(it)]
                    it.h, it.loop = h_out[s : s + n], it.loop + 1
                    cont.append(it)
        if policy.kind == "oracle" and emit:  # analysis: the loop each final token was first the argmax at
            finals = logits[:n_emit].argmax(-1).tolist()
            for (it, _), fa in zip(emit, finals):
                it.req.oracle_loops.append(policy.oracle_loop((it.req, it.pos), fa, B))
        if exited:
            t_kv = time.perf_counter()
            self._fill_skipped(exited, h_out, cont)
            self._charge("kv_fill", t_kv)
        return Decision(cont, emit + exited, logits)

    def _sort_by_loop(self, items: list[Item], h_out: torch.Tensor, starts: list[int]):
        """``items`` as (continuing, emitting at their last loop, intermediate): an intermediate token may leave
        early under the exit policy (prompts never do); a KV-filling item only moves on. The emitting and
        intermediate ones come with the row of their last token in ``h_out``."""
        cont, emit, inter = [], [], []
        for it, s in zip(items, starts):
            h = h_out[s : s + it.length]
            if it.kind == "kv":
                if it.loop < self.B - 1:
                    it.h, it.loop = h, it.loop + 1
                    cont.append(it)
                continue
            last = s + it.length - 1
            if it.loop == self.B - 1:
                emit.append((it, last))
            elif self.policy.active and not it.req.full_depth and (it.kind == "token" or self.policy.kind == "oracle"):
                inter.append((it, last))
            else:
                it.h, it.loop = h, it.loop + 1
                cont.append(it)
        return cont, emit, inter

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
        return self.runner.run(exiting, self.plan.coda)

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
            self.runner.fill_copy(
                l,
                h,
                torch.tensor([it.pos for it, _ in group], device=self.device),
                torch.tensor([it.req.row for it, _ in group], device=self.device),
            )
            self.stats["kv_copy_tokens"] += len(group)
