// Element types of weft's host APIs (collectives, GEMM, fused ops). Host-only header.
#pragma once
#include <cstddef>

namespace weft {

enum class DType { kBF16, kFP16, kFP32 };
size_t dtype_size(DType t);
const char* dtype_name(DType t);

}  // namespace weft
