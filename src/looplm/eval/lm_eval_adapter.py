"""lm-evaluation-harness model ``looplm``: our looped decoder behind lm-eval's ``LM`` interface.

Importing this module registers the model, so after ``import looplm.eval.lm_eval_adapter``
``lm_eval.simple_evaluate(model="looplm", model_args="pretrained=DIR,exit_loop=1", ...)`` works. From a
shell, ``python -m looplm.eval.lm_eval_adapter <lm_eval arguments>`` is the ``lm_eval`` command with
this model registered and the project's task files on the include path, e.g.::

    python -m looplm.eval.lm_eval_adapter --model looplm --model_args pretrained=out/b2,exit_loop=1 \
        --tasks looplm_piqa --limit 20

Loglikelihood scoring (the speed-critical part):

* requests are grouped by their (tokenised) context, so a multiple-choice question's context runs
  once, however many answers it has; its KV cache is copied to one row per answer, and only the
  answers' tokens run again (no recomputation of a shared context);
* groups are sorted by context length, longest first, and batched; contexts are right-padded and run
  without a mask (causal attention keeps padding out of real tokens' past), or left-padded with
  positions from the mask when a sliding window could bind; answers are sorted by length and run in
  chunks that keep padding small, masking the padded cache slots;
* an answer's last token is never fed to the model, and the LM head runs only on the positions
  whose next token is scored, not on every position, and only at the exit asked for (with a
  262k-token vocabulary, as Gemma 3's, the head costs more than the loops' layers);
* with ``all_loops=True`` one pass scores the request at every loop exit 1..B; later calls with another
  ``exit_loop`` (set ``lm.exit_loop``) are served from that memo, so per-loop accuracy costs one pass.

Tokenisation follows lm-eval's ``TemplateLM`` (trailing spaces of a context move to the continuation;
the pair is encoded whole and split), so the requests are exactly those lm-eval's ``hf`` model scores.
"""

from __future__ import annotations

import os
from collections import defaultdict

import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from ..models.loading import accepted_fingerprints

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def check_tokenizer(model, tokenizer) -> None:
    """A tokenizer whose ids do not fit the model's embedding, or whose vocabulary differs from the
    one saved with the model (its fingerprint in config.json), is not the model's own."""
    if tokenizer is None:
        raise ValueError(
            "the model has no tokenizer files; save the model with its tokenizer "
            "(looplm.models.save_model(model, tokenizer, DIR)) or pass tokenizer="
        )
    n_tok, n_emb = len(tokenizer), model.config.vocab_size
    if n_tok > n_emb:
        raise ValueError(
            f"tokenizer mismatch: the tokenizer has {n_tok} tokens but the model's embedding has "
            f"{n_emb} rows; use the tokenizer saved with the model (its directory), not another one"
        )
    saved = getattr(model.config, "tokenizer_fingerprint", None)
    if saved and saved not in accepted_fingerprints(tokenizer):
        raise ValueError(
            "tokenizer mismatch: this tokenizer's vocabulary differs from the one saved with the "
            "model; use the tokenizer saved with the model (its directory), not another one"
        )


def _bool(v) -> bool:
    if isinstance(v, str):
        return v.strip().lower() in ("1", "true", "yes", "y")
    return bool(v)


