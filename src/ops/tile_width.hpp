// weft::gemm's tile width, 128 x 256 or 128 x 128, from how well each fills its blocks' waves (internal to
// src/ops; all_gather_matmul's fused kernel does not use it: src/ops/fused.cu launch_ag says why).
#pragma once
#include <cstdint>

namespace weft::ops {

// 128 x 256 unless 128 x 128 tiles fill the blocks' waves better by more than their lower rate (one H200,
// weft-bench gemm "tile width": the narrow tile ran large problems at 0.994-0.998 of the wide one's rate,
// and small or narrow ones up to 1.9x faster, e.g. 256 x 8192 x 8192 49.0 vs 87.0 us). `blocks`: the
// blocks computing tiles (the SMs, less any communicator blocks).
inline int auto_tile_n(int64_t m, int64_t n, int blocks) {
  constexpr double kNarrowRate = 0.97;
  // Busy share of the block-slots the tiles take: tiles / (waves x blocks).
  auto fill = [&](int64_t tile_n) {
    const int64_t tiles = ((m + 127) / 128) * ((n + tile_n - 1) / tile_n);
    return double(tiles) / double((tiles + blocks - 1) / blocks * blocks);
  };
  return kNarrowRate * fill(128) > fill(256) ? 128 : 256;
}

}  // namespace weft::ops
