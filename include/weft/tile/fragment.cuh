// Register tiles: the fp32 accumulator a warpgroup's 64 x N wgmma leaves in registers, and its conversion
// into a 128-byte-swizzled shared-memory tile (the staging buffer a TMA store reads).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "weft/tile/layout.cuh"
#include "weft/tile/warp_roles.cuh"

namespace weft::tile {

// 64 x N fp32, N / 2 floats per thread. Thread t of the warpgroup (warp w = t / 32, lane l) holds
//   d[i] = D[16 w + l / 4 + 8 ((i / 2) % 2)][8 (i / 4) + 2 (l % 4) + i % 2],
// i.e. for each 8-column group j: d[4j], d[4j+1] are two adjacent columns of row r, d[4j+2], d[4j+3] the
// same columns of row r + 8.
template <int N>
struct AccumM64 {
  static constexpr int kN = N;
  static constexpr int kRegs = N / 2;
  float d[kRegs];

  __device__ static int row(int i) { return 16 * warp_in_warpgroup() + lane_id() / 4 + 8 * ((i / 2) % 2); }
  __device__ static int col(int i) { return 8 * (i / 4) + 2 * (lane_id() % 4) + i % 2; }
};

// Two floats rounded (to nearest even) to a pair of T = bf16 or fp16, the first in the lower half.
template <class T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>, "bf16 or fp16 pairs");
  if constexpr (std::is_same_v<T, __half>) {
    const __half2 v = __floats2half2_rn(lo, hi);
    return reinterpret_cast<const uint32_t&>(v);
  } else {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return reinterpret_cast<const uint32_t&>(v);
  }
}
template <class T>
inline constexpr bool kIs16Bit = std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>;

// Staging tile for one chunk of output columns: 64 rows x 128 bytes (64 bf16 / fp16 or 32 f32 columns).
template <class OutT>
using OutChunk = Sw128Tile<OutT, 64, kSwizzleBytes / static_cast<int>(sizeof(OutT))>;

// Writes accumulator columns [kChunk * C, (kChunk + 1) * C) into `dst` (C = OutChunk<OutT>::kCols),
// converting to OutT (bf16, fp16: round to nearest even; or f32). Each warp writes 8-row groups whose 16-byte
// chunks land on distinct bank groups, so the stores are conflict-free. The caller makes the writes visible
// to TMA (fence_proxy_async_smem, then a barrier).
template <int kChunk, class OutT, int N>
__device__ __forceinline__ void store_accum_chunk(const AccumM64<N>& acc, OutChunk<OutT>& dst) {
  static_assert(kIs16Bit<OutT> || std::is_same_v<OutT, float>, "bf16, fp16 or f32 output");
  constexpr int kCols = OutChunk<OutT>::kCols;
  static_assert((kChunk + 1) * kCols <= N, "chunk past the accumulator");
  const uint32_t lane = static_cast<uint32_t>(lane_id());
  const uint32_t s = lane >> 2;  // row % 8 for both rows this thread holds
  const uint32_t row0 = 16u * static_cast<uint32_t>(warp_in_warpgroup()) + s;
  const uint32_t base = smem_addr(dst.bytes) + row0 * kSwizzleBytes;
  if constexpr (kIs16Bit<OutT>) {
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
      const int j = kChunk * 8 + jj;  // 8-column group of the accumulator
      const uint32_t off = ((static_cast<uint32_t>(jj) ^ s) << 4) + 4u * (lane & 3u);
      asm volatile("st.shared.b32 [%0], %1;" ::"r"(base + off),
                   "r"(pack2<OutT>(acc.d[4 * j], acc.d[4 * j + 1])));
      asm volatile("st.shared.b32 [%0], %1;" ::"r"(base + 8 * kSwizzleBytes + off),
                   "r"(pack2<OutT>(acc.d[4 * j + 2], acc.d[4 * j + 3])));
    }
  } else {
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      const int j = kChunk * 4 + jj;
      const uint32_t chunk16 = 2u * static_cast<uint32_t>(jj) + ((lane >> 1) & 1u);
      const uint32_t off = ((chunk16 ^ s) << 4) + 8u * (lane & 1u);
      asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(base + off), "f"(acc.d[4 * j]),
                   "f"(acc.d[4 * j + 1]));
      asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(base + 8 * kSwizzleBytes + off),
                   "f"(acc.d[4 * j + 2]), "f"(acc.d[4 * j + 3]));
    }
  }
}

// Row by row from registers, no shared memory: rows [0, rows) of the accumulator (rows past it are not
// written) to dst + row * row_stride, columns from 0, as T (bf16, fp16 or f32). For tiles whose rows a TMA
// box cannot cut off (a packed sequence's last rows). Ends converged: a warp-aligned instruction may follow.
template <class T, int N>
__device__ __forceinline__ void store_rows(const AccumM64<N>& acc, T* dst, int64_t row_stride, int rows) {
  static_assert(kIs16Bit<T> || std::is_same_v<T, float>, "bf16, fp16 or f32 output");
#pragma unroll
  for (int j = 0; j < N / 8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = AccumM64<N>::row(2 * h), col = AccumM64<N>::col(4 * j);
      if (row < rows) {
        T* p = dst + row * row_stride + col;
        if constexpr (std::is_same_v<T, float>)
          *reinterpret_cast<float2*>(p) = make_float2(acc.d[4 * j + 2 * h], acc.d[4 * j + 2 * h + 1]);
        else
          *reinterpret_cast<uint32_t*>(p) = pack2<T>(acc.d[4 * j + 2 * h], acc.d[4 * j + 2 * h + 1]);
      }
    }
  __syncwarp();
}

// run[row] = run[row] * a[h] + now[row] * b[h] for rows [0, rows) of an fp32 [rows, row_stride] array
// (h: which of the thread's two rows), the results also into `merged`. Ends converged.
template <int N>
__device__ __forceinline__ void merge_rows(float* run, int64_t row_stride, int rows, const AccumM64<N>& now,
                                           const float (&a)[2], const float (&b)[2], AccumM64<N>& merged) {
#pragma unroll
  for (int j = 0; j < N / 8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = AccumM64<N>::row(2 * h), col = AccumM64<N>::col(4 * j);
      const int i = 4 * j + 2 * h;
      float2 old = make_float2(0.f, 0.f);
      float2* p = reinterpret_cast<float2*>(run + row * row_stride + col);
      if (row < rows) old = *p;
      const float2 m = make_float2(old.x * a[h] + now.d[i] * b[h], old.y * a[h] + now.d[i + 1] * b[h]);
      if (row < rows) *p = m;
      merged.d[i] = m.x;
      merged.d[i + 1] = m.y;
    }
  __syncwarp();
}

}  // namespace weft::tile
