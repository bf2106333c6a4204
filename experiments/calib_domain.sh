#!/usr/bin/env bash
# Does the data-aware conversion's calibration text decide how far the converted model is off the corpus?
# The same conversion (B=2, average + aware-svd, per-depth norms) calibrated on the text the package ships
# (Austen) or on the teacher's own text (out/corpus-gen-512, from `looplm data generate`), with 8,192 or 65,536
# calibration tokens, at rank 64 and 128; then `looplm eval suite` (8 windows a domain, no tasks).
# Resumable: a finished conversion is skipped. Environment: OUT, RANKS.
set -euo pipefail
cd "$(dirname "$0")/.."
LOOPLM=${LOOPLM:-.venv/bin/looplm}
OUT=${OUT:-out}
RANKS=${RANKS:-"64 128"}
[ -f "$OUT/calib-gen/train.txt" ] || $LOOPLM data text "$OUT/corpus-gen-512" --rows 128 --out "$OUT/calib-gen"
models=(smollm2-135m)
for rank in $RANKS; do
  for arm in shipped:8192 gen:8192 gen:65536; do
    src=${arm%%:*}; tokens=${arm##*:}; dir="$OUT/calib-domain/b2-r$rank-$src-$tokens"
    calib=(); [ "$src" = gen ] && calib=(--calib-data "$OUT/calib-gen")
    [ -f "$dir/config.json" ] || $LOOPLM convert smollm2-135m --loops 2 --lora-rank "$rank" "${calib[@]}" \
      --calib-tokens "$tokens" --scored-tokens 0 --out "$dir"
    models+=("$dir")
  done
done
$LOOPLM eval suite "${models[@]}" --windows 8 --tasks none --data "$OUT/corpus-512" --out "$OUT/suite/calib-domain"
