#!/usr/bin/env bash
# Healing judged off its corpus: the teacher's own text against the real corpus, on the out-of-domain suite.
#   1. `looplm data generate`: text sampled from the original SmolLM2 until GEN_TOKENS are kept (98000: one shard
#      of 256 samples, the run of docs/FINDINGS.md), resumable
#   2. three corpora: real (Austen, KJV, Shakespeare, Python docs), generated, and a mix of the two with equal rows
#   3. the same conversion healed on each for the same tokens (AB_TOKENS; rank 64, the quick start's scale)
#   4. one hour at rank 128 on the corpus the suite picks (HOUR_DATA)
#   5. `looplm eval suite`: the original and every healed model on five domains none of the corpora holds,
#      the real corpus's held-out split (in-domain) and LAMBADA
# Every step is resumable: rerun to continue. Environment: OUT, GEN_TOKENS, AB_TOKENS, HOUR_DATA, HOUR_MINUTES,
# STEPS (a subset of "gen ab hour suite").
set -euo pipefail
cd "$(dirname "$0")/.."
LOOPLM=${LOOPLM:-.venv/bin/looplm}
OUT=${OUT:-out}
GEN_TOKENS=${GEN_TOKENS:-98000}
AB_TOKENS=${AB_TOKENS:-300000}
HOUR_DATA=${HOUR_DATA:-mix}
HOUR_MINUTES=${HOUR_MINUTES:-60}
STEPS=${STEPS:-"gen ab hour suite"}
has() { [[ " $STEPS " == *" $1 "* ]]; }

[ -f "$OUT/corpus-512/meta.json" ] || $LOOPLM data build --model smollm2-135m --seq-len 512 --out "$OUT/corpus-512" --no-progress
[ -f "$OUT/calib/train.txt" ] || $LOOPLM data text "$OUT/corpus-512" --rows 16 --out "$OUT/calib"
if has gen; then
  $LOOPLM data generate smollm2-135m --out "$OUT/gen-smollm2" --tokens "$GEN_TOKENS" --corpus "$OUT/corpus-512" --no-progress
fi
rows=$(.venv/bin/python -c 'import json, sys; m = json.load(open(sys.argv[1])); print(m["sources"]["gen-smollm2"]["train"]["seqs"])' \
       "$OUT/corpus-gen/meta.json" 2>/dev/null || true)
[ -n "$rows" ] || { $LOOPLM data build --model smollm2-135m --seq-len 512 --sources "$OUT/gen-smollm2" --out "$OUT/corpus-gen" --no-progress;
                    rows=$(.venv/bin/python -c 'import json, sys; m = json.load(open(sys.argv[1])); print(m["sources"]["gen-smollm2"]["train"]["seqs"])' "$OUT/corpus-gen/meta.json"); }
# the mix: as many real rows as generated ones, a quarter from each real source (the real sources first, so that
# the first held-out rows, which heal evaluates, are the real corpus's)
q=$(( (rows + 3) / 4 ))
[ -f "$OUT/corpus-mix/meta.json" ] || $LOOPLM data build --model smollm2-135m --seq-len 512 --no-progress \
  --sources "austen:$q,kjv:$q,shakespeare:$q,python-docs:$q,$OUT/gen-smollm2" --out "$OUT/corpus-mix"

convert() {  # the recommended conversion: average + data-aware SVD, per-depth norms
  local rank=$1
  [ -f "$OUT/models/b2-r$rank/config.json" ] || $LOOPLM convert --model smollm2-135m --loops 2 --lora-rank "$rank" \
    --init average --lora-init aware-svd --norms per-depth --calib-data "$OUT/calib" --calib-tokens 8192 \
    --ppl-tokens 0 --out "$OUT/models/b2-r$rank"
}
heal() {  # heal MODEL DATA RUN BUDGET...
  local model=$1 data=$2 run=$3; shift 3
  [ -f "$run/heal.json" ] && return 0
  local resume=""; [ -f "$run/run.json" ] && resume="--resume"
  $LOOPLM heal "$model" --teacher smollm2-135m --data "$data" --out "$run" --e2e-rows online --no-progress "$@" $resume
}

if has ab; then
  convert 64
  for arm in real gen mix; do
    data="$OUT/corpus-$arm"; [ $arm = real ] && data="$OUT/corpus-512"
    heal "$OUT/models/b2-r64" "$data" "$OUT/ab/$arm" --tokens "$AB_TOKENS" --cache-rows 64
  done
fi
if has hour; then
  convert 128
  data="$OUT/corpus-$HOUR_DATA"; [ "$HOUR_DATA" = real ] && data="$OUT/corpus-512"
  heal "$OUT/models/b2-r128" "$data" "$OUT/hour/b2-r128-$HOUR_DATA" --budget-minutes "$HOUR_MINUTES" --cache-rows 256 --compile
fi
if has suite; then
  models=(smollm2-135m)
  for d in "$OUT"/ab/*/final "$OUT"/hour/*/final; do [ -d "$d" ] && models+=("$d"); done
  $LOOPLM eval suite "${models[@]}" --data "$OUT/corpus-512" --tasks lambada --limit 200 --out "$OUT/suite/generalize"
fi
