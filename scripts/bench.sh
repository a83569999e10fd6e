#!/usr/bin/env bash
# The main job (README): builds weft, then runs weft-bench single-process on every local GPU.
# Arguments go to weft-bench (e.g. `scripts/bench.sh transfer --json`).
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
root=$(cd "$(dirname "$0")/.." && pwd)
build=${WEFT_BUILD_DIR:-$root/build}
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" -j "$(nproc)" --target weft-bench >/dev/null
exec "$build/bench/weft-bench" "$@"
