#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs every test: lint, the docs site's strict
# build, the GoogleTest suite of the core (ctest, then again under
# ThreadSanitizer), the pytest suite (real multi-process runs), a part of it
# again on the extension built under AddressSanitizer and UBSan
# (scripts/asan.sh), and torch's own distributed test suite over "dsp" at
# world sizes 2 and 3 (tests/conformance). Arguments go to pytest. Prints
# each stage's time.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/stages.sh
PY=${PYTHON:-python3}
export NO_MKDOCS_2_WARNING=1  # mkdocs-material's banner about its successor

# Stages run in a `||` context, where `set -e` does not act: each function
# below passes on its failures itself.
lint() {
  "$PY" -m ruff check . && "$PY" -m ruff format --check .
}

# A sanitizer's script: its last lines when it passes, the whole report when
# it fails (a race is read from its two stacks, a use-after-free from three).
sanitizer() {
  local log
  log=$(mktemp)
  if bash "$1" >"$log" 2>&1; then
    tail -3 "$log"
  else
    cat "$log"
    return 1
  fi
}

conformance() {
  local world
  for world in 2 3; do
    DSP_UNGATE=1 "$PY" tests/conformance/check.py --world "$world" -- -q --no-header -p no:warnings |
      grep -E "^conformance:" || return 1
  done
}

[[ -n "${DSP_STAGE_TABLE_LATER:-}" ]] || trap stage_table EXIT
stage "setup (install, build)" bash scripts/setup.sh
stage "lint (ruff)" lint
docs() {
  "$PY" -m mkdocs build --strict --quiet --site-dir build/site &&
    "$PY" scripts/check_site.py build/site --shots build/site-shots
}
stage "docs (mkdocs build --strict, every page in headless Chromium)" docs
# --no-tests=error: a build that registered no test fails instead of passing.
stage "GoogleTest (core)" ctest --test-dir build --output-on-failure --no-tests=error
stage "GoogleTest (core) under ThreadSanitizer" sanitizer scripts/tsan.sh
stage "pytest" "$PY" -m pytest -q --durations=15 tests/python "$@"
stage "pytest subset under ASan + UBSan" sanitizer scripts/asan.sh
stage "torch's distributed suite over dsp" conformance
