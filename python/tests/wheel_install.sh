#!/usr/bin/env bash
# `pip install .` as a user would make it, without a package index: builds the wheel through weft's own build
# backend (reusing the CMake build tree BUILD, so only the extension's target is brought up to date), checks
# that it holds the `weft` package alone, installs it into a fresh venv and imports it there (no GPU needed).
# Usage: wheel_install.sh SOURCE_DIR BUILD_DIR. Exit 77 (a visible skip) where pip or venv is missing.
set -euo pipefail
src=$1 build=$2
py=${PYTHON:-python3}
if ! "$py" -m pip --version >/dev/null 2>&1 || ! "$py" -c "import venv, ensurepip" >/dev/null 2>&1; then
  echo "SKIPPED: the wheel test needs pip and venv for $py (apt-get install python3-pip python3-venv)"
  exit 77
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
WEFT_WHEEL_BUILD_DIR=$build "$py" -m pip wheel --no-index --no-deps --quiet -w "$tmp/dist" "$src"
wheel=$(ls "$tmp"/dist/weft-*.whl)
echo "built $(basename "$wheel")"
contents=$("$py" -m zipfile -l "$wheel" | awk 'NR > 1 {print $1}')
echo "$contents"
if echo "$contents" | grep -v -E '^weft/([A-Za-z_][A-Za-z0-9_]*\.py|_weft\..*\.so)$|^weft-[^/]*\.dist-info/'; then
  echo "FAIL: the wheel holds files beyond the weft package (above)"
  exit 1
fi
echo "$contents" | grep -q -E '^weft/_weft\..*\.so$' || { echo "FAIL: no extension module in the wheel"; exit 1; }
for f in "$src"/python/weft/*.py; do  # every module of the package
  echo "$contents" | grep -q -x "weft/$(basename "$f")" || { echo "FAIL: weft/$(basename "$f") is not in the wheel"; exit 1; }
done
"$py" -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install --no-index --quiet "$wheel"
cd "$tmp"  # away from the source tree, so the import finds the installed package
"$tmp/venv/bin/python" -c "import weft, sys; print('imported weft', weft.__version__, 'from', weft.__file__); \
sys.exit(0 if '/venv/' in weft.__file__ else 1)"
