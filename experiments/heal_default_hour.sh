#!/usr/bin/env bash
# What does `looplm heal` with default flags give, on a default conversion, judged off the corpus? SmolLM2-135M,
# B=2, rank 64 (`looplm convert smollm2-135m`), healed on the default corpus (the original's own text beside as
# much real text, which `looplm heal` makes itself) for the tokens an idle hour buys on a 2-core AMD EPYC with
# AVX-512 BF16 (given as a token budget, so that other jobs on the machine change the wall time, not the result),
# against the same conversion healed an hour on the real corpus alone (last default), on the out-of-domain suite.
# Resumable: rerun to continue. Needs heal_mix_default.sh's corpus (or makes it: ~20 min of generation).
set -euo pipefail
cd "$(dirname "$0")/.."
LOOPLM=${LOOPLM:-.venv/bin/looplm}
MODEL=out/defaults/out/smollm2-135m-b2-r64   # `looplm convert smollm2-135m` with default flags
[ -f $MODEL/config.json ] || (mkdir -p out/defaults && cd out/defaults && ../../$LOOPLM convert smollm2-135m)
RUN=out/hour/b2-r64-default
if [ ! -f $RUN/heal.json ]; then
  resume=""; [ -f $RUN/run.json ] && resume="--resume"
  # an idle hour of the rank-64 default run: 491 local steps per shared layer (1,005,568 tokens), 472 end-to-end
  # steps (483,328 tokens) and 52 exit-adapter steps
  $LOOPLM heal $MODEL --out $RUN --train-tokens 1542599 --local-share 0.65187 --compile --no-progress $resume
fi
$LOOPLM eval suite smollm2-135m r64-real=out/defaults/out/smollm2-135m-b2-r64-healed/final r64-default=$RUN/final \
  --compare r64-real,r64-default --data out/corpus-512 --tasks lambada --limit 200 --out out/suite/r64-default --resume
