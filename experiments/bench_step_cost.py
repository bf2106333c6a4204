"""What one decode step costs, part by part, and the throughput ceiling that follows for continuous
depth-wise batching with early exits against the vanilla model under sequence-wise batching.

Measured on the serving engine's own code paths, in one process, interleaved (every part once per
round, median over rounds), for n single-token decode items at one position:

- ``vanilla``: `Engine._forward` of the vanilla model (all L layers);
- ``loop``: `Engine._forward` of the looped model at one loop (its K = L / B shared layers; `--loops`);
- ``head``: `model.exit_logits` on n rows (final norm + LM head);
- ``kv_copy``: the k/v projections of the depths after loop 1 for n exited tokens (CALM's copy).

Steady state, decode only, M requests always busy, fractions f_1 .. f_{B-1} of tokens leaving after
loops 1 .. B-1 and the rest running all B loops: a token takes E = sum_j j f_j loops (E = 2 - f at B=2
with f after loop 1), so a request emits a token every E steps and a depth-wise step yields M / E tokens
where a vanilla step yields M. With KV copied the step runs M items; with KV computed later each token
still runs all B loops (its skipped loops as KV-only items), so the step runs B M / E items.
The LM head runs on every row that finishes a loop under a logit policy (margin, softmax), and only on
emitted tokens under a probe. Ceiling = (M / (2 - f)) / t_depth  /  (M / t_vanilla): no scheduling, no
sampling, no prefill, so it is an upper bound on what the engine can measure.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_step_cost.py --json > benchmarks/results/step-cost-smollm2-b2.json
    PYTHONPATH=src .venv/bin/python benchmarks/bench_step_cost.py --loops 3 --sizes 6 \
        --exit-fractions 0,0.127/0.601,0.296/0.497,0/1,1 --json > benchmarks/results/step-cost-smollm2-b3.json

`--head` instead times the LM head alone, two ways, on the model's own weight: `F.linear(x, W)` (the
`nn.Linear` path) against `(W @ x.T).T` (what `exit_logits` does on CPU for 1-64 rows without gradients).

`--packed` instead times a vanilla decode step (`Engine._forward` over all layers, then the LM head) on n items
with every cache row busy, three ways: `F.linear` and attention over gathered cache rows; the engine's MKL-packed
weights (models/packed.py) with gathered rows; packed weights with attention read from the cache in place (the
engine's default on CPU).

`--pack-rows N` packs for N rows instead of 64 (with `--packed`: what the packing row count does).
`--profile` instead prints the torch profiler's top operators for a vanilla step on each n items, the `plain` and
`packed` ways of `--packed` (self CPU time share, 3 steps).

`--attention` instead times single-token attention over every layer's cache rows read in place: SDPA (`attend`)
against the grouped-query matmuls the engine uses on CPU (`attend_one`).

`--fusion` instead times every layer's input projections, matmuls only, on the model's own weights: q, k, v,
gate and up as five `F.linear` calls (what the engine does) against two calls on concatenated weights
(q|k|v and gate|up, as vLLM's QKVParallelLinear and MergedColumnParallelLinear do). `--weights int8|int4`
times the engine's quantized matmuls instead of float32 `F.linear`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from looplm.convert import convert
from looplm.models import load_model
from looplm.models import packed as packing
from looplm.serve.engine import Engine, Item, Request

POS = 64  # decode position: a 64-token context, the middle of the trace's prompts


def decode_items(engine: Engine, n: int, loop: int) -> list[Item]:
    """n single-token items at position POS, each in its own cache row (cache contents do not matter
    for timing)."""
    items = []
    for i in range(n):
        req = Request([1], 1)
        req.row, req.status = i, "running"
        items.append(Item(req, POS, 1, loop, "token", ids=torch.tensor([1 + i], device=engine.device)))
    engine._embed_missing(items)
    return items


def kv_copy(engine: Engine, h: torch.Tensor, loop: int) -> None:
    """The k/v projections of every depth after ``loop``'s for the rows of h (engine._fill_skipped's work)."""
    K, R = engine.K, engine.cache.num_rows
    pos = torch.full((h.shape[0],), POS, device=engine.device)
    row = torch.arange(h.shape[0], device=engine.device)
    cos_sin = engine.model.model.rotary(pos[None], h.dtype)
    for d in range((loop + 1) * K, engine.L):
        k, v = engine.layers[engine.layer_map[d]].project_kv(h[None], engine.slot_map[d], *cos_sin[engine.kinds[d]])
        engine.cache.write(d * R + row, pos, k[0].transpose(0, 1), v[0].transpose(0, 1))


def timed(fn, reps: int) -> float:
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


@torch.no_grad()
def measure(vanilla, looped, sizes: list[int], rounds: int, reps: int, log) -> dict[str, dict[int, float]]:
    B = looped.config.num_loops
    max_n = B * max(sizes)
    ev = Engine(vanilla, max_batch=max_n, max_seq_len=POS + 1)
    el = Engine(looped, max_batch=max_n, max_seq_len=POS + 1)
    parts: dict[str, dict[int, list[float]]] = {k: {} for k in ("vanilla", "loop", "head", "kv_copy")}
    # KV-later steps carry up to B M items; the head and the KV copy also run on a few rows
    needed = sorted({k * n for n in sizes for k in range(1, B + 1)} | {1, 2, 4})
    for r in range(rounds):
        for n in needed:
            iv, il = decode_items(ev, n, 0), decode_items(el, n, 0)
            h = el._forward(il)
            work = {"vanilla": lambda: ev._forward(iv), "loop": lambda: el._forward(il),
                    "head": lambda: looped.exit_logits(h), "kv_copy": lambda: kv_copy(el, h, 0)}
            for name, fn in work.items():
                fn()  # warm-up
                parts[name].setdefault(n, []).append(timed(fn, reps))
        log(f"round {r + 1}/{rounds}: " + ", ".join(
            f"n={n} vanilla {parts['vanilla'][n][-1] * 1e3:.1f} loop {parts['loop'][n][-1] * 1e3:.1f} "
            f"head {parts['head'][n][-1] * 1e3:.1f} ms" for n in sizes))
    return {k: {n: statistics.median(v) for n, v in d.items()} for k, d in parts.items()}


@torch.no_grad()
def head_layouts(model, sizes: list[int], rounds: int, reps: int, log) -> list[dict]:
    """The LM head on n rows: nn.Linear's x W^T against (W x^T)^T, interleaved, median ms."""
    w = model.lm_head.weight
    rows = []
    for n in sizes:
        x = torch.randn(n, w.shape[1], dtype=w.dtype, device=w.device)
        assert torch.allclose(F.linear(x, w), (w @ x.t()).t(), rtol=1e-4, atol=1e-4)
        lin, wxt = [], []
        for _ in range(rounds):
            lin.append(timed(lambda: F.linear(x, w), reps))
            wxt.append(timed(lambda: (w @ x.t()).t().contiguous(), reps))
        a, b = statistics.median(lin), statistics.median(wxt)
        rows.append({"rows": n, "linear_ms": round(a * 1e3, 2), "w_xT_ms": round(b * 1e3, 2), "speedup": round(a / b, 2)})
        log(f"head on {n} rows: linear {a * 1e3:.2f} ms, (W x^T)^T {b * 1e3:.2f} ms, {a / b:.2f}x")
    return rows


