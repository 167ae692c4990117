#!/usr/bin/env bash
# Issue 3, item 4: training ideas at equal wall time on this CPU. Every run trains for
# $MINUTES minutes from the same data, then measures held-out tau with the real engine; the
# table comes from scripts/summarize_runs.py. The schedule: 30 warm-up steps, then a cosine over
# 3000 steps that barely decays within the budget (about 100-200 steps): a near-constant rate.
# Runs one at a time (never two heavy jobs at once); a finished run is skipped on a rerun, so the
# script resumes after an interruption.
set -euo pipefail
cd "$(dirname "$0")/.."
MINUTES=${MINUTES:-2}
DATA=${DATA:-runs/data-sharegpt}
ORIG=${ORIG:-runs/data-sharegpt-orig}
T=runs/table
BASE="--num-layers 3 --block-size 16 --anchors 16 --batch-size 4 --lr 1e-3 --head-vocab 8192 --init target"
COMMON="--max-steps 3000 --warmup 0.01 --save-every 50 --log-every 5 --eval-every 0 --eval-prompts 8 --eval-tokens 64"
run() {  # name, data dir, flags (later flags override BASE)
  local name=$1 data=$2; shift 2
  if [ -f "$T/$name/log.jsonl" ] && grep -q '"final": true' "$T/$name/log.jsonl"; then return; fi
  rm -rf "$T/$name"
  .venv/bin/blockdraft train --data "$data" --out "$T/$name" $BASE "$@" $COMMON --time-budget-minutes "$MINUTES"
}
# the original ShareGPT answers for (the first $ORIG_LIMIT of) the same prompts: prefill only, no
# generation; a 2-minute run sees about 500 sequences, so a smaller set changes little
.venv/bin/blockdraft data --out "$ORIG" --responses dataset --limit "${ORIG_LIMIT:-400}"
run baseline "$DATA"
run init-random "$DATA" --init random
run no-tap-norm "$DATA" --no-tap-norm
run full-vocab-loss "$DATA" --head-vocab 0
run layers-5 "$DATA" --num-layers 5
run anchors-32x2 "$DATA" --anchors 32 --batch-size 2
run lr-3e-3 "$DATA" --lr 3e-3
run original-responses "$ORIG"
run original-target-labels "$ORIG" --labels target
.venv/bin/python scripts/summarize_runs.py $T/* > docs/efficiency-table.md
cat docs/efficiency-table.md
