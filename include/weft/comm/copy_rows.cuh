// Copying rows of 16-byte vectors by one warp, to this GPU or a peer's: an L2 prefetch of the source rows,
// then a copy with four loads in flight per lane. Neither orders anything: publish with a release signal
// after the warp's stores (e.g. __syncwarp, then lane 0's signal_add).
#pragma once
#include <cstdint>

namespace weft {

// Starts pulling rows [r0, r1) of src ([rows][row_vecs] 16-byte vectors) into L2, by lane 0: an
// asynchronous bulk prefetch that takes no registers, so the copy loops that follow find their lines in L2
// instead of waiting on DRAM for each 2 KiB a copying warp (24 registers) can have in flight.
__device__ inline void prefetch_rows_l2(const uint4* src, int r0, int r1, int rows, int row_vecs, int lane) {
  const int64_t valid = int64_t(max(0, min(r1, rows) - r0)) * row_vecs;
  if (lane == 0 && valid > 0)
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src + int64_t(r0) * row_vecs),
                 "r"(static_cast<uint32_t>(valid * 16))
                 : "memory");
}

// Rows [r0, r1) of src ([rows][row_vecs] 16-byte vectors; zeros from row `rows` on) to dst (already offset
// to row r0), by one warp.
__device__ inline void warp_copy_rows(const uint4* src, uint4* dst, int r0, int r1, int rows, int row_vecs,
                                      int lane) {
  const int64_t n = int64_t(r1 - r0) * row_vecs, valid = int64_t(max(0, min(r1, rows) - r0)) * row_vecs;
  const uint4* from = src + int64_t(r0) * row_vecs;
  int64_t i = lane;
  for (; i + 96 < valid; i += 128) {  // 4 loads in flight per lane
    uint4 v[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) v[q] = from[i + 32 * q];
#pragma unroll
    for (int q = 0; q < 4; ++q) dst[i + 32 * q] = v[q];
  }
  for (; i < valid; i += 32) dst[i] = from[i];
  for (; i < n; i += 32) dst[i] = make_uint4(0, 0, 0, 0);
}

}  // namespace weft
