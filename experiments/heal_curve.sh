#!/usr/bin/env bash
# Issue 78 item 8: how does the default recipe's quality grow with healing tokens? SmolLM2-135M B=2, `looplm convert`
# with default flags (middle-cycle, rank 56), healed by `looplm heal`'s defaults on the recipe's corpus for 1/8, 1/4
# and 1/2 of the default hour's tokens (experiments/heal_default_hour.sh: 1,542,599 tokens, 0.65187 of them
# layer-local, the split an idle hour's time budget gives), so each point is the recipe at that budget and other jobs
# change only its wall time. Scored by the suite like the hour (five out-of-domain domains at 16 windows, the real
# corpus's held-out split, LAMBADA at 200 documents) into RESULTS.json, one row a budget (hour-over-F).
# `looplm eval curve` then fits the points with the hour's. Resumable: rerun to continue.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
LOOPLM=${LOOPLM:-"$PYTHON -m looplm"}
OUT=${OUT:-out/curve}
FRACTIONS=${FRACTIONS:-"8 4 2"}          # 1/F of the hour's tokens
REAL=${REAL:-out/corpus-512}
RESULTS=${RESULTS:-docs/results/heal-curve-smollm2-b2-r56-epyc}
HOUR_TOKENS=1542599 LOCAL_SHARE=0.65187
MODEL=$OUT/smollm2-135m-b2-r56
mkdir -p "$OUT"
[ -f "$REAL/meta.json" ] || $LOOPLM data build smollm2-135m --seq-len 512 --out "$REAL" --no-progress
[ -f $MODEL/config.json ] || $LOOPLM convert smollm2-135m --out $MODEL
for f in $FRACTIONS; do
  run=$OUT/b2-r56-hour-over-$f
  if [ ! -f "$run/heal.json" ]; then
    resume=""; [ -f "$run/run.json" ] && resume="--resume"
    # shellcheck disable=SC2086  # $resume is one flag or none
    $LOOPLM heal $MODEL --out "$run" --train-tokens $((HOUR_TOKENS / f)) --local-share $LOCAL_SHARE --compile \
      --no-progress $resume
  fi
  $LOOPLM eval suite smollm2-135m "hour-over-$f=$run/final" --data "$REAL" --tasks lambada --limit 200 --windows 16 \
    --resume --out "$RESULTS" --reproduce "bash experiments/heal_curve.sh"
  rm -f "$RESULTS.md"
done
