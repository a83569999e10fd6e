// cuBLAS GEMM for the fused ops' sequential and pipelined paths (internal to src/ops). Those paths exist to
// be never slower than cuBLAS + NCCL, so their GEMM is cuBLAS itself where it is safe (fused.cu's
// Call::gemm_into says where not): weft::gemm matches cuBLAS on the sweep of the GEMM issue but not on every
// shape and data pattern (bench/RESULTS.md, fused tables).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "weft/ops/gemm.hpp"

namespace weft::ops {

// out [M, N] bf16 = a [M, K] bf16 . b ([K, N] or an [N, K] weight, bf16), fp32 accumulation, on `stream` of
// the current device. One cuBLAS handle (with its own workspace) per device and team rank `rank`, created on
// the first call; that call must not be inside a CUDA-graph capture (`capturing`: then it throws, saying so,
// with `where`).
// Returns false (nothing launched) where cuBLAS cannot take the shape (a dimension above 2^31 - 1).
// With `accumulate`: out = a . b + out, the sum taken in fp32 in the GEMM's epilogue (the copy-engine
// pipeline's partial sums, in place).
bool cublas_gemm_bf16(const void* a, const void* b, void* out, int64_t m, int64_t n, int64_t k,
                      BLayout layout, cudaStream_t stream, int rank, bool capturing, const std::string& where,
                      bool accumulate = false);

// Creates the current device's cuBLAS handle for `rank` if it has none: for a call that does not use cuBLAS
// now, so that a later call under a CUDA-graph capture (which cannot create it) can. The first handle of a
// process waits for the GPU's running work (cuBLAS initializes): a communicator whose thread drives several
// ranks makes every rank's handle at creation, before any kernel that waits for a peer.
void cublas_gemm_ready(int rank, const std::string& where);

}  // namespace weft::ops
