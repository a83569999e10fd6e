// The activation an op applies in a pass it already makes over the data, shared by the host API and the
// device code of those ops.
#pragma once

namespace weft {

// Applied in fp32 (no 16-bit intermediate). kSwiGLU: silu(gate) * up, half as many output columns as
// input ones (each op says where its gate and up halves lie); kGELU: the erf form, torch's default. Which
// op takes which: grouped_gemm's epilogue kNone and kSwiGLU (weft/ops/gemm.hpp), activate_quantize_fp8
// every one.
enum class Activation : int { kNone = 0, kSwiGLU = 1, kSiLU = 2, kGELU = 3, kReLU = 4 };

// The names the two ops' enums had before they became one.
using GemmActivation [[deprecated("use weft::Activation")]] = Activation;
using Fp8Activation [[deprecated("use weft::Activation")]] = Activation;

}  // namespace weft
