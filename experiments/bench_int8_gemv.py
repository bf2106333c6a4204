"""int8 at batch 1: PyTorch's op against the compiled reduction in one or more streams, in isolation and in the engine.

A batch-1 decode product is a matrix-vector product, bound by how fast the int8 weight streams from memory.
Written as ``((q.float() * x.float()).sum(-1) * scale)`` inside a compiled graph, inductor emits one vectorised
C++ loop per product that reads the int8 rows directly (no dequantized copy, no second weight). Split into N
blocks of rows, each its own reduction over the same input (``quantized.int8_gemv``), inductor fuses the blocks
into one loop that reads N weight streams at once: what the engine ships, with N = 4. Two measurements, one
process, interleaved rounds:

* ``kernels``: SmolLM2-135M's 30 layers of int8 products (q|k|v, o, gate|up, down; random weights in six copies,
  640 MB, cycled; one row of bfloat16 activations per product, each its own tensor as in the engine): the op
  eager, the reduction compiled in one stream and in ``int8_gemv``'s four, and the one-stream reduction with one
  input shared by every product of a shape (the earlier form of this comparison: inductor then fuses the products
  that share an input into one loop, which is what made it fast);
* ``engine``: compiled int8 engines (``bench_int8_template.compare_engines``: greedy tokens compared with the first
  engine's; milliseconds per token of one 30-token prompt and 64 new tokens, and of the batch-1 decode loop's graph
  alone). ``shipped``: ``Engine(compile=True)`` as shipped (one-row products in four streams, the LM head's one row
  in a graph of its own, products of 16 rows or more dense: ``quantized.int8_dense``); ``op``: every product through
  PyTorch's op and the head eager, as shipped before 2026-11-28; ``streams-N``: the shipped engine with N streams; ``-unfused``: the decode loop compiled with
  inductor fusing no two nodes.

    PYTHONPATH=src:benchmarks OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_int8_gemv.py --rounds 4 --json OUT.json
    PYTHONPATH=src:benchmarks OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_int8_gemv.py --skip-kernels \
        --engines NAMES [--format int4]
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

WEIGHT_COPIES = 6  # 6 x 106 MB: more than the 480 MiB last-level cache of the largest measured (the AMX Xeon)


def reduction(q: torch.Tensor, scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x [1, K] @ (q [N, K] * scale [N]).T as one float32 reduction over K: one weight stream."""
    return ((q.float() * x.float()).sum(-1) * scale.float()).to(x.dtype).unsqueeze(0)


def op_products(ws, xs):
    return [torch.ops.aten._weight_int8pack_mm(x, q, s) for (q, s), x in zip(ws, xs)]


def reduction_products(ws, xs):
    return [reduction(q, s, x) for (q, s), x in zip(ws, xs)]


def streamed_products(ws, xs):
    return [Q.int8_gemv(q, s, x) for (q, s), x in zip(ws, xs)]


def isolated_products(rounds: int, g: torch.Generator) -> dict:
    copies = []
    for _ in range(WEIGHT_COPIES):
        ws = []
        for _ in range(30):
            for shape in LAYER_SHAPES.values():
                t = Q.int8_portable(torch.randn(*shape, generator=g) * 0.02)
                ws.append((t["q"].contiguous(), t["scale"].to(torch.bfloat16)))
        copies.append(ws)
    xs = [torch.randn(1, q.shape[1], generator=g).to(torch.bfloat16) for q, _ in copies[0]]
    shared = {k: torch.randn(1, k, generator=g).to(torch.bfloat16) for k in {q.shape[1] for q, _ in copies[0]}}
    xs_shared = [shared[q.shape[1]] for q, _ in copies[0]]
    fns = {"op eager": (op_products, xs), "reduction, one stream": (torch.compile(reduction_products), xs),
           "int8_gemv, four streams": (torch.compile(streamed_products), xs),
           "reduction, one input per shape": (torch.compile(reduction_products), xs_shared)}
    with torch.no_grad():
        diff = {n: max(float((a.float() - b.float()).abs().max()) for a, b in zip(op_products(copies[0], x),
                                                                                 f(copies[0], x)))
                for n, (f, x) in fns.items()}
        ms = {n: [] for n in fns}
        for r in range(rounds):
            for n, (f, x) in fns.items():
                ts = []
                for i in range(4 * WEIGHT_COPIES):
                    t = time.perf_counter()
                    f(copies[i % WEIGHT_COPIES], x)
                    ts.append(time.perf_counter() - t)
                ms[n].append(statistics.median(ts) * 1e3)
            print(f"kernels round {r + 1}: " + ", ".join(f"{n} {v[-1]:.2f} ms" for n, v in ms.items()), flush=True)
    nbytes = sum(q.numel() for q, _ in copies[0])
    medians = {n: statistics.median(v) for n, v in ms.items()}
    return {n: {"ms_per_token": round(m, 3), "gb_per_s": round(nbytes / m / 1e6, 1), "max_abs_difference_to_op": diff[n]}
            for n, m in medians.items()}


