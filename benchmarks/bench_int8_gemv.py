"""int8 at batch 1 as an inductor-fused reduction against PyTorch's int8 op: in isolation, and in the engine.

A batch-1 decode product is a matrix-vector product, bound by how fast the int8 weight streams from memory.
Written as ``((q.float() * x.float()).sum(-1) * scale)`` inside a compiled graph, inductor emits one vectorised
C++ loop per product that reads the int8 rows directly (no dequantized copy, no second weight). Two
measurements, one process, interleaved rounds:

* ``kernels``: SmolLM2-135M's 30 layers of int8 products (q|k|v, o, gate|up, down; random weights, one row of
  bfloat16 activations, each product a graph input): the op eager, the op compiled, the reduction compiled;
* ``engine``: the int8 engine compiled as shipped (``op``: ``Engine(compile=True)``) against variants
  (``bench_int8_template.compare_engines``: greedy tokens compared with the first engine's; milliseconds per token of
  one 30-token prompt and 64 new tokens, and of the batch-1 decode loop's graph alone). ``reduction``: int8 weights
  compute a one-row product as the reduction inside compiled graphs; ``-unfused``: the decode loop compiled with
  inductor fusing no two nodes; ``-head-reduction``: the LM head's one-row product (eager, outside the loop) as the
  reduction compiled in a graph of its own.

    PYTHONPATH=src OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_int8_gemv.py --rounds 4 --json OUT.json
    PYTHONPATH=src OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_int8_gemv.py --skip-kernels --engines NAMES
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
from looplm.serve.compiled import _decode_loop, _decode_loop_options, _own_copy


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


def shipped_engine(model) -> Engine:
    """The compiled batch-1 engine as ``looplm serve --compile`` builds it."""
    return Engine(model, max_batch=1, max_seq_len=128, compile=True)


def reduction_engine(model) -> Engine:
    """The shipped compiled engine, its int8 weights computing one-row products as the reduction."""
    for w in model.modules():
        if isinstance(w, Q.Int8Weight):
            w._mm = types.MethodType(_reduction_mm, w)
    return shipped_engine(model)


def unfused(engine: Engine) -> Engine:
    """``engine`` with its batch-1 decode loop compiled without fusing any two nodes (inductor's
    ``max_fusion_size=1``): every product, norm and elementwise step its own kernel."""
    options = {**_decode_loop_options(engine.device), "max_fusion_size": 1}
    engine.compiled.decode_loop_fn = torch.compile(_own_copy(_decode_loop), options=options)
    return engine


def head_as_reduction(engine: Engine) -> Engine:
    """``engine`` with the LM head's one-row product (called eagerly, outside the decode loop) as the reduction
    compiled in a graph of its own."""
    head = engine.model.lm_head.weight_q
    compiled = torch.compile(reduction, options=_decode_loop_options(engine.device))

    def mm(rows: torch.Tensor) -> torch.Tensor:
        if rows.shape[0] == 1 and not torch.compiler.is_compiling():
            return compiled(head.q[:, :head.in_features], head.scale, rows)
        return Q.Int8Weight._mm(head, rows)
    head._mm = mm
    return engine


ENGINES = {
    "op": shipped_engine,
    "reduction": reduction_engine,
    "op-unfused": lambda m: unfused(shipped_engine(m)),
    "reduction-unfused": lambda m: unfused(reduction_engine(m)),
    "op-head-reduction": lambda m: head_as_reduction(shipped_engine(m)),
    "reduction-unfused-head-reduction": lambda m: head_as_reduction(unfused(reduction_engine(m))),
}


def engine_part(model_name: str, rounds: int, names: list[str]) -> dict:
    model = Q.quantize_model(load_model(model_name)[0], "int8")
    return compare_engines(model, {n: ENGINES[n] for n in names}, rounds)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--engines", default=",".join(ENGINES), help="engines compared, comma separated, the first the "
                   "reference: " + ", ".join(ENGINES))
    p.add_argument("--skip-kernels", action="store_true", help="the engine part only")
    args = p.parse_args()
    unknown = set(args.engines.split(",")) - set(ENGINES)
    if unknown:
        p.error(f"unknown engines {sorted(unknown)}; choose from {', '.join(ENGINES)}")
    torch.set_num_threads(args.threads)
    result = {"model": args.model, "threads": args.threads, "rounds": args.rounds, "torch": torch.__version__,
              "cpu": _cpu(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "kernels": None if args.skip_kernels else isolated_products(args.rounds, torch.Generator().manual_seed(0)),
              "engine": engine_part(args.model, args.rounds, args.engines.split(","))}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
