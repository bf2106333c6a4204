"""int8 at batch 1 as an inductor-fused reduction against PyTorch's int8 op: in isolation, and in the engine.

A batch-1 decode product is a matrix-vector product, bound by how fast the int8 weight streams from memory.
Written as ``((q.float() * x.float()).sum(-1) * scale)`` inside a compiled graph, inductor emits one vectorised
C++ loop per product that reads the int8 rows directly (no dequantized copy, no second weight). Two
measurements, one process, interleaved rounds:

* ``kernels``: SmolLM2-135M's 30 layers of int8 products (q|k|v, o, gate|up, down; random weights, one row of
  bfloat16 activations, each product a graph input): the op eager, the op compiled, the reduction compiled;
* ``engine``: the int8 engine compiled as shipped (``Engine(compile=True)``) against the same engine whose int8
  weights compute a one-row product as the reduction inside compiled graphs (``bench_int8_template.compare_engines``:
  greedy tokens compared; milliseconds per token of one 30-token prompt and 64 new tokens, and of the batch-1
  decode loop's graph alone).

    PYTHONPATH=src OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_int8_gemv.py --rounds 4 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import types

import torch

from bench_decode_kernels import LAYER_SHAPES
from bench_int8_template import compare_engines
from bench_llamacpp import _cpu
from looplm.models import load_model
from looplm.models import quantized as Q
from looplm.serve import Engine


def reduction(q: torch.Tensor, scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x [1, K] @ (q [N, K] * scale [N]).T as a float32 reduction over K."""
    return ((q.float() * x.float()).sum(-1) * scale.float()).to(x.dtype).unsqueeze(0)


def op_products(ws, xs):
    return [torch.ops.aten._weight_int8pack_mm(xs[i % len(xs)], q, s) for i, (q, s) in enumerate(ws)]


def reduction_products(ws, xs):
    return [reduction(q, s, xs[i % len(xs)]) for i, (q, s) in enumerate(ws)]


def isolated_products(rounds: int, g: torch.Generator) -> dict:
    ws = []
    for _ in range(30):
        for shape in LAYER_SHAPES.values():
            t = Q.int8_portable(torch.randn(*shape, generator=g) * 0.02)
            ws.append((t["q"].contiguous(), t["scale"].to(torch.bfloat16)))
    xs = [torch.randn(1, s[1], generator=g).to(torch.bfloat16) for s in LAYER_SHAPES.values()]
    fns = {"op eager": op_products, "op compiled": torch.compile(op_products),
           "reduction compiled": torch.compile(reduction_products)}
    with torch.no_grad():
        ref = op_products(ws, xs)
        diff = {n: max(float((a.float() - b.float()).abs().max()) for a, b in zip(ref, f(ws, xs)))
                for n, f in fns.items()}
        ms = {n: [] for n in fns}
        for r in range(rounds):
            for n, f in fns.items():
                ts = []
                for _ in range(20):
                    t = time.perf_counter()
                    f(ws, xs)
                    ts.append(time.perf_counter() - t)
                ms[n].append(statistics.median(ts) * 1e3)
            print(f"kernels round {r + 1}: " + ", ".join(f"{n} {v[-1]:.2f} ms" for n, v in ms.items()), flush=True)
    nbytes = sum(q.numel() for q, _ in ws)
    medians = {n: statistics.median(v) for n, v in ms.items()}
    return {n: {"ms_per_token": round(m, 3), "gb_per_s": round(nbytes / m / 1e6, 1), "max_abs_difference_to_op": diff[n]}
            for n, m in medians.items()}


def _reduction_mm(self, rows: torch.Tensor) -> torch.Tensor:
    """Int8Weight._mm with a one-row product inside a compiled graph as the reduction (the padding columns are
    zero and not read); the realisation hint keeps inductor from recomputing the input per output row."""
    if rows.shape[0] == 1 and torch.compiler.is_compiling():
        rows = torch.ops.prims.inductor_force_stride_order(rows, rows.stride())
        return reduction(self.q[:, :self.in_features], self.scale, rows)
    return Q.Int8Weight._mm(self, rows)


def reduction_engine(model) -> Engine:
    """The shipped compiled engine, its int8 weights computing one-row products as the reduction."""
    for w in model.modules():
        if isinstance(w, Q.Int8Weight):
            w._mm = types.MethodType(_reduction_mm, w)
    return Engine(model, max_batch=1, max_seq_len=128, compile=True)


def engine_part(model_name: str, rounds: int) -> dict:
    model = Q.quantize_model(load_model(model_name)[0], "int8")
    return compare_engines(model, {"op (shipped)": lambda m: Engine(m, max_batch=1, max_seq_len=128, compile=True),
                                   "reduction": reduction_engine}, rounds)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    result = {"model": args.model, "threads": args.threads, "rounds": args.rounds, "torch": torch.__version__,
              "cpu": _cpu(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "kernels": isolated_products(args.rounds, torch.Generator().manual_seed(0)),
              "engine": engine_part(args.model, args.rounds)}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
