"""Stacked input projections (q|k|v and gate|up as one quantized weight each) against separate ones, in the
serving engine: batch-1 decode and a full-batch decode step, int8 and int4 weights, eager and compiled.

One process, one engine per setting, interleaved rounds. Batch 1: one request of 30 prompt tokens and
``--output`` new tokens through the sequence-wise scheduler (tokens/s). Full batch: ``--batch`` requests of
30 prompt tokens and ``--output`` new tokens each, admitted together (tokens/s of the whole batch). The
weights are the same quantized values either way (``quantized.attach``), so the engines' greedy outputs
are compared too.

    PYTHONPATH=src OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_fused_inputs.py --rounds 5 --json
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
from looplm.serve.schedulers import replay


def one_round(engine, batch: int, output: int) -> tuple[float, list[list[int]]]:
    reqs = [Request(list(range(100 + i, 130 + i)), output) for i in range(batch)]
    t = time.perf_counter()
    replay(make_scheduler("sequence", engine), reqs)
    return sum(len(r.output) for r in reqs) / (time.perf_counter() - t), [r.output for r in reqs]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--configs", default="int8,int4,int8-c,int4-c", help="formats; -c: compiled engine")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--output", type=int, default=32)
    p.add_argument("--batch", type=int, default=16, help="requests of the full-batch case (0: skip it)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    base, _ = load_model(args.model)
    engines = {}
    for cfg in args.configs.split(","):
        fmt, compiled = cfg.removesuffix("-c"), cfg.endswith("-c")
        for fuse in (False, True):
            name = f"{cfg} {'stacked' if fuse else 'separate'}"
            model = Q.quantize_model(copy.deepcopy(base), fmt, fuse=fuse)
            engine = Engine(model, max_batch=max(1, args.batch), max_seq_len=30 + args.output + 1, compile=compiled)
            t = time.perf_counter()
            warm_up(engine)
            engines[name] = engine
            print(f"{name:<22} warm-up {time.perf_counter() - t:.1f} s", flush=True)
    cases = {"batch 1": 1, **({f"batch {args.batch}": args.batch} if args.batch > 1 else {})}
    speeds = {case: {name: [] for name in engines} for case in cases}
    outputs = {case: {} for case in cases}
    for r in range(args.rounds + 1):  # round 0 warms every cache length and is not counted
        for case, n in cases.items():
            for name, engine in engines.items():
                tps, out = one_round(engine, n, args.output)
                outputs[case][name] = out
                if r:
                    speeds[case][name].append(tps)
                    print(f"round {r} {case:<9} {name:<22} {tps:7.1f} tokens/s", flush=True)
    table = {case: {name: round(statistics.median(v), 1) for name, v in d.items()} for case, d in speeds.items()}
    same = {case: {cfg: outputs[case][f"{cfg} stacked"] == outputs[case][f"{cfg} separate"]
                   for cfg in args.configs.split(",")} for case in cases}
    result = {"model": args.model, "threads": args.threads, "rounds": args.rounds, "output": args.output,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
              "cpu_capability": torch.backends.cpu.get_cpu_capability(), "tokens_per_s": table,
              "rounds_tokens_per_s": {c: {n: [round(x, 1) for x in v] for n, v in d.items()} for c, d in speeds.items()},
              "same_greedy_output": same}
    print("\n| case | weights | separate tokens/s | stacked tokens/s | stacked / separate | same output |")
    print("|---|---|---:|---:|---:|---|")
    for case in cases:
        for cfg in args.configs.split(","):
            a, b = table[case][f"{cfg} separate"], table[case][f"{cfg} stacked"]
            print(f"| {case} | {cfg} | {a} | {b} | {b / a:.2f}x | {same[case][cfg]} |")
    if args.json:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
