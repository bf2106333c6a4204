"""Speculative decoding: lossless speed from the context and from the loop itself.

A round, for every request decoding (batched over requests; ``schedulers.SpeculativeScheduler`` runs rounds):

1. **Draft** k tokens after the request's pending token (the last one committed, not yet run):
   - ``context``: prompt lookup. The longest final n-gram (n = 3, 2, 1) that occurred before; the tokens that
     followed its last occurrence are copied, and the copy may run on into itself (a period repeats). No model
     call; any model, vanilla included.
   - ``loop1``: the model's own loop 1. Loop 1 runs the same shared weights as the full model's first loop, so
     its hidden states and keys/values for a drafted token are exactly the full model's; it runs k single-token
     steps (the pending token, then each draft), each draft read at loop 1's exit (its exit adapter, if any).
   - ``both``: the context's draft where it has one, else loop 1's.
2. **Verify** all drafted positions at once: the remaining loops over the request's drafted tokens as one
   segment (a ``verify`` item; context drafts run every loop, loop-1 drafts start at loop 2 from the hidden
   states drafting computed, so loop 1 never runs twice). One engine step per loop for all requests.
3. **Accept** the longest prefix the full model agrees with, plus the full model's own next token where it has
   one (greedy: the argmax; sampling: the speculative-sampling rule of Leviathan et al. / Chen et al., so the
   output distribution is the model's). Tokens are committed through ``Engine.commit_token``.
4. **Roll back** the KV cache of rejected positions (``KVCache.truncate``).

k is per request and per source, adapted to the recent acceptance rate: an exponential average a of the fraction
of drafted tokens accepted sets k to about the run of accepted drafts it predicts, a / (1 - a), plus one,
between 1 and ``max_draft``.

Greedy output is the full-depth greedy output (to floating-point ties). Sampled output has the model's
distribution, but not the same tokens as plain decoding with the same seed (the generator is read differently).
Exit policies are refused: speculation is the lossless alternative to early exits.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .context_index import ContextIndex
from .engine import Engine
from .request import Item, Request
from .sampling import draw, filtered_probs

MODES = ("off", "context", "loop1", "both")  # the draft sources (off: no speculation)
FINISHED_KEPT = 4096  # finished requests whose counts a Speculator keeps for state_of


def check_mode(mode: str, num_loops: int) -> None:
    """A usage error (ValueError) for a speculation mode this model cannot run."""
    if mode not in MODES:
        raise ValueError(f"unknown speculation mode {mode!r}; use one of {', '.join(MODES)}")
    if mode == "loop1" and num_loops < 2:
        raise ValueError(
            "--speculate loop1 drafts with the model's first loop, and this model has one loop (B = 1): "
            "its loop 1 is the whole model; use --speculate context"
        )


class SpecState:
    """One request's speculation: its context index (prompt lookup, n-grams of 3 down to 1), draft lengths per
    source and counts."""

    def __init__(self, req: Request, max_draft: int):
        self.request = req
        self.context = ContextIndex(req.prompt, n=3, min_n=1)
        self.max_draft = max_draft
        self.rate = {"context": 0.5, "loop1": 0.5}  # recent fraction of drafted tokens accepted, per source
        self.drafted = self.accepted = self.rounds = self.tokens = 0

    def k(self, source: str) -> int:
        a = min(self.rate[source], 0.95)
        return max(1, min(self.max_draft, round(a / (1 - a)) + 1))

    def update(self, source: str | None, drafted: int, accepted: int, committed: int) -> None:
        if drafted:
            self.rate[source] = 0.7 * self.rate[source] + 0.3 * accepted / drafted
        self.drafted += drafted
        self.accepted += accepted
        self.rounds += 1
        self.tokens += committed


def figures(counts) -> dict:
    """Acceptance rate (accepted / drafted tokens) and mean accepted length (tokens committed per verification,
    the verifier's own token included) from a Speculator's stats or one request's SpecState."""
    get = counts.get if isinstance(counts, dict) else lambda k: getattr(counts, k)
    drafted, accepted, rounds, tokens = (get(k) for k in ("drafted", "accepted", "rounds", "tokens"))
    return {
        "drafted": drafted,
        "accepted": accepted,
        "verifications": rounds,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        "mean_accepted_length": round(tokens / rounds, 3) if rounds else None,
    }


@dataclass
class Draft:
    """One request's round: its pending-token item, the drafted tokens and their source (None: no draft, the
    pending token is verified alone); for loop-1 drafts the count k, each draft's loop-1 state and (sampling) the
    distribution it was drawn from; then the item that verifies them and the full model's logits over it."""

    item: Item
    state: SpecState
    drafts: list[int] = field(default_factory=list)
    source: str | None = None
    k: int = 0
    h: list[torch.Tensor] = field(default_factory=list)
    q: list[torch.Tensor | None] = field(default_factory=list)
    verify: Item | None = None
    logits: torch.Tensor | None = None


def accept_greedy(drafts: list[int], targets: list[int]) -> list[int]:
    """Tokens a greedy round commits: the drafts up to the first one that differs from the full model's argmax
    at its position, then the full model's own token there (when it has a row for it)."""
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return drafts[:a] + targets[a : a + 1]


def accept_sampled(drafts: list[int], q: torch.Tensor, p: torch.Tensor, generator) -> list[int]:
    """Speculative sampling: draft i, drawn from q[i] [V], is accepted with probability min(1, p[i][d] / q[i][d]);
    the first rejected one is replaced by a draw from the normalised max(p[i] - q[i], 0), and when every draft is
    accepted and p has a row after them, a token is drawn from it. Each committed token then has the target
    distribution p given the tokens before it. p [m, V] with m = len(drafts) or len(drafts) + 1."""
    out = []
    for i, d in enumerate(drafts):
        pd, qd = float(p[i, d]), float(q[i, d])
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        if qd > 0 and u * qd < pd:  # u < p/q, without dividing
            out.append(d)
            continue
        residual = (p[i] - q[i]).clamp_min(0)
        out.append(draw(residual if float(residual.sum()) > 0 else p[i], generator))
        return out
    if p.shape[0] > len(drafts):
        out.append(draw(p[len(drafts)], generator))
    return out


class Speculator:
    """Speculative rounds on an engine. ``round(items)`` takes the pending-token items of decoding requests and
    returns the next ones (requests that finished drop out). ``stats``: verifications, drafted, accepted and
    committed tokens, over every request; ``state_of(request)`` one request's."""

    def __init__(self, engine: Engine, mode: str, max_draft: int = 8):
        check_mode(mode, engine.B)
        if mode == "off":
            raise ValueError("a Speculator needs a speculation mode other than off")
        if engine.policy.active:
            raise ValueError(
                "speculative decoding gives the full model's tokens; an exit policy changes them: use one or the other"
            )
        self.engine, self.mode, self.max_draft = engine, mode, max_draft
        self.use_loop1 = mode in ("loop1", "both") and engine.B > 1
        self.use_context = mode in ("context", "both")
        self.states: dict = {}  # request id -> SpecState, while the request runs
        self.finished: OrderedDict = OrderedDict()  # the last FINISHED_KEPT finished requests' states (counts only)
        self.stats = {"rounds": 0, "drafted": 0, "accepted": 0, "tokens": 0}

    def state_of(self, req: Request) -> SpecState | None:
        return self.states.get(req.id) or self.finished.get(req.id)

    def _state(self, req: Request) -> SpecState:
        st = self.states.get(req.id)
        if st is None:
            st = self.states[req.id] = SpecState(req, self.max_draft)
        st.context.extend(req.output[len(st.context.tokens) - len(req.prompt) :])
        return st

    def _retire_finished(self) -> None:
        """Finished requests (done, failed or cancelled) keep their counts a while, for ``state_of`` (a server runs
        for ever); their context index goes."""
        for rid in [rid for rid, st in self.states.items() if st.request.finished]:
            st = self.finished[rid] = self.states.pop(rid)
            st.context = st.request = None
        while len(self.finished) > FINISHED_KEPT:
            self.finished.popitem(last=False)

    @torch.no_grad()
    def round(self, items: list[Item]) -> list[Item]:
        eng = self.engine
        items = [it for it in items if it.req.status == "running"]
        if not items:
            return []
        try:
            drafts = self._draft(items)
            self._verify(drafts)
        except Exception as e:  # a fault fails the requests of this round, not the engine
            eng.fail(items, e)
            drafts = []
        following = [nxt for d in drafts if (nxt := self._accept(d)) is not None]
        self._retire_finished()  # also those cancelled or failed since the last round
        return following

    # --- 1. draft ------------------------------------------------------------------------------------
    def _draft(self, items: list[Item]) -> list[Draft]:
        eng, out, by_loop1 = self.engine, [], []
        for it in items:
            req, st = it.req, self._state(it.req)
            room = req.max_tokens - len(req.output) - 1  # the drafts and the verifier's token fit max_tokens
            d = Draft(it, st)
            if room > 0 and self.use_context:
                d.drafts = st.context.draft(min(room, st.k("context")))
                d.source = "context" if d.drafts else None
            if room > 0 and not d.drafts and self.use_loop1:
                d.source, d.k = "loop1", min(room, st.k("loop1"))
                by_loop1.append(d)
            out.append(d)
        # loop 1, one single-token step per draft for all drafting requests at once: the pending token, then
        # each draft; every draft is read at loop 1's exit
        step = 0
        while True:
            active = [d for d in by_loop1 if step < d.k]
            if not active:
                break
            owner, work = {}, []  # id(work item) -> its draft
            for d in active:
                it = d.item
                tok = it.ids if step == 0 else torch.tensor([d.drafts[-1]], device=eng.device)
                w = Item(it.req, it.pos + step, 1, 0, "token", ids=tok)
                owner[id(w)] = d
                work.append(w)
            order = eng.schedule(work)
            h = self._run(order)
            logits = eng.exit_logits(eng.exit_states(order, list(h.split(1))), [0] * len(order))
            params = [w.req.sampling for w in order]
            greedy = all(p.greedy for p in params)
            q = None if greedy else filtered_probs(logits, params)
            for i, w in enumerate(order):
                d = owner[id(w)]
                d.h.append(h[i : i + 1])
                if greedy or w.req.sampling.greedy:
                    d.drafts.append(int(logits[i].argmax()))
                    d.q.append(None)
                else:
                    d.drafts.append(draw(q[i], w.req.generator))
                    d.q.append(q[i])
            step += 1
        return out

    # --- 2. verify -----------------------------------------------------------------------------------
    def _verify(self, drafts: list[Draft]) -> None:
        eng = self.engine
        for d in drafts:
            it = d.item
            if d.source == "loop1":  # the pending token and k - 1 drafts, from their loop-1 states
                d.verify = Item(it.req, it.pos, d.k, 1, "verify", h=torch.cat(d.h))
            else:  # the pending token and the context's drafts (or none), from their embeddings
                ids = torch.tensor([int(it.ids[0])] + d.drafts, device=eng.device)
                d.verify = Item(it.req, it.pos, len(ids), 0, "verify", ids=ids)
        todo = [d.verify for d in drafts]
        for loop in range(min(v.loop for v in todo), eng.B):  # every step runs one loop: uniform batches
            order = eng.schedule([v for v in todo if v.loop == loop])
            if not order:
                continue
            h = self._run(order)
            for v, part in zip(order, h.split([v.length for v in order])):
                v.h, v.loop = part, loop + 1
        order = eng.schedule(todo)
        rows = eng.exit_states(order, [v.h for v in order])
        logits = dict(
            zip(map(id, order), eng.exit_logits(rows, [eng.B - 1] * rows.shape[0]).split([v.length for v in order]))
        )
        for d in drafts:  # a request cancelled meanwhile has none (and is not accepted)
            d.logits = logits.get(id(d.verify))

    def _run(self, order: list[Item]) -> torch.Tensor:
        t0 = time.perf_counter()
        h = self.engine.execute(order)
        self.engine.record_step(len(order), len({it.loop for it in order}) > 1, h.shape[0], time.perf_counter() - t0)
        return h

    # --- 3. accept, commit, roll back ----------------------------------------------------------------
    def _accept(self, d: Draft) -> Item | None:
        eng, it, req, drafts, logits = self.engine, d.item, d.item.req, d.drafts, d.logits
        if req.status != "running":
            return None
        if req.sampling.greedy:
            tokens = accept_greedy(drafts, logits.argmax(-1).tolist())
        else:
            p = filtered_probs(logits, [req.sampling] * logits.shape[0])
            if d.source == "loop1":
                q = torch.stack(d.q)
            else:  # a context draft is certain: q is one-hot at it
                q = torch.zeros(len(drafts), p.shape[1], device=p.device)
                if drafts:
                    q[torch.arange(len(drafts)), torch.tensor(drafts)] = 1.0
            tokens = accept_sampled(drafts, q, p, req.generator)
        accepted = next((i for i, (a, b) in enumerate(zip(tokens, drafts)) if a != b), min(len(tokens), len(drafts)))
        now, committed, alive = eng.clock(), 0, True
        for tok in tokens:
            committed += 1
            if not eng.commit_token(req, tok, eng.B, now):
                alive = False
                break
        d.state.update(d.source, len(drafts), accepted, committed)
        for key, n in (("rounds", 1), ("drafted", len(drafts)), ("accepted", accepted), ("tokens", committed)):
            self.stats[key] += n
        if not alive:
            return None
        new_pos = it.pos + len(tokens)  # the new pending token's position; the KV beyond it is rejected drafts
        written = it.pos + d.verify.length
        if written > new_pos:
            eng.cache.truncate(req.row, new_pos, written)
        return Item(req, new_pos, 1, 0, "token", ids=torch.tensor([tokens[-1]], device=eng.device))
