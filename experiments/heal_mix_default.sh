#!/usr/bin/env bash
# Which corpus should `looplm heal` default to, judged off the corpus? Two measurements on the mix of real text
# and the original's own text (SmolLM2-135M, B=2), each at the tokens an idle hour (or the quick start's 10
# minutes) buys on a 2-core AMD EPYC with AVX-512 BF16, given as a token budget so that other jobs on the machine
# change the wall time but not the result:
#   1. rank 128, 1M tokens of the original's text (out/gen-start + out/gen-smollm2 of heal_teacher_text.sh) beside
#      as many real rows, against last session's rank-128 hour on 98,000 generated tokens (generalize.sh);
#   2. the quick start's conversion and 10-minute budget on the recipe's corpus (300,000 generated tokens beside as
#      many real ones: what `looplm heal` now makes itself), against the quick start on the real corpus;
# then `looplm eval suite` on all of them. Resumable: rerun to continue. Needs heal_teacher_text.sh's text and
# generalize.sh's rank-128 run for the comparison rows.
set -euo pipefail
cd "$(dirname "$0")/.."
LOOPLM=${LOOPLM:-.venv/bin/looplm}
heal() {  # heal MODEL DATA RUN ARGS...: skip a finished run, resume an interrupted one
  local model=$1 data=$2 run=$3; shift 3
  [ -f "$run/heal.json" ] && return 0
  local resume=""; [ -f "$run/run.json" ] && resume="--resume"
  $LOOPLM heal "$model" --teacher smollm2-135m --data "$data" --out "$run" --no-progress "$@" $resume
}
# 1. rank 128 on 1M generated tokens beside as many real rows
[ -f out/corpus-mix1m/meta.json ] || $LOOPLM data build smollm2-135m --seq-len 512 --no-progress \
  --sources "austen:479,kjv:479,shakespeare:479,python-docs:479,out/gen-start,out/gen-smollm2" --out out/corpus-mix1m
[ -f out/calib/b2-r128-shipped-8192/config.json ] || $LOOPLM convert smollm2-135m --loops 2 --lora-rank 128 \
  --calib-tokens 8192 --scored-tokens 0 --out out/calib/b2-r128-shipped-8192
# the idle hour of generalize.sh's rank-128 run: 837,632 local tokens per layer and 424,960 end to end
heal out/calib/b2-r128-shipped-8192 out/corpus-mix1m out/hour/b2-r128-mix1m --train-tokens 1309810 \
  --local-share 0.6395 --compile
# 2. the recipe's corpus (`looplm heal` without --data makes the same) and the quick start's 10 minutes on it:
#    68 local steps per layer (139,264 tokens) and 70 end-to-end steps (71,680 tokens), not compiled
$LOOPLM data generate smollm2-135m --out out/gen-smollm2-135m --generated-tokens 300000 --no-progress
[ -f out/corpus-smollm2-135m-mix-512/meta.json ] || $LOOPLM data build smollm2-135m --seq-len 512 --no-progress \
  --sources "austen:171,kjv:171,shakespeare:171,python-docs:171,out/gen-smollm2-135m" --out out/corpus-smollm2-135m-mix-512
[ -f out/quickstart/smollm2-135m-b2-r64/config.json ] || $LOOPLM convert smollm2-135m --scored-tokens 0 \
  --out out/quickstart/smollm2-135m-b2-r64
[ -f out/corpus-512/meta.json ] || $LOOPLM data build smollm2-135m --seq-len 512 --no-progress --out out/corpus-512
heal out/quickstart/smollm2-135m-b2-r64 out/corpus-512 out/quickstart/heal-b2-r64 --budget-minutes 10 --cache-rows 64
heal out/quickstart/smollm2-135m-b2-r64 out/corpus-smollm2-135m-mix-512 out/hour/qs-mix --train-tokens 218908 \
  --local-share 0.63618 --cache-rows 64 --no-compile
$LOOPLM eval suite smollm2-135m out/hour/b2-r128-mix/final out/hour/b2-r128-mix1m/final \
  out/quickstart/heal-b2-r64/final out/hour/qs-mix/final --data out/corpus-512 --tasks lambada --limit 200 \
  --out out/suite/mix-hours
