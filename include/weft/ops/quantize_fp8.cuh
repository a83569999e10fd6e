// Device code of weft::quantize_fp8: bf16 / fp16 rows to e4m3 / e5m2 with fp32 scales in the shapes
// weft::gemm_fp8 reads (weft/ops/gemm_fp8_types.hpp). A scale is amax / (the format's largest value), amax
// over the elements it covers (a floor keeps an all-zero group finite); q = x / scale rounded to nearest
// (saturating), so q * scale is x to the format's precision.
//   group kernel   one warp per (row, 128-column group): A's 1 x 128 block scales, and per-row scales by a
//                  warp per row that walks its groups;
//   block kernel   one block per 128 x 128 tile: B's block scales;
//   tensor         an amax kernel (atomicMax on the float's bits, non-negative floats order as integers,
//                  into the scale's slot), the conversion, then the scale from the amax;
//   activation     one warp per (row, 128-column group) as the group kernel, the activation computed in
//                  fp32 from four elements a lane (of gate and up for SwiGLU) held in registers for both the
//                  amax and the conversion (activate_quantize_fp8).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "weft/device/numeric.cuh"  // to_float2
#include "weft/device/search.cuh"
#include "weft/ops/activation_types.hpp"
#include "weft/ops/gemm_fp8_types.hpp"

