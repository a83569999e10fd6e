// The LCSC tile scheduler on the host: every tile exactly once, over any grid and order, and the fused
// reduce-scatter's order (M's parts dealt round-robin).
#include <cuda_runtime.h>  // __host__ / __device__ for the header below
#include <gtest/gtest.h>

#include <set>
#include <utility>
#include <vector>

#include "weft/lcsc/scheduler.cuh"

namespace {

using weft::lcsc::SchedulerParams;
using weft::lcsc::Tile;
using weft::lcsc::GemmTileScheduler;

// Each block's tiles in its order.
std::vector<std::vector<Tile>> walk(const SchedulerParams& p) {
  std::vector<std::vector<Tile>> blocks(p.compute_blocks);
  for (int b = 0; b < p.compute_blocks; ++b) {
    GemmTileScheduler s(p, b / p.cluster_m, b % p.cluster_m);
    Tile t;
    while (s.next(t)) blocks[b].push_back(t);
  }
  return blocks;
}

void expect_each_tile_once(const SchedulerParams& p) {
  std::set<std::pair<int, int>> seen;
  for (const auto& tiles : walk(p))
    for (const Tile& t : tiles) {
      EXPECT_TRUE(t.m >= 0 && t.m < p.tiles_m && t.n >= 0 && t.n < p.tiles_n) << t.m << "," << t.n;
      EXPECT_TRUE(seen.insert({t.m, t.n}).second) << "tile " << t.m << "," << t.n << " twice";
    }
  EXPECT_EQ(seen.size(), size_t(p.tiles_m) * p.tiles_n);
}

TEST(Scheduler, EveryTileOnceInEveryOrder) {
  for (int cluster : {1, 2})
    for (int tiles_m : {2, 8, 24, 64})
      for (int tiles_n : {1, 3, 32})
        for (int blocks : {2, 6, 132})
          for (int parts_log2 : {0, 1, 2})
            for (int start : {0, 5}) {
              SchedulerParams p;
              p.tiles_m = tiles_m;
              p.tiles_n = tiles_n;
              p.cluster_m = cluster;
              p.compute_blocks = blocks;
              p.start_unit = start;
              if (p.units_m() % (1 << parts_log2) != 0) continue;
              p.parts_log2 = parts_log2;
              SCOPED_TRACE(::testing::Message()
                           << "cluster " << cluster << " tiles " << tiles_m << "x" << tiles_n << " blocks "
                           << blocks << " parts 2^" << parts_log2 << " start " << start);
              expect_each_tile_once(p);
            }
}

TEST(Scheduler, DealtPartsShareEveryBand) {
  // 4 parts, none last: the first units of the walk (one per block) touch every part.
  SchedulerParams p;
  p.tiles_m = 64;
  p.tiles_n = 32;
  p.compute_blocks = 8;
  p.parts_log2 = 2;
  std::set<int> parts;
  for (const auto& tiles : walk(p)) parts.insert(tiles.front().m / 16);
  EXPECT_EQ(parts.size(), 4u);
}

}  // namespace
