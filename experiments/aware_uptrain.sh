#!/usr/bin/env bash
# Issue 7: plain against data-aware conversion, then the same short uptraining for both.
# SmolLM2-135M, B=LOOPS, for each rank in RANKS: "plain" = --init average --lora-init svd (the paper's
# init), "aware" = --init average --lora-init aware-svd calibrated on the corpus' training split.
# Resumable: existing models are kept, a started run continues with --resume, a finished run is skipped.
# Environment: LOOPS (default 2), RANKS (default "64"), TOKENS (budget per run, default 5120),
# EVERY (eval/save period in steps), DATA, OUT, CALIB.
# Writes docs/aware/uptrain_b{LOOPS}_r{RANK}_{TOKENS}.{png,json} per rank.
set -euo pipefail
cd "$(dirname "$0")/.."
LOOPLM=${LOOPLM:-.venv/bin/looplm}
DATA=${DATA:-out/corpus-smollm2-512}
OUT=${OUT:-out/aware}
CALIB=${CALIB:-$OUT/calib}          # text files decoded from the corpus' *.train.bin parts, never held-out
LOOPS=${LOOPS:-2}
RANKS=${RANKS:-64}
TOKENS=${TOKENS:-5120}
EVERY=${EVERY:-2}
mkdir -p "$OUT/models" "$OUT/runs" "$CALIB"

# Calibration text: the first, middle and last 512-token rows of each source's *training* split, decoded.
[ -n "$(ls "$CALIB"/*.txt 2>/dev/null)" ] || .venv/bin/python - "$DATA" "$CALIB" <<'PY'
import json, sys
from pathlib import Path
import numpy as np
from looplm.data.corpus import load_tokenizer
data, calib = Path(sys.argv[1]), Path(sys.argv[2])
meta = json.loads((data / "meta.json").read_text())
tok = load_tokenizer(meta["model"])
for source in meta["sources"]:
    rows = np.fromfile(data / "parts" / f"{source}.train.bin", dtype=meta["dtype"]).reshape(-1, meta["seq_len"])
    picks = [rows[0], rows[(len(rows) - 1) // 2], rows[-1]]
    (calib / f"{source}.train.txt").write_text("\n\n".join(tok.decode(r.tolist()) for r in picks), encoding="utf-8")
PY

for rank in $RANKS; do
  plain="plain-b$LOOPS-r$rank" aware="aware-b$LOOPS-r$rank"
  [ -f "$OUT/models/$plain/config.json" ] || $LOOPLM convert --model smollm2-135m --loops "$LOOPS" \
    --lora-rank "$rank" --init average --lora-init svd --out "$OUT/models/$plain" --ppl-tokens 2048 --json
  [ -f "$OUT/models/$aware/config.json" ] || $LOOPLM convert --model smollm2-135m --loops "$LOOPS" \
    --lora-rank "$rank" --init average --lora-init aware-svd --calib-data "$CALIB" --calib-tokens 6144 \
    --out "$OUT/models/$aware" --ppl-tokens 2048 --json

  for name in "$plain" "$aware"; do
    run="$OUT/runs/$name-$TOKENS"
    if [ -d "$run/final" ]; then echo "$name: done"; continue; fi
    resume=""; [ -f "$run/run.json" ] && resume="--resume"
    $LOOPLM train --model "$OUT/models/$name" --teacher smollm2-135m --kd fkl --data "$DATA" --out "$run" \
      --batch-size 2 --seq-len 256 --max-tokens "$TOKENS" --eval-every "$EVERY" --eval-seqs 8 \
      --save-every "$EVERY" --keep 2 --no-progress $resume
  done
  .venv/bin/python experiments/compare_runs.py "docs/aware/uptrain_b${LOOPS}_r${rank}_${TOKENS}.png" \
    "docs/aware/uptrain_b${LOOPS}_r${rank}_${TOKENS}.json" \
    "$OUT/runs/$plain-$TOKENS=plain" "$OUT/runs/$aware-$TOKENS=aware"
done
