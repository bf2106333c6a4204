#!/usr/bin/env bash
# Does weighing the hidden-state error by the channels the original's layers read (--hidden-channels read) heal
# better off the corpus than weighing every channel alike (uniform, the default before this comparison)? The whole recipe, each at the
# token budget of its uniform run: SmolLM2-135M B=2 rank 64 on the default corpus for the tokens of
# heal_default_hour.sh's idle hour, and Gemma-3-270M B=3 rank 64 on the real corpus for the tokens of
# heal_gemma.sh's 30 minutes, and the quick start's conversion for the tokens of its 10 idle minutes (the qs-mix run
# of heal_mix_default.sh); then each pair on the out-of-domain suite, paired. Needs those scripts' runs.
# Resumable: rerun to continue. The heals run side by side, one thread each.
set -euo pipefail
cd "$(dirname "$0")/.."
LOOPLM=${LOOPLM:-.venv/bin/looplm}
heal() {  # heal MODEL RUN ARGS...: skip a finished run, resume an interrupted one
  local model=$1 run=$2; shift 2
  [ -f "$run/heal.json" ] && return 0
  local resume=""; [ -f "$run/run.json" ] && resume="--resume"
  OMP_NUM_THREADS=1 $LOOPLM heal "$model" --out "$run" --no-progress --hidden-channels read "$@" $resume
}
SMOL=out/hour/b2-r64-read
GEMMA=out/hour/gemma3-b3-r64-real-read
heal out/defaults/out/smollm2-135m-b2-r64 $SMOL --train-tokens 1542599 --local-share 0.65187 --compile &
# the uniform Gemma run's plan as tokens: 61 local steps a shared layer (124,928 tokens), 31 end-to-end steps
heal out/defaults/out/gemma3-270m-b3-r64 $GEMMA --data out/corpus-gemma3-270m-512 --train-tokens 160199 \
  --local-share 0.77983 &
heal out/quickstart/smollm2-135m-b2-r64 out/hour/qs-mix-read --data out/corpus-smollm2-135m-mix-512 \
  --train-tokens 218908 --local-share 0.63618 --cache-rows 64 --no-compile &
wait
# the original and the uniform runs were scored with these settings before: their rows are kept, not scored again
[ -f out/suite/r64-read.json ] || cp out/suite/r64-default.json out/suite/r64-read.json
[ -f out/suite/gemma3-b3-r64-read.json ] || cp out/suite/gemma3-b3-r64.json out/suite/gemma3-b3-r64-read.json
[ -f out/suite/qs-read.json ] || cp out/suite/mix-hours.json out/suite/qs-read.json
{
  $LOOPLM eval suite smollm2-135m r64-default=out/hour/b2-r64-default/final r64-read=$SMOL/final \
    --compare r64-default,r64-read --data out/corpus-512 --tasks lambada --limit 200 --out out/suite/r64-read --resume
  $LOOPLM eval suite smollm2-135m qs-mix=out/hour/qs-mix/final qs-read=out/hour/qs-mix-read/final \
    --compare qs-mix,qs-read --data out/corpus-512 --tasks lambada --limit 200 --out out/suite/qs-read --resume
} &
OMP_NUM_THREADS=1 $LOOPLM eval suite gemma3-270m g-r64=out/hour/gemma3-b3-r64-real/final g-r64-read=$GEMMA/final \
  --compare g-r64,g-r64-read --data out/corpus-gemma3-270m-512 --tasks lambada --limit 200 \
  --out out/suite/gemma3-b3-r64-read --resume &
wait
