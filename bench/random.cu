// bf16 helpers of the GEMM-based modes, on the GPU: random inputs (host generation of the fused mode's 512
// MiB operands took seconds per shape) and the relative error of one output against another.
#include <cuda_bf16.h>

#include <cmath>

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

// sums[0] += (x - y)^2, sums[1] += y^2.
__global__ void diff_kernel(const __nv_bfloat16* x, const __nv_bfloat16* y, uint64_t n, double* sums) {
  double d = 0, r = 0;
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < n;
       i += uint64_t(gridDim.x) * blockDim.x) {
    const double a = __bfloat162float(x[i]), b = __bfloat162float(y[i]);
    d += (a - b) * (a - b);
    r += b * b;
  }
  for (int o = 16; o > 0; o /= 2) {
    d += __shfl_down_sync(0xffffffffu, d, o);
    r += __shfl_down_sync(0xffffffffu, r, o);
  }
  if (threadIdx.x % 32 == 0) {
    atomicAdd(&sums[0], d);
    atomicAdd(&sums[1], r);
  }
}

}  // namespace

double rel_err_bf16(const void* x, const void* y, uint64_t n, cudaStream_t stream) {
  DeviceBuffer sums(2 * sizeof(double));
  WEFT_CUDA_CHECK(cudaMemsetAsync(sums.p, 0, 2 * sizeof(double), stream));
  diff_kernel<<<1024, 256, 0, stream>>>(static_cast<const __nv_bfloat16*>(x),
                                        static_cast<const __nv_bfloat16*>(y), n,
                                        static_cast<double*>(sums.p));
  WEFT_CUDA_CHECK(cudaGetLastError());
  double h[2];
  WEFT_CUDA_CHECK(cudaMemcpyAsync(h, sums.p, sizeof(h), cudaMemcpyDeviceToHost, stream));
  WEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
  return h[1] > 0 ? std::sqrt(h[0] / h[1]) : -1;
}

void fill_uniform_bf16(void* p, uint64_t n, uint64_t seed, cudaStream_t stream) {
  fill_uniform_kernel<<<1024, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(p), n, seed);
  WEFT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace weft::bench
