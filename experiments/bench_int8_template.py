"""inductor's own int8 GEMM against PyTorch's int8 op at batch 1: in isolation, and in the compiled engine.

With freezing (a compiled module's parameters and buffers become graph constants) and max-autotune, inductor may
replace ``aten._weight_int8pack_mm`` by its C++ GEMM template, timed against the op at compile time. Two
measurements, one process, interleaved rounds:

* ``kernels``: SmolLM2-135M's 30 layers of int8 products (q|k|v, o, gate|up, down; random weights, one row of
  bfloat16 activations), the op called eagerly against the same calls in one frozen, autotuned module;
* ``engine``: the int8 engine compiled as shipped (``Engine(compile=True)``: the batch-1 loop is one graph, the
  weights graph inputs) against the same engine whose batch-1 loop graph is a frozen, autotuned module of the
  loop's layers. Greedy tokens compared, milliseconds per token of one 30-token prompt and 64 new tokens, and
  the process's resident memory added by each engine's warm-up (after handing freed heap back to the OS).

    PYTHONPATH=src OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_int8_template.py --rounds 4 --json OUT.json

``--format int4`` runs the engine part on int4 weights instead (inductor's int4 template against the int4 op); the
isolated part is int8's only.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
from torch import nn
from torch._inductor import config as inductor_config

from bench_compiled_b1 import one_round
from bench_decode_kernels import LAYER_SHAPES
from bench_llamacpp import _cpu
from looplm.models import load_model
from looplm.models import quantized as Q
from looplm.serve import Engine, Request, make_scheduler, warm_up
from looplm.serve import compiled as C
from looplm.serve.schedulers import replay

FROZEN = {"freezing": True, "max_autotune_gemm_backends": "CPP,ATEN"}  # read while a graph compiles


def rss_mb() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2 ** 20


class Products(nn.Module):
    """One token's int8 layer products, weights as buffers (what freezing makes constants)."""

    def __init__(self, layers: int, g: torch.Generator):
        super().__init__()
        self.n = layers
        for i in range(layers):
            for j, shape in enumerate(LAYER_SHAPES.values()):
                t = Q.int8_portable(torch.randn(*shape, generator=g) * 0.02)
                self.register_buffer(f"q{i}_{j}", t["q"].contiguous())
                self.register_buffer(f"s{i}_{j}", t["scale"].to(torch.bfloat16))

    def forward(self, xs):
        return [torch.ops.aten._weight_int8pack_mm(xs[j], getattr(self, f"q{i}_{j}"), getattr(self, f"s{i}_{j}"))
                for i in range(self.n) for j in range(len(xs))]


class Loop(nn.Module):
    """The engine's batch-1 loop (serve/compiled.py's ``_decode_loop``) with its layers as submodules."""

    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, *args):
        return C._decode_loop(self.layers, *args)


def frozen_engine(model) -> Engine:
    engine = Engine(model, max_batch=1, max_seq_len=128, compile=True)
    shipped, loops = engine.compiled.decode_loop_fn, {}

    def decode_loop_fn(layers, *args):
        if args[3].shape[1] != 1:  # h: batch 1 only (warm-up also compiles other shapes)
            return shipped(layers, *args)
        key = tuple(map(id, layers))
        if key not in loops:
            loops[key] = torch.compile(Loop(layers), mode="max-autotune-no-cudagraphs")
        with torch.no_grad(), inductor_config.patch(FROZEN):
            return loops[key](*args)
    engine.compiled.decode_loop_fn = decode_loop_fn
    return engine


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--format", default="int8", choices=["int8", "int4"], help="the engine part's weights")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    result = {"model": args.model, "format": args.format, "threads": args.threads, "rounds": args.rounds,
              "torch": torch.__version__, "cpu": _cpu(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if args.format == "int8":
        result["kernels"] = isolated_products(args.rounds, g)
    result["engine"] = engine_part(args.model, args.format, args.rounds)
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def isolated_products(rounds: int, g: torch.Generator) -> dict:
    products = Products(30, g).eval()
    xs = [torch.randn(1, s[1], generator=g).to(torch.bfloat16) for s in LAYER_SHAPES.values()]
    t = time.perf_counter()
    with torch.no_grad(), inductor_config.patch(FROZEN):
        frozen = torch.compile(products, mode="max-autotune-no-cudagraphs")
        diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(products(xs), frozen(xs)))
    compile_s = time.perf_counter() - t

    def ms(fn, n=20):
        ts = []
        with torch.no_grad():
            for _ in range(n):
                t = time.perf_counter()
                fn(xs)
                ts.append(time.perf_counter() - t)
        return statistics.median(ts) * 1e3
    kernels = {"op": [], "template": []}
    for r in range(rounds):
        kernels["op"].append(ms(products))
        kernels["template"].append(ms(frozen))
        print(f"kernels round {r + 1}: op {kernels['op'][-1]:.2f} ms, template {kernels['template'][-1]:.2f} ms",
              flush=True)
    return {"ms_per_token": {k: round(statistics.median(v), 3) for k, v in kernels.items()},
            "max_abs_difference": diff, "compile_seconds": round(compile_s, 1)}


