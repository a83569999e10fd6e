// The grouped GEMMs of an MoE layer's fused forms (src/ops/moe.cu), on the host side of weft::grouped_gemm
// (src/ops/gemm.cu). Arguments as weft::grouped_gemm's (weft/ops/gemm.hpp), C bf16.
//   grouped_gemm_scatter   C's rows sent to their own places on some rank and nowhere else
//                          (weft/ops/gemm.cuh GroupedGemmScatterOp): the combine inside the second GEMM.
//   grouped_gemm_dispatch  A's rows moved into dispatch.rows by the kernel's helper warps while the tiles
//                          whose rows have landed run (weft/ops/moe_dispatch.cuh): the dispatch inside the
//                          first GEMM. It waits for peers: options.max_blocks must keep it within the
//                          rank's SM budget.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "weft/ops/gemm.cuh"
#include "weft/ops/gemm.hpp"
#include "weft/ops/moe_dispatch.cuh"

namespace weft::ops {

// Each returns the GEMM's plan; `launch` false: only that (nothing built or launched).
Plan grouped_gemm_scatter(const void* a, const void* b, const int32_t* group_end, int groups, int64_t rows,
                          int64_t n, int64_t k, BLayout b_layout, const ScatterRows& scatter,
                          cudaStream_t stream, const GemmOptions& options = {}, bool launch = true);

Plan grouped_gemm_dispatch(const void* b, void* c, int64_t rows, int64_t n, int64_t k, BLayout b_layout,
                           const MoeDispatchRows& dispatch, cudaStream_t stream, const GemmOptions& options,
                           bool launch = true);

}  // namespace weft::ops
