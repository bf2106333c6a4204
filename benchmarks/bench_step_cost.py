"""What one decode step costs, part by part, and the throughput ceiling that follows for continuous
depth-wise batching with early exits against the vanilla model under sequence-wise batching.

Measured on the serving engine's own code paths, in one process, interleaved (every part once per
round, median over rounds), for n single-token decode items at one position:

- ``vanilla``: `Engine._forward` of the vanilla model (all L layers);
- ``loop``: `Engine._forward` of the looped model at one loop (its K = L / B shared layers);
- ``head``: `model.exit_logits` on n rows (final norm + LM head);
- ``kv_copy``: the k/v projections of the skipped depths for n exited tokens (CALM's copy).

Steady state, decode only, M requests always busy, a fraction f of tokens leaving after loop 1 (B=2):
a request emits a token every 2 - f steps, so a depth-wise step yields M / (2 - f) tokens where a
vanilla step yields M. With KV copied the step runs M items; with KV computed later each token
still runs both loops (its skipped loop as a KV-only item), so the step runs 2M / (2 - f) items.
The LM head runs on every row that finishes a loop under a logit policy (margin, softmax), and only on
emitted tokens under a probe. Ceiling = (M / (2 - f)) / t_depth  /  (M / t_vanilla): no scheduling, no
sampling, no prefill, so it is an upper bound on what the engine can measure.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_step_cost.py --json > benchmarks/results/step-cost-smollm2-b2.json

`--head` instead times the LM head alone, two ways, on the model's own weight: `F.linear(x, W)` (the
`nn.Linear` path) against `(W @ x.T).T` (what `exit_logits` does on CPU for 1-64 rows without gradients).
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
    max_n = 2 * max(sizes)
    ev = Engine(vanilla, max_batch=max_n, max_seq_len=POS + 1)
    el = Engine(looped, max_batch=max_n, max_seq_len=POS + 1)
    parts: dict[str, dict[int, list[float]]] = {k: {} for k in ("vanilla", "loop", "head", "kv_copy")}
    # KV-later steps carry up to 2M items; the head and the KV copy also run on a few rows
    needed = sorted(set(sizes) | {2 * n for n in sizes} | {1, 2, 4})
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


def interp(table: dict[int, float], x: float) -> float:
    """Linear interpolation of a measured cost at a fractional item count."""
    xs = sorted(table)
    x = min(max(x, xs[0]), xs[-1])
    lo = max(k for k in xs if k <= x)
    hi = min(k for k in xs if k >= x)
    return table[lo] if hi == lo else table[lo] + (table[hi] - table[lo]) * (x - lo) / (hi - lo)


def ceiling(t: dict[str, dict[int, float]], M: int, f: float, kv_mode: str, decide: str) -> float:
    """Depth-wise (B=2, exit fraction f after loop 1) over vanilla sequence-wise tokens/s, M rows busy."""
    t_vanilla = t["vanilla"][M] + t["head"][M]
    tokens = M / (2 - f)
    items = M if kv_mode == "copy" else 2 * M / (2 - f)
    head_rows = M if decide == "logits" else tokens
    t_depth = interp(t["loop"], items) + interp(t["head"], head_rows)
    if kv_mode == "copy":
        t_depth += interp(t["kv_copy"], max(1.0, f * tokens)) if f > 0 else 0.0
    return (tokens / t_depth) / (M / t_vanilla)


def needed_f(t, M, target, kv_mode, decide) -> float | None:
    """Smallest exit fraction whose ceiling reaches ``target`` (None: not even f = 1)."""
    for i in range(101):
        if ceiling(t, M, i / 100, kv_mode, decide) >= target:
            return i / 100
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--sizes", default="6,12,32", help="busy rows M (KV rows) to evaluate")
    p.add_argument("--exit-fractions", default="0,0.525,0.78,1.0",
                   help="f to tabulate (0.525: margin:0.05 measured; 0.78: the oracle, docs/BENCHMARKS.md)")
    p.add_argument("--target", type=float, default=1.4, help="speed-up over vanilla sequence-wise to solve for")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--head", action="store_true", help="time only the LM head's two layouts")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    vanilla, _ = load_model(args.model)
    vanilla.eval()
    if args.head:
        rows = head_layouts(vanilla, [int(s) for s in args.sizes.split(",")], args.rounds, args.reps, log)
        out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": args.model,
               "torch_threads": torch.get_num_threads(), "head": rows}
        print(json.dumps(out, indent=1) if args.json else "\n".join(
            f"| {r['rows']} | {r['linear_ms']} | {r['w_xT_ms']} | {r['speedup']}x |" for r in rows))
        return 0
    looped = convert(vanilla, loops=2, init="stepwise").eval()  # the exit model's architecture: B=2, rank 0
    sizes = [int(s) for s in args.sizes.split(",")]
    t = measure(vanilla, looped, sizes, args.rounds, args.reps, log)
    fs = [float(x) for x in args.exit_fractions.split(",")]
    rows = []
    for M in sizes:
        for kv in ("copy", "later"):
            for decide in ("logits", "probe"):
                rows.append({"rows_busy": M, "kv_mode": kv, "decision": decide,
                             "ceiling_vs_sequence": {str(f): round(ceiling(t, M, f, kv, decide), 3) for f in fs},
                             f"exit_fraction_for_{args.target}x": needed_f(t, M, args.target, kv, decide)})
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": args.model,
           "looped": "B=2 stepwise rank 0 (converted; timing does not depend on the weights)",
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
        print(f"\n| M | KV | decision | " + " | ".join(f"f={f}" for f in fs) + f" | f for {args.target}x |")
        print("|---:|---|---|" + "---:|" * (len(fs) + 1))
        for r in rows:
            print(f"| {r['rows_busy']} | {r['kv_mode']} | {r['decision']} | "
                  + " | ".join(f"{v}x" for v in r["ceiling_vs_sequence"].values())
                  + f" | {r[f'exit_fraction_for_{args.target}x']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
