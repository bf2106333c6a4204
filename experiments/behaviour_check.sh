#!/usr/bin/env bash
# Does a refactor keep behaviour? Runs the same small jobs on two source trees (BEFORE and AFTER, each a checkout's
# src/) and compares: a heal on a pinned token budget (the healed weights, to the last bit), a `looplm train` run
# (its metrics records, to the last digit) and the engine's greedy tokens with and without an exit policy and
# speculation. SmolLM2-135M converted with the defaults, on the real corpus. Prints one line per check and exits 1
# on any difference.
#   BEFORE=/path/to/old/checkout AFTER=. bash experiments/behaviour_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
BEFORE=${BEFORE:?give BEFORE=DIR, a checkout of the code before the change}
AFTER=${AFTER:-.}
OUT=${OUT:-out/behaviour}
CORPUS=${CORPUS:-out/corpus-512}
STUDENT=${STUDENT:-out/hour/smollm2-135m-b2-r56}
mkdir -p "$OUT"
run() {  # run TREE ARGS...: the looplm command of that tree's source, on one thread
  local tree=$1; shift
  OMP_NUM_THREADS=1 PYTHONPATH="$tree/src" $PYTHON -m looplm "$@"
}
[ -f "$CORPUS/meta.json" ] || $PYTHON -m looplm data build smollm2-135m --seq-len 512 --out "$CORPUS" --no-progress
[ -f "$STUDENT/config.json" ] || $PYTHON -m looplm convert smollm2-135m --scored-tokens 0 --out "$STUDENT"
status=0
for side in before after; do
  tree=$BEFORE; [ $side = after ] && tree=$AFTER
  [ -f "$OUT/$side/heal/final/model.safetensors" ] || run "$tree" heal "$STUDENT" --data "$CORPUS" \
    --out "$OUT/$side/heal" --train-tokens 16384 --cache-rows 8 --seed 0 --no-compile --no-progress > /dev/null
  [ -f "$OUT/$side/train/metrics.jsonl" ] || run "$tree" train "$STUDENT" --data "$CORPUS" --out "$OUT/$side/train" \
    --max-steps 4 --batch-size 2 --seq-len 128 --eval-every-steps 2 --eval-rows 2 --no-progress > /dev/null
  for policy in none margin:0.5 spec; do
    extra=(--exit-policy "$policy"); [ $policy = spec ] && extra=(--speculate both)
    run "$tree" generate "$STUDENT" "The history of the" "def fibonacci(n):" --max-new-tokens 24 "${extra[@]}" \
      --json | $PYTHON -c "import json,sys; print(json.dumps([r['token_ids'] for r in json.load(sys.stdin)['results']]))" \
      > "$OUT/$side/tokens-$policy.json"
  done
done
same() {  # same WHAT FILE_BEFORE FILE_AFTER
  if cmp -s "$2" "$3"; then echo "same: $1"; else echo "DIFFERENT: $1 ($2, $3)"; status=1; fi
}
same "healed weights" "$OUT/before/heal/final/model.safetensors" "$OUT/after/heal/final/model.safetensors"
$PYTHON - "$OUT" <<'PY' > "$OUT/train-records.txt"
import json, sys
for side in ("before", "after"):
    rows = [json.loads(l) for l in open(f"{sys.argv[1]}/{side}/train/metrics.jsonl")]
    drop = ("time", "seconds", "elapsed", "per_s", "wall")
    print(side, json.dumps([{k: v for k, v in r.items() if not any(d in k for d in drop)} for r in rows], sort_keys=True))
PY
if [ "$(sed -n 1p "$OUT/train-records.txt" | cut -d' ' -f2-)" = "$(sed -n 2p "$OUT/train-records.txt" | cut -d' ' -f2-)" ]; then
  echo "same: train metrics"; else echo "DIFFERENT: train metrics ($OUT/train-records.txt)"; status=1; fi
for policy in none margin:0.5 spec; do
  same "greedy tokens ($policy)" "$OUT/before/tokens-$policy.json" "$OUT/after/tokens-$policy.json"
done
exit $status
