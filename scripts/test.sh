#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs every test: lint, the GoogleTest suite
# of the core (ctest, then again under ThreadSanitizer), the pytest suite
# (real multi-process runs), and torch's own distributed test suite over
# "dsp" at world sizes 2 and 3 (tests/conformance).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}

echo "== lint"
"$PY" -m ruff check .
"$PY" -m ruff format --check .

echo "== GoogleTest (core)"
ctest --test-dir build --output-on-failure

echo "== GoogleTest (core) under ThreadSanitizer"
bash scripts/tsan.sh 2>&1 | tail -3

echo "== pytest"
"$PY" -m pytest -q tests/python "$@"

echo "== torch's distributed test suite over dsp"
for world in 2 3; do
  DSP_UNGATE=1 "$PY" tests/conformance/check.py --world "$world" -- -q --no-header -p no:warnings |
    grep -E "^conformance:"
done
