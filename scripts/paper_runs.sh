#!/usr/bin/env bash
# Issue 3, deliverable 6: the paper's initialisation comparison on SmolLM2-135M at B=2.
# Five students, each uptrained with forward-KL distillation from the full-size model on the same
# token budget, then held-out perplexity per exit and curves as PNG:
#   rec-stepwise   recursive, Stepwise init         (paper: best without LoRA)
#   rec-average    recursive, Average init
#   rel-svd64      relaxed, Average + SVD rank 64   (paper: best with LoRA; SVD beats zero init)
#   rel-zero64     relaxed, Average + zero rank 64
#   rec-random     recursive, random init           (paper: far worse than pretrained init)
# Resumable and idempotent: rerun it to continue where a stopped run left off; finished runs are
# skipped. Environment: TOKENS (budget per student), OUT, DATA, STUDENTS (subset, space separated),
# LOOPS (B, default 2; e.g. LOOPS=3 OUT=out/paper-b3 for the B=3 students).
set -euo pipefail
cd "$(dirname "$0")/.."
LOOPLM=${LOOPLM:-.venv/bin/looplm}
DATA=${DATA:-out/corpus-smollm2-512}
OUT=${OUT:-out/paper-b2}
LOOPS=${LOOPS:-2}
TOKENS=${TOKENS:-163840}           # 160 steps of 2 x 512: 24-31 min each on this idle 2-core CPU (fp32); 409600 for an hour
STUDENTS=${STUDENTS:-"rec-stepwise rec-average rel-svd64 rel-zero64 rec-random"}

declare -A CONVERT=(
  [rec-stepwise]="--init stepwise --lora-rank 0"
  [rec-average]="--init average --lora-rank 0"
  [rel-svd64]="--init average --lora-rank 64 --lora-init svd"
  [rel-zero64]="--init average --lora-rank 64 --lora-init zero"
  [rec-random]="--init random --lora-rank 0"
)

[ -f "$DATA/meta.json" ] || $LOOPLM data build --model smollm2-135m --seq-len 512 --out "$DATA"

for s in $STUDENTS; do
  model="$OUT/models/$s" run="$OUT/runs/$s"
  [ -f "$model/config.json" ] || $LOOPLM convert --model smollm2-135m --loops "$LOOPS" ${CONVERT[$s]} \
                                   --out "$model" --ppl-tokens 0
  if [ -d "$run/final" ]; then echo "$s: done"; continue; fi
  resume=""; [ -f "$run/run.json" ] && resume="--resume"
  $LOOPLM train --model "$model" --teacher smollm2-135m --kd fkl --data "$DATA" --out "$run" \
      --batch-size 2 --seq-len 512 --max-tokens "$TOKENS" --eval-every 20 --eval-seqs 16 \
      --save-every 10 --keep 2 --no-progress $resume
done
$LOOPLM plot "$OUT"/runs/* --out "$OUT"
