"""Start a healing run that repeats another run's local stage step for step and changes only later settings.

A time budget turns into a local step count measured at the start of each run, and held-out perplexity after
the local stage swings with it (50.8 against 121.0 from 553 and 421 steps per layer, docs/FINDINGS.md), so two
end-to-end settings compared across fresh runs also compare two local stages. This writes DST/run.json with
SRC's settings and SRC's local plan (the local stage is deterministic given its step count, seed and cache
rows), the given settings changed; `looplm heal ... --out DST --resume` (or scripts/heal_runs.sh, which adds
--resume) then runs the whole hour from the start: cache, the same local stage, and the end-to-end and exit
stages with the new settings, their step counts fixed again from measured step times as in any run.

    python scripts/heal_same_local.py out/heal/runs/b2-r128@online out/heal/runs/b2-r128@online-batch4 \
        --set e2e_batch=4
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

LOCAL_KEYS = ("local_share", "local_mode", "cache_rows", "seq_len", "local_batch", "local_lr", "seed", "precision",
              "budget_minutes", "tokens", "base_weights")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", help="a healing run directory (its run.json holds the plan)")
    ap.add_argument("dst", help="the new run directory (must not exist yet)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a setting of the end-to-end or exit stage to change (JSON value), e.g. e2e_batch=4")
    a = ap.parse_args()
    src, dst = Path(a.src), Path(a.dst)
    if not (src / "run.json").exists():
        print(f"error: {src} has no run.json; give a healing run directory", file=sys.stderr)
        return 2
    if dst.exists():
        print(f"error: {dst} exists; give a new directory", file=sys.stderr)
        return 2
    run = json.loads((src / "run.json").read_text())
    config, plan = run["config"], run["plan"]
    changes = {}
    for item in a.set:
        key, _, value = item.partition("=")
        if key not in config or key in LOCAL_KEYS:
            print(f"error: --set {item}: {key!r} is not an end-to-end or exit setting of the run", file=sys.stderr)
            return 2
        try:
            changes[key] = json.loads(value)
        except json.JSONDecodeError:
            print(f"error: --set {item}: the value is not a JSON number, string or boolean", file=sys.stderr)
            return 2
    # the later stages' counts are measured again in the new run; scale the planned ones by the batch so that the
    # exit stage keeps its tokens and its share of the hour
    scale = changes.get("e2e_batch", config["e2e_batch"]) / config["e2e_batch"]
    config.update(changes, out=str(dst), resume=False)
    plan["e2e_steps"] = max(1, round(plan["e2e_steps"] / scale))
    plan["e2e_tokens"] = plan["e2e_steps"] * config["e2e_batch"] * config["seq_len"]
    plan["e2e_replanned_at"] = []
    if plan.get("exit_steps"):
        plan["exit_steps"] = max(1, round(plan["exit_steps"] / scale))
        plan["exit_step_seconds"] *= scale
    dst.mkdir(parents=True)
    run.update(config=config, plan=plan, cache=str(dst / "cache"), same_local_as=str(src), changed=changes)
    (dst / "run.json").write_text(json.dumps(run, indent=2) + "\n")
    print(f"{dst}: {plan['local_steps_per_layer']} local steps per layer as in {src}; changed {changes or 'nothing'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
