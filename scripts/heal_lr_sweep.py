"""Learning rate of the layer-local stage: train one shared layer alone (parallel inputs) from the same
start at each rate, and score its relative error on cache rows it did not train on.

    .venv/bin/python scripts/heal_lr_sweep.py out/heal/models/b2-r64 --teacher smollm2-135m \
        --data out/corpus-smollm2-512 --cache out/cache-64 --cache-rows 64 --layer 5 --steps 40 \
        --lrs 1e-4,3e-4,1e-3,3e-3
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

    results = {"layer": args.layer, "steps": args.steps, "start": error(h.student), "lrs": {}}
    print(f"layer {args.layer} before training: held-out relative error {results['start']:.5f}")
    for lr in map(float, args.lrs.split(",")):
        model = copy.deepcopy(h.student).requires_grad_(False)
        block = model.model.layers[args.layer].requires_grad_(True)
        opt = torch.optim.AdamW(block.parameters(), lr=lr, weight_decay=0.0)
        rng = np.random.default_rng(0)
        t0 = time.perf_counter()
        for s in range(args.steps):
            idx = rng.choice(train_rows, size=h.cfg.local_batch, replace=False)
            h._local_step(model, args.layer, idx, opt, {}, lr * _cosine(s, args.steps, max(1, args.steps // 20)))
        results["lrs"][lr] = error(model)
        print(f"lr {lr:g}: held-out relative error {results['lrs'][lr]:.5f} ({time.perf_counter() - t0:.0f} s)",
              flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
