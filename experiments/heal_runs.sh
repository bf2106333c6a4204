#!/usr/bin/env bash
# Issue 18's measurements: healing against the paper's recipe on this machine, one hour each.
#   <name>        data-aware conversion (average + aware-svd), then `looplm heal --budget-minutes 60` with a
#                 256-row teacher cache for the local stage and the end-to-end rows read online (runs before
#                 2026-11-27 05:00 UTC read them from the cache: HEAL_ARGS="--e2e-rows cache"). HEAL_ARGS adds
#                 options, e.g. "--local-share 0.25"
#   paper-r64     the paper's recipe at the same hour: average + plain SVD rank 64, then end-to-end
#                 0.5 CE + 0.5 forward KL from the online teacher, `looplm train --budget-minutes MINUTES`
#                 (PAPER_TOKENS=N trains N tokens instead; the run of 2026-11-25 used 450560: 440 steps of
#                 2 x 512, an hour of both cores in bf16 at the ~8 s per step measured that day)
# Runs (RUNS, space separated; default all, in this order):
#   b2-r64 b2-r128 b2-r0 b3-r64 paper-r64 gemma-b3-r64
# A variant of a run is named <run>@<tag> (e.g. b2-r128@local65 with HEAL_ARGS="--local-share 0.65"): it heals
# the base run's conversion into out/heal/runs/<run>@<tag>, so two recipes start from the same weights.
# Resumable: rerun to continue a killed run; finished runs are skipped. Environment: OUT, MINUTES, RUNS,
# HEAL_ARGS, THREADS (OMP threads; default both cores).
set -euo pipefail
cd "$(dirname "$0")/.."
LOOPLM=${LOOPLM:-.venv/bin/looplm}
OUT=${OUT:-out/heal}
MINUTES=${MINUTES:-60}
RUNS=${RUNS:-"b2-r64 b2-r128 b2-r0 b3-r64 paper-r64 gemma-b3-r64"}
PAPER_TOKENS=${PAPER_TOKENS:-}
HEAL_ARGS=${HEAL_ARGS:-}
export OMP_NUM_THREADS=${THREADS:-2}

corpus() {  # corpus for a model: SmolLM2 and Gemma tokenise differently
  local model=$1 dir="$OUT/corpus-$1-512"
  [ -f "$dir/meta.json" ] || $LOOPLM data build --model "$model" --seq-len 512 --out "$dir" --no-progress >&2
  [ -f "$OUT/calib-$model/train.txt" ] || $LOOPLM data text "$dir" --rows 16 --out "$OUT/calib-$model" >&2
  echo "$dir"
}

for r in $RUNS; do
  base=${r%%@*}
  case $base in
    b2-r64)  model=smollm2-135m loops=2 rank=64 ;;
    b2-r128) model=smollm2-135m loops=2 rank=128 ;;
    b2-r0)   model=smollm2-135m loops=2 rank=0 ;;
    b3-r64)  model=smollm2-135m loops=3 rank=64 ;;
    paper-r64) model=smollm2-135m loops=2 rank=64 ;;
    gemma-b3-r64) model=gemma3-270m loops=3 rank=64 ;;
    *) echo "unknown run $r" >&2; exit 2 ;;
  esac
  data=$(corpus $model)
  student="$OUT/models/$base" run="$OUT/runs/$r"
  if [ "$base" = paper-r64 ]; then
    [ -f "$student/config.json" ] || $LOOPLM convert --model $model --loops $loops --lora-rank $rank \
        --init average --lora-init svd --ppl-tokens 0 --out "$student"
    if [ -d "$run/final" ]; then echo "$r: done"; continue; fi
    resume=""; [ -f "$run/run.json" ] && resume="--resume"
    budget="--budget-minutes $MINUTES"; [ -n "$PAPER_TOKENS" ] && budget="--max-tokens $PAPER_TOKENS"
    $LOOPLM train --model "$student" --teacher $model --kd fkl --data "$data" --out "$run" --batch-size 2 \
        --seq-len 512 $budget --eval-every 40 --eval-seqs 16 --save-every 20 --keep 2 \
        --no-progress $resume
    continue
  fi
  # Per-depth norms: each depth's norm weights heal on their own (2,003 against 3,982 held-out perplexity
  # after conversion at B=2 rank 64, docs/FINDINGS.md healing section); Gemma's post-norms need them anyway.
  norms="--norms per-depth"
  init="--init average --lora-init aware-svd"
  [ $rank = 0 ] && init="--init aware"                    # rank 0: the data-aware shared weight alone
  [ -f "$student/config.json" ] || $LOOPLM convert --model $model --loops $loops --lora-rank $rank $init $norms \
      --calib-data "$OUT/calib-$model" --calib-tokens 8192 --ppl-tokens 0 --out "$student"
  if [ -f "$run/heal.json" ]; then echo "$r: done"; continue; fi
  resume=""; [ -f "$run/run.json" ] && resume="--resume"
  # --e2e-rows online: the end-to-end stage reads new training rows with the original run on them, instead of
  # re-reading the 256 cached ones (B=2 rank 128, 2026-11-27: 41.22 against 42.76; docs/FINDINGS.md).
  # --compile: 1.40x faster end-to-end steps (runs before 2026-11-27 13:30 UTC were eager)
  $LOOPLM heal "$student" --teacher $model --data "$data" --out "$run" --budget-minutes "$MINUTES" \
      --cache-rows 256 --e2e-rows online --compile --no-progress $HEAL_ARGS $resume
done
