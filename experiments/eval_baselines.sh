#!/usr/bin/env bash
# Issue 4, deliverable 5: the originals (SmolLM2-135M, Gemma-3-270M) and their B=2 / B=3 conversions
# before uptraining (LoRA rank 0, 64, full), on the seven tasks and held-out perplexity, then one
# report (markdown table + Pareto PNG). Resumable: a row whose results exist is skipped.
#   LIMIT (SmolLM2, default 10) and GLIMIT (Gemma, default 5): documents per task; OUT: results root.
set -euo pipefail
cd "$(dirname "$0")/.."
LOOPLM=${LOOPLM:-.venv/bin/looplm}
OUT=${OUT:-out/baselines}
L=${LIMIT:-10} GL=${GLIMIT:-5}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}   # one thread: shared 2-core machines spin-wait otherwise

evaluate() {  # name model limit
  local dir="$OUT/$1"
  if [ ! -f "$dir/eval/fewshot.json" ]; then
    $LOOPLM eval fewshot "$2" --tasks paper7 --limit "$3" --all-loops --save-dir "$dir" --json > "$OUT/$1.fewshot.log"
  fi
  if [ ! -f "$dir/eval/ppl-heldout_sample.json" ]; then
    $LOOPLM eval ppl "$2" --max-tokens 2048 --save-dir "$dir" --json > "$OUT/$1.ppl.log"
  fi
  echo "$(date -u +%T) $1: done"
}

converted() {  # family model loops rank limit: convert, evaluate, drop the weights (results stay)
  local name="$1-b$3-r$4" model="$OUT/models/$1-b$3-r$4"
  [ "$4" = full ] && name="$1-b$3-full" model="$OUT/models/$1-b$3-full"
  if [ -f "$OUT/$name/eval/fewshot.json" ] && [ -f "$OUT/$name/eval/ppl-heldout_sample.json" ]; then
    echo "$name: done"; return
  fi
  [ -f "$model/model.safetensors" ] || $LOOPLM convert --model "$2" --loops "$3" --lora-rank "$4" \
                                          --ppl-tokens 0 --out "$model" --json > "$OUT/$name.convert.log"
  evaluate "$name" "$model" "$5"
  rm -rf "$model"
}

mkdir -p "$OUT"
evaluate smollm2-135m smollm2-135m "$L"
evaluate gemma3-270m gemma3-270m "$GL"
for B in 2 3; do
  for R in 0 64 full; do
    converted smollm2 smollm2-135m "$B" "$R" "$L"
    converted gemma3 gemma3-270m "$B" "$R" "$GL"
  done
done
rows=()
for fam in smollm2:smollm2-135m gemma3:gemma3-270m; do
  rows+=("$OUT/${fam#*:}")
  for B in 2 3; do for R in r0 r64 full; do rows+=("$OUT/${fam%%:*}-b$B-$R"); done; done
done
$LOOPLM report "${rows[@]}" --out "$OUT/report"
echo "report: $OUT/report/report.md"
