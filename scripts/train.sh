#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the main job: data-parallel training on
# the CPU with 2 processes over the "dsp" backend, launched by torchrun.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec torchrun --standalone --nproc-per-node "${NPROC:-2}" examples/ddp_simple.py "$@"
