// Row-wise work on register tiles (tile/fragment.cuh's AccumM64: a warpgroup's 64 x N fp32 accumulator, each
// thread holding two rows, r and r + 8, spread over the 4 lanes of a quad): fast exp2 / log2, quad
// reductions, row scaling, the conversion of an accumulator into the bf16 A operand of a following
// register-A MMA, and the online softmax of flash attention.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>
#include <limits>

#include "weft/tile/fragment.cuh"

namespace weft::tile {

inline constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// 2^x and log2(x) on the special-function unit (relative error about 2^-22; ex2(-inf) = 0). weft is not
// built with fast math, so exp2f / log2f would be the slower accurate forms.
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// 1 / x on the special-function unit (about 1 ulp); `1.f / x` without fast math is an IEEE division whose
// slow path is a subroutine call, and a call in a consumer caps its registers.
__device__ __forceinline__ float rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float lg2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Reductions over the 4 lanes of a quad (the lanes holding one accumulator row).
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Which of the thread's two rows register i belongs to: 0 for row r, 1 for row r + 8.
__host__ __device__ constexpr int row_half(int i) {
  return (i / 2) % 2;
}

// acc row h (of the thread's two) *= f[h].
template <int N>
__device__ __forceinline__ void scale_rows(AccumM64<N>& acc, const float (&f)[2]) {
#pragma unroll
  for (int i = 0; i < AccumM64<N>::kRegs; ++i) acc.d[i] *= f[row_half(i)];
}

// The 64 x N accumulator as the T (bf16 or fp16) A operand of N / 16 register-A MMAs (wgmma::mma_rs):
// k-step s uses a[4 s .. 4 s + 3]. The accumulator and the A operand share their layout, so register j of
// k-step s is the pair (d[8 s + 2 j], d[8 s + 2 j + 1]) rounded to T, the first in the lower half.
template <class T = __nv_bfloat16, int N>
__device__ __forceinline__ void pack_a(const AccumM64<N>& acc, uint32_t (&a)[N / 4]) {
#pragma unroll
  for (int j = 0; j < N / 4; ++j) a[j] = pack2<T>(acc.d[2 * j], acc.d[2 * j + 1]);
}

// The online softmax of a 64-row tile over key blocks of N columns (flash attention): the running row
// maxima of the raw scores and the running row sums of exp(scale * (score - max)), per thread for its two
// rows (sums are kept per thread and summed over the quad at the end). Rows that have seen only masked
// (-inf) scores keep max = -inf and sum = 0, and never produce NaN.
template <int N>
struct OnlineSoftmax {
  float max[2] = {kNegInf, kNegInf};
  float sum[2] = {0.f, 0.f};

  // Takes the raw scores of the next key block and turns them, in place, into P = exp(scale * (s - max))
  // with the updated maxima (scale_log2 = scale * log2(e)). `rescale[h]` is what the output rows
  // accumulated so far must be multiplied by (exp(scale * (old max - new max))).
  __device__ __forceinline__ void step(AccumM64<N>& s, float scale_log2, float (&rescale)[2]) {
    float shift[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float m = max[h];
#pragma unroll
      for (int i = 0; i < AccumM64<N>::kRegs; ++i)
        if (row_half(i) == h) m = fmaxf(m, s.d[i]);
      m = quad_max(m);
      // A row with no visible key yet: shift by 0, so exp2(-inf - 0) = 0 instead of NaN.
      shift[h] = m == kNegInf ? 0.f : m * scale_log2;
      rescale[h] = ex2(max[h] * scale_log2 - shift[h]);
      max[h] = m;
      sum[h] *= rescale[h];
    }
#pragma unroll
    for (int i = 0; i < AccumM64<N>::kRegs; ++i) {
      const int h = row_half(i);
      s.d[i] = ex2(fmaf(s.d[i], scale_log2, -shift[h]));
      sum[h] += s.d[i];
    }
  }

  // After the last block: the factor that normalises each output row (0 for a row that saw no key) and
  // the row's log-sum-exp in natural log (-inf for such a row); scale is the softmax scale.
  __device__ __forceinline__ void finish(float scale, float (&inv)[2], float (&lse)[2]) const {
    constexpr float kLn2 = 0.69314718055994530942f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float total = quad_sum(sum[h]);
      const bool any = total > 0.f;
      inv[h] = any ? rcp(total) : 0.f;
      lse[h] = any ? max[h] * scale + lg2(total) * kLn2 : kNegInf;
    }
  }
};

}  // namespace weft::tile
