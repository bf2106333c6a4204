#!/bin/bash
# Does `looplm heal` heal as it did before the one-training-stack refactor (issue 57)? The quick start's heal at
# 41db5a4 (the last commit before it) and at the commit this script was added, on the same converted student,
# corpus, token budget and flags (the later commit given the earlier default: every hidden channel alike), one
# thread each, side by side. Then the rank-64 hour with the earlier defaults, against the hour healed before the
# refactor (docs/results/heal-default-b2-r64-epyc.json, 50b321f).
#   bash experiments/heal_refactor_ab.sh            # out/ab57/{qs-pre,qs-post,hour-post}
set -e
cd "$(dirname "$0")/.."
PY=$PWD/.venv/bin/python
STUDENT=out/defaults/out/smollm2-135m-b2-r64          # `looplm convert smollm2-135m` (B=2, rank 64)
CORPUS=out/defaults/out/corpus-smollm2-135m-512       # the real-text corpus, heal's default before 8a7939b
[ -d /tmp/looplm-pre ] || git worktree add /tmp/looplm-pre 41db5a4 -f
[ -d /tmp/looplm-post ] || git worktree add /tmp/looplm-post 8d54ba5 -f
COMMON="$STUDENT --data $CORPUS --train-tokens 218908 --local-share 0.63618 --cache-rows 64 --no-progress"
OMP_NUM_THREADS=1 PYTHONPATH=/tmp/looplm-pre/src $PY -m looplm heal $COMMON --out out/ab57/qs-pre &
OMP_NUM_THREADS=1 PYTHONPATH=/tmp/looplm-post/src $PY -m looplm heal $COMMON --out out/ab57/qs-post \
  --hidden-channels uniform --no-compile &
wait
cmp out/ab57/qs-pre/final/model.safetensors out/ab57/qs-post/final/model.safetensors && echo "same weights"
PYTHONPATH=/tmp/looplm-post/src $PY -m looplm heal $STUDENT --data $CORPUS --hidden-channels uniform \
  --budget-minutes 60 --out out/ab57/hour-post --no-progress
