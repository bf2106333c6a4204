#!/usr/bin/env bash
# Issue 5: the early-exit-trained model that the serving benchmarks use, and its exit probe.
#   1. rec-stepwise of the paper runs (SmolLM2-135M B=2 recursive Stepwise, 163,840 tokens of forward-KL
#      uptraining; scripts/paper_runs.sh),
#   2. post-trained 40,960 tokens with the paper's early-exit recipe (aggressive, c = 0.1, self-distillation),
#      on new tokens (rows the uptraining did not read; `--data-rows new`, the default with --early-exit) and at
#      the uptraining's learning rate (2e-4, as the paper keeps it; models made before issue 19 used 1e-4 and
#      re-read the uptraining's first rows),
#   3. optionally (EXIT_MORE_TOKENS > 0) a second post-training stage of that many tokens, same recipe, started
#      from stage 2's result with a fresh warmup and cosine schedule (the model the serving benchmarks of
#      2026-11-23 afternoon use: EXIT_MORE_TOKENS=122880, 163,840 post-training tokens in all),
#   4. the learned exit probe fitted on the corpus' training split (`looplm fit-exit-probe`).
# Resumable and idempotent like paper_runs.sh. Environment: OUT, DATA, LOOPS (as in paper_runs.sh), EXIT_TOKENS,
# EXIT_MORE_TOKENS. Prints the directory of the final exit model. The B=3 model of 2026-11-23 evening:
#   LOOPS=3 OUT=out/paper-b3 bash scripts/exit_model.sh
set -euo pipefail
cd "$(dirname "$0")/.."
LOOPLM=${LOOPLM:-.venv/bin/looplm}
DATA=${DATA:-out/corpus-smollm2-512}
OUT=${OUT:-out/paper-b2}
EXIT_TOKENS=${EXIT_TOKENS:-40960}
EXIT_MORE_TOKENS=${EXIT_MORE_TOKENS:-0}

# KEEP inside OUT: this script needs the trained model itself, which a committed KEEP of results does not hold.
STUDENTS=rec-stepwise LIMIT=0 OUT="$OUT" KEEP="$OUT/kept" DATA="$DATA" bash experiments/paper_runs.sh

post_train() {  # post_train FROM RUN TOKENS: the paper's early-exit recipe (aggressive, c = 0.1, self-distillation)
  local from=$1 run=$2 tokens=$3
  [ -d "$run/final" ] && return 0
  local resume=""; [ -f "$run/run.json" ] && resume="--resume"
  $LOOPLM train --model "$from" --teacher smollm2-135m --kd fkl --data "$DATA" --out "$run" \
      --early-exit aggressive --exit-coef 0.1 --self-distill --data-rows new --lr 2e-4 --batch-size 2 --seq-len 512 \
      --max-tokens "$tokens" --eval-every 20 --eval-seqs 16 --save-every 10 --keep 2 --no-progress $resume
}

run="$OUT/runs/rec-stepwise-exit"
post_train "$OUT/runs/rec-stepwise/final" "$run" "$EXIT_TOKENS"
if [ "$EXIT_MORE_TOKENS" -gt 0 ]; then
  post_train "$run/final" "$run-more" "$EXIT_MORE_TOKENS"
  run="$run-more"
fi
[ -f "$run/final/exit_probe.safetensors" ] || $LOOPLM fit-exit-probe "$run/final" --data "$DATA"
echo "$run/final"
