#!/usr/bin/env bash
# Issue 78: which sharing plan heals best, at equal N-emb and equal tokens, out of domain (SmolLM2-135M, B=2).
# Students (rank 0 unless named; data-aware shared weights, per-depth norms, as the claims' rec):
#   rec        cycle, 15 shared layers (the paper's plan)
#   mc         middle-cycle: layer 0 and layer 29 unique, the middle 28 depths as 14 layers looped twice
#   mcs        mc with a loop scale (`--loop-scale`: each loop's output times a vector of its own, ones at first)
#   mcm        mc with a magnitude (`--magnitude`: each shared linear's output times a vector per depth, ones at first)
#   p2c2, p3c3 prelude / core x 2 / coda: 2 + 13 x 2 + 2 and 3 + 12 x 2 + 3
#   rec-r12    cycle with a rank-12 LoRA per depth: about one layer's parameters (3.66M), mc's N-emb
#   reducedN   the reduced-size model of N layers (Stepwise picks, the first and last kept), each plan's N-emb
#   def        `looplm convert`'s defaults before this comparison: cycle, rank 64 (N-emb 72.7M)
#   mc56       the same conversion with middle-cycle at rank 56, the rank that keeps its N-emb at def's
#   NAME-seedN NAME's conversion healed again with seed N (its own teacher cache, OUT/cache-seedN: other rows), for
#              the claims' gap over seeds (`looplm eval claims --plans`)
# Each is healed (`looplm heal`, the recipe) on the claims' token budget (327,452 tokens, 0.6395 of them local), one
# teacher cache for all (OUT/cache: the same rows of the same original; run a second heal beside the first only once
# the first has written it), on the real corpus's training split (HEAL_DATA), into OUT/heal/NAME; `looplm eval suite` scores them on the five out-of-domain domains, the
# real corpus's held-out split and the seven tasks (LIMIT documents each) into RESULTS.json.
# Resumable: every step skips what is finished and resumes what was interrupted. Environment: OUT, STUDENTS, STEPS
# (a subset of "convert heal suite"), TASKS, LIMIT, WINDOWS, RESULTS, HEAL_BUDGET, HEAL_DATA, TAG (a suffix of the
# suite's names, so that the same plans healed on other text are told apart: -mix on the recipe's corpus), PYTHON,
# LOOPLM.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
LOOPLM=${LOOPLM:-"$PYTHON -m looplm"}
OUT=${OUT:-out/sharing/smollm2}
STUDENTS=${STUDENTS:-"mc reduced16 rec reduced15 def mc56 p3c3 reduced18 rec-r12 p2c2 reduced17"}
STEPS=${STEPS:-"convert heal suite"}
LIMIT=${LIMIT:-500}
TASKS=${TASKS:-paper7}  # none: perplexity alone (the tasks cost about 20 minutes a model at 100 documents a task)
WINDOWS=${WINDOWS:-32}
RESULTS=${RESULTS:-docs/results/sharing/smollm2}
HEAL_BUDGET=${HEAL_BUDGET:-"--train-tokens 327452 --local-share 0.6395"}
TAG=${TAG:-}
HEAL_DATA=${HEAL_DATA:-$OUT/corpus-512}  # the real text's training split (the recipe's mix needs 90 min of the original's text first)
model=smollm2-135m real=$OUT/corpus-512 calib=$OUT/calib
has() { [[ " $STEPS " == *" $1 "* ]]; }
mkdir -p "$OUT/logs" "$OUT/models" "$OUT/heal" "$(dirname "$RESULTS")"
[ -f "$real/meta.json" ] || $LOOPLM data build "$model" --seq-len 512 --out "$real" --no-progress
[ -f "$calib/train.txt" ] || $LOOPLM data text "$real" --rows 16 --out "$calib"

convert() {  # convert NAME DIR
  local name=$1 dir=$2 aware="--init aware --norms per-depth --calib-data $calib --calib-tokens 8192 --scored-tokens 0"
  [ -f "$dir/config.json" ] && return 0
  # shellcheck disable=SC2086  # word lists
  case $name in
    reduced*) $LOOPLM baseline "$model" --layers "${name#reduced}" --out "$dir" ;;
    rec) $LOOPLM convert "$model" --loops 2 --sharing cycle --lora-rank 0 $aware --out "$dir" ;;
    rec-r*) $LOOPLM convert "$model" --loops 2 --sharing cycle --lora-rank "${name#rec-r}" --lora-init aware-svd $aware --out "$dir" ;;
    def) $LOOPLM convert "$model" --loops 2 --lora-rank 64 --sharing cycle --calib-data "$calib" --scored-tokens 0 \
           --out "$dir" ;;
    mc56) $LOOPLM convert "$model" --loops 2 --lora-rank 56 --sharing middle-cycle --calib-data "$calib" \
           --scored-tokens 0 --out "$dir" ;;
    mc) $LOOPLM convert "$model" --loops 2 --lora-rank 0 --sharing middle-cycle $aware --out "$dir" ;;
    mcs) $LOOPLM convert "$model" --loops 2 --lora-rank 0 --sharing middle-cycle --loop-scale $aware --out "$dir" ;;
    mcm) $LOOPLM convert "$model" --loops 2 --lora-rank 0 --sharing middle-cycle --magnitude $aware --out "$dir" ;;
    p*c*) local p=${name#p}; p=${p%c*}
          $LOOPLM convert "$model" --loops 2 --lora-rank 0 --prelude "$p" --coda "${name##*c}" $aware --out "$dir" ;;
    *) echo "error: unknown student $name" >&2; exit 2 ;;
  esac
}

for s in $STUDENTS; do
  base=${s%-seed*} seed=0 cache=$OUT/cache
  [ "$base" != "$s" ] && seed=${s##*-seed} && cache=$OUT/cache-seed$seed
  has convert && convert "$base" "$OUT/models/$base"
  if has heal && [ ! -f "$OUT/heal/$s/heal.json" ]; then
    resume=""; [ -f "$OUT/heal/$s/run.json" ] && resume="--resume"
    # shellcheck disable=SC2086
    $LOOPLM heal "$OUT/models/$base" --teacher "$model" --data "$HEAL_DATA" --out "$OUT/heal/$s" --cache "$cache" \
      --seed "$seed" --no-progress $HEAL_BUDGET --compile $resume
  fi
done

if has suite; then
  specs=("original=$model") names=()
  for s in $STUDENTS; do
    [ -f "$OUT/heal/$s/final/config.json" ] && specs+=("$s$TAG=$OUT/heal/$s/final") && names+=("$s")
  done
  pairs=()
  for p in mc-seed1,reduced16-seed1 mcs,mc mcs,reduced16 mcm,mc mcm,reduced16 mc,reduced16 rec,reduced15 p3c3,reduced18 p2c2,reduced17 mc,rec-r12 mc,rec mc,def p3c3,mc p2c2,mc mc56,def; do
    [[ " ${names[*]} " == *" ${p%,*} "* && " ${names[*]} " == *" ${p#*,} "* ]] && pairs+=(--compare "${p%,*}$TAG,${p#*,}$TAG")
  done
  $LOOPLM eval suite "${specs[@]}" --data "$real" --tasks "$TASKS" --limit "$LIMIT" --windows "$WINDOWS" \
    "${pairs[@]}" --resume --out "$RESULTS" \
    --reproduce "STUDENTS=\"${names[*]}\"${TAG:+ HEAL_DATA=$HEAL_DATA OUT=$OUT TAG=$TAG} bash experiments/sharing_comparison.sh" \
    > "$OUT/logs/suite.log"
  echo "wrote $RESULTS.md"
fi
