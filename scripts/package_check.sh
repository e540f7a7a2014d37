#!/usr/bin/env bash
# Builds the sdist and a wheel, installs each into a fresh virtual
# environment (with torch, pinned) and runs tests/package/smoke.py there,
# from outside the source tree, so that the installed package is what runs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH="torch==${DSP_TORCH_VERSION:-2.13.0}"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
"$PY" -m pip install -q --disable-pip-version-check build
"$PY" -m build --sdist --no-isolation --outdir "$OUT/dist" . >/dev/null
"$PY" -m pip wheel -q --disable-pip-version-check --no-build-isolation --no-deps \
  -w "$OUT/dist" .
cp tests/package/smoke.py "$OUT/"
for kind in whl tar.gz; do
  artifact="$(ls "$OUT"/dist/dsparallel-*."$kind")"
  venv="$OUT/venv-${kind%%.*}"
  "$PY" -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "$TORCH" numpy setuptools wheel ninja
  echo "== package: $(basename "$artifact") into a fresh venv"
  "$venv/bin/pip" install -q --disable-pip-version-check --no-build-isolation --no-deps "$artifact"
  (cd "$OUT" && "$venv/bin/python" smoke.py --expect-under "$venv")
done
