#!/usr/bin/env bash
# Installs everything dsparallel needs on a fresh Debian machine and builds it:
# system packages, the CPU build of torch, test tools, the GoogleTest suite
# (CMake) and the extension (pip, no build isolation). Idempotent and quick
# when everything is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

# iproute2 and util-linux: the tests that build network and mount namespaces;
# chromium and its driver: the docs check (scripts/check_site.py).
APT_PACKAGES=(cmake ninja-build libgtest-dev g++ iproute2 util-linux chromium chromium-driver)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
# torch imports every installed backend extension at its own import; an
# earlier editable install whose checkout is gone would make 'import torch'
# (hence this build) fail. The build needs no autoloading.
export TORCH_DEVICE_BACKEND_AUTOLOAD=0
# Always pin torch: a bare 'torch' would pull a multi-GB CUDA build.
"$PY" -m pip install -q --disable-pip-version-check \
  "torch==${DSP_TORCH_VERSION:-2.13.0}" numpy matplotlib tqdm pytest pytest-timeout ninja ruff \
  setuptools wheel expecttest build transformers==5.25.0 safetensors==0.8.0 \
  datasets==5.2.0 tensorboard==2.21.0 accelerate==1.13.0 lightning==2.6.0 \
  fastapi==0.165.0 uvicorn==0.55.0 openai==3.63.0 selenium==4.51.0 \
  mkdocs==1.6.1 mkdocs-material==9.8.2 mkdocstrings==1.0.8 mkdocstrings-python==2.0.11

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build
# Rebuild the extension only when its sources changed (a stamp of their hash)
# or the installed one is another checkout's (checked from outside the repo,
# where the current directory cannot stand in for the install).
stamp=build/.extension-stamp
hash=$(cat setup.py $(find csrc -type f | sort) | sha256sum | cut -d' ' -f1)
if [[ "$(cat "$stamp" 2>/dev/null)" != "$hash" ]] ||
  ! (root=$PWD && cd / && "$PY" -c "import sys, dsparallel._C as c; assert c.__file__.startswith(sys.argv[1])" "$root/") 2>/dev/null; then
  "$PY" -m pip install -q --disable-pip-version-check --no-build-isolation -e .
  echo "$hash" >"$stamp"
fi
