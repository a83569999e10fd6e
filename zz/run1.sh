#!/bin/bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32
mkdir -p $OUT/logs
t0=$(date +%s)
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release > $OUT/logs/cfg.log 2>&1 || { tail -20 $OUT/logs/cfg.log; exit 1; }
cmake --build build -j 16 --target weft-bench weft-gpu-tests weft-launch weft-host-tests > $OUT/logs/build.log 2>&1 || { grep -E "error|Error" $OUT/logs/build.log | head -40; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"
build/tests/host/weft-host-tests --gtest_brief=1 2>&1 | tail -3
T=build/tests/gpu/weft-gpu-tests
for W in 4 8 2 3; do
  timeout 300 $T --gpus 1 --ranks $W --team-only --quick --filter hybrid,subteam > $OUT/logs/w$W.log 2>&1; echo "W=$W rc=$?"
  grep -E "passed|failed|FAIL|skipp" $OUT/logs/w$W.log | tail -6
done
grep -E "rank 0/" $OUT/logs/w8.log | head -20
echo "tests done $(( $(date +%s) - t0 )) s"
for W in 4 8; do
  timeout 200 build/bench/weft-bench context_attention --ranks $W --quick --cp-methods hybrid > $OUT/logs/bench$W.log 2>&1; echo "bench W=$W rc=$?"
  grep -E "^\|" $OUT/logs/bench$W.log | head -12
done
echo "all $(( $(date +%s) - t0 )) s"
