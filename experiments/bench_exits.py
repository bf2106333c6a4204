"""Exit policies side by side on one engine, one trace, one process: the vanilla model under static and
sequence-wise batching, and the looped model under depth-wise batching with each exit policy. Rounds
are interleaved (every configuration once per round, median tokens/s over rounds), so the shared
machine's load swings hit all of them alike. Agreement: generated tokens equal to the looped model's
full-depth greedy choice given the same prefix (teacher-forced, as in `looplm bench serve`).

    PYTHONPATH=src .venv/bin/python benchmarks/bench_exits.py --looped out/paper-b2/runs/rec-stepwise-exit/final \
        --policies none,margin:0.03,probe:0.5,probe --rounds 2 --json > benchmarks/results/exits-smollm2-b2.json

`--without-lora` adds each looped model with its per-depth LoRA removed (the shared weights alone, full depth): what
the LoRA costs. Every run reports where its steps' time went (`step_ms_per_token`: the loop body, the LM head,
decide's exit rule, the KV fill of skipped loops, sampling, commit; ms per generated token).

`--looped` takes several models, comma-separated (e.g. the B=2 and B=3 exit models side by side in one
run); their configurations are then named by B, or by directory when two share a B.

The trace is `bench serve`'s (held-out Milton text, seed 0); defaults are the trace of docs/history/BENCHMARKS-serving-2026-11-22-23.md
"With an early-exit-trained model" (12 requests, prompts 16-64, outputs 8-40, 6 KV rows, all at once).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time

import torch

from looplm.models import load_model
from looplm.serve.bench import agreement, heldout_text, make_trace, run_trace
from looplm.serve.exits import parse_policy


def without_lora(model):
    """A copy of a looped model with every per-depth LoRA removed: the recursive model of its shared weights."""
    m = copy.deepcopy(model)
    for mod in m.modules():
        if getattr(mod, "lora_A", None) is not None:
            mod.lora_A = mod.lora_B = None
    return m


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--looped", required=True, help="saved looped model(s), comma-separated (with "
                   "exit_probe.safetensors for probe)")
    p.add_argument("--policies", default="none,margin:0.03,probe")
    p.add_argument("--kv-mode", default="later", choices=["copy", "later"])
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--prompt-len", default="16:64")
    p.add_argument("--output-len", default="8:40")
    p.add_argument("--max-batch", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--without-lora", action="store_true", help="add each looped model without its LoRA, full depth")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    rng = lambda s: tuple(int(x) for x in s.split(":"))  # noqa: E731
    vanilla, tok = load_model(args.model)
    paths = [x for x in args.looped.split(",") if x]
    loopeds = [load_model(x)[0] for x in paths]
    Bs = [m.config.num_loops for m in loopeds]
    labels = [""] if len(paths) == 1 else [f"B={b} " if Bs.count(b) == 1 else f"{x} " for b, x in zip(Bs, paths)]
    ids = tok(heldout_text(), add_special_tokens=False)["input_ids"]
    trace = make_trace(ids, args.requests, rng(args.prompt_len), rng(args.output_len), "all", seed=0)
    max_seq_len = rng(args.prompt_len)[1] + rng(args.output_len)[1]
    configs = [("vanilla static", vanilla, "static", None), ("vanilla sequence", vanilla, "sequence", None)]
    for label, looped in zip(labels, loopeds):
        configs += [(f"{label}depth {pol}", looped, "depth", parse_policy(pol).bind(looped))
                    for pol in args.policies.split(",")]
        if args.without_lora:
            bare = without_lora(looped)
            configs.append((f"{label}depth none, no LoRA", bare, "depth", parse_policy("none").bind(bare)))
    runs = {name: [] for name, *_ in configs}
    for r in range(args.rounds):
        for name, model, sched, pol in configs:
            fig, reqs, _ = run_trace(model, trace, sched, args.max_batch, max_seq_len, pol, args.kv_mode)
            if model is not vanilla:
                fig["agreement"] = round(agreement(model, reqs), 4)
            runs[name].append(fig)
            log(f"round {r + 1} {name:<22} {fig['tokens_per_s']:7.1f} tok/s  exits/loop {fig['exits_per_loop']}"
                + (f"  agreement {fig['agreement']:.3f}" if "agreement" in fig else ""))
    base = {k: statistics.median(f["tokens_per_s"] for f in runs[f"vanilla {k}"]) for k in ("static", "sequence")}

    def paired(name, k):  # median over rounds of this round's ratio: robust to load swings between rounds
        return round(statistics.median(a["tokens_per_s"] / b["tokens_per_s"]
                                       for a, b in zip(runs[name], runs[f"vanilla {k}"])), 3)

    table = []
    for name, model, _, pol in configs:
        tps = statistics.median(f["tokens_per_s"] for f in runs[name])
        last = runs[name][-1]
        table.append({"config": name, "threshold": None if pol is None else pol.threshold,
                      "tokens_per_s": round(tps, 2), "per_round": [f["tokens_per_s"] for f in runs[name]],
                      "vs_static": round(tps / base["static"], 3), "vs_sequence": round(tps / base["sequence"], 3),
                      "vs_static_paired": paired(name, "static"), "vs_sequence_paired": paired(name, "sequence"),
                      "exits_per_loop": last["exits_per_loop"], "agreement": last.get("agreement"),
                      "step_ms_per_token": {k: round(statistics.median(f["step_ms_per_token"][k]
                                                                       for f in runs[name]), 3)
                                            for k in last["step_ms_per_token"]},
                      "ms_per_token": round(1e3 / tps, 3)})
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": args.model, "looped": args.looped,
           "kv_mode": args.kv_mode, "requests": args.requests, "prompt_len": args.prompt_len,
           "output_len": args.output_len, "max_batch": args.max_batch, "rounds": args.rounds,
           "torch_threads": torch.get_num_threads(), "table": table}
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print("| config | tok/s | vs vanilla static (medians / paired) | vs vanilla sequence (medians / paired) "
              "| exits per loop | agreement |")
        print("|---|---:|---|---|---|---:|")
        for t in table:
            print(f"| {t['config']} | {t['tokens_per_s']} | {t['vs_static']}x / {t['vs_static_paired']}x | "
                  f"{t['vs_sequence']}x / {t['vs_sequence_paired']}x | "
                  f"{t['exits_per_loop']} | {t['agreement'] if t['agreement'] is not None else '-'} |")
        parts = list(table[0]["step_ms_per_token"])
        print("\n| config (ms per generated token) | all | " + " | ".join(parts) + " | rest |")
        print("|---|---:|" + "---:|" * (len(parts) + 1))
        for t in table:
            ms = t["step_ms_per_token"]
            print(f"| {t['config']} | {t['ms_per_token']} | " + " | ".join(str(ms[k]) for k in parts)
                  + f" | {t['ms_per_token'] - sum(ms.values()):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
