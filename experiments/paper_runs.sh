#!/usr/bin/env bash
# Issues 3 and 19: the paper's initialisation comparison on SmolLM2-135M at B=2, with the faithful inits
# (Stepwise and Lower copy their layers' norms, Random uses no pretrained weight; issue 19).
# Students, each uptrained with forward-KL distillation from the full-size model on the same token budget:
#   rec-stepwise        recursive, Stepwise init         (paper: best without LoRA)
#   rec-average         recursive, Average init
#   rec-random          recursive, Random init           (paper: far worse than pretrained init)
#   rel-svd64           relaxed, Average + SVD rank 64   (paper: best with LoRA; SVD beats zero init)
#   rel-stepwise-svd64  relaxed, Stepwise + SVD rank 64  (against rel-svd64: "Average is the best init with LoRA")
#   rel-zero64          relaxed, Average + zero rank 64
# Then every student and the original on the seven tasks (first LIMIT documents per task, with standard
# errors; docs/guides/evaluate.md), held-out perplexity per exit, curves as PNG and one report (KEEP/report.md).
# Resumable and idempotent: rerun it to continue where a stopped run left off; finished steps are skipped.
# Each student is trained, then evaluated, then its small results (metrics.jsonl, eval/*.json) are copied into
# KEEP (committed): a student found there is done, so the comparison continues on a new machine whose out/ is
# empty, and the curves and the report are built from KEEP alone.
# Environment: TOKENS (budget per student), OUT, DATA, KEEP, STUDENTS (subset, space separated), LOOPS (B, default
# 2; e.g. LOOPS=3 OUT=out/paper-b3-faithful KEEP=experiments/results/paper_b3_faithful), LIMIT (documents per task, default 200;
# 0 skips the few-shot evaluation), PRECISION (train's --precision, default fp32 so that every student of one
# comparison trains alike whichever machine kind it runs on).
# Issue 19 asks for an hour of this CPU per student. TOKENS=215040 (210 steps of 2 x 512) is the hour of the
# AVX2-only EPYC in fp32 (17 s a step); the AVX-512 machines run the same students faster.
set -euo pipefail
cd "$(dirname "$0")/.."
LOOPLM=${LOOPLM:-.venv/bin/looplm}
DATA=${DATA:-out/corpus-smollm2-512}
OUT=${OUT:-out/paper-b2-faithful}   # not out/paper-b2: its students were converted before issue 19
LOOPS=${LOOPS:-2}
TOKENS=${TOKENS:-163840}           # 160 steps of 2 x 512: 24-31 min each on this idle 2-core CPU (fp32); 409600 for an hour
LIMIT=${LIMIT:-200}
KEEP=${KEEP:-experiments/results/paper_b${LOOPS}_faithful}
PRECISION=${PRECISION:-fp32}
STUDENTS=${STUDENTS:-"rec-stepwise rec-average rec-random rel-svd64 rel-stepwise-svd64 rel-zero64"}

declare -A CONVERT=(
  [rec-stepwise]="--init stepwise --lora-rank 0"
  [rec-average]="--init average --lora-rank 0"
  [rec-random]="--init random --lora-rank 0"
  [rel-svd64]="--init average --lora-rank 64 --lora-init svd"
  [rel-stepwise-svd64]="--init stepwise --lora-rank 64 --lora-init svd"
  [rel-zero64]="--init average --lora-rank 64 --lora-init zero"
)

[ -f "$DATA/meta.json" ] || $LOOPLM data build --model smollm2-135m --seq-len 512 --out "$DATA"

