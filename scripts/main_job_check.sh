#!/usr/bin/env bash
# CI's run of the main job (scripts/train.sh) in a fresh run folder, then
# checks that it learned: 100 steps take the loss from ln(2048) = 7.6 at
# the first step to about 6.1 (the mean of the last five logged steps, one
# batch being one or two documents of very different kinds) and the
# held-out README's to about 6.1; each must be under 0.85 x the first
# step's loss, which a model that does not learn stays above.
set -euo pipefail
cd "$(dirname "$0")/.."
run=$(mktemp -d)
trap 'rm -rf "$run"' EXIT
bash scripts/train.sh --train.steps=100 --checkpoint.dir="$run/checkpoints" \
  --metrics.jsonl="$run/metrics.jsonl" --metrics.tensorboard="$run/tensorboard" \
  --metrics.plot="$run/loss.png" "$@"
python3 - "$run/metrics.jsonl" <<'PY'
import json, sys

rows = [json.loads(line) for line in open(sys.argv[1])]
train = [r["loss"] for r in rows if "loss" in r]
held = [r["eval_loss"] for r in rows if "eval_loss" in r]
last = sum(train[-5:]) / 5
print(f"main job: loss {train[0]:.3f} -> {last:.3f} (last five logged), held-out {held[-1]:.3f}")
if not last < 0.85 * train[0]:
    sys.exit(f"the training loss did not fall enough: {train[0]:.3f} -> {last:.3f}")
if not held[-1] < 0.85 * train[0]:
    sys.exit(f"the held-out loss did not fall enough: {train[0]:.3f} -> {held[-1]:.3f}")
PY
