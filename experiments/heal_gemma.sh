#!/usr/bin/env bash
# Gemma-3-270M at B=3 rank 64 (`looplm convert gemma3-270m --loops 3`, default flags), healed on the real corpus
# (the original's own text not generated yet) for 30 minutes (on a busy 2-core AMD EPYC with AVX-512 BF16, one
# thread: 757,760 local and 31,744 end-to-end tokens), then `looplm eval suite` against the original. And why its layer-local stage does not heal it:
# a local stage alone (60 steps per shared layer on the same cache) with the hidden-state error weighing every
# channel alike (the default) against weighing each as the original's norms scale it where its layers read the
# residual stream (--hidden-channels read). Resumable: rerun to continue.
set -euo pipefail
cd "$(dirname "$0")/.."
LOOPLM=${LOOPLM:-.venv/bin/looplm}
MODEL=out/defaults/out/gemma3-270m-b3-r64
DATA=out/corpus-gemma3-270m-512
[ -f $MODEL/config.json ] || (mkdir -p out/defaults && cd out/defaults && ../../$LOOPLM convert gemma3-270m --loops 3)
[ -f $DATA/meta.json ] || $LOOPLM data build gemma3-270m --seq-len 512 --no-progress --out $DATA
heal() {  # heal RUN ARGS...: skip a finished run, resume an interrupted one
  local run=$1; shift
  [ -f "$run/heal.json" ] && return 0
  local resume=""; [ -f "$run/run.json" ] && resume="--resume"
  $LOOPLM heal $MODEL --data $DATA --out "$run" --no-progress "$@" $resume
}
RUN=out/hour/gemma3-b3-r64-real
heal $RUN --budget-minutes 30
$LOOPLM eval suite gemma3-270m g-r64=$RUN/final --data $DATA --tasks lambada --limit 200 --out out/suite/gemma3-b3-r64 \
  --resume
for channels in uniform read; do
  heal out/gemma-local/$channels --cache $RUN/cache --train-tokens 122880 --local-share 1.0 --no-compile \
    --hidden-channels $channels
done