@register_model("looplm")
class LoopLMEval(TemplateLM):
    """``pretrained``: a looplm/HF directory, .gguf file, embedded name, or an in-memory
    LoopLMForCausalLM (then pass ``tokenizer``). ``exit_loop``: static exit after loop i (default B)."""

    def __init__(
        self,
        pretrained="smollm2-135m",
        tokenizer=None,
        exit_loop=None,
        batch_size=16,
        max_length=None,
        all_loops=False,
        device="cpu",
        dtype="float32",
        max_gen_toks=256,
        exit_rule=None,
        **kwargs,
    ):
        super().__init__()
        from ..models import load_model

        if isinstance(pretrained, str):
            model, tok = load_model(pretrained, dtype=getattr(torch, str(dtype)))
            if tokenizer is not None:
                tok = tokenizer if not isinstance(tokenizer, str) else _load_tokenizer(tokenizer)
        else:
            model, tok = pretrained, tokenizer
        check_tokenizer(model, tok)
        if device in (None, "auto") or (str(device).startswith("cuda") and not torch.cuda.is_available()):
            device = "cpu"  # lm_eval's CLI defaults to cuda; this is a CPU project
        self.model = model.eval().to(device)
        self.tokenizer = tok
        self.config = model.config
        self.B = model.config.num_loops
        self.exit_loop = self.model.model.check_loops(None if exit_loop in (None, "", "None") else int(exit_loop))
        try:
            self.batch_size = max(1, int(batch_size))
        except (TypeError, ValueError):  # "auto" and friends: a fixed size that suits a CPU
            self.batch_size = 16
        self._max_length = int(max_length) if max_length else None
        self.all_loops = _bool(all_loops)
        self.max_gen_toks = int(max_gen_toks)
        self.add_bos_token = bool(getattr(model.config, "add_bos_token", False)) or None
        self._memo: dict[tuple, list[tuple[float, bool]]] = {}
        self.forward_tokens = 0  # tokens run through the model (for benchmarks)
        # Dynamic exit (teacher-forced): exit_rule(logits [n, V], loop index 0..B-2) -> bool [n], "this
        # token leaves after that loop". Every scored token is then also scored at its own exit loop (memo
        # entry B); ``use_exit_rule = True`` makes results come from there. exit_stats counts exits per
        # loop and tokens whose exit argmax equals the final loop's.
        self.exit_rule = exit_rule
        self.use_exit_rule = False
        self.exit_stats = {"exits_per_loop": [0] * self.B, "agree": 0, "tokens": 0}

    # --- TemplateLM plumbing ---------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        if self._max_length:
            return self._max_length
        return int(getattr(self.config, "max_position_embeddings", 2048) or 2048)

    @property
    def device(self):
        return next(self.model.parameters()).device

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len=None, **kwargs):
        # As lm-eval's hf model: the model's BOS setting decides when the caller does not.
        if add_special_tokens is None and self.add_bos_token is not None:
            bos = self.tokenizer.bos_token
            add_special_tokens = not (bos and string.startswith(bos))
        kw = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        enc = self.tokenizer.encode(string, **kw)
        if (
            add_special_tokens
            and self.add_bos_token
            and self.tokenizer.bos_token_id is not None
            and (not enc or enc[0] != self.tokenizer.bos_token_id)
        ):
            enc = [self.tokenizer.bos_token_id] + enc
        if left_truncate_len:
            enc = enc[-left_truncate_len:]
        return enc

    def tok_decode(self, tokens, **kwargs) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=kwargs.get("skip_special_tokens", True))

    # --- loglikelihood ---------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        loops = self.B if (self.all_loops or self.exit_rule is not None) else self.exit_loop
        entries = loops + (self.exit_rule is not None)  # memo entries a scored request gets
        keys = []
        todo: dict[tuple, list[int]] = defaultdict(list)  # context -> continuations still to score
        for _, ctx, cont in requests:
            if not cont:
                raise ValueError("an empty continuation cannot be scored")
            if len(cont) > self.max_length:
                raise ValueError(f"a continuation of {len(cont)} tokens is longer than max_length={self.max_length}")
            whole = (list(ctx) + list(cont))[-(self.max_length + 1) :]
            ctx_t = tuple(whole[: len(whole) - len(cont)])
            key = (ctx_t, tuple(cont))
            keys.append(key)
            memo = self._memo.get(key)
            if memo is None or len(memo) < entries:
                todo[ctx_t].append(key)
        # Dedupe continuations within a context, longest groups first.
        groups = sorted(
            ((c, sorted(set(ks), key=lambda k: -len(k[1]))) for c, ks in todo.items()),
            key=lambda g: (-len(g[0]), -max(len(k[1]) for k in g[1])),
        )
        n_rows = sum(len(ks) for _, ks in groups)
        bar = tqdm(total=n_rows, desc="looplm loglikelihood", disable=disable_tqdm or n_rows == 0)
        batch: list = []
        rows = 0
        for g in groups:
            if batch and (len(batch) >= self.batch_size or rows + len(g[1]) > 8 * self.batch_size):
                self._score_batch(batch, loops)
                bar.update(rows)
                batch, rows = [], 0
            batch.append(g)
            rows += len(g[1])
        if batch:
            self._score_batch(batch, loops)
            bar.update(rows)
        bar.close()
        out = []
        for (req_str, _, _), key in zip(requests, keys):
            res = self._memo[key][self.B if self.use_exit_rule else self.exit_loop - 1]
            out.append(res)
            if req_str is not None:
                self.cache_hook.add_partial("loglikelihood", req_str, res)
        if not self.all_loops and self.exit_rule is None:
            self._memo.clear()
        return out

    @torch.no_grad()
    def _score_batch(self, groups, loops: int) -> None:
        """Score every continuation of the given context groups at exits 1..loops, into self._memo.

        Pass 1 runs each group's context; a group with a single continuation runs it inline (context +
        continuation[:-1] as one sequence). Pass 2 runs the continuations of multi-answer groups on
        copies of their context's KV cache. Then the exit head runs on the scored positions only."""
        from transformers import DynamicCache

        dev = self.device
        inline = [len(ks) == 1 for _, ks in groups]
        ctx_lens = torch.tensor([len(c) for c, _ in groups])
        conts = [(gi, k[1]) for gi, (_, ks) in enumerate(groups) for k in ks]
        keys = [k for _, ks in groups for k in ks]
        cont_rows = [r for r, (gi, c) in enumerate(conts) if not inline[gi] and len(c) > 1]
        Tm = max((len(conts[r][1]) - 1 for r in cont_rows), default=0)
        ids, mask1, offset, left = self._pass1_inputs(groups, inline, Tm)
        cache = DynamicCache() if cont_rows else None
        if left:
            pos = (mask1.cumsum(-1) - 1).clamp(min=0)
            states1 = self._loop_states(ids, cache, loops, mask=mask1, pos=pos)
        else:
            states1 = self._loop_states(ids, cache, loops)
        self.forward_tokens += int(mask1.sum())
        src1_g, src1_t, order = _target_positions(groups, conts, inline, offset)
        cont_h = None
        place = {}
        if cont_rows:
            cont_h = self._continuations(cache, groups, conts, cont_rows, ctx_lens, mask1, loops, place)
        n1 = len(src1_g)
        index = torch.tensor([i if kind == "1" else n1 + place[i] for kind, i in order]).to(dev)
        g_idx, t_idx = torch.tensor(src1_g).to(dev), torch.tensor(src1_t).to(dev)
        tgt = torch.tensor([t for _, c in conts for t in c]).to(dev)

        def hidden(li: int) -> torch.Tensor:
            """Loop ``li``'s hidden state before each target token, in target order."""
            h = states1[li][g_idx, t_idx]
            if cont_h is not None:
                h = torch.cat([h, cont_h[li]], dim=0)
            return h[index]

        results = self._score_heads(hidden, tgt, [len(c) for _, c in conts], loops)
        for key, res in zip(keys, results):
            self._memo[key] = res

    def _pass1_inputs(self, groups, inline: list[bool], Tm: int):
        """Pass 1's token ids and mask [G, T1] (a group's context, and its one continuation but the last token when
        inline), each row's padding offset, and whether the rows are left-padded. ``Tm``: the longest pass-2 run."""
        G = len(groups)
        seqs = [list(c) + (list(ks[0][1][:-1]) if inline[g] else []) for g, (c, ks) in enumerate(groups)]
        seq_lens = torch.tensor([len(x) for x in seqs])
        T1 = int(seq_lens.max())
        # Right padding: causal attention keeps padding out of every real token's past, so pass 1 needs
        # no mask (the fast causal kernel); pass 2 masks the padded cache slots. A sliding window counts
        # cache slots, not positions, so when it could bind, pass 1 is left-padded (positions from the
        # mask), which keeps slots == positions.
        window = getattr(self.config, "sliding_window_size", None)
        left = bool(window) and T1 + Tm > window and bool((seq_lens != T1).any())
        ids = torch.zeros((G, T1), dtype=torch.long)
        mask1 = torch.zeros((G, T1), dtype=torch.long)
        offset = (T1 - seq_lens) if left else torch.zeros(G, dtype=torch.long)
        for g, x in enumerate(seqs):
            o = int(offset[g])
            ids[g, o : o + len(x)] = torch.tensor(x)
            mask1[g, o : o + len(x)] = 1
        return ids, mask1, offset, left

    def _loop_states(self, ids, cache, loops: int, mask=None, pos=None) -> list[torch.Tensor]:
        """Every loop's hidden states of ``ids`` (appended to ``cache``); ``mask`` and ``pos`` for padded rows
        whose positions are not their slots."""
        dev = self.device
        padded = {} if mask is None else {"attention_mask": mask.to(dev), "position_ids": pos.to(dev)}
        _, states, _ = self.model.model(
            ids.to(dev), past_key_values=cache, num_loops=loops, output_loop_states=True, **padded
        )
        return states

    def _score_heads(self, hidden, tgt, lengths: list[int], loops: int) -> list[list]:
        """Each continuation's (log-likelihood, greedy) at exits 1..loops from ``hidden(loop)``, the states before
        its ``lengths`` target tokens ``tgt``; with an exit rule, then at each token's own exit (entry B)."""
        dev = self.device
        results = [[] for _ in lengths]
        rule = self.exit_rule is not None  # then loops == B
        # The head runs at every exit only when every exit is kept; otherwise at the last alone (the memo's
        # earlier entries stay None: the memo is cleared after the call).
        heads = range(loops) if (self.all_loops or rule) else [loops - 1]
        for res in results:
            res.extend([None] * (loops - len(heads)))
        if rule:  # each token's log-prob, greedy hit and argmax at the loop it leaves after
            gone = torch.zeros(len(tgt), dtype=torch.bool, device=dev)
            dyn_ll = torch.zeros(len(tgt), dtype=torch.float64, device=dev)
            dyn_hit = torch.zeros(len(tgt), dtype=torch.bool, device=dev)
            dyn_arg = torch.zeros(len(tgt), dtype=torch.long, device=dev)
        for li in heads:
            logits = self.model.exit_logits(hidden(li), loop=li).float()
            logp = F.log_softmax(logits, dim=-1)
            ll = logp.gather(1, tgt[:, None])[:, 0].double()
            arg = logp.argmax(-1)
            _append_scores(results, lengths, ll.cpu(), (arg == tgt).cpu())
            if rule:
                now = ~gone if li == loops - 1 else (self.exit_rule(logits, li).to(dev) & ~gone)
                dyn_ll = torch.where(now, ll, dyn_ll)
                dyn_hit = torch.where(now, arg == tgt, dyn_hit)
                dyn_arg = torch.where(now, arg, dyn_arg)
                gone |= now
                self.exit_stats["exits_per_loop"][li] += int(now.sum())
        if rule:
            _append_scores(results, lengths, dyn_ll.cpu(), dyn_hit.cpu())
            self.exit_stats["agree"] += int((dyn_arg == arg).sum())
            self.exit_stats["tokens"] += len(tgt)
        return results

    def _continuations(self, cache, groups, conts, rows, ctx_lens, mask1, loops, place):
        """Pass 2: continuation tokens (all but the last) of multi-answer groups, on copies of their
        context's cache rows. Rows are sorted by length and cut into chunks minimising padded tokens
        plus a per-call cost. Fills ``place[(row, t)]``; returns per-loop hidden states [n, d]."""
        dev = self.device
        rows = sorted(rows, key=lambda r: -len(conts[r][1]))
        lens = [len(conts[r][1]) - 1 for r in rows]
        chunks = _chunk_by_length(lens, call_cost=CALL_COST_TOKENS)
        pieces = [[] for _ in range(loops)]
        n = 0
        for lo, hi in chunks:
            chunk = rows[lo:hi]
            Tm = lens[lo]
            R = len(chunk)
            ids = torch.zeros((R, Tm), dtype=torch.long)
            cmask = torch.zeros((R, Tm), dtype=torch.long)
            for j, r in enumerate(chunk):
                c = conts[r][1]
                ids[j, : len(c) - 1] = torch.tensor(c[:-1])
                cmask[j, : len(c) - 1] = 1
            grp = torch.tensor([conts[r][0] for r in chunk])
            sub = _select_cache(cache, grp.to(dev))
            mask = torch.cat([mask1[grp], cmask], dim=1)
            pos = ctx_lens[grp][:, None] + torch.arange(Tm)[None]
            states = self._loop_states(ids, sub, loops, mask=mask, pos=pos)
            self.forward_tokens += int(cmask.sum())
            sel = cmask.bool().to(dev)
            for li in range(loops):
                pieces[li].append(states[li][sel])  # row-major: each row's tokens in order
            for r in chunk:
                for t in range(len(conts[r][1]) - 1):
                    place[(r, t)] = n
                    n += 1
        return [torch.cat(p, dim=0) for p in pieces]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        windows, counts = [], []
        for (string,) in tqdm([r.args for r in requests], disable=disable_tqdm, desc="rolling windows"):
            ws = list(
                map(
                    lm_utils.make_disjoint_window,
                    lm_utils.get_rolling_token_windows(
                        token_list=self.tok_encode(string),
                        prefix_token=self.prefix_token_id,
                        max_seq_len=self.max_length,
                        context_len=1,
                    ),
                )
            )
            windows.extend((None, list(a), list(b)) for a, b in ws)
            counts.append(len(ws))
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        out, i = [], 0
        for req, n in zip(requests, counts):
            total = sum(s for s, _ in scores[i : i + n])
            i += n
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return out

    # --- generation (greedy, one request at a time, KV cache) -------------------------------------
    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False):
        from transformers import DynamicCache

        out = []
        for req in tqdm(requests, disable=disable_tqdm, desc="looplm generate"):
            context, gen_kwargs = req.args
            gen_kwargs = dict(gen_kwargs or {})
            until = gen_kwargs.pop("until", None) or []
            if isinstance(until, str):
                until = [until]
            eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
            until = list(until) + ([eos] if eos and eos not in until else [])
            max_new = int(gen_kwargs.pop("max_gen_toks", self.max_gen_toks))
            ids = self.tok_encode(context, left_truncate_len=max(1, self.max_length - max_new))
            cache = DynamicCache()
            x = torch.tensor([ids], device=self.device)
            new: list[int] = []
            text = ""
            for _ in range(max_new):
                h, _, cache = self.model.model(x, past_key_values=cache, num_loops=self.exit_loop)
                nxt = int(self.model.exit_logits(h[:, -1], loop=self.exit_loop - 1).argmax(-1))
                if nxt == self.eot_token_id:
                    break
                new.append(nxt)
                text = self.tok_decode(new)
                if any(u in text for u in until if u):
                    break
                x = torch.tensor([[nxt]], device=self.device)
            for u in until:
                if u:
                    text = text.split(u)[0]
            out.append(text)
            self.cache_hook.add_partial("generate_until", (context, req.args[1]), text)
        return out


