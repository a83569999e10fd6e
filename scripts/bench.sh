#!/usr/bin/env bash
# The main job (README): builds weft, then runs weft-bench single-process on every local GPU.
# Arguments go to weft-bench (e.g. `scripts/bench.sh transfer --json`). Build progress goes to stderr, so
# --json output on stdout stays clean.
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
root=$(cd "$(dirname "$0")/.." && pwd)
build=${WEFT_BUILD_DIR:-$root/build}
echo "bench.sh: configuring and building weft-bench in $build (a first build compiles every kernel for" \
  "sm_90a: minutes; progress below)" >&2
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
# Progress lines and errors only; a failed build still fails the script (pipefail: cmake's status).
cmake --build "$build" -j "$(nproc)" --target weft-bench 2>&1 |
  { grep --line-buffered -E '^\[ *[0-9]+%\]|error' >&2 || true; }
echo "bench.sh: running $build/bench/weft-bench $*" >&2
exec "$build/bench/weft-bench" "$@"
