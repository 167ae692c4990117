#!/usr/bin/env bash
# Step 2, on the H200 (device tool), as four calls while the machine stays warm:
#   carry gpu-bundle/part0: bash scripts/gpu/train_h200.sh stash 0
#   carry gpu-bundle/part1: bash scripts/gpu/train_h200.sh stash 1
#   carry gpu-bundle/part2: bash scripts/gpu/train_h200.sh stash 2
#   carry gpu-bundle/main:  bash scripts/gpu/train_h200.sh run        (the drafter comes back in $OUT)
# `run` regenerates responses with the target (bf16, batched), caches its features, trains the
# drafter with bf16 autocast, and writes the drafter, the training log and the data manifest to
# $OUT. DATA_MINUTES / TRAIN_MINUTES / LIMIT size it to the device time left.
set -euo pipefail
STASH=/tmp/blockdraft-stash
WORK=/tmp/blockdraft-gpu
case "${1:-}" in
  stash)
    mkdir -p "$STASH" && cp "gpu-bundle/part$2/"gguf.part* "$STASH/" && ls -l "$STASH" ;;
  run)
    export PYTHONUNBUFFERED=1
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site gpu-bundle/main/wheels/*.whl
    export PYTHONPATH="/tmp/site:$PWD" BLOCKDRAFT_CACHE="$WORK/cache" BLOCKDRAFT_SMOLLM2_GGUF_DIR="$WORK/gguf"
    mkdir -p "$WORK/gguf" && cat "$STASH"/gguf.part* > "$WORK/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    timeout "$(( ${DATA_MINUTES:-4} * 60 ))" python3 -m blockdraft.cli data --source gpu-bundle/main/prompts.jsonl.gz \
        --out "$WORK/data" --limit "${LIMIT:-40000}" --batch-size 512 --max-new-tokens 256 || true  # resumable
    python3 -m blockdraft.cli train --data "$WORK/data" --out "$WORK/run" --init target --num-layers 5 \
        --block-size 16 --anchors 32 --batch-size 64 --lr 1e-3 --max-steps 100000 --save-every 500 \
        --log-every 50 --eval-every 0 --time-budget-minutes "${TRAIN_MINUTES:-5}" --resume
    cp "$WORK/run/drafter/config.json" "$WORK/run/drafter/model.safetensors" "$WORK/run/log.jsonl" \
       "$WORK/data/manifest.json" "$OUT/" ;;
  *) echo "usage: $0 stash N | run" >&2; exit 2 ;;
esac
