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

With --from-local-end (SRC kept its local-end/ checkpoint: runs since 2026-11-27 do), the new run does not repeat the
local stage: it starts from SRC's state at the end of it, on SRC's run clock, with SRC's records up to there and
SRC's teacher cache (linked), so that only the later stages run, with the budget SRC's had left.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
from looplm.train.heal import HealConfig, logged_by  # noqa: E402

LOCAL_KEYS = ("local_share", "local_mode", "cache_rows", "seq_len", "local_batch", "local_lr", "seed", "precision",
              "budget_minutes", "tokens", "base_weights")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", help="a healing run directory (its run.json holds the plan)")
    ap.add_argument("dst", help="the new run directory (must not exist yet)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a setting of the end-to-end or exit stage to change (JSON value), e.g. e2e_batch=4")
    ap.add_argument("--from-local-end", action="store_true",
                    help="start from SRC's checkpoint at the end of its local stage instead of repeating the stage")
    a = ap.parse_args()
    src, dst = Path(a.src), Path(a.dst)
    if not (src / "run.json").exists():
        print(f"error: {src} has no run.json; give a healing run directory", file=sys.stderr)
        return 2
    if dst.exists():
        print(f"error: {dst} exists; give a new directory", file=sys.stderr)
        return 2
    local_end = src / "local-end"
    if a.from_local_end and not (local_end / "state.json").exists():
        print(f"error: {src} kept no checkpoint at the end of its local stage ({local_end}); drop --from-local-end "
              f"to repeat the stage", file=sys.stderr)
        return 2
    run = json.loads((src / "run.json").read_text())
    src_cache = Path(run["cache"])
    if a.from_local_end and not (src_cache / "meta.json").exists():
        print(f"error: {src}'s teacher cache {run['cache']} is gone; drop --from-local-end to rebuild it and repeat "
              f"the local stage", file=sys.stderr)
        return 2
    config, plan = run["config"], run["plan"]
    changes = {}
    for item in a.set:
        key, _, value = item.partition("=")
        if key not in HealConfig.FIXED or key in LOCAL_KEYS:
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
    if a.from_local_end:
        start_at_local_end(src, dst, src_cache)
        run["from_local_end_of"] = str(src)
    (dst / "run.json").write_text(json.dumps(run, indent=2) + "\n")
    print(f"{dst}: {plan['local_steps_per_layer']} local steps per layer as in {src}"
          f"{' (starting at the end of its local stage)' if a.from_local_end else ''}; changed {changes or 'nothing'}")
    return 0


def start_at_local_end(src: Path, dst: Path, cache: Path) -> None:
    """DST resumes where SRC's local stage ended: its checkpoint (as DST's latest), its records up to then, its
    cache linked (the end-to-end stage reads it with --e2e-rows cache; every run checks it at start)."""
    state = json.loads((src / "local-end" / "state.json").read_text())
    name = f"{state['stage']}-{state['visit']:03d}-{state['step']:06d}"
    shutil.copytree(src / "local-end", dst / "checkpoints" / name)
    (dst / "latest").write_text(name + "\n")
    records = [json.loads(line) for line in (src / "metrics.jsonl").read_text().splitlines() if line.strip()]
    before = [r for r in records if logged_by(r, state["time"]) and r.get("stage") not in ("e2e", "exit")]
    (dst / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in before))
    (dst / "cache").symlink_to(cache.resolve(), target_is_directory=True)


if __name__ == "__main__":
    sys.exit(main())
