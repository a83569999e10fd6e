#!/usr/bin/env bash
# Development helper for a lent GPU machine: the GPU suite in pieces that fit one device call.
#   scripts/device_suite.sh PATTERN...   builds what the suite needs, then tests/gpu/run.sh PATTERN for each
#                                        pattern in turn (run.sh's own pattern rules: "-x" is all but x);
#                                        its logs, in one archive, and the summaries land in $OUT.
# The whole suite at 4 GPUs takes ~25 minutes of device time, past one 600 s call: these parts cover every
# step of run.sh between them, each call taking a few: "single-process", "multi-process", "rank death",
# "virtual", "python", "examples", "consumer", "one process", and the sanitizer steps as "memcheck",
# "racecheck", "synccheck" (each part's logs are archived when it ends: at 2 ranks memcheck and racecheck
# together took ~500 s on 4 x H200, 2026-11-27). WEFT_SUITE_QUICK=1 runs the real-GPU team steps with fewer
# sizes. Keep the device call's own output unpiped (or write it under $OUT): a call cut by its time limit
# returns only what was printed, and `| tail` prints nothing until its input ends.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
root=$(cd "$(dirname "$0")/.." && pwd)
if [ $# -eq 0 ]; then
  echo "usage: scripts/device_suite.sh PATTERN... (see the header)" >&2
  exit 2
fi
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
cd "$root" || exit 1
build=$(realpath -m "${WEFT_BUILD_DIR:-build}")
export WEFT_BUILD_DIR=$build
t0=$SECONDS
targets=${TARGETS:-weft-gpu-tests weft-launch hello_team matmul_to_next weft-multinode-tests hello_nodes}
# shellcheck disable=SC2086  # the targets are words
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release >"$OUT/build.log" 2>&1 &&
  cmake --build "$build" -j "$(nproc)" --target $targets >>"$OUT/build.log" 2>&1 || {
  tail -40 "$OUT/build.log"
  exit 1
}
# The Python module where pybind11 and the Python headers are (run.sh skips the Python steps otherwise).
cmake --build "$build" -j "$(nproc)" --target _weft >>"$OUT/build.log" 2>&1 || true
echo "build: $((SECONDS - t0)) s"
nvidia-smi -L
logs=$(mktemp -d)
rc=0
i=0
for pattern in "$@"; do
  i=$((i + 1))
  mkdir -p "$logs/part$i"
  WEFT_LOG_DIR="$logs/part$i" tests/gpu/run.sh "$pattern" 2>&1 | tee -a "$OUT/suite.log" |
    grep --line-buffered -vE '^    \|'
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
  tar -C "$logs" -czf "$OUT/gpu-logs.tgz" .  # after every part: a call cut short keeps what ran
done
exit $rc
