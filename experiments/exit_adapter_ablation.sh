#!/usr/bin/env bash
# The paper's appendix-I ablation (body frozen, only a LoRA on the classifier head trains for the intermediate
# exits, rank 128) beside a tuned-lens affine exit adapter, on one looped model and the same tokens:
#   looplm train --early-exit aggressive --self-distill --exit-adapter head-lora:128|affine --freeze-body
# Both runs start from MODEL, read the same rows (same seed), run side by side with one thread each, and
# evaluate held-out perplexity per loop exit at step 0 (the plain exits) and at the end. Resumable.
# Environment: MODEL (a looped looplm directory), DATA (its corpus), OUT, STEPS, SEQ, BATCH, LR, EVAL_SEQS,
# KINDS (default "head-lora:128 affine"). Prints loop-1 and final perplexity before and after per adapter.
set -euo pipefail
cd "$(dirname "$0")/.."
LOOPLM=${LOOPLM:-.venv/bin/looplm}
MODEL=${MODEL:?give MODEL=a looped looplm directory}
DATA=${DATA:?give DATA=its corpus directory}
OUT=${OUT:-out/exit-adapter-ablation}
STEPS=${STEPS:-60}
SEQ=${SEQ:-256}
BATCH=${BATCH:-2}
LR=${LR:-1e-3}
EVAL_SEQS=${EVAL_SEQS:-8}
KINDS=${KINDS:-"head-lora:128 affine"}

mkdir -p "$OUT"
pids=()
for kind in $KINDS; do
  run="$OUT/${kind//:/}"
  [ -d "$run/final" ] && continue
  resume=""; [ -f "$run/run.json" ] && resume="--resume"
  OMP_NUM_THREADS=1 $LOOPLM train --model "$MODEL" --data "$DATA" --out "$run" --early-exit aggressive \
      --self-distill --exit-adapter "$kind" --freeze-body --lr "$LR" --batch-size "$BATCH" --seq-len "$SEQ" \
      --max-steps "$STEPS" --eval-every "$STEPS" --eval-seqs "$EVAL_SEQS" --save-every 10 --keep 1 \
      --precision fp32 --no-progress $resume > "$run.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done

python3 - "$OUT" $KINDS <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print("| adapter | trained params | loop-1 ppl before | loop-1 ppl after | final ppl before | final ppl after | steps | s |")
print("|---|---|---|---|---|---|---|---|")
for kind in sys.argv[2:]:
    run = out / kind.replace(":", "")
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    ev = [r for r in recs if r.get("eval")]
    steps = [r for r in recs if not r.get("eval")]
    log = (out / f"{kind.replace(':', '')}.log").read_text()
    n = next((line.split()[1] for line in log.splitlines() if line.startswith("training ")), "?")
    print(f"| {kind} | {n} | {ev[0]['ppl_1']:,.2f} | {ev[-1]['ppl_1']:,.2f} | {ev[0]['ppl_2']:,.2f} | "
          f"{ev[-1]['ppl_2']:,.2f} | {ev[-1]['step']} | {steps[-1]['time']:.0f} |")
EOF
