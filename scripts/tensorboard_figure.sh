#!/usr/bin/env bash
# The training guide's TensorBoard figure: TensorBoard over the main job's
# folder (bash scripts/train.sh writes runs/llama-docs/tensorboard),
# photographed by headless Chromium (apt-get install chromium).
#   bash scripts/tensorboard_figure.sh [logdir] [out.png]
set -euo pipefail
cd "$(dirname "$0")/.."
LOGDIR=${1:-runs/llama-docs/tensorboard}
OUT=${2:-docs/figures/tensorboard-loss.png}
PORT=${PORT:-6123}
python3 -m tensorboard.main --logdir_spec "main-job:$LOGDIR" --port "$PORT" >/dev/null 2>&1 &
BOARD=$!
trap 'kill $BOARD 2>/dev/null || true' EXIT
for _ in $(seq 60); do
  curl -fs "http://localhost:$PORT/data/runs" >/dev/null && break
  sleep 0.5
done
# Time for the page's scripts to fetch and draw the scalars.
chromium --headless=new --no-sandbox --disable-gpu --hide-scrollbars \
  --window-size=1000,460 --virtual-time-budget=60000 \
  --screenshot="$OUT" "http://localhost:$PORT/#scalars&tagFilter=%5Eloss%24&_ignoreYOutliers=false&_smoothingWeight=0" >/dev/null 2>&1
echo "wrote $OUT"
