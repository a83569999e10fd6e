// weft::gemm's tile width rule (src/ops/tile_width.hpp): the cases bench/RESULTS.md's tables were taken
// at, so that a change of the rule shows here.
#include <gtest/gtest.h>

#include "ops/tile_width.hpp"

using weft::ops::auto_tile_n;

TEST(TileWidth, WideTilesWhereTheyFillTheWaves) {
  EXPECT_EQ(auto_tile_n(8192, 8192, 132), 256);   // 16 waves of wide tiles or 32 of narrow, 97% busy
  EXPECT_EQ(auto_tile_n(2048, 28672, 132), 256);  // 14 waves or 28, 97% busy
  EXPECT_EQ(auto_tile_n(16384, 2048, 116), 256);  // 1024 tiles on 116 blocks: 8.8 of 9 waves busy
  EXPECT_EQ(auto_tile_n(1024, 120, 116), 256);    // N <= 128: one column of tiles either way
}

TEST(TileWidth, NarrowTilesWherePartialWavesWouldIdleBlocks) {
  EXPECT_EQ(auto_tile_n(256, 8192, 132), 128);   // 64 wide tiles would leave half the SMs idle
  EXPECT_EQ(auto_tile_n(8192, 2048, 116), 128);  // 512 wide tiles take 5 waves with 4.4 busy, 1024
                                                 // narrow ones 9 with 8.8
  EXPECT_EQ(auto_tile_n(4096, 2048, 116), 128);  // 256 wide tiles: 3 waves, 2.2 busy
}
