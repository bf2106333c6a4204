"""int4 at batch 1: inductor-compiled reductions that read PyTorch's int4 CPU layout directly, against the op itself.

The int4 op's packed layout (``_convert_weight_to_int4pack_for_cpu``, torch 2.13 on an AVX-512 CPU), decoded here:
[N/64, K, 32] bytes, byte d of a 64-row block's column k holding row d in its low nibble and row d + 32 in its high
one (``bench_decode_kernels._int4_dense`` dequantizes it, equal to the op's own). A one-row product on that layout is
a reduction over K with the 32 bytes of a block contiguous. Two forms, each in 1 or 4 weight streams (as
``quantized.int8_gemv``): ``a`` sums each group of 32 columns, then applies the group's scale and minimum; ``b``
dequantizes every weight inline. 30 SmolLM2 layers of q|k|v, o, gate|up and down, random weights in COPIES copies
cycled (10: 660 MB, more than the AMX Xeon's 480 MiB L3), one row of bfloat16 activations per product.

    PYTHONPATH=src OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_int4_layout.py 10 a1,a4,b1,b4

Result (2026-11-28 11:33-11:57 UTC, AMX Xeon, 2 threads; ``benchmarks/results/int4-layout-reductions-amx.log``): the
op 5.55 ms (12.0 GB/s), ``a`` 17.1 ms in one stream and 12.6 in four, ``b`` 43.6 and 44.2; first compiles of 79 to
619 s. Nothing here beats the op, so the engine keeps it (docs/BENCHMARKS.md, "int8 steps of many rows").
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

from looplm.models import quantized as Q

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gu": (3072, 576), "down": (576, 1536)}


def force(x, stride):
    return torch.ops.prims.inductor_force_stride_order(x, stride)


def gemv_a(packed, sz, x, group, streams):
    """two-level: per-group partial sums, then scales."""
    n, k = packed.shape[0], packed.shape[1] * 2
    nb, ng = n // 64, k // group
    dtype = x.dtype
    x = force(x, x.stride()).float().reshape(ng, group)
    xs = x.sum(-1)
    p = packed.view(nb, ng, group, 32)
    s = sz[..., 0].view(ng, nb, 2, 32)
    z = sz[..., 1].view(ng, nb, 2, 32)
    streams = next(t for t in range(streams, 0, -1) if nb % t == 0)
    m = nb // streams
    outs = []
    for i in range(streams):
        pb = p[i * m:(i + 1) * m]
        halves = []
        for h, q in enumerate((pb & 15, pb >> 4)):
            part = (q.float() * x[None, :, :, None]).sum(2)  # [m, ng, 32]
            sh = s[:, i * m:(i + 1) * m, h].float().permute(1, 0, 2)
            zh = z[:, i * m:(i + 1) * m, h].float().permute(1, 0, 2)
            halves.append((sh * (part - 8 * xs[None, :, None]) + zh * xs[None, :, None]).sum(1))  # [m, 32]
        outs.append(torch.stack(halves, 1).reshape(m * 64))
    return torch.cat(outs).to(dtype).unsqueeze(0)


def gemv_b(packed, sz, x, group, streams):
    """one-level: dequantize inline, one reduction over k."""
    n, k = packed.shape[0], packed.shape[1] * 2
    nb, ng = n // 64, k // group
    dtype = x.dtype
    x = force(x, x.stride()).float().reshape(k)
    p = packed.view(nb, k, 32)
    s = sz[..., 0].view(ng, 1, nb, 2, 32).expand(ng, group, nb, 2, 32).reshape(k, nb, 2, 32)
    z = (sz[..., 1] - 8 * sz[..., 0]).view(ng, 1, nb, 2, 32).expand(ng, group, nb, 2, 32).reshape(k, nb, 2, 32)
    streams = next(t for t in range(streams, 0, -1) if nb % t == 0)
    m = nb // streams
    outs = []
    for i in range(streams):
        pb = p[i * m:(i + 1) * m]
        halves = []
        for h, q in enumerate((pb & 15, pb >> 4)):
            sh = s[:, i * m:(i + 1) * m, h].float().permute(1, 0, 2)
            zh = z[:, i * m:(i + 1) * m, h].float().permute(1, 0, 2)
            halves.append(((q.float() * sh + zh) * x[None, :, None]).sum(1))
        outs.append(torch.stack(halves, 1).reshape(m * 64))
    return torch.cat(outs).to(dtype).unsqueeze(0)


def make(g):
    ws = []
    for _ in range(30):
        for shape in SHAPES.values():
            w = Q.make_weight(Q.portable(torch.randn(*shape, generator=g) * 0.02, "int4"), torch.bfloat16)
            ws.append((w.packed, w.scales_zeros, w.group))
    return ws


def op_products(ws, xs):
    return [torch.ops.aten._weight_int4pack_mm_for_cpu(x, p, g, sz) for (p, sz, g), x in zip(ws, xs)]


def variant(fn, streams):
    def products(ws, xs):
        return [fn(p, sz, x, g, streams) for (p, sz, g), x in zip(ws, xs)]
    return products


if __name__ == "__main__":
    torch.set_num_threads(2)
    COPIES = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    names = sys.argv[2].split(",") if len(sys.argv) > 2 else ["a1", "a4", "b1", "b4"]
    g = torch.Generator().manual_seed(0)
    copies = [make(g) for _ in range(COPIES)]
    xs = [torch.randn(1, p.shape[1] * 2, generator=g).to(torch.bfloat16) for p, _, _ in copies[0]]
    fns = {"op": op_products}
    for n in names:
        fns[n] = torch.compile(variant({"a": gemv_a, "b": gemv_b}[n[0]], int(n[1:])))
    nbytes = sum(p.numel() + sz.numel() * 2 for p, sz, _ in copies[0])
    with torch.no_grad():
        ref = op_products(copies[0], xs)
        for n, f in fns.items():
            t = time.perf_counter()
            out = f(copies[0], xs)
            d = max(float((a.float() - b.float()).abs().max() / a.float().abs().max()) for a, b in zip(ref, out))
            print(f"{n}: first call {time.perf_counter() - t:.1f}s, max rel diff {d:.4f}", flush=True)
        ms = {n: [] for n in fns}
        for r in range(3):
            for n, f in fns.items():
                ts = []
                for i in range(4 * COPIES):
                    t = time.perf_counter()
                    f(copies[i % COPIES], xs)
                    ts.append(time.perf_counter() - t)
                ms[n].append(statistics.median(ts) * 1e3)
            print(f"round {r+1}: " + ", ".join(f"{n} {v[-1]:.2f}" for n, v in ms.items()), flush=True)
    for n, v in ms.items():
        m = statistics.median(v)
        print(f"{n}: {m:.2f} ms, {nbytes / m / 1e6:.1f} GB/s")
