// Warp-level tensor-core MMA (mma.sync m16n8k16, 16-bit inputs, fp32 accumulators) and the in-register 8x8
// transpose (movmatrix), for kernels whose tiles are too small for a warpgroup's wgmma: a decode step's 16
// query rows against a few tokens.
//
// Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k16"), lane = 4 g + c:
//   A (16 x 16, row):   a0 = (g, 2c..2c+1), a1 = (g + 8, 2c..2c+1), a2 = (g, 2c+8..2c+9), a3 = (g + 8,
//   2c+8..2c+9) B (16 x 8, col):    b0 = (k 2c..2c+1, n g), b1 = (k 2c+8..2c+9, n g) C (16 x 8, fp32):   c0,
//   c1 = (g, 2c..2c+1), c2, c3 = (g + 8, 2c..2c+1)
// Each 32-bit register holds two 16-bit elements, the lower index in the low half.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace weft::tile {

template <class T>
struct MmaType;
template <>
struct MmaType<__nv_bfloat16> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
};
template <>
struct MmaType<__half> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
};

// d += a . b for one 16 x 8 x 16 tile.
template <class T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#define WEFT_MMA_16816(TYPE)                                 \
  asm("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE \
      ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "            \
      "{%8, %9}, {%0, %1, %2, %3};"                          \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])       \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
  if constexpr (std::is_same_v<T, __half>)
    WEFT_MMA_16816("f16");
  else
    WEFT_MMA_16816("bf16");
#undef WEFT_MMA_16816
}

// The warp's 8 x 8 16-bit matrix, lane 4 g + c holding (g, 2c..2c+1), transposed: the lane then holds
// (2c, g) and (2c + 1, g) of the original.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

}  // namespace weft::tile
