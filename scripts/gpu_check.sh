#!/usr/bin/env bash
# One prepared run for a machine with a GPU: build, the GPU tests, a short
# GPU benchmark, and the ZeRO benchmark with CPU ranks on the machine's own
# cores (one core per rank: no oversubscription, unlike a 2-core machine).
# Results go to ${OUT:-gpu_out}/ (build log, pytest log, benchmark tables
# and JSON). Meant to finish in under 8 minutes on one GPU. Uses the torch
# already installed there (no download). GPU_BENCH=0 / ZERO_BENCH=0 skip a
# benchmark.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 MAX_JOBS="${MAX_JOBS:-$(nproc)}"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
"$PY" -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.device_count())" \
  | tee "$OUT/torch.txt"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
start=$(date +%s)
if ! timeout 300 "$PY" -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; then
  echo "build failed; see $OUT/build.log"; tail -30 "$OUT/build.log"; exit 1
fi
echo "build: $(( $(date +%s) - start )) s"
timeout 150 "$PY" -m pytest -v -rs tests/python/test_gpu.py tests/python/test_collectives.py \
  tests/python/test_zero.py \
  > "$OUT/pytest.log" 2>&1
echo "pytest rc=$? (tail):"; tail -3 "$OUT/pytest.log"
if [[ "${GPU_BENCH:-1}" == 1 ]]; then
  timeout 120 "$PY" benchmarks/gpu.py --json "$OUT/gpu_bench.json" | tee "$OUT/gpu_bench.txt"
fi
if [[ "${ZERO_BENCH:-1}" == 1 ]]; then
  (cd benchmarks && timeout 330 "$PY" zero.py --worlds 2 4) | tee "$OUT/zero_cpu.txt"
fi
echo "total: $(( $(date +%s) - start )) s"