def engine_part(model_name: str, fmt: str, rounds: int) -> dict:
    model = Q.quantize_model(load_model(model_name)[0], fmt)
    return compare_engines(model, {"shipped": lambda m: Engine(m, max_batch=1, max_seq_len=128, compile=True),
                                   "frozen template": frozen_engine}, rounds)


def timed_decode_loop(engine: Engine) -> dict:
    """Wrap the engine's compiled batch-1 loop call with a timer; returns its accumulator."""
    inner, acc = engine.compiled.decode_loop, {"seconds": 0.0, "calls": 0}

    def decode_loop(*args):
        t = time.perf_counter()
        out = inner(*args)
        acc["seconds"] += time.perf_counter() - t
        acc["calls"] += 1
        return out
    engine.compiled.decode_loop = decode_loop
    return acc


def compare_engines(model, makers: dict, rounds: int) -> dict:
    """Engines built by ``makers`` (name -> function of a model copy) on copies of ``model``, warmed up, then
    interleaved rounds of one 30-token prompt and 64 new tokens: milliseconds per token, of the batch-1 decode
    loop's graph per call, warm-up time and resident memory added, and how many greedy tokens of each agree with the
    first's."""
    engines, loops, extra = {}, {}, {}
    timers = {"step": 0.0, "forward": 0.0, "call": 0.0, "after": 0.0}
    for name, make in makers.items():
        before = rss_mb()
        t = time.perf_counter()
        engines[name] = make(copy.deepcopy(model))
        loops[name] = timed_decode_loop(engines[name])
        warm_up(engines[name])
        one_round(engines[name], timers, 64)  # first use of each cache length
        Q.release_freed_memory()
        extra[name] = {"warm_up_seconds": round(time.perf_counter() - t, 1), "rss_added_mb": round(rss_mb() - before)}
        print(f"{name}: {extra[name]}", flush=True)
    outs = {}
    for name, e in engines.items():
        req = Request(list(range(100, 130)), 64)
        replay(make_scheduler("sequence", e), [req])
        outs[name] = req.output
    walls, loop_ms = {n: [] for n in engines}, {n: [] for n in engines}
    for r in range(rounds):
        for name, e in engines.items():
            loops[name].update(seconds=0.0, calls=0)
            walls[name].append(one_round(e, timers, 64)["wall"])
            loop_ms[name].append(loops[name]["seconds"] / max(loops[name]["calls"], 1) * 1e3)
        print(f"engine round {r + 1}: " + ", ".join(f"{n} {walls[n][-1]:.2f} ms/token (loop {loop_ms[n][-1]:.2f})"
                                                    for n in engines), flush=True)
    result = {name: {"ms_per_token": round(statistics.median(walls[name]), 3), "rounds": [round(x, 2) for x in walls[name]],
                     "decode_loop_ms": round(statistics.median(loop_ms[name]), 3), **extra[name]} for name in engines}
    first, *others = outs
    result["same_tokens"] = (f"{sum(x == y for x, y in zip(outs[first], outs[others[0]]))} of {len(outs[first])}"
                             if len(others) == 1 else {n: f"{sum(x == y for x, y in zip(outs[first], outs[n]))} of "
                                                          f"{len(outs[first])} with {first}" for n in others})
    return result


if __name__ == "__main__":
    raise SystemExit(main())
