#!/usr/bin/env bash
# Issue 5: the early-exit-trained model that the serving benchmarks use, and its exit probe.
#   1. rec-stepwise of the paper runs (SmolLM2-135M B=2 recursive Stepwise, 163,840 tokens of forward-KL
#      uptraining; scripts/paper_runs.sh),
#   2. post-trained 40,960 tokens with the paper's early-exit recipe (aggressive, c = 0.1, self-distillation),
#   3. the learned exit probe fitted on the corpus' training split (`looplm fit-exit-probe`).
# Resumable and idempotent like paper_runs.sh. Environment: OUT, DATA (as in paper_runs.sh), EXIT_TOKENS.
set -euo pipefail
cd "$(dirname "$0")/.."
LOOPLM=${LOOPLM:-.venv/bin/looplm}
DATA=${DATA:-out/corpus-smollm2-512}
OUT=${OUT:-out/paper-b2}
EXIT_TOKENS=${EXIT_TOKENS:-40960}

STUDENTS=rec-stepwise OUT="$OUT" DATA="$DATA" bash scripts/paper_runs.sh
run="$OUT/runs/rec-stepwise-exit"
if [ ! -d "$run/final" ]; then
  resume=""; [ -f "$run/run.json" ] && resume="--resume"
  $LOOPLM train --model "$OUT/runs/rec-stepwise/final" --teacher smollm2-135m --kd fkl --data "$DATA" --out "$run" \
      --early-exit aggressive --exit-coef 0.1 --self-distill --lr 1e-4 --batch-size 2 --seq-len 512 \
      --max-tokens "$EXIT_TOKENS" --eval-every 20 --eval-seqs 16 --save-every 10 --keep 2 --no-progress $resume
fi
[ -f "$run/final/exit_probe.safetensors" ] || $LOOPLM fit-exit-probe "$run/final" --data "$DATA"
