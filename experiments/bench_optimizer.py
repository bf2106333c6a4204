"""AdamW's update of the parameters a healing step trains, PyTorch's default implementation against the
fused kernel (train/optim.py), in turns in one process: one shared layer (the layer-local stage) and every
shared layer (the end-to-end stage) of a converted model, random gradients.

    PYTHONPATH=src OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_optimizer.py \
        --model out/heal/models/b2-r128 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from looplm.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a converted looplm model directory")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    model, _ = load_model(args.model)
    sets = {"one layer (local stage)": list(model.model.layers[0].parameters()),
            "all layers (end to end)": list(model.model.layers.parameters())}
    print(f"threads {torch.get_num_threads()}")
    for name, params in sets.items():
        for p in params:
            p.grad = torch.randn_like(p)
        opts = {kind: torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, fused=kind == "fused")
                for kind in ("default", "fused")}
        times = {kind: [] for kind in opts}
        for opt in opts.values():
            opt.step()  # allocates the moments
        for _ in range(args.rounds):
            for kind, opt in opts.items():
                t0 = time.perf_counter()
                opt.step()
                times[kind].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"{name}, {sum(p.numel() for p in params):,} parameters: default {med['default']:.3f} s, "
              f"fused {med['fused']:.3f} s ({med['default'] / med['fused']:.1f}x)")


if __name__ == "__main__":
    main()