# A forward call costs about as much as this many padded tokens of work, whatever its size (every layer's
# small ops run once per call).
CALL_COST_TOKENS = 32


def _chunk_by_length(lens: list[int], call_cost: int) -> list[tuple[int, int]]:
    """Cut a list of lengths sorted longest first into [lo, hi) chunks, each padded to its first
    length, minimising padded tokens + call_cost per chunk (exact, by dynamic programming)."""
    n = len(lens)
    best = [0.0] + [float("inf")] * n
    cut = [0] * (n + 1)
    for hi in range(1, n + 1):
        for lo in range(hi):
            cost = best[lo] + call_cost + lens[lo] * (hi - lo)
            if cost < best[hi]:
                best[hi], cut[hi] = cost, lo
    out, hi = [], n
    while hi > 0:
        out.append((cut[hi], hi))
        hi = cut[hi]
    return out[::-1]


def _target_positions(groups, conts, inline: list[bool], offset) -> tuple[list[int], list[int], list[tuple]]:
    """Where each target token's predicting hidden state is: pass 1's (group, slot) lists, and per target token in
    order ("1", index into them) or ("2", (continuation row, token)) for a pass-2 state."""
    src1_g, src1_t, order = [], [], []
    for r, (gi, c) in enumerate(conts):
        o, n_ctx = int(offset[gi]), len(groups[gi][0])
        if inline[gi]:
            for t in range(len(c)):
                order.append(("1", len(src1_g)))
                src1_g.append(gi)
                src1_t.append(o + n_ctx - 1 + t)
        else:
            order.append(("1", len(src1_g)))
            src1_g.append(gi)
            src1_t.append(o + n_ctx - 1)
            order.extend(("2", (r, t)) for t in range(len(c) - 1))
    return src1_g, src1_t, order


def _append_scores(results: list[list], lengths: list[int], ll: torch.Tensor, greedy: torch.Tensor) -> None:
    """Append to each continuation's results its (summed log-likelihood, all tokens greedy) from per-token ``ll``
    and ``greedy`` (the continuations' tokens one after another)."""
    start = 0
    for res, n in zip(results, lengths):
        res.append((float(ll[start : start + n].sum()), bool(greedy[start : start + n].all())))
        start += n


def _select_cache(cache, idx: torch.Tensor):
    """A new DynamicCache holding rows ``idx`` of ``cache`` (one row per continuation)."""
    from transformers import DynamicCache

    out = DynamicCache()
    for i, layer in enumerate(cache.layers):
        out.update(layer.keys.index_select(0, idx), layer.values.index_select(0, idx), i)
    return out


def _load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def main(argv=None) -> int:
    """``lm_eval`` with the ``looplm`` model registered and the project's tasks on the include path."""
    import sys

    from .tasks import include_path

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--include_path" not in argv:
        argv += ["--include_path", str(include_path())]
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm_eval"] + argv
    return cli_evaluate() or 0


if __name__ == "__main__":
    raise SystemExit(main())