@torch.no_grad()
def projection_fusion(model, sizes: list[int], rounds: int, reps: int, log, weights: str = "fp32") -> list[dict]:
    """All layers' q, k, v, gate, up projections on n rows: five separate matmuls per layer against two
    on concatenated weights (q|k|v, gate|up), interleaved, median ms. Matmuls only: the split of the
    fused output into views costs nothing. ``weights`` int8/int4: the engine's quantized matmuls
    (models/quantized.py) on the weights quantized separately and concatenated."""
    if any(l.mlp.gate_proj is None for l in model.model.layers):
        raise SystemExit("--fusion needs a GLU model (gate and up projections)")
    sep = [[m.weight for m in (l.attn.q_proj, l.attn.k_proj, l.attn.v_proj, l.mlp.gate_proj, l.mlp.up_proj)]
           for l in model.model.layers]
    fused = [[torch.cat(ws[:3]), torch.cat(ws[3:])] for ws in sep]
    if weights == "fp32":
        mm = F.linear
    else:
        from looplm.models import quantized as q
        q.check_format(weights, "cpu")
        as_q = lambda w: q.make_weight(q.portable(w, weights), q.DEFAULT_ACT)  # noqa: E731
        sep = [[as_q(w) for w in ws] for ws in sep]
        fused = [[as_q(w) for w in ws] for ws in fused]
        mm = lambda x, w: w.linear(x)  # noqa: E731

    def run(weights, x):
        for ws in weights:
            for w in ws:
                mm(x, w)

    rows = []
    for n in sizes:
        x = torch.randn(1, n, model.config.hidden_size, device=model.lm_head.weight.device)
        a_t, b_t = [], []
        for _ in range(rounds):
            a_t.append(timed(lambda: run(sep, x), reps))
            b_t.append(timed(lambda: run(fused, x), reps))
        a, b = statistics.median(a_t), statistics.median(b_t)
        rows.append({"rows": n, "separate_ms": round(a * 1e3, 2), "fused_ms": round(b * 1e3, 2),
                     "speedup": round(a / b, 2)})
        log(f"{weights} projections on {n} rows: 5 separate {a * 1e3:.2f} ms, 2 fused {b * 1e3:.2f} ms, {a / b:.2f}x")
    return rows


