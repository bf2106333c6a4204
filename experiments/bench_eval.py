"""Loglikelihood requests/s: our `looplm` lm-eval model against lm-eval's own `hf` model (HFLM on the
transformers model), on the same requests, same machine, one run, side by side.

    PYTHONPATH=src python benchmarks/bench_eval.py --tasks piqa,arc_easy,hellaswag --limit 10

Requests are built by lm-eval from the project's task files (the seven tasks' standard prompts),
then given to each model's ``loglikelihood``; results are checked to agree (max |delta loglik|).
Each model runs ``--repeats`` times; the best time is kept (the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import datetime, timezone

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))


def build_requests(task_names, limit):
    from lm_eval.tasks import TaskManager, get_task_dict
    from looplm.eval.tasks import PAPER7, include_path
    tm = TaskManager(include_path=str(include_path()), include_defaults=False)
    tasks = get_task_dict([PAPER7[t][0] for t in task_names], tm)
    reqs = []
    for name, task in tasks.items():
        task.build_all_requests(limit=limit, rank=0, world_size=1)
        reqs.extend(i for i in task.instances if i.request_type == "loglikelihood")
    return reqs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tasks", default="piqa,arc_easy,hellaswag")
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    from lm_eval.models.huggingface import HFLM
    from looplm.eval.lm_eval_adapter import LoopLMEval
    from looplm.eval.tasks import resolve_tasks
    from looplm.models import load_hf_reference, load_model

    tasks = resolve_tasks(args.tasks)
    reqs = build_requests(tasks, args.limit)
    model, tok = load_model(args.model)
    hf, hf_tok = load_hf_reference(args.model)
    ours = LoopLMEval(pretrained=model, tokenizer=tok, batch_size=args.batch_size)
    peer = HFLM(pretrained=hf, tokenizer=hf_tok, batch_size=args.batch_size)
    timings, outputs = {}, {}
    for rep in range(args.repeats):
        for name, lm in (("looplm", ours), ("hf", peer)):  # alternate so load changes hit both
            t0 = time.perf_counter()
            outputs[name] = lm.loglikelihood(reqs, disable_tqdm=True)
            dt = time.perf_counter() - t0
            timings[name] = min(dt, timings.get(name, float("inf")))
    diff = max(abs(a[0] - b[0]) for a, b in zip(outputs["looplm"], outputs["hf"]))
    greedy_same = all(a[1] == b[1] for a, b in zip(outputs["looplm"], outputs["hf"]))
    result = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
                   f"{torch.get_num_threads()} threads",
        "command": "PYTHONPATH=src python benchmarks/bench_eval.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "model": args.model, "tasks": tasks, "limit": args.limit, "requests": len(reqs),
        "batch_size": args.batch_size,
        "looplm_seconds": round(timings["looplm"], 2), "hf_seconds": round(timings["hf"], 2),
        "looplm_req_per_s": round(len(reqs) / timings["looplm"], 2),
        "hf_req_per_s": round(len(reqs) / timings["hf"], 2),
        "speedup": round(timings["hf"] / timings["looplm"], 2),
        "max_abs_loglik_diff": diff, "greedy_flags_equal": greedy_same,
        "looplm_forward_tokens": ours.forward_tokens // max(args.repeats, 1),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for k, v in result.items():
            print(f"{k:>22}: {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