def _int8_weights(model):
    return [w for w in model.modules() if isinstance(w, Q.Int8Weight)]


def shipped_engine(model) -> Engine:
    """The compiled batch-1 engine as ``looplm serve --compile`` builds it."""
    return Engine(model, max_batch=1, max_seq_len=128, compile=True)


def op_engine(model) -> Engine:
    """The compiled engine before the streamed reduction: one-row products through the op, the head eager (and
    products of many rows through the op too, as before ``int8_dense``)."""
    for w in _int8_weights(model):
        w._mm = w._op_mm  # as shipped before 2026-11-28: PyTorch's op at every row count
    engine = shipped_engine(model)
    engine.quantized = False  # keeps the head's one row out of a compiled graph, as it was
    return engine


def streams_engine(streams: int):
    def make(model) -> Engine:
        def mm(self, rows):
            if rows.shape[0] == 1 and torch.compiler.is_compiling():
                return Q.int8_gemv(self.q[:, :self.in_features], self.scale, rows, streams)
            return Q.Int8Weight._mm(self, rows)  # other row counts as shipped
        for w in _int8_weights(model):
            w._mm = types.MethodType(mm, w)
        return shipped_engine(model)
    return make


def unfused(engine: Engine) -> Engine:
    """``engine`` with its batch-1 decode loop compiled without fusing any two nodes (inductor's
    ``max_fusion_size=1``): every product, norm and elementwise step its own kernel."""
    options = {**_decode_loop_options(engine.device), "max_fusion_size": 1}
    engine.compiled.decode_loop_fn = torch.compile(_own_copy(_decode_loop), options=options)
    return engine


ENGINES = {
    "shipped": shipped_engine,
    "op": op_engine,
    "streams-1": streams_engine(1),
    "streams-2": streams_engine(2),
    "streams-8": streams_engine(8),
    "op-unfused": lambda m: unfused(op_engine(m)),
    "shipped-unfused": lambda m: unfused(shipped_engine(m)),
}


def engine_part(model_name: str, rounds: int, names: list[str], fmt: str = "int8") -> dict:
    """The engines on ``fmt`` weights (int4: only the int8 LM head takes the int8 paths compared)."""
    model = Q.quantize_model(load_model(model_name)[0], fmt)
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
    p.add_argument("--format", default="int8", choices=["int8", "int4"], help="the engines' layer weights (the LM "
                   "head is int8 under both)")
    args = p.parse_args()
    unknown = set(args.engines.split(",")) - set(ENGINES)
    if unknown:
        p.error(f"unknown engines {sorted(unknown)}; choose from {', '.join(ENGINES)}")
    torch.set_num_threads(args.threads)
    result = {"model": args.model, "threads": args.threads, "rounds": args.rounds, "torch": torch.__version__,
              "cpu": _cpu(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "kernels": None if args.skip_kernels else isolated_products(args.rounds, torch.Generator().manual_seed(0)),
              "format": args.format, "engine": engine_part(args.model, args.rounds, args.engines.split(","), args.format)}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