@torch.no_grad()
def packed_vs_plain(model, sizes: list[int], rounds: int, reps: int, log) -> list[dict]:
    """A vanilla decode step (all layers + LM head) on n items, every row busy, three ways, interleaved,
    median ms: F.linear with gathered attention (``plain``), packed weights with gathered attention
    (``packed_gather``), packed weights with attention read in place (``packed``, the engine's default)."""
    ways = {"plain": (False, 2.0), "packed_gather": (True, 2.0), "packed": (True, Engine.in_place_min_fraction)}
    rows = []
    for n in sizes:
        eng = Engine(model, max_batch=n, max_seq_len=POS + 1)  # packs the weights
        items = decode_items(eng, n, 0)
        t = {w: [] for w in ways}
        for _ in range(rounds):
            for w, (pack, frac) in ways.items():
                packing.enabled, eng.in_place_min_fraction = pack, frac
                model.exit_logits(eng._forward(items))  # warm-up
                t[w].append(timed(lambda: model.exit_logits(eng._forward(items)), reps))
        packing.enabled = True
        ms = {w: statistics.median(v) * 1e3 for w, v in t.items()}
        rows.append({"rows": n, **{f"{w}_ms": round(v, 2) for w, v in ms.items()},
                     "speedup": round(ms["plain"] / ms["packed"], 2)})
        log(f"vanilla step on {n} items: " + ", ".join(f"{w} {v:.2f} ms" for w, v in ms.items()))
    return rows


@torch.no_grad()
def attention_kernels(model, sizes: list[int], rounds: int, reps: int, log) -> list[dict]:
    """Single-token attention of every layer over n cache rows read in place, SDPA (``attend``) against
    grouped-query matmuls (``attend_one``), interleaved, median ms."""
    eng = Engine(model, max_batch=max(sizes), max_seq_len=POS + 1)
    c = model.config
    rows = []
    for n in sizes:
        q = torch.randn(n, c.num_attention_heads, 1, c.head_dim)
        mask = torch.ones(n, 1, 1, POS + 1, dtype=torch.bool)
        views = [tuple(x[:n] for x in eng.cache.depth_rows(d, POS + 1)) for d in range(eng.L)]
        attn = [eng.layers[eng.layer_map[d]].attn for d in range(eng.L)]
        run = {"sdpa": lambda: [a.attend(q, k, v, mask) for a, (k, v) in zip(attn, views)],
               "grouped": lambda: [a.attend_one(q, k, v, mask) for a, (k, v) in zip(attn, views)]}
        t = {w: [] for w in run}
        for _ in range(rounds):
            for w, fn in run.items():
                fn()
                t[w].append(timed(fn, reps))
        a, b = (statistics.median(t[w]) * 1e3 for w in run)
        rows.append({"rows": n, "sdpa_ms": round(a, 2), "grouped_ms": round(b, 2), "speedup": round(a / b, 2)})
        log(f"attention of {eng.L} layers on {n} rows: SDPA {a:.2f} ms, grouped {b:.2f} ms, {a / b:.2f}x")
    return rows


