#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the main job: a small GPT trained on the
# CPU with tensor x pipeline parallelism (4 processes: tp 2 x pp 2, 1F1B) over
# the "dsp" backend, launched by torchrun.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec torchrun --standalone --nproc-per-node "${NPROC:-4}" examples/train_gpt.py "$@"
