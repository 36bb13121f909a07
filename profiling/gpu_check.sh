#!/usr/bin/env bash
# The one prepared GPU run (about 5 minutes on an H200): CUDA tests, then the
# GPU benchmarks whose figures go into BENCHMARKS.md. Everything it prints is
# also written to ${OUT:-.}/gpu_check.log.
#
#   profiling/gpu_check.sh            # from the repository root, venv built by `make test`
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
LOG="${OUT:-.}/gpu_check.log"
run() { echo "\$ $*" | tee -a "$LOG"; timeout 240 "$@" 2>&1 | tee -a "$LOG"; }
: > "$LOG"
run nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv
run "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
# CUDA tests: graph capture, replay == eager, cuBLAS bit-identity, RNG bits CPU == CUDA.
run "$PY" -m pytest -q -m cuda -x tests
run "$PY" -m pytest -q -x tests/test_step_engine.py tests/test_speculative.py
# The tail at DeepSeek-V3 sizes: eager vs replay per bucket, and the weight-read floor.
run "$PY" -m profiling.bench step --device cuda --hidden 7168 --vocab 129280 --dtype bf16 --max-bucket 64
run "$PY" -m profiling.bench step --device cuda --hidden 7168 --vocab 129280 --dtype bf16 --max-bucket 64 --drafts 3
run "$PY" -m engine demo --device cuda --requests 16 --check-determinism
echo "log: $LOG"
