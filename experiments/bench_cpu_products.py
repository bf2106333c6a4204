"""What does a float32 product of a few rows cost on this CPU, each way torch offers, with the weights read from
memory as a decode step reads them? A speculative round verifies k + 1 positions in one step, which pays only
if k + 1 rows cost little more than one.

Times ``models/cpu_products.measure_plan`` on a model's own weights (a pass over all of its linears, up to
128 MB, per timing; its LoRA products; its LM head): ``F.linear``, MKL's packed copy, and ``(W x^T)^T`` (one row
doubled to two) at 1-64 rows, and prints what the engine picks on this machine; then greedy decoding of 64 tokens
on the engine (sequence-wise, batch 1 and 4) with its measured ways against every product through F.linear, the
better of 3 rounds each, alternating, and whether the tokens are the same. ``--weights int4`` quantizes first
(then only the float LoRA has ways to choose). (experiments/bench_small_rows.py timed one
weight again and again, so it stayed in cache: a compute-bound figure that no decode step sees.)

    PYTHONPATH=src .venv/bin/python experiments/bench_cpu_products.py [MODEL] [--weights int4]
"""

import argparse
import time

import torch

from looplm.models import cpu_products, load_model
from looplm.models.cpu_products import BUCKETS, MEASURED_BYTES, measure_plan
from looplm.models.layers import LoopLinear
from looplm.models.quantized import prepare
from looplm.serve.engine import Engine
from looplm.serve.schedulers import generate
from looplm.util import cpu_model

PROMPT = "The old man walked along the shore, thinking about"


def table(name: str, weights: list[torch.Tensor], forms=("linear", "packed", "transposed")) -> None:
    plan = measure_plan(weights, forms=forms)
    mb = sum(w.numel() * 4 for w in weights) / 2**20
    timed = min(mb, max(MEASURED_BYTES / 2**20, weights[0].numel() * 4 / 2**20))  # measure_plan reads up to this
    print(f"\n{name} ({len(weights)} weights, {mb:.0f} MB; ms a pass over {timed:.0f} MB of them; the engine picks: "
          f"{plan.summary()})")
    print("| rows | " + " | ".join(forms) + " | best x one row |")
    print("|---:|" + "---:|" * (len(forms) + 1))
    one = min(plan.seconds[1].values())
    for b in BUCKETS:
        s = plan.seconds[b]
        cells = " | ".join(f"{s[f] * 1e3:.1f}" for f in forms)
        print(f"| {b} | {cells} | {min(s.values()) / one:.2f}x |")


def decode(model, prompt: list[int], tuned: bool, batch: int, tokens: int = 64) -> tuple[float, list[int]]:
    engine = Engine(model, max_batch=batch, max_seq_len=256, tune_products=tuned)
    if not tuned:
        cpu_products.release(model)  # an earlier engine's ways are attached to the model
    t0 = time.perf_counter()
    reqs = generate(engine, [prompt] * batch, max_tokens=tokens, scheduler="sequence", full_depth=True)
    return sum(len(r.output) for r in reqs) / (time.perf_counter() - t0), reqs[0].output


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--weights", default="fp32", choices=["fp32", "int4"])
    args = ap.parse_args()
    torch.set_num_threads(2)
    model, tok = load_model(args.model)
    model = prepare(model, args.weights)
    print(f"{cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}; {args.model} {args.weights}")
    prompt = tok(PROMPT)["input_ids"]
    print("\n| batch | every product F.linear, tokens/s | the measured ways, tokens/s | speedup | same tokens |")
    print("|---:|---:|---:|---:|---|")
    for batch in (1, 4):
        best, outs = {False: 0.0, True: 0.0}, {}
        for _ in range(3):
            for tuned in (False, True):
                tps, outs[tuned] = decode(model, prompt, tuned, batch)
                best[tuned] = max(best[tuned], tps)
        print(f"| {batch} | {best[False]:.1f} | {best[True]:.1f} | {best[True] / best[False]:.2f}x | {outs[True] == outs[False]} |")
    if args.weights != "fp32":
        return
    linears = [m for m in model.modules() if isinstance(m, LoopLinear)]
    with torch.no_grad():
        table("shared linears", [m.weight.detach() for m in linears])
        loras = [w.detach() for m in linears if m.lora_A is not None for s in range(m.lora_A.shape[0])
                 for w in (m.lora_A[s], m.lora_B[s])]  # fmt: skip
        if loras:
            table("LoRA products", loras, forms=("linear", "transposed"))
        table("LM head", [model.lm_head.weight.detach()])


if __name__ == "__main__":
    main()
