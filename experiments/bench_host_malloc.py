"""A healing step with glibc's defaults against ``keep_freed_host_memory`` (looplm.util: large blocks from the heap,
freed memory kept), in alternating child processes: the setting is per process and cannot be undone in one. Each
child runs `looplm heal`'s own steps as a run does: a few compiled local steps (the local stage comes first), then
``--steps`` compiled end-to-end steps at learning rate 0 on the same rows in every child. The first two end-to-end
steps (compiling, first touch of the process's memory) are not counted.

    PYTHONPATH=src OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_host_malloc.py \\
        --model out/heal/models/b2-r128 --cache out/heal/runs/b2-r128@am28b/cache --teacher smollm2-135m \\
        --data out/heal/corpus-smollm2-135m-512 --rounds 2 --steps 8 --json OUT.json
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

VARIANTS = ("glibc defaults", "freed memory kept")


def faults_and_system_seconds() -> tuple[int, float]:
    fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
    return int(fields[7]), int(fields[12]) / os.sysconf("SC_CLK_TCK")


def child(args) -> dict:
    import numpy as np
    import torch

    from looplm.train.heal import HealConfig, Healer
    from looplm.train.optim import adamw
    from looplm.train.teacher_cache import TeacherCache
    from looplm.util import keep_freed_host_memory

    applied = keep_freed_host_memory() if args.child == VARIANTS[1] else False
    with tempfile.TemporaryDirectory() as out:
        cfg = HealConfig(model=args.model, teacher=args.teacher, data=args.data, out=out, budget_minutes=60,
                         e2e_rows="online", cache_rows=4, compile=True, progress=False)
        healer = Healer(cfg, log=lambda *a: None)
        healer.prepare()
    healer.cache = TeacherCache(args.cache, verify=False)
    model = healer.student
    healer._compile_layers(model, healer.teacher)
    opt = adamw(model.model.layers[0].parameters(), lr=0.0)
    for _ in range(3):
        healer._local_step(model, 0, np.arange(4), opt, inputs={}, lr=0.0)
    model.train()
    opt = adamw(healer._trainable(model), lr=0.0)
    steps = []
    for s in range(args.steps):
        f0, sys0 = faults_and_system_seconds()
        t = time.perf_counter()
        rec = healer._e2e_step(model, s, opt, 0.0)
        f1, sys1 = faults_and_system_seconds()
        steps.append({"seconds": time.perf_counter() - t, "system_seconds": sys1 - sys0, "page_faults": f1 - f0,
                      "kd": rec["kd"]})
    return {"applied": applied, "steps": steps, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "threads": torch.get_num_threads()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a converted looplm directory")
    ap.add_argument("--cache", required=True, help="a healing run's teacher cache (for the local steps)")
    ap.add_argument("--teacher", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8, help="end-to-end steps per child (the first two not counted)")
    ap.add_argument("--json")
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    runs = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        for v in VARIANTS:
            cmd = [sys.executable, __file__, "--model", args.model, "--cache", args.cache, "--teacher", args.teacher,
                   "--data", args.data, "--steps", str(args.steps), "--child", v]
            res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            runs[v].append(res)
            timed = res["steps"][2:]
            print(f"round {r} {v:18s}: step median {statistics.median(s['seconds'] for s in timed):.3f} s, system "
                  f"{statistics.median(s['system_seconds'] for s in timed):.2f} s, page faults "
                  f"{statistics.median(s['page_faults'] for s in timed):,.0f} a step; peak RSS {res['peak_rss_mb']:,.0f} MB"
                  + ("" if v == VARIANTS[0] or res["applied"] else " (NOT applied on this platform)"), flush=True)
    summary = {}
    for v, rs in runs.items():
        timed = [s for res in rs for s in res["steps"][2:]]
        summary[v] = {"median_s": statistics.median(s["seconds"] for s in timed),
                      "median_system_s": statistics.median(s["system_seconds"] for s in timed),
                      "median_page_faults": statistics.median(s["page_faults"] for s in timed),
                      "peak_rss_mb": max(res["peak_rss_mb"] for res in rs)}
    a, b = (summary[v] for v in VARIANTS)
    kd_same = all(x["kd"] == y["kd"] for x, y in zip(runs[VARIANTS[0]][0]["steps"], runs[VARIANTS[1]][0]["steps"]))
    print(f"end-to-end step: {a['median_s']:.3f} s with glibc's defaults, {b['median_s']:.3f} s with freed memory "
          f"kept: {a['median_s'] / b['median_s']:.2f}x; page faults {a['median_page_faults']:,.0f} -> "
          f"{b['median_page_faults']:,.0f} a step; peak RSS {a['peak_rss_mb']:,.0f} -> {b['peak_rss_mb']:,.0f} MB; "
          f"the same losses: {kd_same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": platform.processor() or platform.machine(), "args": vars(args), "summary": summary,
                       "runs": runs, "same_losses": kd_same}, f, indent=1)


if __name__ == "__main__":
    main()
