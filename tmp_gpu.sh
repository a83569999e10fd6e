#!/usr/bin/env bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
set -u
mkdir -p $OUT/logs
t0=$SECONDS
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release > $OUT/logs/cmake.log 2>&1
cmake --build build -j16 --target weft-gpu-tests weft-launch hello_team matmul_to_next > $OUT/logs/build.log 2>&1 || { tail -50 $OUT/logs/build.log; exit 1; }
echo "build $((SECONDS-t0)) s"
WEFT_LOG_DIR=$OUT/logs tests/gpu/run.sh "$@" 2>&1 | tail -40
