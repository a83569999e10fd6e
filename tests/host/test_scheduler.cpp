// The LCSC tile scheduler on the host: every tile exactly once, over any grid and order, and the fused
// reduce-scatter's order (M's parts dealt round-robin).
#include <cuda_runtime.h>  // __host__ / __device__ for the header below
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

#include "weft/lcsc/attention_scheduler.cuh"
#include "weft/lcsc/scheduler.cuh"

namespace {

using weft::lcsc::GemmTileScheduler;
using weft::lcsc::SchedulerParams;
using weft::lcsc::Tile;

// Each block's work items in its order, as the LCSC kernel walks them (clusters of `cluster` blocks).
template <class Scheduler>
std::vector<std::vector<typename Scheduler::Work>> walk_blocks(const typename Scheduler::Params& p,
                                                               int cluster) {
  std::vector<std::vector<typename Scheduler::Work>> blocks(Scheduler::compute_blocks(p));
  for (int b = 0; b < Scheduler::compute_blocks(p); ++b) {
    Scheduler s(p, b / cluster, b % cluster);
    typename Scheduler::Work w;
    while (s.next(w)) blocks[b].push_back(w);
  }
  return blocks;
}
std::vector<std::vector<Tile>> walk(const SchedulerParams& p) {
  return walk_blocks<GemmTileScheduler>(p, p.cluster_m);
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

// ---- the attention scheduler ---------------------------------------------------------------------------

namespace {

using weft::lcsc::AttentionScheduler;
using weft::lcsc::AttentionSchedulerParams;
using weft::lcsc::AttentionWork;

std::vector<std::vector<AttentionWork>> walk_attention(const AttentionSchedulerParams& p) {
  return walk_blocks<AttentionScheduler>(p, 1);
}

}  // namespace

TEST(AttentionScheduler, EveryItemOnceWithVariableLengths) {
  // Packed rows of five sequences, 64 rows per block: 5, 1, 8, 3 and 0 blocks (the longest is 8).
  const std::vector<int> begin = {0, 317, 318, 830, 1023}, end = {317, 318, 830, 980, 1023};
  const std::vector<int> blocks_of = {5, 1, 8, 3, 0};
  for (int order = 0; order < 4; ++order)
    for (bool packed : {false, true})
      for (int blocks : {1, 3, 7, 132})
        for (int section_pairs : {0, 1, 5, 15, 40}) {  // 15 = every pair; 5 leaves a short last section
          const bool paired = order & 1;
          AttentionSchedulerParams p;
          p.heads_outer = order & 2;
          p.batch = 5;
          p.heads = 3;
          p.q_blocks = 8;
          if (packed) {
            p.row_begin = begin.data();
            p.row_end = end.data();
            p.block_rows = 64;
          }
          p.paired = paired;
          p.compute_blocks = blocks;
          p.section_pairs = section_pairs;
          std::set<std::tuple<int, int, int>> seen;
          for (const auto& items : walk_attention(p)) {
            int iteration = 0;
            for (const AttentionWork& w : items) {
              const int count = packed ? blocks_of[w.batch] : p.q_blocks;
              EXPECT_TRUE(w.batch >= 0 && w.batch < p.batch && w.head >= 0 && w.head < p.heads &&
                          w.q_block >= 0 && w.q_block < count);
              EXPECT_TRUE(seen.insert({w.batch, w.head, w.q_block}).second) << "an item twice";
              EXPECT_EQ(w.iteration, iteration++);
            }
          }
          EXPECT_EQ(seen.size(), size_t(p.heads) * (packed ? 5 + 1 + 8 + 3 : p.batch * p.q_blocks));
        }
}

// Heads outer, sections of one head's pairs: every block takes its items head after head.
TEST(AttentionScheduler, HeadsOuterRunsHeadAfterHead) {
  const std::vector<int> begin = {0, 317, 318, 830}, end = {317, 318, 830, 980};
  for (bool paired : {false, true})
    for (int blocks : {1, 5, 16, 132}) {
      AttentionSchedulerParams p;
      p.batch = 4;
      p.heads = 6;
      p.q_blocks = 8;
      p.row_begin = begin.data();
      p.row_end = end.data();
      p.block_rows = 64;
      p.paired = paired;
      p.heads_outer = true;
      p.compute_blocks = blocks;
      p.section_pairs = p.batch;
      int items = 0;
      for (const auto& block : walk_attention(p)) {
        for (size_t i = 1; i < block.size(); ++i) EXPECT_LE(block[i - 1].head, block[i].head);
        items += static_cast<int>(block.size());
      }
      EXPECT_EQ(items, p.heads * (5 + 1 + 8 + 3));
    }
}

// Causal: query block j costs j + 1 key blocks. Paired (block j with block count - 1 - j as one unit), the
// persistent blocks' totals differ by at most one unit (count + 1 key blocks) whatever the section size
// when the count is even; in order, by far more.
TEST(AttentionScheduler, CausalPairsBalanceTheBlocks) {
  struct Shape {
    int batch, heads, q_blocks;
  };
  for (Shape s : {Shape{1, 32, 64}, Shape{4, 16, 32}, Shape{8, 64, 16}, Shape{2, 8, 128}, Shape{16, 16, 7}})
    for (bool paired : {true, false})
      for (int section_pairs : {0, 1, 3, 16}) {
        AttentionSchedulerParams p;
        p.batch = s.batch;
        p.heads = s.heads;
        p.q_blocks = s.q_blocks;
        p.paired = paired;
        p.compute_blocks = 132;
        p.section_pairs = section_pairs;
        int64_t most = 0, least = INT64_MAX, total = 0;
        for (const auto& items : walk_attention(p)) {
          int64_t cost = 0;
          for (const AttentionWork& w : items) cost += w.q_block + 1;
          most = std::max(most, cost);
          least = std::min(least, cost);
          total += cost;
        }
        const double mean = double(total) / p.compute_blocks;
        // An odd count leaves a middle block as a unit of half the cost: within 20% of the mean then (the
        // 7-block shape with sections of 3 pairs: 1.18).
        if (paired && s.q_blocks % 2 == 0)
          EXPECT_LE(most - least, s.q_blocks + 1) << s.batch << "x" << s.heads << "x" << s.q_blocks;
        if (paired) EXPECT_LE(most / mean, 1.2) << s.batch << "x" << s.heads << "x" << s.q_blocks;
        std::printf("  causal %dx%dx%d %s, sections of %d pairs: busiest block %.3f of the mean\n", s.batch,
                    s.heads, s.q_blocks, paired ? "paired  " : "in order", section_pairs, most / mean);
      }
}
