"""The distillation loss through SmolLM2's 49,152-word head: logits materialised then ``kd_loss`` (what
healing did before) against the fused, chunked ``head_kd_loss`` (train/losses.py), in float32 (``fused``),
under bf16 autocast (``fused-bf16``: the gradient's head product in bf16, the logits float32, as healing runs
it with ``--precision bf16``) and that with each chunk's softmax math compiled (``fused-bf16-c``, as ``looplm
heal --compile`` runs it). Forward and backward of one end-to-end healing batch (2 x 512 tokens), the variants
in turns in one process (a shared machine's load swings skew ratios less), then each variant's peak memory in
a fresh child process. The bf16 variants' loss and gradient are compared with float32's (relative differences).

    PYTHONPATH=src OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_kd_loss.py --rounds 5 --json OUT.json

Shapes default to SmolLM2-135M's (random weights: the cost does not depend on their values).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time

import torch

from looplm.train.losses import head_kd_loss, kd_loss


def make(args, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(args.batch, args.seq_len, args.hidden, generator=g).requires_grad_()
    zt = torch.randn(args.batch, args.seq_len, args.hidden, generator=g)
    w = torch.randn(args.vocab, args.hidden, generator=g) * args.hidden ** -0.5
    return z, zt, w


VARIANTS = ("plain", "fused", "fused-bf16", "fused-bf16-c")


def loss_of(variant: str, z, zt, w) -> torch.Tensor:
    if variant == "plain":
        with torch.no_grad():
            teacher_logits = zt @ w.t()
        return kd_loss(z @ w.t(), teacher_logits)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=variant.startswith("fused-bf16")):
        return head_kd_loss(z, w, zt, w, compiled=variant.endswith("-c"))


def step(variant: str, z, zt, w) -> float:
    t0 = time.perf_counter()
    loss_of(variant, z, zt, w).backward()
    z.grad = None
    return time.perf_counter() - t0


def bf16_error(args) -> dict:
    """Relative differences of the bf16 variants' losses and gradients from float32's, on logits of a trained
    model's size (a spread of ~12, top ones near 40) and a student close to its teacher: there bf16's
    rounding matters most (the timing inputs' logits are ~N(0, 1))."""
    g = torch.Generator().manual_seed(1)
    z = torch.randn(args.batch, args.seq_len, args.hidden, generator=g).requires_grad_()
    zt = z.detach() + 0.05 * torch.randn(z.shape, generator=g)
    w = torch.randn(args.vocab, args.hidden, generator=g) * 0.5
    out = {}
    for v in ("fused", "fused-bf16", "fused-bf16-c"):
        loss = loss_of(v, z, zt, w)
        (grad,) = torch.autograd.grad(loss, z)
        out[v] = (loss.item(), grad)
    l32, g32 = out["fused"]
    return {v: {"loss_rel": abs(out[v][0] - l32) / abs(l32), "grad_rel": ((out[v][1] - g32).norm() / g32.norm()).item()}
            for v in ("fused-bf16", "fused-bf16-c")}


def child(args) -> None:
    """One variant alone: peak RSS growth over the process's state after setup, in MiB."""
    z, zt, w = make(args)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(2):
        step(args.child, z, zt, w)
    print(json.dumps({"peak_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--rounds", type=int, default=5, help="timed steps per variant (after one warm-up each)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    variants = VARIANTS
    # children first: Linux keeps a process's peak RSS across exec, so a child forked from a parent that
    # already holds the timing run's tensors would report the parent's peak
    shape = ["--batch", str(args.batch), "--seq-len", str(args.seq_len), "--hidden", str(args.hidden),
             "--vocab", str(args.vocab)]
    memory = {v: json.loads(subprocess.run([sys.executable, __file__, "--child", v, *shape], check=True,
                                            capture_output=True, text=True).stdout.strip().splitlines()[-1])
              for v in variants}
    z, zt, w = make(args)
    times = {v: [] for v in variants}
    for v in variants:
        step(v, z, zt, w)  # warm-up
    for _ in range(args.rounds):
        for v in variants:
            times[v].append(step(v, z, zt, w))
    result = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
              "shape": vars(args) | {"json": None, "child": None},
              **{v: {"median_s": statistics.median(times[v]), "times_s": times[v], **memory[v]} for v in variants}}
    result["speedup"] = result["plain"]["median_s"] / result["fused"]["median_s"]
    result["memory_ratio"] = result["plain"]["peak_mib"] / max(result["fused"]["peak_mib"], 1e-9)
    result["bf16_speedup"] = {v: result["fused"]["median_s"] / result[v]["median_s"] for v in ("fused-bf16", "fused-bf16-c")}
    result["bf16_error"] = bf16_error(args)
    for v in variants:
        print(f"{v:10s} {result[v]['median_s']:.3f} s (median of {args.rounds}), peak +{result[v]['peak_mib']:.0f} MiB")
    print(f"fused: {result['speedup']:.2f}x faster, {result['memory_ratio']:.1f}x less peak memory")
    for v, e in result["bf16_error"].items():
        print(f"{v}: {result['bf16_speedup'][v]:.2f}x faster than fused float32; loss differs by "
              f"{e['loss_rel']:.2e}, gradient by {e['grad_rel']:.2e} (relative)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
