"""What rescoring the LM head's leading logits in float32 (``QuantHead.RESCORED``) adds to the int8 head's time:
SmolLM2-135M's tied int8 head (49,152 x 576, bfloat16 activations), a call of 1 and of 64 rows, rescored against
not, interleaved rounds, median milliseconds per call.

    PYTHONPATH=src OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_head_rescore.py --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from looplm.models import load_model
from looplm.models import quantized as Q


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=30)
    args = ap.parse_args()
    model = Q.quantize_model(load_model(args.model)[0].eval(), "int8")
    head = model.lm_head
    times = {}
    with torch.no_grad():
        for r in range(args.rounds):
            for rows in (1, 64):
                x = torch.randn(rows, head.weight_q.in_features)
                for k in (0, Q.QuantHead.RESCORED):
                    head.RESCORED = k
                    head(x)
                    t0 = time.perf_counter()
                    for _ in range(args.calls):
                        head(x)
                    times.setdefault((rows, k), []).append((time.perf_counter() - t0) / args.calls * 1e3)
            print(f"round {r}: " + ", ".join(f"{rows} row(s) rescored {k}: {v[-1]:.3f} ms"
                                             for (rows, k), v in times.items()), flush=True)
    for (rows, k), v in times.items():
        print(f"median, {rows} row(s), {k} logits rescored: {statistics.median(v):.3f} ms")


if __name__ == "__main__":
    main()