namespace weft::ops::fp8 {

inline constexpr float kAmaxFloor = 1e-12f;

template <bool kE5M2>
__device__ __forceinline__ float max_value() {
  return kE5M2 ? 57344.f : 448.f;
}
template <bool kE5M2>
__device__ __forceinline__ uint8_t encode(float v) {
  if constexpr (kE5M2)
    return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E5M2);
  else
    return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
}
__device__ __forceinline__ float load(const __nv_bfloat16* p) {
  return __bfloat162float(*p);
}
__device__ __forceinline__ float load(const __half* p) {
  return __half2float(*p);
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Four adjacent bf16 / fp16 elements as floats, in one 8-byte load (p 8-byte aligned).
template <class T>
__device__ __forceinline__ float4 load4(const T* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  const float2 a = to_float2(reinterpret_cast<const T*>(&u.x)),
               b = to_float2(reinterpret_cast<const T*>(&u.y));
  return make_float4(a.x, a.y, b.x, b.y);
}

template <Activation kAct>
__device__ __forceinline__ float activate(float x, float up) {
  if constexpr (kAct == Activation::kSwiGLU) return x / (1.f + expf(-x)) * up;
  if constexpr (kAct == Activation::kSiLU) return x / (1.f + expf(-x));
  if constexpr (kAct == Activation::kGELU) return 0.5f * x * (1.f + erff(x * 0.70710678118654752f));
  if constexpr (kAct == Activation::kReLU) return fmaxf(x, 0.f);
  return x;
}

// The rows activate_quantize_kernel writes: all, or group e's first group_rows[e] (Fp8QuantizeRows).
struct QuantizedRows {
  const int32_t* group_end;
  const int32_t* group_rows;  // null: every row
  int groups;
  __device__ __forceinline__ bool has(int64_t row) const {
    if (group_rows == nullptr) return true;
    const int e = first_greater(group_end, groups, static_cast<int>(row));
    if (e == groups) return false;
    const int begin = e > 0 ? __ldg(group_end + e - 1) : 0;
    return row - begin < __ldg(group_rows + e);
  }
};

// Where row i's scale of 128-column group g goes: scales[i * row + g * group] (row-major [rows, groups]:
// (groups, 1), rows of a stride: (stride, 1), M-major: (1, stride); one scale a row: (1, 0)).
struct ScaleSteps {
  int64_t row, group;
};

// out [rows, cols] = activation(in) quantized, A's 1 x 128 block scales at `steps`. in's row: cols elements,
// or for SwiGLU 2 cols ([gate | up]). One warp per (row, 128-column group), four columns a lane: cols, ld_in
// and ld_out multiples of 4 (the host checks them).
template <class T, bool kE5M2, Activation kAct>
__global__ void activate_quantize_kernel(const T* in, int64_t ld_in, uint8_t* out, int64_t ld_out,
                                         float* scales, ScaleSteps steps, int64_t rows, int64_t cols,
                                         QuantizedRows which) {
  const int lane = threadIdx.x % 32;
  const int64_t groups = (cols + kFp8ScaleBlock - 1) / kFp8ScaleBlock;
  for (int64_t u = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32; u < rows * groups;
       u += int64_t(gridDim.x) * blockDim.x / 32) {
    const int64_t row = u / groups, g = u % groups, c = g * kFp8ScaleBlock + 4 * lane;
    if (!which.has(row)) continue;  // (the same for the whole warp)
    float y[4] = {0.f, 0.f, 0.f, 0.f};
    if (c < cols) {
      const float4 x = load4(in + row * ld_in + c);
      float4 up = make_float4(1.f, 1.f, 1.f, 1.f);
      if constexpr (kAct == Activation::kSwiGLU) up = load4(in + row * ld_in + cols + c);
      y[0] = activate<kAct>(x.x, up.x);
      y[1] = activate<kAct>(x.y, up.y);
      y[2] = activate<kAct>(x.z, up.z);
      y[3] = activate<kAct>(x.w, up.w);
    }
    float amax = fmaxf(fmaxf(fabsf(y[0]), fabsf(y[1])), fmaxf(fabsf(y[2]), fabsf(y[3])));
    amax = fmaxf(warp_max(amax), kAmaxFloor);
    const float inv = max_value<kE5M2>() / amax;
    if (c < cols) {
      const uint32_t q = uint32_t(encode<kE5M2>(y[0] * inv)) | uint32_t(encode<kE5M2>(y[1] * inv)) << 8 |
                         uint32_t(encode<kE5M2>(y[2] * inv)) << 16 |
                         uint32_t(encode<kE5M2>(y[3] * inv)) << 24;
      *reinterpret_cast<uint32_t*>(out + row * ld_out + c) = q;
    }
    if (lane == 0) scales[row * steps.row + g * steps.group] = amax / max_value<kE5M2>();
  }
}

// Rows of `cols` elements (row stride ld_in / ld_out elements). kPerRow: one scale per row; else one per
// 128-column group; each at `steps`. One warp per (row, group) or per row.
template <class T, bool kE5M2, bool kPerRow>
__global__ void quantize_groups_kernel(const T* in, int64_t ld_in, uint8_t* out, int64_t ld_out,
                                       float* scales, ScaleSteps steps, int64_t rows, int64_t cols) {
  const int lane = threadIdx.x % 32;
  const int64_t groups = (cols + kFp8ScaleBlock - 1) / kFp8ScaleBlock;
  const int64_t units = kPerRow ? rows : rows * groups;
  for (int64_t u = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32; u < units;
       u += int64_t(gridDim.x) * blockDim.x / 32) {
    const int64_t row = kPerRow ? u : u / groups;
    const int64_t g0 = kPerRow ? 0 : u % groups, g1 = kPerRow ? groups : g0 + 1;
    const T* x = in + row * ld_in;
    float amax = 0.f;
    for (int64_t c = g0 * kFp8ScaleBlock + lane; c < cols && c < g1 * kFp8ScaleBlock; c += 32)
      amax = fmaxf(amax, fabsf(load(x + c)));
    amax = fmaxf(warp_max(amax), kAmaxFloor);
    const float scale = amax / max_value<kE5M2>(), inv = max_value<kE5M2>() / amax;
    for (int64_t c = g0 * kFp8ScaleBlock + lane; c < cols && c < g1 * kFp8ScaleBlock; c += 32)
      out[row * ld_out + c] = encode<kE5M2>(load(x + c) * inv);
    if (lane == 0) scales[row * steps.row + g0 * steps.group] = scale;
  }
}

// One block (256 threads) per 128 x 128 tile, a 1-D grid of them row-major: scales[tile_row * col_tiles +
// tile_col].
template <class T, bool kE5M2>
__global__ void quantize_blocks_kernel(const T* in, int64_t ld_in, uint8_t* out, int64_t ld_out,
                                       float* scales, int64_t rows, int64_t cols) {
  __shared__ float warp_amax[8];
  const int64_t col_tiles = (cols + kFp8ScaleBlock - 1) / kFp8ScaleBlock;
  const int64_t tile = blockIdx.x;  // row tile tile / col_tiles, column tile tile % col_tiles
  const int64_t r0 = tile / col_tiles * kFp8ScaleBlock, c0 = tile % col_tiles * kFp8ScaleBlock;
  const int64_t r1 = min(rows, r0 + kFp8ScaleBlock), c1 = min(cols, c0 + kFp8ScaleBlock);
  float amax = 0.f;
  for (int64_t r = r0 + threadIdx.x / 32; r < r1; r += 8)
    for (int64_t c = c0 + threadIdx.x % 32; c < c1; c += 32)
      amax = fmaxf(amax, fabsf(load(in + r * ld_in + c)));
  amax = warp_max(amax);
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = kAmaxFloor;
#pragma unroll
  for (int w = 0; w < 8; ++w) amax = fmaxf(amax, warp_amax[w]);
  const float inv = max_value<kE5M2>() / amax;
  for (int64_t r = r0 + threadIdx.x / 32; r < r1; r += 8)
    for (int64_t c = c0 + threadIdx.x % 32; c < c1; c += 32)
      out[r * ld_out + c] = encode<kE5M2>(load(in + r * ld_in + c) * inv);
  if (threadIdx.x == 0) scales[tile] = amax / max_value<kE5M2>();
}

// Per tensor: amax into *amax_bits (a float's bits, zeroed before; non-negative floats order as integers).
template <class T>
__global__ void amax_kernel(const T* in, int64_t ld_in, int64_t rows, int64_t cols, unsigned int* amax_bits) {
  float amax = 0.f;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < rows * cols;
       i += int64_t(gridDim.x) * blockDim.x)
    amax = fmaxf(amax, fabsf(load(in + (i / cols) * ld_in + i % cols)));
  amax = warp_max(amax);
  if (threadIdx.x % 32 == 0) atomicMax(amax_bits, __float_as_uint(amax));
}
// Per tensor: the conversion with the one scale, whose slot holds the amax's bits until finish_tensor_scale
// turns it into the scale.
template <class T, bool kE5M2>
__global__ void quantize_tensor_kernel(const T* in, int64_t ld_in, uint8_t* out, int64_t ld_out,
                                       const unsigned int* amax_bits, int64_t rows, int64_t cols) {
  const float inv = max_value<kE5M2>() / fmaxf(__uint_as_float(*amax_bits), kAmaxFloor);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < rows * cols;
       i += int64_t(gridDim.x) * blockDim.x)
    out[(i / cols) * ld_out + i % cols] = encode<kE5M2>(load(in + (i / cols) * ld_in + i % cols) * inv);
}
template <bool kE5M2>
__global__ void finish_tensor_scale(float* scale) {
  *scale =
      fmaxf(__uint_as_float(*reinterpret_cast<const unsigned int*>(scale)), kAmaxFloor) / max_value<kE5M2>();
}

}  // namespace weft::ops::fp8
