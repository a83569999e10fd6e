#!/usr/bin/env bash
# Development helper for a lent GPU machine: the GPU suite in pieces that fit one device call.
#   scripts/device_suite.sh PATTERN...   builds what the suite needs, then tests/gpu/run.sh PATTERN for each
#                                        pattern in turn (run.sh's own pattern rules: "-x" is all but x);
#                                        its logs, in one archive, and the summaries land in $OUT.
#   scripts/device_suite.sh PATTERN... --pairs PATTERN... --lanes PATTERN... --serial PATTERN...
#                                        sections in the order given: plain patterns (or after --serial) run
#                                        one after another on every GPU; after --pairs they are dealt
#                                        round-robin to pairs of GPUs (0,1 / 2,3 / ..., CUDA_VISIBLE_DEVICES),
#                                        each pair running its share in turn, the pairs side by side (steps of
#                                        2 GPUs: "single-process, 2", "multi-process, 2", the 2-process Python
#                                        steps, the sanitizers at 2 ranks, fake nodes 2 x 1); after --lanes, to
#                                        one GPU each (virtual ranks, examples, one-GPU Python, the attention
#                                        sanitizer steps). Not for timings.
# The whole suite at 4 GPUs takes ~28 minutes of device time, past one 600 s call. On 4 x H200 (2026-11-27,
# bench/RESULTS.md "The GPU suite at 4 x H200" and "4 GPUs on the merged branches") these ran: "single-process,
# 2" on 0,1 beside "multi-process, 2" and the 2-process Python steps on 2,3 (373 s); "memcheck, 2" on 0,1 beside
# the virtual ranks on 2 and 3 (441 s); the build (127 s) and "single-process, 4" (336 s) in one call (472 s);
# "multi-process, 4" (357 s) and the 4-process steps (~190 s) in one call (547 s). A schedule of four calls on
# one warm machine that covers every step of run.sh at 4 GPUs:
#   1. "single-process, 4"
#   2. "multi-process, 4" "fake nodes: 2 x 2" "python (torchrun), 4" "backend 'weft' (torchrun), 4"
#      "fake nodes of 2" "tp_mlp.py trains (torchrun), 4" "train_transformer.py (torchrun), 4"
#   3. --pairs "single-process, 2" "multi-process, 2" "racecheck, 2" "memcheck, 2" "rank death"
#      "fake nodes: 2 x 1" "hello_nodes" "python (torchrun), 2" "backend 'weft' (torchrun), 2"
#      "fake nodes of 1" "tp_mlp.py trains (torchrun), 2" "train_transformer.py (torchrun), 2" "synccheck, 2"
#      "two torchrun launchers"   (dealt round-robin: pair 0,1 runs ~440 s, pair 2,3 ~360 s)
#   4. --lanes "virtual ranks, W = 2 on" "W = 3" "W = 4" "W = 8" "SM budget" "examples (hello_team"
#      "find_package" "one process" "python: flash attention" "python: grouped_mm" "python: scaled_mm"
#      "python: torch operators on virtual" "python: examples/tp_mlp.py trains on virtual"
#      "python: examples/train_transformer.py on a virtual" "memcheck, attention"
#      "racecheck, attention" "synccheck, attention"   (~230 s)
# Chain the calls (the machine goes back 30 s after a call; a fresh one costs ~50 s and the build again).
# (--pairs with one pattern uses only the first pair: a section ends before the next one starts.)
# At 2 GPUs (2 x H200, code 81fe093, bench/RESULTS.md "The GPU suite at 2 GPUs, every step, with faster host
# references") every step ran in ~900 s of calls on one warm machine:
#   1. "single-process, 2" "multi-process, 2" "rank death" "fake nodes: 2 x 1" "hello_nodes"   (build 90 s; 266 s)
#   2. "python (torchrun), 2" "backend 'weft' (torchrun), 2" "fake nodes of 1" "tp_mlp.py trains (torchrun), 2"
#      "train_transformer.py (torchrun), 2" "synccheck, 2" "racecheck, 2" "memcheck, 2"   (~320 s)
#   3. --lanes "W = 8" "W = 4" "W = 2 on" "W = 3" "SM budget" "python: flash attention" "python: torch operators
#      on virtual" "python: examples/tp_mlp.py trains on virtual" "python: grouped_mm" "python: scaled_mm"
#      "memcheck, attention" "racecheck, attention" "synccheck, attention" "examples (hello_team" "find_package"
#      "one process"   (~270 s)
# The 4-GPU times above predate the faster host references. With them (4 x H200, code 372223a, bench/RESULTS.md "The
# GPU suite at 4 GPUs, every step, on one commit") the four calls took: 1. 159 s (build 97 s on the fresh machine
# before it); 2. 332 s; 3. 301 s; 4. 145 s: ~1030 s of device time with the machine's start, every step of run.sh.
# On 4 x H200 (code 687be33, bench/RESULTS.md "The GPU suite's 4-GPU steps on 687be33"), call 2's steps one
# run.sh pattern at a time on a warm machine: "single-process, 4" 131 s; "multi-process, 4" 144 s; "fake nodes:
# 2 x 2", "python (torchrun), 4" and "backend 'weft' (torchrun), 4" 62 s together; "fake nodes of 2",
# "tp_mlp.py trains (torchrun), 4" and "train_transformer.py (torchrun), 4" 85 s together.
# At 2 x H200 (code 1077c78, bench/RESULTS.md "The GPU suite at 2 GPUs on 1077c78") the 2-GPU schedule above took:
# 1. 306 s with a fresh build (98 s); 2. 366 s (racecheck alone 158 s); 3. past 357 s on two lanes (virtual W = 8
# 53 s, W = 2 55 s, W = 4 57 s, ...): budget ~1100 s of device time for every step at 2 GPUs.
# WEFT_PREBUILT=1: the executables come from scripts/prebuilt.sh (built before the call, carried in "out";
# only the Python module builds here, ~10 s), which saves the build's 110-175 s of device time; the
# find_package consumer step, which installs a build, needs one made on the machine.
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
default_build=build
[ "${WEFT_PREBUILT:-0}" = 1 ] && default_build=build-prebuilt  # (never over a CMake build)
build=$(realpath -m "${WEFT_BUILD_DIR:-$default_build}")
export WEFT_BUILD_DIR=$build
t0=$SECONDS
targets=${TARGETS:-$(grep -v '^#' tests/gpu/programs.txt | cut -d' ' -f1 | tr '\n' ' ')}
if [ "${WEFT_PREBUILT:-0}" = 1 ]; then
  # Executables built before the call (scripts/prebuilt.sh): only the Python module builds here.
  scripts/prebuilt.sh unpack "$build" || exit 1
  export WEFT_SUITE_NO_BUILD=1
