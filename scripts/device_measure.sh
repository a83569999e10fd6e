#!/usr/bin/env bash
# Development helper for a lent multi-GPU machine: the measurements the open issues wait for, by name, at
# the --quick sizes earlier runs used (each tool capped at 580 s; at 2 x H200 with WEFT_PREBUILT=1, tp + moe
# took 130 s and cp + decode + fp8 + rooted 124 s, before cp's small sizes were added; 4 GPUs not timed yet).
#   scripts/device_measure.sh PLAN...     PLAN: tp (fused TP ops with timelines, GEMM + all-reduce at decode
#                                         sizes, all-to-all, Python bench), moe, cp (sequence parallel; with
#                                         2k / 8k a GPU timelines and host_vs_gpu.py, at 2k with the ring
#                                         ops' phases and every call's GPU activities: --kernels),
#                                         decode (flash_decode), fp8 (FP8 GEMM and TP ops), rooted (broadcast,
#                                         scatter, gather, reduce, all_to_all_v)
# Every GPU of the machine; one output file per plan and tool and the timelines (tl/), all in one archive,
# $OUT/measure.tgz, rewritten after every tool (a device call returns at most 8 files of $OUT, and a call cut
# short keeps what ran), and a line per tool on stdout. Baselines (NCCL, cuBLAS, torch) run inside each tool, in the same process.
# Timings of record only at real GPUs: on one GPU the team rows are virtual or missing. WEFT_PREBUILT=1: the
# executables and weft's install tree from scripts/prebuilt.sh pack (carry "out"); only the Python module
# builds on the machine.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 1
plans="tp moe cp decode fp8 rooted"
[ $# -gt 0 ] || { sed -n 2,16p "$0"; exit 2; }
for plan in "$@"; do  # every name checked before the build
  case " $plans " in *" $plan "*) ;; *) echo "device_measure.sh: no plan '$plan' (plans: $plans)" >&2; exit 2 ;; esac
done
OUT=${OUT:-/tmp/out}
logs=$(mktemp -d /tmp/weft-measure.XXXXXX)  # the files behind $OUT/measure.tgz
mkdir -p "$OUT" "$logs/tl"
pack() { tar -C "$logs" -czf "$OUT/measure.tgz" .; }
default_build=build
[ "${WEFT_PREBUILT:-0}" = 1 ] && default_build=build-prebuilt  # (never over a CMake build)
build=$(realpath -m "${WEFT_BUILD_DIR:-$default_build}")
n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
[ "$n" -ge 1 ] || { echo "device_measure.sh: no GPU (nvidia-smi -L lists none)" >&2; exit 1; }
rc=0  # the first failing tool's exit status, the script's own
t0=$SECONDS
if [ "${WEFT_PREBUILT:-0}" = 1 ]; then  # built before the call (scripts/prebuilt.sh): no build's device time
  scripts/prebuilt.sh unpack "$build" >"$logs/build.log" 2>&1 && ls "$build"/python/weft/_weft*.so >/dev/null 2>&1 ||
    { cat "$logs/build.log"; tail -20 "$build/python-build.log" 2>/dev/null; pack; exit 1; }
else
  cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release >"$logs/build.log" 2>&1 &&
    cmake --build "$build" -j "$(nproc)" --target weft-bench _weft >>"$logs/build.log" 2>&1 ||
    { tail -30 "$logs/build.log"; pack; exit 1; }
fi
echo "build: $((SECONDS - t0)) s; $n GPUs"
bench() {  # bench NAME ARGS...: weft-bench over every GPU
  local name=$1 t=$SECONDS
  shift
  timeout 580 "$build/bench/weft-bench" --gpus "$n" "$@" >"$logs/$name-${n}gpu.txt" 2>&1
  local r=$?
  [ $r -eq 0 ] || [ $rc -ne 0 ] || rc=$r
  pack
  echo "== $name ($((SECONDS - t)) s, exit $r): measure.tgz: $name-${n}gpu.txt"
}
py() {  # py NAME SCRIPT ARGS...: a Python bench under torchrun, a process per GPU
  local name=$1 t=$SECONDS
  shift
  PYTHONPATH="$build/python" timeout 580 python3 -m torch.distributed.run --nproc_per_node="$n" \
    --master-port=$((20000 + RANDOM % 20000)) "$@" >"$logs/$name-${n}gpu.txt" 2>&1
  local r=$?
  [ $r -eq 0 ] || [ $rc -ne 0 ] || rc=$r
  pack
  echo "== $name ($((SECONDS - t)) s, exit $r): measure.tgz: $name-${n}gpu.txt"
}
for plan in "$@"; do
  case $plan in
    tp)
      bench fused fused --quick --timeline "$logs/tl"
      bench decode decode
      bench alltoall alltoall --quick
      py bench_py python/benchmarks/bench.py --quick
      ;;
    moe) py moe_py python/benchmarks/moe.py --quick; bench moe moe --quick --timeline "$logs/tl" ;;
    cp)
      py context_parallel python/benchmarks/context_parallel.py --quick
      bench cp context_attention --quick
      # 2k and 8k tokens a GPU, Llama3-8B-like heads: the kernels' per-rank timelines, and host vs GPU time
      bench cp_small context_attention --quick --cp-seqs $((2048 * n)),$((8192 * n)) --cp-heads 32,8 \
        --cp-methods ring,ulysses --timeline "$logs/tl"
      py host_vs_gpu python/benchmarks/host_vs_gpu.py 2048 8192
      # At 2k: the ring ops' phases per call, GPU and host time (ops::PhaseClock), and each method's GPU
      # activities of one call (torch.profiler), kernel by kernel with the idle time between them.
      export WEFT_OP_PHASES=1
      py host_vs_gpu_phases python/benchmarks/host_vs_gpu.py 2048 --kernels
      unset WEFT_OP_PHASES
      ;;
    decode) bench flash_decode flash_decode --timeline "$logs/tl"; py decode_py python/benchmarks/decode.py --quick ;;
    fp8) bench gemm_fp8 gemm_fp8 --quick; py fp8_tp python/benchmarks/fp8_tp.py --quick ;;
    rooted) bench rooted broadcast scatter gather reduce alltoallv --quick ;;
  esac
done
echo "total: $((SECONDS - t0)) s"
exit $rc