@torch.no_grad()
def profile_step(model, sizes: list[int], rounds: int, reps: int, log, top: int = 8) -> list[dict]:
    """The torch profiler's top operators (share of self CPU time) in a vanilla step on n items, F.linear with
    gathered attention against the engine's default (packed weights, attention in place)."""
    from torch.profiler import ProfilerActivity, profile
    rows = []
    for n in sizes:
        eng = Engine(model, max_batch=n, max_seq_len=POS + 1)
        items = decode_items(eng, n, 0)
        for way, pack, frac in (("plain", False, 2.0), ("packed", True, Engine.in_place_min_fraction)):
            packing.enabled, eng.in_place_min_fraction = pack, frac
            model.exit_logits(eng._forward(items))  # warm-up
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    model.exit_logits(eng._forward(items))
            ev = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
            total = sum(e.self_cpu_time_total for e in ev)
            ops = {e.key: round(e.self_cpu_time_total / total, 3) for e in ev[:top]}
            rows.append({"rows": n, "way": way, "step_ms": round(total / 3e3, 2), "top_ops": ops})
            log(f"{way} step on {n} items, {total / 3e3:.1f} ms of operators: "
                + ", ".join(f"{k} {v:.0%}" for k, v in ops.items()))
        packing.enabled = True
    return rows


def interp(table: dict[int, float], x: float) -> float:
    """Linear interpolation of a measured cost at a fractional item count."""
    xs = sorted(table)
    x = min(max(x, xs[0]), xs[-1])
    lo = max(k for k in xs if k <= x)
    hi = min(k for k in xs if k >= x)
    return table[lo] if hi == lo else table[lo] + (table[hi] - table[lo]) * (x - lo) / (hi - lo)


def ceiling(t: dict[str, dict[int, float]], M: int, fs: list[float], kv_mode: str, decide: str) -> float:
    """Depth-wise over vanilla sequence-wise tokens/s, M rows busy; fs[j]: the fraction of tokens leaving
    after loop j + 1 (j < B - 1), the rest run all B = len(fs) + 1 loops."""
    B = len(fs) + 1
    t_vanilla = t["vanilla"][M] + t["head"][M]
    loops_per_token = sum((j + 1) * f for j, f in enumerate(fs)) + B * (1 - sum(fs))
    tokens = M / loops_per_token
    items = M if kv_mode == "copy" else B * M / loops_per_token
    head_rows = M if decide == "logits" else tokens
    t_depth = interp(t["loop"], items) + interp(t["head"], head_rows)
    if kv_mode == "copy":  # kv_copy covers the B - 1 loops after loop 1; a later exit copies fewer
        t_depth += sum(interp(t["kv_copy"], max(1.0, f * tokens)) * (B - 1 - j) / (B - 1)
                       for j, f in enumerate(fs) if f > 0)
    return (tokens / t_depth) / (M / t_vanilla)


def needed_f(t, M, target, kv_mode, decide, B: int = 2) -> float | None:
    """Smallest fraction leaving after loop 1 (none after other loops) whose ceiling reaches ``target``
    (None: not even 1)."""
    for i in range(101):
        if ceiling(t, M, [i / 100] + [0.0] * (B - 2), kv_mode, decide) >= target:
            return i / 100
    return None


def parse_mix(text: str, B: int) -> list[float]:
    """'0.5' (after loop 1) or '0.3/0.2' (after loops 1 and 2): B - 1 early-exit fractions."""
    fs = [float(x) for x in text.split("/")]
    if len(fs) > B - 1 or any(f < 0 for f in fs) or sum(fs) > 1 + 1e-9:
        raise SystemExit(f"exit mix {text!r}: give at most B - 1 = {B - 1} fractions, each >= 0, summing to <= 1")
    return fs + [0.0] * (B - 1 - len(fs))


