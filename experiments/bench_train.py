"""Training throughput and peak memory: recursive (rank 0) and relaxed (rank 64) vs vanilla in our loop,
and our loop vs a plain transformers training step on the vanilla model, same batch.

Each configuration runs in its own subprocess (so peak memory is its own): `looplm train`'s Trainer
for a few steps on a real corpus (tokens/s per step from metrics.jsonl, the first steps dropped as
warm-up), or a plain `AutoModelForCausalLM` step (forward with labels, backward, clip, AdamW).

    PYTHONPATH=src nice -n 5 python benchmarks/bench_train.py --data out/corpus-smollm2-512 \
        --batch-size 2 --seq-len 256 --steps 6 --precision bf16

`--interleave` instead runs the looplm configs in one process, one model step of each in turn, for
ratios that a shared machine's load swings cannot skew (docs/BENCHMARKS.md, "merged LoRA weights").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = ("vanilla", "recursive", "relaxed", "hf-plain")
# Also accepted by --configs: "relaxed-unmerged", the relaxed model with the LoRA always applied as two
# small matmuls (LoopLinear's path before merged weights for large batches), to measure that choice.


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_one(args) -> dict:
    import numpy as np
    import torch

    torch.manual_seed(0)
    if args.config == "hf-plain":
        from looplm.models import load_hf_reference
        from looplm.data.corpus import PackedCorpus
        model, _ = load_hf_reference(args.model)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=2e-4, betas=(0.9, 0.95), weight_decay=0.1)
        rows = PackedCorpus(args.data).splits["train"]
        times = []
        for step in range(args.steps):
            ids = torch.from_numpy(np.asarray(rows[step * args.batch_size:(step + 1) * args.batch_size, :args.seq_len],
                                              dtype=np.int64))
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
        tps = [args.batch_size * args.seq_len / t for t in times[args.warmup:]]
    else:
        from looplm.convert import convert
        from looplm.models import load_model, save_model
        from looplm.train.loop import TrainConfig, train
        if args.config == "relaxed-unmerged":
            from looplm.models.layers import LoopLinear
            LoopLinear.merge_lora = False
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = args.model
            if args.config != "vanilla":
                vanilla, tok = load_model(args.model)
                rank = 0 if args.config == "recursive" else 64
                m = convert(vanilla, loops=2, init="stepwise" if rank == 0 else "average", lora_ranks=rank,
                            lora_init="svd")
                model_dir = str(save_model(m, tok, Path(tmp) / "model"))
                del vanilla, m
            cfg = TrainConfig(model=model_dir, data=args.data, out=str(Path(tmp) / "run"), max_steps=args.steps,
                              batch_size=args.batch_size, seq_len=args.seq_len, precision=args.precision,
                              progress=False, keep=1)
            train(cfg, log=lambda *a: None)
            recs = [json.loads(x) for x in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
            tps = [r["tok_per_s"] for r in recs if not r.get("eval")][args.warmup:]
    return {"config": args.config, "tok_per_s": statistics.median(tps), "steps_timed": len(tps),
            "peak_rss_mib": round(peak_rss_mib())}


def interleaved(args) -> dict:
    """All configs in one process, one training step each in turn, so every config sees the same load:
    the ratios of a shared machine without the process-to-process swing. Model steps only (forward
    with CE, backward, clip, AdamW), no Trainer bookkeeping; no peak memory (one process)."""
    import numpy as np
    import torch
    from looplm.convert import convert
    from looplm.models import load_model
    from looplm.models.layers import LoopLinear
    from looplm.data.corpus import PackedCorpus

    torch.manual_seed(0)
    vanilla, _ = load_model(args.model)
    models = {}
    for name in args.configs.split(","):
        if name == "vanilla":
            models[name] = vanilla
        elif name in ("recursive", "relaxed", "relaxed-unmerged"):
            rank = 0 if name == "recursive" else 64
            models[name] = convert(vanilla, loops=2, init="stepwise" if rank == 0 else "average",
                                   lora_ranks=rank, lora_init="svd")
            if name == "relaxed-unmerged":
                for mod in models[name].modules():
                    if isinstance(mod, LoopLinear):
                        mod.merge_lora = False
        else:
            raise SystemExit(f"--interleave supports vanilla, recursive, relaxed, relaxed-unmerged; not {name}")
    opts = {n: torch.optim.AdamW(m.parameters(), lr=2e-5) for n, m in models.items()}
    rows = PackedCorpus(args.data).splits["train"]
    times = {n: [] for n in models}
    for step in range(args.steps):
        ids = torch.from_numpy(np.asarray(rows[step * args.batch_size:(step + 1) * args.batch_size, :args.seq_len],
                                          dtype=np.int64))
        for name, model in models.items():
            model.train()
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opts[name].step()
            opts[name].zero_grad(set_to_none=True)
            times[name].append(time.perf_counter() - t0)
    return {n: {"tok_per_s": statistics.median(args.batch_size * args.seq_len / t for t in ts[args.warmup:]),
                "peak_rss_mib": None} for n, ts in times.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--data", default="out/corpus-smollm2-512")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--rounds", type=int, default=1,
                   help="run the config list this many times, interleaved; report each config's median")
    p.add_argument("--interleave", action="store_true",
                   help="one process, one step of each config in turn (ratios under changing load)")
    p.add_argument("--config", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.config:
        print(json.dumps(run_one(args)))
        return 0
    if args.interleave:
        results = interleaved(args)
        return report(args, results)
    runs: dict[str, list[dict]] = {}
    for _ in range(args.rounds):  # interleaved, so a load change on the shared machine hits every config
        for name in args.configs.split(","):
            cmd = [sys.executable, __file__, "--config", name, *sys.argv[1:]]
            r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ})
            if r.returncode != 0:
                print(f"{name}: failed\n{r.stderr[-2000:]}", file=sys.stderr)
                continue
            runs.setdefault(name, []).append(json.loads(r.stdout.strip().splitlines()[-1]))
            print(json.dumps(runs[name][-1]), flush=True)
    results = {name: {"tok_per_s": statistics.median(x["tok_per_s"] for x in rs),
                      "peak_rss_mib": max(x["peak_rss_mib"] for x in rs)} for name, rs in runs.items()}
    return report(args, results)


def report(args, results: dict) -> int:
    base = results.get("vanilla", {}).get("tok_per_s")
    print(f"\n{platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{time.strftime('%Y-%m-%d')}, batch {args.batch_size} x {args.seq_len}, {args.precision}, "
          + ("interleaved steps in one process" if args.interleave else f"median of {args.rounds} round(s)"))
    print(f"| config | tokens/s | vs vanilla (our loop) | peak RSS MiB |")
    print(f"|---|---|---|---|")
    for name, r in results.items():
        rel = f"{r['tok_per_s'] / base:.2f}x" if base else "-"
        rss = "-" if r["peak_rss_mib"] is None else r["peak_rss_mib"]  # one process: no per-config peak
        print(f"| {name} | {r['tok_per_s']:.0f} | {rel} | {rss} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
