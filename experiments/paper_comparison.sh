#!/usr/bin/env bash
# Issue 59: the paper's central comparison (Figure 1 / Table 3) at small scale, decided beyond two standard errors.
# Per family (FAMILIES: smollm2 = SmolLM2-135M at B=2, gemma3 = Gemma-3-270M at B=3, its (a)/(b) pair only):
#   rec       (a) the recursive model, rank 0 (data-aware shared weights, per-depth norms)
#   reduced   (b) the reduced-size model of the same N-emb: the L/B layers Stepwise picks, run once, pretrained
#                 (`looplm baseline`; 15 of SmolLM2's 30 layers, 6 of Gemma's 18)
#   rel64, rel128  (c) relaxed: the same conversion with per-depth LoRA of rank 64 and 128 (smollm2 only)
#   lora4, prefix71  rec's conversion relaxed at equal parameters (smollm2 only): per-depth LoRA of rank 4
#                 (1,221,120) against 71 learned prefix vectors per depth (appendix G; 1,226,880)
#   rec-average, rec-stepwise, rec-random, rel-stepwise64, rel-zero64  the paper's initialisations (smollm2 only):
#                 rank 0 from Average, Stepwise or Random shared weights; rank 64 from Stepwise, or with zero LoRA
#                 (rel64 is Average with SVD LoRA)
#   original  (d) the reference
#   NAME-seedN  NAME healed again with seed N (its cached rows, data order and new parameters; its own teacher cache,
#                 OUT/FAMILY/cache-seedN): the pair that decides, rec-seed1 and reduced-seed1, for Gemma-3-270M
# Each student is healed (`looplm heal`) for the same budget (the family's, below: the tokens a quarter hour of healing
# reads, with its local share; one teacher cache per family, OUT/FAMILY/cache) into OUT/FAMILY/heal/NAME, named
# NAME-heal in the suite; rec and reduced are also uptrained with the paper's recipe (`looplm train`: 0.5 CE + 0.5 forward KL from the original, online) for the
# wall time their healing took (its heal.json) into OUT/FAMILY/kd/NAME, named NAME-kd. Then `looplm eval suite`
# scores every model on the five out-of-domain domains, the real corpus's held-out split and the seven tasks (LIMIT
# documents each), keeping every window's loss and every document's score, into RESULTS/FAMILY.json (committed:
# a later session, whose out/ is new, scores only the models missing there); `looplm eval claims` decides the
# paper's claims from the suites of every family in FAMILIES, into one table (CLAIMS_OUT).
# The early-exit rows (step exits, smollm2): rec's healed model post-trained for EXIT_STEPS steps of the paper's
# uptraining loss (0.5 CE + 0.5 KD) four ways, on the same rows: rec-exit (the paper's early-exit post-training:
# every intermediate exit at 0.1 with distillation from the detached final exit), rec-exitctl (the control: the
# same steps, no exit term), and from OUT/FAMILY/models/rec-body (the healed model without the affine exit adapter
# healing trained) rec-exitbody (the same early-exit post-training, body trained, no adapter) against rec-exitlora
# (a rank-128 LoRA on the LM head per intermediate exit, body frozen: the paper's appendix-I alternative). Their
# suite, RESULTS/FAMILY-exits[-perplexity].json, scores each at its final loop and at loop 1 (MODEL@1, named
# NAME-loop1), with EXIT_WINDOWS windows.
# Healing is the recipe as `looplm heal` ships it (the out-of-domain suite settled it: docs/RESULTS.md "Healed
# quality off the corpus"): no --data, so it reads out/corpus-<teacher>-mix-512, the original's own text beside as
# many real tokens, which the first heal of a family makes (the teacher writes 300,000 tokens: ~20 min for SmolLM2);
# the uptraining reads the same corpus. The in-domain held-out split is the real corpus's (OUT/FAMILY/corpus-512,
# the default sources); its blocks are held out of every corpus built from the same sources.
# `looplm heal` distils layer by layer: each of the reduced-size model's depths learns the span of the original's
# layers from the one it copies to the next copied one (train/heal/inputs.py, teacher_spans).
# Resumable: every step skips what is finished (a converted model's config.json, a run's heal.json or final/, the
# suite's rows scored so far) and resumes what was interrupted (--resume). Environment: OUT, FAMILIES, STUDENTS (a
# subset of the family's), HEAL_BUDGET, HEAL_ARGS, LIMIT, WINDOWS, TASKS (paper7, or none: perplexity alone, into
# RESULTS/FAMILY-perplexity.json, for a session with no time for the tasks: its models are gone in the next one),
# STEPS (a subset of "data convert heal kd suite exits claims"), EXIT_STEPS, EXIT_WINDOWS, RESULTS, CLAIMS_OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
LOOPLM=${LOOPLM:-.venv/bin/looplm}
PYTHON=${PYTHON:-.venv/bin/python}
OUT=${OUT:-out/paper-comparison}
FAMILIES=${FAMILIES:-smollm2}
# a quarter hour of healing at B=2 rank 128 on the EPYC (AVX-512 BF16): its end-to-end and local tokens, as tokens
# so that every student reads the same text whichever machine and whatever its speed. A quarter, not the hour: a
# session here is three hours on a new machine, which must set up, make the recipe's corpus (20-35 minutes), heal
# a pair and score it; on the AVX2-only EPYC that leaves about an hour for the pair's healing.
# Gemma gets half the tokens, about the same minutes: a Gemma-3-270M token costs about twice a SmolLM2 one (18 layer
# passes 640 wide and a 262k-token head, against 30 passes 576 wide and a 49k one). HEAL_BUDGET sets both.
smollm2_budget="--train-tokens 327452 --local-share 0.6395" gemma3_budget="--train-tokens 163726 --local-share 0.6395"
HEAL_ARGS=${HEAL_ARGS:-"--compile"}  # a token budget is not compiled by default; everything else is the recipe's
LIMIT=${LIMIT:-500}
TASKS=${TASKS:-paper7}
WINDOWS=${WINDOWS:-32}
STEPS=${STEPS:-"data convert heal kd suite exits claims"}
EXIT_STEPS=${EXIT_STEPS:-40}
EXIT_WINDOWS=${EXIT_WINDOWS:-16}
RESULTS=${RESULTS:-docs/results/paper-comparison}
CLAIMS_OUT=${CLAIMS_OUT:-docs/results/claims-small-scale.md}
has() { [[ " $STEPS " == *" $1 "* ]]; }

