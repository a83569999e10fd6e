// Plain types of the FP8 GEMM, shared by its host API (weft/ops/gemm.hpp) and its device code
// (weft/ops/gemm_fp8.cuh).
#pragma once
#include "weft/ops/activation_types.hpp"  // Activation (Fp8Activation's name before)

namespace weft {

// The 8-bit float formats of an FP8 GEMM's operands (A and B alike).
enum class Fp8Type : int {
  kE4M3 = 0,  // 4 exponent, 3 mantissa bits (max 448): weights and activations
  kE5M2 = 1,  // 5 exponent, 2 mantissa bits (max 57344): gradients
};

// How an FP8 GEMM's fp32 scales apply (C = scaled A . B; see weft::gemm_fp8).
enum class Fp8Scaling : int {
  kTensor = 0,  // scale_a [1], scale_b [1]
  kRowCol = 1,  // scale_a [M] (per row of A), scale_b [N] (per row of B, i.e. per column of C)
  kBlock = 2,   // scale_a [M, ceil(K / 128)] (1 x 128 groups), scale_b [ceil(N / 128), ceil(K / 128)]
                // (128 x 128 blocks), both row-major: DeepSeek-V3's block scaling
};

inline constexpr int kFp8ScaleBlock = 128;  // kBlock's group of K (and block of N)

}  // namespace weft
