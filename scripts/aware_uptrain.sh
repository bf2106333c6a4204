#!/usr/bin/env bash
# Issue 7: plain against data-aware conversion, then the same short uptraining for both.
# SmolLM2-135M, B=2, rank 64: "plain" = --init average --lora-init svd (the paper's init),
# "aware" = --init average --lora-init aware-svd calibrated on the corpus' training split.
# Resumable: existing models are kept, a started run continues with --resume, a finished run is skipped.
# Environment: TOKENS (budget per run, default 5120), EVERY (eval/save period in steps), DATA, OUT, CALIB.
set -euo pipefail
cd "$(dirname "$0")/.."
LOOPLM=${LOOPLM:-.venv/bin/looplm}
DATA=${DATA:-out/corpus-smollm2-512}
OUT=${OUT:-out/aware}
CALIB=${CALIB:-$OUT/calib}          # text files decoded from the corpus' *.train.bin parts, never held-out
TOKENS=${TOKENS:-5120}
EVERY=${EVERY:-2}
mkdir -p "$OUT/models" "$OUT/runs" "$CALIB"

# Calibration text: the first, middle and last 512-token rows of each source's *training* split, decoded.
[ -n "$(ls "$CALIB"/*.txt 2>/dev/null)" ] || .venv/bin/python - "$DATA" "$CALIB" <<'PY'
import json, sys
from pathlib import Path
import numpy as np
from looplm.train.corpus import load_tokenizer
data, calib = Path(sys.argv[1]), Path(sys.argv[2])
meta = json.loads((data / "meta.json").read_text())
tok = load_tokenizer(meta["model"])
for source in meta["sources"]:
    rows = np.fromfile(data / "parts" / f"{source}.train.bin", dtype=meta["dtype"]).reshape(-1, meta["seq_len"])
    picks = [rows[0], rows[(len(rows) - 1) // 2], rows[-1]]
    (calib / f"{source}.train.txt").write_text("\n\n".join(tok.decode(r.tolist()) for r in picks), encoding="utf-8")
PY

[ -f "$OUT/models/plain-b2-r64/config.json" ] || $LOOPLM convert --model smollm2-135m --loops 2 \
  --lora-rank 64 --init average --lora-init svd --out "$OUT/models/plain-b2-r64" --ppl-tokens 2048 --json
[ -f "$OUT/models/aware-b2-r64/config.json" ] || $LOOPLM convert --model smollm2-135m --loops 2 \
  --lora-rank 64 --init average --lora-init aware-svd --calib-data "$CALIB" --calib-tokens 6144 \
  --out "$OUT/models/aware-b2-r64" --ppl-tokens 2048 --json

for name in plain-b2-r64 aware-b2-r64; do
  run="$OUT/runs/$name"
  if [ -d "$run/final" ]; then echo "$name: done"; continue; fi
  resume=""; [ -f "$run/run.json" ] && resume="--resume"
  $LOOPLM train --model "$OUT/models/$name" --teacher smollm2-135m --kd fkl --data "$DATA" --out "$run" \
    --batch-size 2 --seq-len 256 --max-tokens "$TOKENS" --eval-every "$EVERY" --eval-seqs 8 \
    --save-every "$EVERY" --keep 2 --no-progress $resume
done
.venv/bin/python scripts/compare_runs.py docs/aware/uptrain_b2_r64.png docs/aware/uptrain_b2_r64.json \
  "$OUT/runs/plain-b2-r64=plain" "$OUT/runs/aware-b2-r64=aware"
