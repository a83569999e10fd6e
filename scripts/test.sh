#!/usr/bin/env bash
# The test command (README; .ci/run calls exactly this): installs missing build dependencies where it can,
# configures and builds everything (all device code for sm_90a), then runs every registered test with
# ctest. Host tests need no GPU; GPU tests skip visibly when none is present. On a GPU machine, the full
# multi-GPU suite is tests/gpu/run.sh.
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
root=$(cd "$(dirname "$0")/.." && pwd)
build=${WEFT_BUILD_DIR:-$root/build}

missing=()
command -v cmake >/dev/null || missing+=(cmake)
command -v g++ >/dev/null || missing+=(g++)
[ -f /usr/include/gtest/gtest.h ] || [ -f /usr/local/include/gtest/gtest.h ] || missing+=(libgtest-dev)
# The Python package's no-GPU tests: pybind11 headers (Debian's, unless pip's is there) and Python headers.
python3 -m pybind11 --cmakedir >/dev/null 2>&1 || [ -d /usr/lib/cmake/pybind11 ] || missing+=(pybind11-dev)
[ -f "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])' 2>/dev/null)/Python.h" ] || missing+=(python3-dev)
# The wheel test (python/tests/wheel_install.sh): pip builds the wheel, a fresh venv installs it.
python3 -m pip --version >/dev/null 2>&1 || missing+=(python3-pip)
python3 -c "import venv, ensurepip" >/dev/null 2>&1 || missing+=(python3-venv)
if [ ${#missing[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "installing: ${missing[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
  else
    echo "warning: missing ${missing[*]} and cannot install them here; building what is possible" >&2
  fi
fi

cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release
cmake --build "$build" -j "$(nproc)"
cd "$build"
rc=0
ctest --output-on-failure --timeout 900 "$@" || rc=$?
# What did not run, and why, one line per skipped test (LastTest.log holds each test's output after a
# "N/M Testing: <name>" line): a skipped ctest entry prints "SKIPPED: <reason>" (the first one counts), a skipped
# Python unittest case "<case> ... skipped '<reason>'", a skipped GoogleTest case its reason on the line before
# "[  SKIPPED ] <case>".
log=Testing/Temporary/LastTest.log
if [ -f "$log" ]; then
  awk '/^[0-9]+\/[0-9]+ Testing: / { name = $3; said = 0 }
       /^SKIPPED: / && !said { sub(/^SKIPPED: /, ""); lines = lines "  " name ": " $0 "\n"; said = 1 }
       / \.\.\. skipped \047/ { s = $0; sub(/ \.\.\. skipped \047/, ": ", s); sub(/\047$/, "", s);
                                lines = lines "  " name ", " s "\n" }
       /^\[  SKIPPED \] [^ ]+ \(/ { lines = lines "  " name ": " prev "\n" }
       { prev = $0 }
       END { if (lines != "") printf "Skipped, and why:\n%s", lines }' "$log"
fi
exit $rc
