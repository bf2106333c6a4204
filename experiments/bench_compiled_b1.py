"""Where a compiled batch-1 decode token's time goes, and what the whole-loop graph's two call options save:
dynamo's guards on the modules the graph reads (kept or skipped) and the graph's wrapper (Python or C++).

One process, one int4 engine per setting (each compiles its own copy of the whole-loop function, so the
settings never share graphs), interleaved rounds of one request of 30 prompt tokens and 64 new tokens.
Timers wrap the engine's parts: ``step`` (one engine step), ``forward`` (the loop), ``call`` (the call into the
whole-loop graph, guards included) and ``after`` (head, sampling, bookkeeping); milliseconds per token.

    PYTHONPATH=src OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_compiled_b1.py --rounds 3 --json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

from looplm.models import load_model
from looplm.models import quantized as Q
from looplm.serve import Engine, Request, make_scheduler, warm_up
from looplm.serve import compiled as C
from looplm.serve.schedulers import replay

SETTINGS = {  # name: (skip module guards, C++ wrapper)
    "guards, Python wrapper": (False, False),
    "guards, C++ wrapper": (False, True),
    "no module guards, Python wrapper": (True, False),
    "no module guards, C++ wrapper (default)": (True, True),
}


def engine_for(model, skip_guards: bool, cpp: bool):
    engine = Engine(model, max_batch=1, max_seq_len=128, compile=True)
    options = {}
    if skip_guards:
        options["guard_filter_fn"] = torch.compiler.skip_guard_on_all_nn_modules_unsafe
    if cpp:
        options["cpp_wrapper"] = True
    engine.compiled.decode_loop_fn = torch.compile(C._own_copy(C._decode_loop), options=options)
    timers = {"step": 0.0, "forward": 0.0, "call": 0.0, "after": 0.0}

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            timers[name] += time.perf_counter() - t
            return out
        return wrapper

    engine.step, engine._forward = timed("step", engine.step), timed("forward", engine._forward)
    engine._after_loop = timed("after", engine._after_loop)
    engine.compiled.decode_loop_fn = timed("call", engine.compiled.decode_loop_fn)
    t = time.perf_counter()
    warm_up(engine)
    return engine, timers, time.perf_counter() - t


def one_round(engine, timers, output: int) -> dict:
    for k in timers:
        timers[k] = 0.0
    req = Request(list(range(100, 130)), output)
    t = time.perf_counter()
    replay(make_scheduler("sequence", engine), [req])
    n = len(req.output)
    return {"wall": (time.perf_counter() - t) / n * 1e3, **{k: v / n * 1e3 for k, v in timers.items()}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model(args.model)
    model = Q.quantize_model(model, "int4")
    engines = {}
    for name, (skip, cpp) in SETTINGS.items():
        engine, timers, warm = engine_for(copy.deepcopy(model), skip, cpp)
        one_round(engine, timers, args.output)  # first use of each cache length
        engines[name] = (engine, timers, warm)
        print(f"{name:<42} warm-up {warm:.1f} s", flush=True)
    rounds = {name: [] for name in SETTINGS}
    for r in range(args.rounds):
        for name, (engine, timers, _) in engines.items():
            rounds[name].append(one_round(engine, timers, args.output))
            print(f"round {r + 1} {name:<42} " + ", ".join(f"{k} {v:.2f}" for k, v in rounds[name][-1].items()),
                  flush=True)
    result = {"model": args.model, "threads": args.threads, "rounds": args.rounds, "output": args.output,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
              "ms_per_token": {name: {k: round(statistics.median(x[k] for x in rs), 3) for k in rs[0]}
                               for name, rs in rounds.items()},
              "warm_up_seconds": {name: round(e[2], 1) for name, e in engines.items()}}
    print("\n| setting | call | step | wall | warm-up |\n|---|---:|---:|---:|---:|")
    for name, m in result["ms_per_token"].items():
        print(f"| {name} | {m['call']:.2f} | {m['step']:.2f} | {m['wall']:.2f} | {result['warm_up_seconds'][name]} s |")
    if args.json:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
