#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs every test: lint, the GoogleTest suite
# of the core (ctest) and the pytest suite (real multi-process runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}

echo "== lint"
"$PY" -m ruff check .
"$PY" -m ruff format --check .

echo "== GoogleTest (core)"
ctest --test-dir build --output-on-failure

echo "== pytest"
"$PY" -m pytest -q tests/python "$@"
