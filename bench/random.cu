// Random bf16 inputs for the GEMM-based modes, generated on the GPU (host generation of the fused mode's
// 512 MiB operands took seconds per shape).
#include <cuda_bf16.h>

#include "bench.hpp"

namespace weft::bench {
namespace {

// Uniform in [-1, 1), from a hash of (seed, index): every element differs, the same seed gives the same data.
__global__ void fill_uniform_kernel(__nv_bfloat16* p, uint64_t n, uint64_t seed) {
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < n;
       i += uint64_t(gridDim.x) * blockDim.x) {
    uint64_t x = (seed << 40) ^ i;
    x = (x ^ (x >> 31)) * 0x7fb5d329728ea185ull;
    x = (x ^ (x >> 27)) * 0x81dadef4bc2dd44dull;
    x ^= x >> 33;
    p[i] = __float2bfloat16(float(x >> 40) * (2.0f / 16777216.0f) - 1.0f);
  }
}

}  // namespace

void fill_uniform_bf16(void* p, uint64_t n, uint64_t seed, cudaStream_t stream) {
  fill_uniform_kernel<<<1024, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(p), n, seed);
  WEFT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace weft::bench
