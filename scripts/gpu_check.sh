#!/usr/bin/env bash
# One prepared run for a machine with a GPU: build, the GPU tests, a short
# GPU benchmark, and the ZeRO benchmark with CPU ranks on the machine's own
# cores (one core per rank: no oversubscription, unlike a 2-core machine).
# Each step's log goes to ${OUT:-gpu_out}/<step>.log and a JSON summary of
# every step (exit status, seconds) to $OUT/summary.json; the script exits
# non-zero if any step failed. Meant to finish in under 8 minutes on one GPU.
# Uses the torch already installed there (no download). GPU_BENCH=0 /
# ZERO_BENCH=0 skip a benchmark.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 MAX_JOBS="${MAX_JOBS:-$(nproc)}"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || true

steps=()
failed=0
# step NAME TIMEOUT_S CMD...: runs CMD with its output in $OUT/NAME.log.
step() {
  local name=$1 limit=$2 t0 rc
  shift 2
  t0=$(date +%s)
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  steps+=("{\"step\": \"$name\", \"rc\": $rc, \"seconds\": $(($(date +%s) - t0))}")
  echo "$name: rc=$rc ($(($(date +%s) - t0)) s); tail of $OUT/$name.log:"
  tail -3 "$OUT/$name.log"
  ((rc == 0)) || failed=1
  return $rc
}

if step torch 60 "$PY" -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.device_count()); assert torch.cuda.is_available(), 'no CUDA GPU'" &&
  step build 300 "$PY" -m pip install --no-build-isolation --no-deps -e .; then
  step pytest 150 "$PY" -m pytest -v -rs tests/python/test_gpu.py tests/python/test_collectives.py \
    tests/python/test_zero.py
  if [[ "${GPU_BENCH:-1}" == 1 ]]; then
    step gpu_bench 120 "$PY" benchmarks/gpu.py
  fi
  if [[ "${ZERO_BENCH:-1}" == 1 ]]; then
    step zero_bench 330 "$PY" benchmarks/zero.py --worlds 2 4
  fi
  cp benchmarks/results/gpu-*.json benchmarks/results/zero-*.json "$OUT/" 2>/dev/null
fi
(
  IFS=,
  echo "{\"failed\": $failed, \"steps\": [${steps[*]}]}"
) >"$OUT/summary.json"
cat "$OUT/summary.json"
exit $failed
