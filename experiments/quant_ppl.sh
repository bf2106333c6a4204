#!/usr/bin/env bash
# Held-out perplexity of models as served with quantized weights (LoRA shared): each float model, rounded to
# nearest (`looplm quantize`) and by GPTQ (`looplm quantize --calibrate`, calibrated on the corpus's first
# training rows), scored on the first 8,192 tokens of the corpus's held-out split. Resumable (a stored
# quantized model is reused). One line per model and variant: NAME VARIANT PERPLEXITY.
#   DATA=out/heal/corpus-smollm2-135m-512 OUT=out/gptq/q WEIGHTS=int4 bash scripts/quant_ppl.sh \
#       healed=out/heal/runs/b2-r64/final aware=out/gptq/heal-int4/final
set -euo pipefail
cd "$(dirname "$0")/.."
LOOPLM=${LOOPLM:-.venv/bin/looplm}
DATA=${DATA:?give the corpus directory in DATA}
OUT=${OUT:-out/quant-ppl}
WEIGHTS=${WEIGHTS:-int4}
ppl() { $LOOPLM eval ppl "$1" --data "$DATA" --max-tokens 8192 --no-save --json |
          python3 -c 'import json, sys; print(round(json.load(sys.stdin)["perplexity"], 2))'; }
for spec in "$@"; do
  name=${spec%%=*} dir=${spec#*=}
  [ -d "$OUT/$name-nearest" ] || $LOOPLM quantize "$dir" --out "$OUT/$name-nearest" --weights "$WEIGHTS" >&2
  [ -d "$OUT/$name-gptq" ] || $LOOPLM quantize "$dir" --out "$OUT/$name-gptq" --weights "$WEIGHTS" --calibrate "$DATA" >&2
  echo "$name float $(ppl "$dir")"
  echo "$name $WEIGHTS-nearest $(ppl "$OUT/$name-nearest")"
  echo "$name $WEIGHTS-gptq $(ppl "$OUT/$name-gptq")"
done