def main() -> int:
    global POS
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--sizes", default="6,12,32", help="busy rows M (KV rows) to evaluate")
    p.add_argument("--exit-fractions", default="0,0.525,0.78,1.0",
                   help="exit mixes to tabulate: f after loop 1, or f1/f2/... after loops 1, 2, ... "
                        "(0.525: margin:0.05 measured at B=2; 0.78: its oracle, docs/BENCHMARKS.md)")
    p.add_argument("--loops", type=int, default=2, help="B of the looped model timed (K = L / B shared layers)")
    p.add_argument("--target", type=float, default=1.4, help="speed-up over vanilla sequence-wise to solve for")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--head", action="store_true", help="time only the LM head's two layouts")
    p.add_argument("--fusion", action="store_true", help="time only separate against fused input projections")
    p.add_argument("--weights", default="fp32", choices=("fp32", "int8", "int4"),
                   help="with --fusion: the weight format of the timed matmuls")
    p.add_argument("--attention", action="store_true", help="time only single-token attention: SDPA against "
                   "grouped-query matmuls")
    p.add_argument("--packed", action="store_true", help="time only a vanilla step with packed weights against F.linear")
    p.add_argument("--profile", action="store_true", help="profile a vanilla step, plain and packed")
    p.add_argument("--pack-rows", type=int, default=packing.PACK_ROWS, help="the row count weights are packed for")
    p.add_argument("--pos", type=int, default=POS, help="decode position of every item (context length - 1)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    POS = args.pos
    packing.PACK_ROWS = args.pack_rows
    torch.set_num_threads(args.threads)
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    vanilla, _ = load_model(args.model)
    vanilla.eval()
    # single-part modes: (key in the JSON, timing function, the timed columns of the markdown rows)
    mode = {"head": ("head", head_layouts, ("linear_ms", "w_xT_ms")),
            "fusion": ("projections", projection_fusion, ("separate_ms", "fused_ms")),
            "packed": ("vanilla_step", packed_vs_plain, ("plain_ms", "packed_gather_ms", "packed_ms")),
            "attention": ("attention", attention_kernels, ("sdpa_ms", "grouped_ms"))}
    if args.profile:
        rows = profile_step(vanilla, [int(s) for s in args.sizes.split(",")], args.rounds, args.reps,
                            lambda *a: print(*a, file=sys.stderr, flush=True))  # stdout: the JSON
        print(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": args.model,
                          "torch_threads": torch.get_num_threads(), "decode_position": POS, "profile": rows}, indent=1))
        return 0
    chosen = next((m for m in mode if getattr(args, m)), None)
    if chosen:
        key, fn, cols = mode[chosen]
        extra = {"weights": args.weights} if chosen == "fusion" else {}
        rows = fn(vanilla, [int(s) for s in args.sizes.split(",")], args.rounds, args.reps, log, **extra)
        out = {**extra, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": args.model,
               "torch_threads": torch.get_num_threads(), "decode_position": POS, key: rows}
        print(json.dumps(out, indent=1) if args.json else "\n".join(
            f"| {r['rows']} | " + " | ".join(str(r[c]) for c in cols) + f" | {r['speedup']}x |" for r in rows))
        return 0
    B = args.loops
    looped = convert(vanilla, loops=B, init="stepwise").eval()  # the exit models' architecture: rank 0
    sizes = [int(s) for s in args.sizes.split(",")]
    t = measure(vanilla, looped, sizes, args.rounds, args.reps, log)
    mixes = args.exit_fractions.split(",")
    rows = []
    for M in sizes:
        for kv in ("copy", "later"):
            for decide in ("logits", "probe"):
                rows.append({"rows_busy": M, "kv_mode": kv, "decision": decide,
                             "ceiling_vs_sequence": {m: round(ceiling(t, M, parse_mix(m, B), kv, decide), 3)
                                                     for m in mixes},
                             f"exit_fraction_for_{args.target}x": needed_f(t, M, args.target, kv, decide, B)})
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": args.model,
           "looped": f"B={B} stepwise rank 0 (converted; timing does not depend on the weights)",
           "torch_threads": torch.get_num_threads(), "rounds": args.rounds, "reps": args.reps,
           "decode_position": POS,
           "step_parts_ms": {k: {str(n): round(v * 1e3, 2) for n, v in d.items()} for k, d in t.items()},
           "ceilings": rows}
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print("| M | n | vanilla ms | loop ms | head ms | kv copy ms |")
        print("|---:|---:|---:|---:|---:|---:|")
        for n in sorted(t["vanilla"]):
            print(f"| {'*' if n in sizes else ''} | {n} | {t['vanilla'][n] * 1e3:.1f} | {t['loop'][n] * 1e3:.1f} | "
                  f"{t['head'][n] * 1e3:.1f} | {t['kv_copy'][n] * 1e3:.1f} |")
        print(f"\n| M | KV | decision | " + " | ".join(f"f={m}" for m in mixes) + f" | f for {args.target}x |")
        print("|---:|---|---|" + "---:|" * (len(mixes) + 1))
        for r in rows:
            print(f"| {r['rows_busy']} | {r['kv_mode']} | {r['decision']} | "
                  + " | ".join(f"{v}x" for v in r["ceiling_vs_sequence"].values())
                  + f" | {r[f'exit_fraction_for_{args.target}x']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