family() {  # family NAME: sets model, loops, budget, students (healed) and kd_students (uptrained) of STUDENTS
  case $1 in
    smollm2) model=smollm2-135m loops=2 kd_students="rec reduced"
             students="rec reduced rel64 rel128 lora4 prefix71 rec-average rec-stepwise rec-random rel-stepwise64 rel-zero64"
             budget=${HEAL_BUDGET:-$smollm2_budget} ;;
    gemma3) model=gemma3-270m loops=3 students="rec reduced rec-seed1 reduced-seed1" kd_students="rec reduced" budget=${HEAL_BUDGET:-$gemma3_budget} ;;
    *) echo "error: unknown family $1 in FAMILIES (use smollm2 and/or gemma3)" >&2; exit 2 ;;
  esac
  all_students=$students all_kd_students=$kd_students  # the suite scores whatever of them exists
  if [ -n "${STUDENTS:-}" ]; then
    students=$(only "$students") kd_students=$(only "$kd_students")
  fi
}

only() {  # only LIST: the names of LIST that STUDENTS holds
  local s out=""
  for s in $1; do [[ " $STUDENTS " == *" $s "* ]] && out+="$s "; done
  echo "$out"
}

scored() {  # scored NAME SUITE: whether RESULTS/SUITE.json holds a row of NAME (scored in an earlier session)
  $PYTHON -c 'import json, sys; sys.exit(sys.argv[1] not in [r["name"] for r in json.load(open(sys.argv[2]))["rows"]])' \
    "$1" "$RESULTS/$2.json" 2>/dev/null
}

corpora() {  # corpora FAMILY: sets real (the in-domain held-out split's corpus), calib, heal_data (the recipe's)
  local dir="$OUT/$1"
  real="$dir/corpus-512" calib="$dir/calib" heal_data="out/corpus-$model-mix-512"
  has data || return 0
  [ -f "$real/meta.json" ] || $LOOPLM data build "$model" --seq-len 512 --out "$real" --no-progress
  [ -f "$calib/train.txt" ] || $LOOPLM data text "$real" --rows 16 --out "$calib"
}

