#!/usr/bin/env bash
# Development helper for a lent GPU machine: environment facts, build, quick tests and bench; logs to $OUT.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ nvidia-smi -L; nvidia-smi topo -m; gcc --version | head -1; cmake --version | head -1; nvcc --version | tail -1;
  which compute-sanitizer mpirun ninja; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
t0=$SECONDS
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release > "$OUT/build.log" 2>&1 && cmake --build build -j "$(nproc)" --target weft-gpu-tests weft-launch weft-bench >> "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "build: $((SECONDS - t0)) s"; grep -iE "warning|spill" "$OUT/build.log" | head -5
for a in "$@"; do
  echo "=== $a"; t1=$SECONDS
  timeout 240 bash -c "$a" > "$OUT/step.log" 2>&1; rc=$?
  tail -60 "$OUT/step.log"; cat "$OUT/step.log" >> "$OUT/steps.log"
  echo "=== rc=$rc ($((SECONDS - t1)) s)"
done
