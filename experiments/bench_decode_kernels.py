"""The weight matmuls of one decode step, kernel by kernel: what each CPU kernel that ships with PyTorch
costs at SmolLM2-135M's shapes (30 layers of q|k|v, o, gate|up and down, and the 49,152-word LM head).

Each layer gets its own random weights (30 distinct copies, as in the model), and a "token" runs the 30 layers'
four products one after another and then the head, so weights stream from memory as in a real token rather
than staying in cache. Kernels: PyTorch's weight-only int4 (`_weight_int4pack_mm_for_cpu`, groups of 32) and int8
(`_weight_int8pack_mm`, per channel), each fed bfloat16 (the engine's default), float16 or float32 activations; float32
`F.linear`; bfloat16 weights and activations through `F.linear`; FBGEMM's dynamically quantized int8 linear (`torch.ao` dynamic quantization: int8 activations per
tensor, a different numerical contract from weight-only); int8 x int8 with activations quantized per row through
``torch._int_mm``; int8 or int4 weights dequantized to bfloat16 at every call and multiplied by the bfloat16 GEMM,
compiled (``dequantized``: a many-row step's alternative to the ops). Reports milliseconds per step for the layers and
for the head, and the rate of weight bytes read. ``--batch N`` makes a step N tokens (N rows through every
product: a batched decode step of the serving engine); the default is batch 1.

    PYTHONPATH=src OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_decode_kernels.py --rounds 5 --json
    PYTHONPATH=src OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_decode_kernels.py --batch 64 --tokens 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

from bench_llamacpp import _cpu
from looplm.models import quantized as Q

LAYER_SHAPES = {"q|k|v": (960, 576), "o": (576, 576), "gate|up": (3072, 576), "down": (576, 1536)}
HEAD_SHAPE = (49152, 576)


def weight_only(fmt: str, act: torch.dtype):
    def make(w):
        q = Q.make_weight(Q.portable(w, fmt, Q.DEFAULT_GROUP), act)
        return q.linear, q.nbytes
    return make


def int8_op(w):
    """int8 weights through PyTorch's op at every row count (``Int8Weight._op_mm``; the shipped weight multiplies
    ``DENSE_ROWS`` rows or more as ``int8_dense``)."""
    q = Q.make_weight(Q.portable(w, "int8"), torch.bfloat16)
    return (lambda x: q._op_mm(x.to(torch.bfloat16))), q.nbytes


def fp32(w):
    return (lambda x: F.linear(x, w)), w.numel() * 4


def bf16(w):
    """bfloat16 weights and activations through ``F.linear`` (oneDNN's bfloat16 GEMM: AMX tiles on a CPU that
    has them)."""
    wb = w.to(torch.bfloat16)
    return (lambda x: F.linear(x.to(torch.bfloat16), wb)), wb.numel() * 2


def fbgemm_dynamic(w):
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data.copy_(w)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(lin), {torch.nn.Linear}, dtype=torch.qint8)
    return q, w.numel()  # int8 weights; FBGEMM's packed form adds a little


def int8_per_row(w):
    """int8 weights per output channel, activations quantized to int8 per row, ``torch._int_mm`` (the product a
    per-request int8 path would need: no scale shared between rows)."""
    t = Q.int8_portable(w)
    qt, scale = t["q"].t().contiguous(), t["scale"]

    def f(x):
        xs = (x.abs().amax(1, keepdim=True) / 127).clamp_min(1e-12)
        return torch._int_mm(torch.round(x / xs).to(torch.int8), qt) * xs * scale
    return f, w.numel()


def _int8_dense(x, q, scale):
    return Q.int8_dense(q, scale, x.to(torch.bfloat16))


def _int4_dense(x, packed, scales_zeros, group):
    """x @ W.T with W dequantized from the int4 op's CPU layout, decoded (torch 2.13, AVX-512): [N/64, K, 32] bytes,
    byte d of a 64-row block's column k holding row d in its low nibble and row d + 32 in its high one. Built as
    W.T [K, N] in bfloat16, equal to the op's own dequantized weight (``QuantWeight.dequantize``)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    p = packed.view(n // 64, k, 32).permute(1, 0, 2)
    codes = torch.stack([p & 15, p >> 4], 2).reshape(k // group, group, n)
    w = (codes.to(torch.bfloat16) - 8) * scales_zeros[..., 0].unsqueeze(1) + scales_zeros[..., 1].unsqueeze(1)
    return x.to(torch.bfloat16) @ w.reshape(k, n)


_int8_dense_c, _int4_dense_c = torch.compile(_int8_dense), torch.compile(_int4_dense)


def dequantized(fmt: str):
    """``fmt`` weights dequantized to bfloat16 at every call and multiplied by oneDNN's bfloat16 GEMM, the two
    compiled together (the weights are graph inputs: one graph per shape): what a many-row step could run in place of
    the op, whose cost grows with the rows. Only the quantized weight is held; the bfloat16 one is a temporary."""
    def make(w):
        q = Q.make_weight(Q.portable(w, fmt, Q.DEFAULT_GROUP), torch.bfloat16)
        if fmt == "int8":
            qq = q.q[:, :q.in_features]
            return (lambda x: _int8_dense_c(x, qq, q.scale)), q.nbytes
        return (lambda x: _int4_dense_c(x, q.packed, q.scales_zeros, q.group)), q.nbytes
    return make


KERNELS = {"int4 (bf16 act)": weight_only("int4", torch.bfloat16), "int4 (fp32 act)": weight_only("int4", torch.float32),
           "int8 (bf16 act)": weight_only("int8", torch.bfloat16), "int8 (fp32 act)": weight_only("int8", torch.float32),
           "int4 (fp16 act)": weight_only("int4", torch.float16), "int8 (fp16 act)": weight_only("int8", torch.float16),
           "fp32": fp32, "bf16": bf16, "fbgemm dynamic int8": fbgemm_dynamic, "int8 x int8 per row": int8_per_row,
           "int8 op (bf16 act)": int8_op, "int8 dequantized per call": dequantized("int8"),
           "int4 dequantized per call": dequantized("int4")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kernels", default=",".join(KERNELS))
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--tokens", type=int, default=20, help="steps per round")
    p.add_argument("--batch", type=int, default=1, help="tokens per step (rows through every product)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    g = torch.Generator().manual_seed(0)
    names = args.kernels.split(",")
    built, nbytes = {}, {}
    for name in names:
        make = KERNELS[name]
        layers = [[make(torch.randn(*s, generator=g) * 0.02) for s in LAYER_SHAPES.values()] for _ in range(args.layers)]
        head = make(torch.randn(*HEAD_SHAPE, generator=g) * 0.02)
        built[name] = ([[f for f, _ in layer] for layer in layers], head[0])
        nbytes[name] = (sum(b for layer in layers for _, b in layer), head[1])
    xs = {k: torch.randn(args.batch, s[1], generator=g) for k, s in LAYER_SHAPES.items()}
    xh = torch.randn(args.batch, HEAD_SHAPE[1], generator=g)
    times = {n: {"layers": [], "head": []} for n in names}

    @torch.no_grad()
    def token(name):
        layers, head = built[name]
        t = time.perf_counter()
        for fns in layers:
            for f, x in zip(fns, xs.values()):
                f(x)
        t1 = time.perf_counter()
        head(xh)
        return t1 - t, time.perf_counter() - t1

    for name in names:  # warm up every kernel
        token(name)
    for rnd in range(args.rounds):
        for name in names:  # interleaved
            lt = [token(name) for _ in range(args.tokens)]
            times[name]["layers"].append(statistics.median(a for a, _ in lt))
            times[name]["head"].append(statistics.median(b for _, b in lt))
        log(f"round {rnd + 1}: " + ", ".join(f"{n} {times[n]['layers'][-1] * 1e3:.2f}+{times[n]['head'][-1] * 1e3:.2f} ms"
                                             for n in names))
    flops_layers = 2 * args.batch * args.layers * sum(o * i for o, i in LAYER_SHAPES.values())
    result = {"cpu": _cpu(), "torch": torch.__version__, "threads": args.threads, "layers": args.layers,
              "batch": args.batch,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv[1:]),
              "kernels": {}}
    for name in names:
        lay, hd = statistics.median(times[name]["layers"]), statistics.median(times[name]["head"])
        result["kernels"][name] = {
            "layers_ms": round(lay * 1e3, 3), "head_ms": round(hd * 1e3, 3), "step_ms": round((lay + hd) * 1e3, 3),
            "token_ms": round((lay + hd) * 1e3 / args.batch, 3),
            "layer_weights_mb": round(nbytes[name][0] / 2 ** 20, 1), "head_weights_mb": round(nbytes[name][1] / 2 ** 20, 1),
            "layers_gb_per_s": round(nbytes[name][0] / lay / 1e9, 2), "layers_gflop_per_s": round(flops_layers / lay / 1e9, 1),
            "head_gb_per_s": round(nbytes[name][1] / hd / 1e9, 2)}
        log(f"  {name:<22} {result['kernels'][name]}")
    if args.json:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