convert() {  # convert NAME DIR: the student NAME of this family, built once
  local name=$1 dir=$2
  [ -f "$dir/config.json" ] && return 0
  case $name in
    reduced) $LOOPLM baseline "$model" --loops "$loops" --out "$dir" ;;
    rec) $LOOPLM convert "$model" --loops "$loops" --sharing cycle --lora-rank 0 --init aware --norms per-depth \
           --calib-data "$calib" --calib-tokens 8192 --scored-tokens 0 --out "$dir" ;;
    lora4) $LOOPLM convert "$model" --loops "$loops" --sharing cycle --lora-rank 4 --init aware --lora-init aware-svd --norms per-depth \
           --calib-data "$calib" --calib-tokens 8192 --scored-tokens 0 --out "$dir" ;;
    prefix71) $LOOPLM convert "$model" --loops "$loops" --sharing cycle --relax prefix --prefix-length 71 --init aware \
           --norms per-depth --calib-data "$calib" --calib-tokens 8192 --scored-tokens 0 --out "$dir" ;;
    rec-average|rec-stepwise|rec-random) $LOOPLM convert "$model" --loops "$loops" --sharing cycle --lora-rank 0 --init "${name#rec-}" \
           --norms per-depth --out "$dir" ;;
    rel-stepwise64) $LOOPLM convert "$model" --loops "$loops" --sharing cycle --lora-rank 64 --init stepwise --lora-init aware-svd \
           --norms per-depth --calib-data "$calib" --calib-tokens 8192 --scored-tokens 0 --out "$dir" ;;
    rel-zero64) $LOOPLM convert "$model" --loops "$loops" --sharing cycle --lora-rank 64 --init average --lora-init zero \
           --norms per-depth --out "$dir" ;;
    rel*) $LOOPLM convert "$model" --loops "$loops" --sharing cycle --lora-rank "${name#rel}" --init average --lora-init aware-svd \
           --norms per-depth --calib-data "$calib" --calib-tokens 8192 --scored-tokens 0 --out "$dir" ;;
  esac
}

heal() {  # heal STUDENT RUN SEED
  local student=$1 run=$2 seed=$3 cache
  [ -f "$run/heal.json" ] && return 0
  local resume=""; [ -f "$run/run.json" ] && resume="--resume"
  cache="$(dirname "$(dirname "$run")")/cache"
  [ "$seed" = 0 ] || cache+="-seed$seed"  # another seed caches other rows
  # shellcheck disable=SC2086  # the budget and options are word lists
  $LOOPLM heal "$student" --teacher "$model" --out "$run" --cache "$cache" --seed "$seed" \
    --no-progress $budget $HEAL_ARGS $resume
}

uptrain() {  # uptrain STUDENT RUN HEAL: the paper's recipe (experiments/paper_runs.sh's) for the minutes HEAL took
  local student=$1 run=$2 heal=$3
  [ -d "$run/final" ] && return 0
  [ -f "$heal/heal.json" ] || { echo "skip $run: its healing ($heal) has not finished, and sets its minutes" >&2; return 0; }
  local minutes; minutes=$($PYTHON -c 'import json, sys; print(json.load(open(sys.argv[1]))["minutes"])' "$heal/heal.json")
  local resume=""; [ -f "$run/run.json" ] && resume="--resume"
  $LOOPLM train "$student" --teacher "$model" --kd fkl --data "$heal_data" --out "$run" --batch-size 2 \
    --seq-len 512 --budget-minutes "$minutes" --eval-every-steps 40 --eval-rows 16 --save-every-steps 20 --keep 2 \
    --no-progress $resume
}

exits() {  # exits: the early-exit rows of this family, post-trained from rec's healed model, then their suite
  local base=$dir/heal/rec/final e run start args suite=$fam-exits
  [ -f "$base/config.json" ] || { echo "skip exits: rec's healing ($base) has not finished" >&2; return 0; }
  local body=$dir/models/rec-body  # the healed model without its exit adapter
  [ -f "$body/config.json" ] || $PYTHON -c 'import sys
from looplm.models import load_model, save_model
model, tok = load_model(sys.argv[1])
model.exit_adapter = model.config.exit_adapter = None
save_model(model, tok, sys.argv[2])' "$base" "$body"
  for e in exit exitctl exitbody exitlora; do
    run=$dir/exits/$e
    [ -d "$run/final" ] && continue
    case $e in
      exit) start=$base args="--early-exit aggressive --self-distill" ;;
      exitctl) start=$base args="--early-exit none" ;;
      exitbody) start=$body args="--early-exit aggressive --self-distill" ;;
      exitlora) start=$body args="--early-exit aggressive --self-distill --exit-adapter head-lora:128 --freeze-body" ;;
    esac
    [ -f "$run/run.json" ] && args+=" --resume"
    # shellcheck disable=SC2086  # a word list
    $LOOPLM train "$start" --teacher "$model" --kd fkl --data "$heal_data" --data-rows new --out "$run" \
      --batch-size 2 --seq-len 512 --max-steps "$EXIT_STEPS" --save-every-steps 10 --no-progress $args
  done
  [ "$TASKS" = none ] && suite+=-perplexity
  $LOOPLM eval suite "original=$model" "rec-heal=$base" "rec-heal-loop1=$base@1" \
    "rec-exit=$dir/exits/exit/final" "rec-exit-loop1=$dir/exits/exit/final@1" \
    "rec-exitctl=$dir/exits/exitctl/final" "rec-exitctl-loop1=$dir/exits/exitctl/final@1" \
    "rec-exitbody-loop1=$dir/exits/exitbody/final@1" "rec-exitlora-loop1=$dir/exits/exitlora/final@1" \
    --data "$real" --tasks "$TASKS" --limit "$LIMIT" \
    --windows "$EXIT_WINDOWS" --compare rec-exit,rec-exitctl --compare rec-exit-loop1,rec-exitctl-loop1 \
    --compare rec-exitbody-loop1,rec-exitlora-loop1 --resume --out "$RESULTS/$suite" \
    --reproduce "FAMILIES=$fam OUT=$OUT STEPS=\"exits\" EXIT_STEPS=$EXIT_STEPS TASKS=$TASKS bash experiments/paper_comparison.sh" \
    > "$dir/logs/suite-$suite.log"
}

