#!/bin/bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=32
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release > $OUT/cmake.log 2>&1
cmake --build build -j16 --target _weft > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
export PYTHONPATH=build/python WEFT_TIMEOUT_MS=2000
for c in ${CASES:-}; do timeout 60 python3 zz_dbg.py $c 2>&1 | tail -2; done
for c in ${ECASES:-}; do CUDA_MODULE_LOADING=EAGER timeout 100 python3 zz_dbg.py $c 2>&1 | sed 's/^/EAGER /' | tail -2; done
[ -n "${W:-}" ] && timeout 400 python3 python/tests/gpu_team.py $W 2>&1 | tee $OUT/team.log | tail -40
exit 0
