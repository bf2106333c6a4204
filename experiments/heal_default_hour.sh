#!/usr/bin/env bash
# What do `looplm convert` and `looplm heal` with default flags give in an hour, judged off the corpus and on LAMBADA?
# SmolLM2-135M, B=2: the default conversion (middle-cycle, rank 56), healed on the default corpus (the original's
# own text beside as much real text, which `looplm heal` makes itself) for the tokens an idle hour bought the cycle
# rank-64 default on a 2-core AMD EPYC with AVX-512 BF16 (a token budget: other jobs change the wall time, not the
# result). Scored by the suite on the five out-of-domain domains (16 windows each), the real corpus's held-out
# split and LAMBADA (200 documents), beside the original. VARIANT=magnitude adds `--magnitude` to the conversion
# (likewise loop-scale) and heals it alike, scored beside the default's row and compared with it. Resumable: rerun
# to continue.
set -euo pipefail
cd "$(dirname "$0")/.."
LOOPLM=${LOOPLM:-.venv/bin/looplm}
OUT=${OUT:-out/hour}
VARIANT=${VARIANT:-}
MODEL=$OUT/smollm2-135m-b2-r56${VARIANT:+-$VARIANT}   # `looplm convert smollm2-135m` with default flags (and --VARIANT)
RUN=$OUT/b2-r56-${VARIANT:-default}
REAL=${REAL:-out/corpus-512}
RESULTS=${RESULTS:-docs/results/ood-smollm2-b2-r56-hour-epyc}
mkdir -p "$OUT"
[ -f "$REAL/meta.json" ] || $LOOPLM data build smollm2-135m --seq-len 512 --out "$REAL" --no-progress
[ -f $MODEL/config.json ] || $LOOPLM convert smollm2-135m ${VARIANT:+--$VARIANT} --out $MODEL
if [ ! -f $RUN/heal.json ]; then
  resume=""; [ -f $RUN/run.json ] && resume="--resume"
  # the cycle rank-64 default's idle hour: 1,005,568 layer-local and 483,328 end-to-end tokens, 52 exit-adapter steps
  $LOOPLM heal $MODEL --out $RUN --train-tokens 1542599 --local-share 0.65187 --compile --no-progress $resume
fi
specs=(default-hour=$OUT/b2-r56-default/final) pairs=()
[ -n "$VARIANT" ] && specs+=("$VARIANT-hour=$RUN/final") && pairs=(--compare "$VARIANT-hour,default-hour")
$LOOPLM eval suite smollm2-135m "${specs[@]}" "${pairs[@]}" --data "$REAL" --tasks lambada --limit 200 --windows 16 \
  --resume --out "$RESULTS" --reproduce "${VARIANT:+VARIANT=$VARIANT }bash experiments/heal_default_hour.sh"
