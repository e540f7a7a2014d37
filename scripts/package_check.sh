#!/usr/bin/env bash
# Packages dsparallel and checks what a user would install:
# - the wheel, built from this tree: the editable install of scripts/setup.sh
#   and the wheel share the object folder build/ext (setup.py), so this only
#   links; installed into a fresh virtual environment (with torch, pinned),
#   where tests/package/smoke.py runs from outside the source tree;
# - the sdist, built (no compile) and compared with the tree: it must hold
#   every file the wheel was built from, byte for byte, so that building it
#   compiles exactly what the wheel holds. Compiling it a second time would
#   only repeat the wheel's compile, for several minutes on two cores.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH="torch==${DSP_TORCH_VERSION:-2.13.0}"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT

"$PY" -m build --sdist --no-isolation --outdir "$OUT/dist" . >/dev/null
# What ninja would compile before the wheel is built: nothing, when the
# tests' build (scripts/setup.sh) is current. Under CI a second compile fails.
[[ -f build/ext/build.ninja ]] || { echo "package_check: no build/ext: run scripts/setup.sh first" >&2; exit 1; }
stale=$(ninja -C build/ext -n | grep -c "^\[" || true)
echo "== package: sources the wheel compiles beyond the tests' build: $stale"
if [[ -n "${CI:-}" && "$stale" != 0 ]]; then
  echo "package_check: the wheel would compile the extension again" >&2
  exit 1
fi
"$PY" -m pip wheel -q --disable-pip-version-check --no-build-isolation --no-deps \
  -w "$OUT/dist" .

echo "== package: the sdist holds every file the wheel was built from"
mkdir "$OUT/sdist"
tar -xzf "$OUT"/dist/dsparallel-*.tar.gz -C "$OUT/sdist" --strip-components 1
missing=0
while read -r f; do
  if ! cmp -s "$f" "$OUT/sdist/$f"; then
    echo "package_check: the sdist lacks (or differs in) $f" >&2
    missing=1
  fi
done < <(git ls-files csrc dsparallel setup.py pyproject.toml dsparallel_autoload.py \
  README.md CHANGELOG.md LICENSE MANIFEST.in)
((missing == 0)) || exit 1

wheel="$(ls "$OUT"/dist/dsparallel-*.whl)"
venv="$OUT/venv"
"$PY" -m venv "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check "$TORCH" numpy
echo "== package: $(basename "$wheel") into a fresh venv"
"$venv/bin/pip" install -q --disable-pip-version-check --no-deps "$wheel"
cp tests/package/smoke.py "$OUT/"
(cd "$OUT" && "$venv/bin/python" smoke.py --expect-under "$venv")
