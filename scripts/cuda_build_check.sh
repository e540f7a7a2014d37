#!/usr/bin/env bash
# Builds the extension against torch's CUDA build (torch==2.14.1, in its own
# virtual environment, with nvcc from CUDA_HOME) and loads the result, so that
# a compile or link error in the CUDA configuration fails CI even though CI
# has no GPU. Nothing here needs a GPU; the build goes to a temporary folder
# and does not touch the CPU install.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${DSP_CUDA_VENV:-/tmp/dsp-cuda-venv}"
TORCH="torch==${DSP_CUDA_TORCH_VERSION:-2.14.1}"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
if [ ! -x "$CUDA_HOME/bin/nvcc" ]; then
  # Our sources are C++ (CUDA tensors go through torch's NCCL group), so the
  # build needs torch's CUDA headers and libraries, not nvcc; say so loudly.
  echo "cuda_build_check: WARNING: no nvcc under CUDA_HOME=$CUDA_HOME (not needed today)" >&2
fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# A machine that cannot get the CUDA build of torch cannot run this check.
# By hand that is reported and skipped; under CI (CI set) it fails, so that CI
# can never lose the check silently. Compile and link errors always fail.
if ! "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$TORCH" numpy ninja \
  setuptools wheel; then
  if [ -n "${CI:-}" ]; then
    echo "cuda_build_check: FAILED: could not install $TORCH into $VENV (CI must run this check)" >&2
    exit 1
  fi
  echo "cuda_build_check: SKIPPED: could not install $TORCH into $VENV" >&2
  exit 0
fi
"$VENV/bin/python" -c "import torch; assert torch.version.cuda, 'not a CUDA build of torch'; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"

OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
"$VENV/bin/python" setup.py -q build_ext --build-temp "$OUT/tmp" --build-lib "$OUT/lib"
SO="$(ls "$OUT"/lib/dsparallel/_C*.so)"
# Loading resolves every symbol against the CUDA build's libraries.
"$VENV/bin/python" - "$SO" <<'PY'
import importlib.util, sys
import torch  # noqa: F401  (libtorch first)
spec = importlib.util.spec_from_file_location("dsparallel._C", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
assert hasattr(mod, "ProcessGroupDSP")
print("cuda_build_check: built and loaded", sys.argv[1].rsplit("/", 1)[-1])
PY