for fam in $FAMILIES; do
  family "$fam"
  dir="$OUT/$fam"
  mkdir -p "$dir/logs"
  corpora "$fam"
  for s in $students; do
    base=${s%-seed*} seed=0  # NAME-seedN: NAME's conversion, healed with seed N
    [ "$base" = "$s" ] || seed=${s##*-seed}
    has convert && convert "$base" "$dir/models/$base"
    has heal && heal "$dir/models/$base" "$dir/heal/$s" "$seed"
  done
  if has kd; then
    for s in $kd_students; do uptrain "$dir/models/$s" "$dir/kd/$s" "$dir/heal/$s"; done
  fi
  if has suite; then
    suite=$fam reproduce="FAMILIES=$fam OUT=$OUT"
    [ "$TASKS" = none ] && suite=$fam-perplexity reproduce+=" TASKS=none"
    specs=("original=$model") names=() scored_students=()
    for s in $all_students; do  # every model healed here or scored in an earlier session (kept, not reloaded)
      { [ -f "$dir/heal/$s/final/config.json" ] || scored "$s-heal" "$suite"; } &&
        specs+=("$s-heal=$dir/heal/$s/final") && names+=("$s-heal") && scored_students+=("$s")
    done
    for s in $all_kd_students; do
      { [ -f "$dir/kd/$s/final/config.json" ] || scored "$s-kd" "$suite"; } &&
        specs+=("$s-kd=$dir/kd/$s/final") && names+=("$s-kd")
    done
    # the command that makes every row the file holds, whichever sessions scored them (not only this one's), and
    # no more: the uptraining step only where the file holds an uptrained row
    steps="data convert heal suite claims"
    [[ " ${names[*]} " == *-kd" "* ]] && steps="data convert heal kd suite claims"
    [ "${scored_students[*]}" != "$all_students" ] && reproduce+=" STUDENTS=\"${scored_students[*]}\""
    reproduce+=" STEPS=\"$steps\""
    pairs=()  # the pairs the claims turn on, where both models exist
    for p in rec-heal,reduced-heal rec-kd,reduced-kd rel64-heal,rec-heal rel128-heal,rel64-heal rel64-heal,reduced-heal rel128-heal,reduced-heal rec-heal,rec-kd \
             reduced-heal,reduced-kd lora4-heal,prefix71-heal rec-stepwise-heal,rec-average-heal \
             rel64-heal,rel-stepwise64-heal rel64-heal,rel-zero64-heal rec-average-heal,rec-random-heal \
             rel64-heal,rec-average-heal rel-stepwise64-heal,rec-stepwise-heal rec-average-heal,rec-heal \
             rec-seed1-heal,reduced-seed1-heal \
             rec-heal,rec-seed1-heal reduced-heal,reduced-seed1-heal; do
      [[ " ${names[*]} " == *" ${p%,*} "* && " ${names[*]} " == *" ${p#*,} "* ]] && pairs+=(--compare "$p")
    done
    $LOOPLM eval suite "${specs[@]}" --data "$real" --tasks "$TASKS" --limit "$LIMIT" --windows "$WINDOWS" \
      "${pairs[@]}" --resume --out "$RESULTS/$suite" \
      --reproduce "$reproduce bash experiments/paper_comparison.sh" > "$dir/logs/suite-$suite.log"
  fi
  if has exits && [ "$fam" = smollm2 ]; then exits; fi
done
if has claims; then  # one table over every family's suite
  results=()
  for fam in $FAMILIES; do
    for f in "$RESULTS/$fam"{,-perplexity,-exits,-exits-perplexity}.json; do [ -f "$f" ] && results+=("$f"); done
  done
  [ ${#results[@]} -gt 0 ] || { echo "error: no suite results in $RESULTS yet: run the suite step first" >&2; exit 2; }
  $LOOPLM eval claims "${results[@]}" --out "$CLAIMS_OUT" > /dev/null
  echo "wrote $CLAIMS_OUT"
fi
