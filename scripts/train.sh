#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the main job: the trainer
# (python -m dsparallel.train) on a small Llama over this repository's docs,
# with a byte-level BPE tokenizer trained on them (cached in build/), 4
# processes on the CPU at tensor 2 x pipeline 2 (1F1B) over the "dsp"
# backend, launched by torchrun. Evaluation on the README, checkpoints,
# metrics and the loss curve go to runs/llama-docs/ (a rerun resumes from
# its latest checkpoint: remove that folder to start over). Arguments
# override the config: --train.steps=100 --parallel.tensor=1 ...
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 -m dsparallel.train.tokenizer --files 'docs/**/*.md' --vocab-size 2048 \
  --out build/tokenizer-docs
exec torchrun --standalone --nproc-per-node "${NPROC:-4}" --max-restarts "${MAX_RESTARTS:-1}" \
  -m dsparallel.train --config examples/configs/llama-docs.toml "$@"