else
  # shellcheck disable=SC2086  # the targets are words
  cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release >"$OUT/build.log" 2>&1 &&
    cmake --build "$build" -j "$(nproc)" --target $targets >>"$OUT/build.log" 2>&1 || {
    tail -40 "$OUT/build.log"
    exit 1
  }
  # The Python module where pybind11 and the Python headers are (run.sh skips the Python steps otherwise).
  cmake --build "$build" -j "$(nproc)" --target _weft >>"$OUT/build.log" 2>&1 || true
fi
echo "build: $((SECONDS - t0)) s"
nvidia-smi -L
logs=$(mktemp -d)
rc=0
gpus=$(nvidia-smi -L | grep -c '^GPU')
# run_side_by_side GROUP_SIZE PATTERN...: the patterns dealt round-robin to groups of GROUP_SIZE GPUs (0..,
# then the next ones), each group running its patterns in turn, the groups side by side.
run_side_by_side() {
  local size=$1
  shift
  local pats=("$@") groups=$((gpus / size)) g j job
  [ "$groups" -ge 1 ] || { echo "device_suite.sh: $gpus GPUs, groups of $size do not fit" >&2; return 1; }
  for ((g = 0; g < groups; g++)); do
    (
      local visible group_rc=0
      visible=$(seq -s, $((g * size)) $((g * size + size - 1)))
      for ((j = g; j < ${#pats[@]}; j += groups)); do
        mkdir -p "$logs/g$size.$g.$j"
        CUDA_VISIBLE_DEVICES=$visible WEFT_SUITE_NO_BUILD=1 WEFT_LOG_DIR="$logs/g$size.$g.$j" \
          tests/gpu/run.sh "${pats[j]}" >>"$OUT/group$size.$g.log" 2>&1 || group_rc=1
      done
      exit $group_rc
    ) &
  done
  local section_rc=0
  for job in $(jobs -p); do wait "$job" || section_rc=1; done
  cat "$OUT"/group"$size".*.log >>"$OUT/suite.log"
  grep -hE '^  (PASS|FAIL)|summary:|ERROR SUMMARY' "$OUT"/group"$size".*.log
  rm -f "$OUT"/group"$size".*.log
  tar -C "$logs" -czf "$OUT/gpu-logs.tgz" .
  return $section_rc
}
steps=0
run_serial() {
  local pattern
  for pattern in "$@"; do
    steps=$((steps + 1))
    mkdir -p "$logs/serial.$steps"
    WEFT_LOG_DIR="$logs/serial.$steps" tests/gpu/run.sh "$pattern" 2>&1 | tee -a "$OUT/suite.log" |
      grep --line-buffered -vE '^    \|'
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    tar -C "$logs" -czf "$OUT/gpu-logs.tgz" .  # after every step: a call cut short keeps what ran
  done
}
# Sections in the order given: plain patterns run one after another on every GPU; after --pairs, on pairs
# of GPUs side by side; after --lanes, on one GPU each side by side; --serial returns to the first mode.
mode=serial section=()
flush() {
  [ "${#section[@]}" -gt 0 ] || return 0
  case $mode in
    serial) run_serial "${section[@]}" ;;
    pairs) run_side_by_side 2 "${section[@]}" || rc=1 ;;
    lanes) run_side_by_side 1 "${section[@]}" || rc=1 ;;
  esac
  section=()
}
for pattern in "$@"; do
  case $pattern in
    --serial | --pairs | --lanes)
      flush
      mode=${pattern#--}
      ;;
    *) section+=("$pattern") ;;
  esac
done
flush
exit $rc
