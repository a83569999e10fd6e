#!/usr/bin/env bash
# Development helper for a lent GPU machine: the GPU suite in pieces that fit one device call.
#   scripts/device_suite.sh PATTERN...   builds what the suite needs, then tests/gpu/run.sh PATTERN for each
#                                        pattern in turn (run.sh's own pattern rules: "-x" is all but x);
#                                        its logs, in one archive, and the summaries land in $OUT.
#   scripts/device_suite.sh PATTERN... --lanes PATTERN...
#                                        the patterns after --lanes (steps of one GPU each: virtual ranks,
#                                        examples, one-GPU Python, the attention sanitizer steps) dealt
#                                        round-robin to one lane per GPU, the lanes side by side
#                                        (CUDA_VISIBLE_DEVICES=g), after the patterns before it. Not for steps
#                                        of several GPUs, nor for timings.
# The whole suite at 4 GPUs takes ~25 minutes of device time, past one 600 s call: these parts cover every
# step of run.sh between them, each call taking a few: "single-process", "multi-process", "rank death",
# "virtual", "python", "examples", "consumer", "one process", and the sanitizer steps as "memcheck",
# "racecheck", "synccheck" (each part's logs are archived when it ends: at 2 ranks memcheck and racecheck
# together took ~500 s on 4 x H200, 2026-11-27). At 2 GPUs the whole suite took four calls and ~1500 s of
# device time with the one-GPU steps in lanes (bench/RESULTS.md, "The GPU suite at 2 GPUs, every step"):
#   1. "python: the torch.distributed backend" "fake nodes" "examples: hello_nodes" "rank death" "multi-process"
#   2. "single-process" --lanes "virtual ranks, W = 2 on" "W = 4" "W = 3" "W = 8"
#   3. "python (torchrun)" "tp_mlp.py trains (torchrun)" "train_transformer.py (torchrun)" "synccheck, 2"
#      --lanes "SM budget" "python: flash attention" "examples (hello_team" "python: grouped_mm" "one process"
#      "python: scaled_mm" "python: torch operators on virtual" "find_package" "python: examples/tp_mlp.py
#      trains on virtual" "memcheck, attention" "racecheck, attention" "synccheck, attention"
#   4. "memcheck, 2" "racecheck, 2" (~210 s each)
# WEFT_SUITE_QUICK=1 runs the real-GPU team steps with fewer sizes. Keep the device call's own output unpiped (or write it under $OUT): a call cut by its time limit
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
serial=() lanes=() in_lanes=0
for pattern in "$@"; do
  if [ "$pattern" = --lanes ]; then
    in_lanes=1
  elif [ "$in_lanes" = 1 ]; then
    lanes+=("$pattern")
  else
    serial+=("$pattern")
  fi
done
for pattern in "${serial[@]}"; do
  i=$((i + 1))
  mkdir -p "$logs/part$i"
  WEFT_LOG_DIR="$logs/part$i" tests/gpu/run.sh "$pattern" 2>&1 | tee -a "$OUT/suite.log" |
    grep --line-buffered -vE '^    \|'
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
  tar -C "$logs" -czf "$OUT/gpu-logs.tgz" .  # after every part: a call cut short keeps what ran
done
if [ "${#lanes[@]}" -gt 0 ]; then
  gpus=$(nvidia-smi -L | grep -c '^GPU')
  for ((g = 0; g < gpus; g++)); do
    (
      lane_rc=0
      for ((j = g; j < ${#lanes[@]}; j += gpus)); do
        mkdir -p "$logs/lane$g.$j"
        CUDA_VISIBLE_DEVICES=$g WEFT_SUITE_NO_BUILD=1 WEFT_LOG_DIR="$logs/lane$g.$j" tests/gpu/run.sh "${lanes[j]}" \
          >>"$OUT/lane$g.log" 2>&1 || lane_rc=1
      done
      exit $lane_rc
    ) &
  done
  for job in $(jobs -p); do wait "$job" || rc=1; done
  cat "$OUT"/lane*.log >>"$OUT/suite.log"
  grep -hE '^  (PASS|FAIL)|summary:|ERROR SUMMARY' "$OUT"/lane*.log
  tar -C "$logs" -czf "$OUT/gpu-logs.tgz" .
fi
exit $rc
