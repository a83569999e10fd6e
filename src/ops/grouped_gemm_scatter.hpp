// A grouped GEMM whose epilogue sends each row of C to its own place on some rank (weft/ops/gemm.cuh
// GroupedGemmScatterOp): the MoE combine's data movement inside the second expert GEMM (src/ops/moe.cu).
// Arguments as weft::grouped_gemm's (weft/ops/gemm.hpp), C bf16 and nowhere but the scatter's rows.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "weft/ops/gemm.cuh"
#include "weft/ops/gemm.hpp"

namespace weft::ops {

void grouped_gemm_scatter(const void* a, const void* b, const int32_t* group_end, int groups, int64_t rows,
                          int64_t n, int64_t k, BLayout b_layout, const ScatterRows& scatter,
                          cudaStream_t stream, const GemmOptions& options = {});

}  // namespace weft::ops
