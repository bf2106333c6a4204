#!/usr/bin/env bash
# Issue 55: the default recipe (`looplm convert`, `looplm heal` for an hour) healed on the teacher's own text
# instead of the four-source real corpus, judged on the out-of-domain suite. Resumable: rerun to continue.
#   1. SmolLM2 writes ~800k tokens from bare document starts (40 minutes at ~320 tokens/s, bf16, 2 cores),
#      beside the 200k-token set of 2026-11-29 (half continuing snippets of the real corpus)
#   2. both packed into one corpus (1,916 training rows of 512 tokens: the hour reads each row once)
#   3. the default conversion healed an hour on it (the same conversion as the default-recipe run)
#   4. the suite: the original, the default-recipe model (real corpus) and this one
set -euo pipefail
cd "$(dirname "$0")/.."
L=${LOOPLM:-.venv/bin/looplm}
$L data generate smollm2-135m --out out/gen-start --prompt-mix start:1 --budget-minutes 40 --max-new-tokens 448 --no-progress
[ -f out/corpus-gen-512/meta.json ] || $L data build smollm2-135m --sources out/gen-start,out/gen-smollm2 --out out/corpus-gen-512 --no-progress
R=""; [ -f out/gen/b2-r64-gen/run.json ] && R=--resume
[ -f out/gen/b2-r64-gen/final/config.json ] || $L heal out/defaults/out/smollm2-135m-b2-r64 --data out/corpus-gen-512 \
  --out out/gen/b2-r64-gen --no-progress $R
$L eval suite smollm2-135m out/defaults/out/smollm2-135m-b2-r64-healed/final out/gen/b2-r64-gen/final \
  --data out/corpus-512 --tasks lambada --limit 200 --out out/gen/suite
