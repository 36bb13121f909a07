#!/usr/bin/env bash
# Profile the demo under Nsight Systems with the engine's NVTX ranges.
#
#   profiling/nsys.sh [output-name] [-- demo options]
#
# --trace=cuda,nvtx,osrt   kernels and copies, our NVTX ranges (domain "step-engine"), OS runtime
# --cuda-graph-trace=node  show the kernels inside each replayed graph, not one opaque launch
# --capture-range=none     the whole run (capture happens at start-up and is worth seeing)
# --sample=none --cpuctxsw=none  keep the report small; the ranges say where host time goes
# Open the .nsys-rep in the Nsight Systems GUI, or summarise it with
#   nsys stats --report nvtx_sum,cuda_gpu_kern_sum OUTPUT.nsys-rep
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-step-engine-demo}"
shift || true
[ "${1:-}" = "--" ] && shift
if ! command -v nsys >/dev/null; then
    echo "nsys not found: install Nsight Systems (it ships with the CUDA toolkit) or use 'python -m engine demo --trace FILE'" >&2
    exit 2
fi
PY="${PYTHON:-.venv/bin/python}"
exec nsys profile \
    --trace=cuda,nvtx,osrt \
    --cuda-graph-trace=node \
    --sample=none --cpuctxsw=none \
    --force-overwrite=true \
    --output="$out" \
    "$PY" -m engine demo --device cuda "$@"
