"""Learning rate and batch of the layer-local stage: train one shared layer alone (parallel inputs) from the
same start at each (rate, rows per step, anchor), and score its relative error on cache rows it did not train on and
the whole model's held-out perplexity with that one layer healed. The layer's error alone misleads: at
lr 3e-3 it is as low as at 2e-3, while the model after three such layers is 4x worse (docs/FINDINGS.md,
"The local stage's rate and batch, judged by the model"). Every batch reads the same number of rows
(``--steps`` x 4): a batch of 1 takes four times the steps of 4.

    .venv/bin/python scripts/heal_lr_sweep.py out/heal/models/b2-r64 --teacher smollm2-135m \
        --data out/corpus-smollm2-512 --cache out/cache-64 --cache-rows 64 --layer 5 --steps 40 \
        --lrs 1e-4,3e-4,1e-3,3e-3 [--batches 4,2,1] [--anchors 0,1,10]
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import numpy as np
import torch

from looplm.convert.recursive import tied_depths
from looplm.train.heal import HealConfig, Healer, _cosine, relative_error
from looplm.train.teacher_cache import build_cache


def add_anchor(opt, params: list, weight: float) -> None:
    """Add the gradient of weight * ||theta - theta_0||^2 / ||theta_0||^2 before every step of ``opt``
    (after the local step's gradient clipping)."""
    start = [p.detach().clone() for p in params]
    scale = 2 * weight / sum(float(p.pow(2).sum()) for p in start)
    step = opt.step

    def anchored_step(*a, **kw):
        for p, p0 in zip(params, start):
            if p.grad is not None:
                p.grad.add_(p.detach() - p0, alpha=scale)
        return step(*a, **kw)
    opt.step = anchored_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--teacher", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--cache-rows", type=int, default=64)
    ap.add_argument("--held-rows", type=int, default=8, help="the last cache rows, never trained on")
    ap.add_argument("--layer", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lrs", default="1e-4,3e-4,1e-3,3e-3")
    ap.add_argument("--batches", default="4", help="rows per tied depth per step; steps scale to equal rows")
    ap.add_argument("--anchors", default="0", help="weights of a pull toward the converted weights: "
                    "anchor x ||theta - theta_0||^2 / ||theta_0||^2 added to the layer's loss")
    args = ap.parse_args()
    h = Healer(HealConfig(model=args.model, teacher=args.teacher, data=args.data, out="/dev/null", tokens=1,
                          cache_rows=args.cache_rows, cache=args.cache), log=print)
    h.prepare()
    h.cache = build_cache(h.teacher, h.corpus, args.cache, h.rows, h.cfg.seq_len, progress=False)
    train_rows = args.cache_rows - args.held_rows
    held = np.arange(train_rows, args.cache_rows)
    depths = tied_depths(h.student.config)[args.layer]

    @torch.no_grad()
    def error(model) -> float:
        return sum(relative_error(h._run_depth(model, d, h.cache.inputs(d, held)), h.cache.outputs(d, held)).item()
                   for d in depths) / len(depths)

    results = {"layer": args.layer, "steps_at_batch_4": args.steps, "start": error(h.student),
               "start_ppl": h.evaluate(h.student)["ppl"], "runs": []}
    print(f"layer {args.layer} before training: held-out relative error {results['start']:.5f}, "
          f"model perplexity {results['start_ppl']:.1f}")
    grid = [(b, lr, a) for b in map(int, args.batches.split(",")) for lr in map(float, args.lrs.split(","))
            for a in map(float, args.anchors.split(","))]
    for batch, lr, anchor in grid:
        steps = args.steps * 4 // batch
        model = copy.deepcopy(h.student).requires_grad_(False)
        block = model.model.layers[args.layer].requires_grad_(True)
        opt = torch.optim.AdamW(block.parameters(), lr=lr, weight_decay=0.0)
        if anchor:
            add_anchor(opt, list(block.parameters()), anchor)
        rng = np.random.default_rng(0)
        t0 = time.perf_counter()
        for s in range(steps):
            idx = rng.choice(train_rows, size=batch, replace=False)
            h._local_step(model, args.layer, idx, opt, {}, lr * _cosine(s, steps, max(1, steps // 20)))
        run = {"batch": batch, "steps": steps, "lr": lr, "anchor": anchor,
               "seconds": round(time.perf_counter() - t0, 1), "error": error(model), "ppl": h.evaluate(model)["ppl"]}
        results["runs"].append(run)
        print(f"batch {batch} x {steps} steps, lr {lr:g}, anchor {anchor:g}: held-out relative error {run['error']:.5f}, "
              f"model perplexity {run['ppl']:.1f} ({run['seconds']:.0f} s)", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