evaluate() {  # evaluate NAME MODEL: few-shot (every exit) and held-out perplexity into $OUT/eval/NAME
  local dir="$OUT/eval/$1"
  mkdir -p "$OUT/eval"
  if [ "$LIMIT" -gt 0 ] && [ ! -f "$dir/eval/fewshot.json" ]; then
    $LOOPLM eval fewshot "$2" --tasks paper7 --limit "$LIMIT" --all-loops --save-dir "$dir" --json \
      > "$OUT/eval/$1.fewshot.log"
  fi
  [ -f "$dir/eval/ppl-heldout_sample.json" ] || $LOOPLM eval ppl "$2" --save-dir "$dir" --json > "$OUT/eval/$1.ppl.log"
  echo "$1: evaluated"
}
keep() {  # keep NAME [RUN]: the small results of one finished model into $KEEP/NAME, written last
  local dest="$KEEP/$1" tmp="$KEEP/.$1.tmp"
  rm -rf "$tmp" && mkdir -p "$tmp/eval"
  cp "$OUT/eval/$1"/eval/*.json "$tmp/eval/"
  if [ -n "${2:-}" ]; then cp "$2/metrics.jsonl" "$tmp/"; fi
  rm -rf "$dest" && mv "$tmp" "$dest"
}
done_with() { [ -f "$KEEP/$1/eval/ppl-heldout_sample.json" ] && { [ "$LIMIT" -eq 0 ] || [ -f "$KEEP/$1/eval/fewshot.json" ]; }; }

# The kept students and the ones still to train must share one recipe: KEEP records it.
settings="tokens=$TOKENS precision=$PRECISION loops=$LOOPS"
mkdir -p "$KEEP"
if [ -f "$KEEP/settings" ] && [ "$(cat "$KEEP/settings")" != "$settings" ]; then
  echo "error: $KEEP holds students trained with '$(cat "$KEEP/settings")', not '$settings'; set TOKENS," \
       "PRECISION and LOOPS to those, or give another KEEP" >&2
  exit 2
fi
# A student already trained in OUT (e.g. by scripts/exit_model.sh, whose KEEP is new) must have this recipe too.
for s in $STUDENTS; do
  r="$OUT/runs/$s/run.json"
  [ -f "$r" ] || continue
  was=$(${PYTHON:-.venv/bin/python} -c 'import json, sys; c = json.load(open(sys.argv[1]))["config"]
print("tokens=%s precision=%s" % (c["max_tokens"], c["precision"]))' "$r")
  if [ "$was loops=$LOOPS" != "$settings" ]; then
    echo "error: $OUT/runs/$s was trained with '$was', not '${settings% loops=*}'; set TOKENS and PRECISION to" \
         "those, or give another OUT" >&2
    exit 2
  fi
done
echo "$settings" > "$KEEP/settings"
if done_with original; then echo "original: kept"; else evaluate original smollm2-135m && keep original; fi
for s in $STUDENTS; do
  if done_with "$s"; then echo "$s: kept in $KEEP/$s"; continue; fi
  model="$OUT/models/$s" run="$OUT/runs/$s"
  [ -f "$model/config.json" ] || $LOOPLM convert --model smollm2-135m --loops "$LOOPS" ${CONVERT[$s]} \
                                   --out "$model" --ppl-tokens 0
  if [ ! -d "$run/final" ]; then
    resume=""; [ -f "$run/run.json" ] && resume="--resume"
    $LOOPLM train --model "$model" --teacher smollm2-135m --kd fkl --data "$DATA" --out "$run" \
        --batch-size 2 --seq-len 512 --max-tokens "$TOKENS" --eval-every 20 --eval-seqs 16 \
        --save-every 10 --keep 2 --precision "$PRECISION" --no-progress $resume
  fi
  evaluate "$s" "$run/final"
  keep "$s" "$run"
done

kept=() reports=("$KEEP/original")
for s in $STUDENTS; do
  if done_with "$s"; then kept+=("$KEEP/$s"); reports+=("$KEEP/$s"); fi
done
$LOOPLM plot "${kept[@]}" --out "$KEEP"
[ "$LIMIT" -gt 0 ] || exit 0
$LOOPLM report "${reports[@]}" --out "$KEEP" --title "SmolLM2-135M B=$LOOPS students after $TOKENS tokens"
