"""What does a float32 product of a few rows cost on this CPU, each way torch offers, with the weights read from
memory as a decode step reads them? A speculative round verifies k + 1 positions in one step, which pays only
if k + 1 rows cost little more than one.

Times ``models/cpu_products.measure_plan`` on a model's own weights (a pass over all of its linears, up to
128 MB, per timing; its LoRA products; its LM head): ``F.linear``, MKL's packed copy, and ``(W x^T)^T`` (one row
doubled to two) at 1-64 rows, and prints what the engine picks on this machine. (experiments/bench_small_rows.py timed one
weight again and again, so it stayed in cache: a compute-bound figure that no decode step sees.)

    PYTHONPATH=src .venv/bin/python experiments/bench_cpu_products.py [MODEL]
"""

import sys

import torch

from looplm.models import load_model
from looplm.models.cpu_products import BUCKETS, measure_plan
from looplm.models.layers import LoopLinear
from looplm.util import cpu_model


def table(name: str, weights: list[torch.Tensor], forms=("linear", "packed", "transposed")) -> None:
    plan = measure_plan(weights, forms=forms)
    mb = sum(w.numel() * 4 for w in weights) / 2**20
    print(f"\n{name} ({len(weights)} weights, {mb:.0f} MB; ms a pass; the engine picks: {plan.summary()})")
    print("| rows | " + " | ".join(forms) + " | best x one row |")
    print("|---:|" + "---:|" * (len(forms) + 1))
    one = min(plan.seconds[1].values())
    for b in BUCKETS:
        s = plan.seconds[b]
        cells = " | ".join(f"{s[f] * 1e3:.1f}" for f in forms)
        print(f"| {b} | {cells} | {min(s.values()) / one:.2f}x |")


def main() -> None:
    torch.set_num_threads(2)
    spec = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m"
    model, _ = load_model(spec)
    print(f"{cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}; {spec}")
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
