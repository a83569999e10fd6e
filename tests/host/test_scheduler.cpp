// The LCSC tile scheduler on the host: every tile exactly once, over any grid and order, and the fused
// reduce-scatter's order (M's parts dealt round-robin); the grouped GEMM's live tiles, spread over the
// blocks.
#include <cuda_runtime.h>  // __host__ / __device__ for the header below
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <map>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "weft/lcsc/attention_scheduler.cuh"
#include "weft/lcsc/grouped_scheduler.cuh"
#include "weft/lcsc/owner_rounds_scheduler.cuh"
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

// The owners' rounds (Partials::kSummedInEpilogue): every rank takes every tile once, each owner's own tile
// at a later position than every peer's position of it (the epilogue that adds the peers' partials comes
// after them), and each full round sends one partial to every other owner.
TEST(OwnerRoundsScheduler, OwnTileAfterEveryPeersPartial) {
  using weft::lcsc::OwnerRoundsParams;
  using weft::lcsc::OwnerRoundsScheduler;
  using weft::lcsc::OwnerTile;
  for (int world : {1, 2, 3, 4, 8})
    for (int shard_tiles_m : {1, 3, 16})
      for (int tiles_n : {1, 5, 32})
        for (int delay : {0, 1, 7, 1000})
          for (int blocks : {1, 6, 132}) {
            SCOPED_TRACE(::testing::Message() << "world " << world << " shard tiles " << shard_tiles_m << "x"
                                              << tiles_n << " delay " << delay << " blocks " << blocks);
            std::vector<std::map<std::pair<int, int>, int>> position(world);  // per rank: tile -> position
            for (int r = 0; r < world; ++r) {
              OwnerRoundsParams p;
              p.world = world;
              p.rank = r;
              p.shard_tiles_m = shard_tiles_m;
              p.tiles_m = world * shard_tiles_m;
              p.tiles_n = tiles_n;
              p.delay = delay;
              p.group_m = 4;
              p.compute_blocks = blocks;
              for (const auto& tiles : walk_blocks<OwnerRoundsScheduler>(p, 1))
                for (const OwnerTile& t : tiles) {
                  EXPECT_TRUE(t.m >= 0 && t.m < p.tiles_m && t.n >= 0 && t.n < tiles_n) << t.m << "," << t.n;
                  EXPECT_EQ(t.owner, t.m / shard_tiles_m);
                  EXPECT_TRUE(position[r].emplace(std::pair{t.m, t.n}, t.unit).second) << "tile twice";
                }
              EXPECT_EQ(position[r].size(), size_t(p.tiles_m) * tiles_n);
              // The first min(delay, T) rounds hold the peers' tiles only: each sends one partial to every
              // other owner.
              const int peer_rounds = world > 1 ? std::min(delay, p.shard_tiles()) : 0;
              for (int t = 0; t < peer_rounds; ++t) {
                std::set<int> owners;
                for (int j = 0; j < world - 1; ++j) {
                  int owner, k;
                  OwnerRoundsScheduler::place(p, t * (world - 1) + j, owner, k);
                  EXPECT_EQ(k, t);
                  owners.insert(owner);
                }
                EXPECT_EQ(int(owners.size()), world - 1);
                EXPECT_EQ(owners.count(r), 0u);
              }
            }
            for (int o = 0; o < world; ++o)
              for (const auto& [tile, own] : position[o]) {
                if (tile.first / shard_tiles_m != o) continue;
                for (int r = 0; r < world; ++r)
                  if (r != o) EXPECT_LT(position[r].at(tile), own) << "rank " << r << " after owner " << o;
              }
          }
}

namespace {

// Five sequences of three heads, 8 blocks at most; packed: rows of 64 per block, 5, 1, 8, 3 and 0 blocks.
const std::vector<int> kFiveBegin = {0, 317, 318, 830, 1023}, kFiveEnd = {317, 318, 830, 980, 1023};
AttentionSchedulerParams five_sequences(bool packed, bool heads_outer, int blocks, int section_pairs) {
  AttentionSchedulerParams p;
  p.heads_outer = heads_outer;
  p.batch = 5;
  p.heads = 3;
  p.q_blocks = 8;
  if (packed) {
    p.row_begin = kFiveBegin.data();
    p.row_end = kFiveEnd.data();
    p.block_rows = 64;
  }
  p.compute_blocks = blocks;
  p.section_pairs = section_pairs;
  return p;
}

}  // namespace

TEST(AttentionScheduler, EveryItemOnceWithVariableLengths) {
  const std::vector<int> blocks_of = {5, 1, 8, 3, 0};
  for (int order = 0; order < 4; ++order)
    for (bool packed : {false, true})
      for (int blocks : {1, 3, 7, 132})
        for (int section_pairs : {0, 1, 5, 15, 40}) {  // 15 = every pair; 5 leaves a short last section
          AttentionSchedulerParams p = five_sequences(packed, order & 2, blocks, section_pairs);
          p.paired = order & 1;
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

namespace {

// Whether persistent blocks that each run their items in order finish them all when item (b, h, n) cannot
// finish before item (b, h, n + 1) has (where both exist): the deterministic attention backward's dQ turns
// (each key block's adds wait for the later key blocks' adds into the same query block).
bool runs_to_the_end_waiting_for_the_next_block(const std::vector<std::vector<AttentionWork>>& blocks,
                                                const std::set<std::tuple<int, int, int>>& items) {
  std::set<std::tuple<int, int, int>> done;
  std::vector<size_t> next(blocks.size(), 0);
  for (bool moved = true; moved;) {
    moved = false;
    for (size_t c = 0; c < blocks.size(); ++c)
      while (next[c] < blocks[c].size()) {
        const AttentionWork& w = blocks[c][next[c]];
        const std::tuple<int, int, int> after{w.batch, w.head, w.q_block + 1};
        if (items.count(after) && !done.count(after)) break;
        done.insert({w.batch, w.head, w.q_block});
        ++next[c];
        moved = true;
      }
  }
  return done.size() == items.size();
}

// The schedules both reversed-order tests walk: five sequences, packed or not, heads outer or not, over a
// range of blocks and section sizes, forward and reversed; fn(params, blocks, label).
template <class Fn>
void for_each_reversible_schedule(Fn fn) {
  for (bool reversed : {true, false})
    for (bool packed : {false, true})
      for (bool heads_outer : {false, true})
        for (int blocks : {1, 2, 3, 7, 132})
          for (int section_pairs : {0, 1, 5}) {
            AttentionSchedulerParams p = five_sequences(packed, heads_outer, blocks, section_pairs);
            p.reversed = reversed;
            const std::string label = std::to_string(blocks) + " blocks, sections of " +
                                      std::to_string(section_pairs) + (packed ? ", packed" : "") +
                                      (heads_outer ? ", heads outer" : "");
            fn(p, blocks, label);
          }
}

}  // namespace

// Reversed: every item once, a pair's blocks last first; with waits on the next block, the blocks always run
// to the end (the same waits in the forward order can leave every block waiting).
TEST(AttentionScheduler, ReversedRunsWaitsOnLaterBlocksToTheEnd) {
  bool forward_stuck = false;
  for_each_reversible_schedule([&](const AttentionSchedulerParams& p, int, const std::string& label) {
    const bool packed = p.row_begin != nullptr;
    const auto walked = walk_attention(p);
    std::set<std::tuple<int, int, int>> items;
    for (const auto& block : walked)
      for (const AttentionWork& w : block) {
        EXPECT_TRUE(items.insert({w.batch, w.head, w.q_block}).second) << "an item twice";
        if (!p.reversed) continue;
        for (const AttentionWork& earlier : block)  // a pair's later blocks before its earlier ones
          if (&earlier == &w)
            break;
          else if (earlier.batch == w.batch && earlier.head == w.head)
            EXPECT_GT(earlier.q_block, w.q_block);
      }
    EXPECT_EQ(items.size(), size_t(p.heads) * (packed ? 5 + 1 + 8 + 3 : p.batch * p.q_blocks));
    const bool finished = runs_to_the_end_waiting_for_the_next_block(walked, items);
    if (p.reversed)
      EXPECT_TRUE(finished) << label;
    else
      forward_stuck |= !finished;
  });
  EXPECT_TRUE(forward_stuck) << "the check never fails: it does not test the order";
}

// Claimed units (AttentionScheduler::at, as lcsc::ClaimedTiles takes them: each free block claims the next
// unit, blocks of random speed): the same items as next()'s walk, each once, units past a sequence's end
// skipped, each block's iteration count; reversed, a pair's later blocks claimed before its earlier ones, and
// the blocks always run to the end when each item waits for the pair's next block. (Claims out of unit
// order can leave every block waiting: the check can fail.)
TEST(AttentionScheduler, ClaimedUnitsRunToTheEndInEveryTiming) {
  std::mt19937 rng(7);
  bool out_of_order_stuck = false;
  for_each_reversible_schedule([&](const AttentionSchedulerParams& p, int blocks, const std::string& label) {
    std::set<std::tuple<int, int, int>> walked;
    for (const auto& block : walk_attention(p))
      for (const AttentionWork& w : block) walked.insert({w.batch, w.head, w.q_block});
    for (int timing = 0; timing < 20; ++timing) {
      // Each block's scheduler sees only its own claims (its iteration count), as on the GPU.
      std::vector<AttentionScheduler> scheds;
      for (int b = 0; b < blocks; ++b) scheds.emplace_back(p, b, 0);
      std::vector<std::vector<AttentionWork>> claimed(blocks);
      std::vector<int> free_at(blocks, 0);
      std::set<std::tuple<int, int, int>> items;
      for (int u = 0; u < scheds[0].units(); ++u) {
        const int b = int(std::min_element(free_at.begin(), free_at.end()) - free_at.begin());
        AttentionWork w;
        if (!scheds[b].at(u, w)) continue;
        EXPECT_EQ(w.iteration, int(claimed[b].size()));
        EXPECT_TRUE(items.insert({w.batch, w.head, w.q_block}).second) << "an item twice";
        if (p.reversed)
          for (const auto& other : claimed)
            for (const AttentionWork& earlier : other)
              if (earlier.batch == w.batch && earlier.head == w.head) EXPECT_GT(earlier.q_block, w.q_block);
        claimed[b].push_back(w);
        free_at[b] += 1 + int(rng() % 10);
      }
      EXPECT_EQ(items, walked);
      if (p.reversed) EXPECT_TRUE(runs_to_the_end_waiting_for_the_next_block(claimed, items)) << label;
    }
    if (p.reversed && blocks > 1) {  // the same units claimed last first, dealt round robin
      AttentionScheduler sched(p, 0, 0);
      std::vector<std::vector<AttentionWork>> backwards(blocks);
      std::set<std::tuple<int, int, int>> items;
      for (int u = sched.units() - 1, n = 0; u >= 0; --u) {
        AttentionWork w;
        if (!sched.at(u, w)) continue;
        backwards[n++ % blocks].push_back(w);
        items.insert({w.batch, w.head, w.q_block});
      }
      out_of_order_stuck |= !runs_to_the_end_waiting_for_the_next_block(backwards, items);
    }
  });
  EXPECT_TRUE(out_of_order_stuck) << "the check never fails: it does not test the claim order";
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

// ---- the grouped GEMM's scheduler ----------------------------------------------------------------------

namespace {

using weft::lcsc::GroupedSchedulerParams;
using weft::lcsc::GroupTile;
using Grouped = weft::lcsc::GroupedTileScheduler<128>;

// Groups of whole 128-row tiles: group e spans tile rows [sum of spans before e, + span[e]), and counts
// rows[e] rows (any value: negative, 0, past its span).
struct Groups {
  std::vector<int32_t> end, rows;
  Groups(const std::vector<int>& spans, const std::vector<int32_t>& counts) : rows(counts) {
    int32_t at = 0;
    for (int s : spans) end.push_back(at += 128 * s);
  }
  GroupedSchedulerParams params(int tiles_m, int tiles_n, int blocks, bool counted) const {
    GroupedSchedulerParams p;
    p.tiles_m = tiles_m;
    p.tiles_n = tiles_n;
    p.compute_blocks = blocks;
    p.group_end = end.data();
    p.group_rows = counted ? rows.data() : nullptr;
    p.groups = static_cast<int>(end.size());
    return p;
  }
};

std::vector<std::vector<GroupTile>> walk_grouped(const GroupedSchedulerParams& p) {
  Grouped::Storage storage{};
  Grouped::prepare(p, storage);
  std::vector<std::vector<GroupTile>> blocks(p.compute_blocks);
  for (int b = 0; b < p.compute_blocks; ++b) {
    Grouped s(p, storage, b, 0);
    GroupTile t;
    while (s.next(t)) blocks[b].push_back(t);
  }
  return blocks;
}

// The tiles holding counted rows, by the definition: tile row m of the capacity in group e's span, its first
// row less than group_rows[e] past the group's first row. Each with its group.
std::map<std::pair<int, int>, int> live_tiles(const GroupedSchedulerParams& p) {
  std::map<std::pair<int, int>, int> live;
  for (int e = 0, begin = 0; e < p.groups; begin = p.group_end[e++])
    for (int m = begin / 128; m < std::min(p.group_end[e] / 128, p.tiles_m); ++m)
      if (m * 128 - begin < p.group_rows[e])
        for (int n = 0; n < p.tiles_n; ++n) live[{m, n}] = e;
  return live;
}

}  // namespace

// Without group_rows: GemmTileScheduler's walk of the capacity, tile for tile, block for block.
TEST(GroupedScheduler, WithoutCountsWalksTheCapacityAsGemmTileScheduler) {
  const Groups g({2, 0, 5, 1}, {0, 0, 0, 0});
  for (int tiles_m : {8, 10})
    for (int tiles_n : {1, 3})
      for (int blocks : {1, 5, 132})
        for (int start : {0, 7}) {
          GroupedSchedulerParams p = g.params(tiles_m, tiles_n, blocks, false);
          p.start_unit = start;
          p.group_m = start ? 3 : 16;
          const auto grouped = walk_grouped(p);
          const auto plain = walk(p);
          ASSERT_EQ(grouped.size(), plain.size());
          for (size_t b = 0; b < plain.size(); ++b) {
            ASSERT_EQ(grouped[b].size(), plain[b].size());
            for (size_t i = 0; i < plain[b].size(); ++i) {
              EXPECT_EQ(grouped[b][i].m, plain[b][i].m);
              EXPECT_EQ(grouped[b][i].n, plain[b][i].n);
              EXPECT_EQ(grouped[b][i].unit, plain[b][i].unit);
              EXPECT_EQ(grouped[b][i].iteration, plain[b][i].iteration);
              EXPECT_EQ(grouped[b][i].group, -1);
            }
          }
        }
}

// With group_rows: every tile holding counted rows exactly once, with its group, and no other tile; the
// blocks' shares differ by at most one tile. Groups of 0 to 5 tile rows, counts of none, some, all and more
// than the span; a capacity that ends inside the groups; up to 1000 groups (several a chunk of the table).
TEST(GroupedScheduler, CountedWalksEveryLiveTileOnceEvenly) {
  std::mt19937 rng(2024);
  for (int groups : {1, 3, 64, 128, 129, 300, 1000})
    for (int trial = 0; trial < 3; ++trial) {
      std::vector<int> spans(groups);
      std::vector<int32_t> counts(groups);
      int tiles = 0;
      for (int e = 0; e < groups; ++e) {
        spans[e] = static_cast<int>(rng() % 6);
        const int32_t span_rows = 128 * spans[e];
        const int32_t pick[] = {
            0, 1, 127, 128, 129, span_rows, span_rows + 5, -3, static_cast<int32_t>(rng() % (span_rows + 1))};
        counts[e] = pick[rng() % 9];
        tiles += spans[e];
      }
      const Groups g(spans, counts);
      for (int tiles_m : {tiles, tiles * 3 / 4 + 1})
        for (int tiles_n : {1, 3, 8})
          for (int blocks : {1, 7, 132})
            for (int start : {0, 5}) {
              GroupedSchedulerParams p = g.params(tiles_m, tiles_n, blocks, true);
              p.start_unit = start;
              p.group_m = start ? 3 : 16;
              SCOPED_TRACE(::testing::Message() << groups << " groups (trial " << trial << "), tiles "
                                                << tiles_m << "x" << tiles_n << ", " << blocks << " blocks");
              const auto want = live_tiles(p);
              std::set<std::pair<int, int>> seen;
              size_t most = 0, least = SIZE_MAX;
              for (const auto& block : walk_grouped(p)) {
                int iteration = 0;
                for (const GroupTile& t : block) {
                  const auto it = want.find({t.m, t.n});
                  ASSERT_TRUE(it != want.end()) << "tile " << t.m << "," << t.n << " holds no counted row";
                  EXPECT_EQ(t.group, it->second) << "tile " << t.m << "," << t.n;
                  EXPECT_TRUE(seen.insert({t.m, t.n}).second) << "tile " << t.m << "," << t.n << " twice";
                  EXPECT_EQ(t.iteration, iteration++);
                }
                most = std::max(most, block.size());
                least = std::min(least, block.size());
              }
              EXPECT_EQ(seen.size(), want.size());
              EXPECT_LE(most - least, 1u);
            }
    }
}

// The decode case of a low-latency dispatch (4 ranks x 128 tokens: groups of 512 rows, 4 tile rows; 16 rows
// counted in each of 64 groups; 8 tile columns; 132 blocks). Walking the capacity, the live tile rows are
// every 4th, so are the live units, and block c takes units c mod 132: only the 33 blocks c = 0 mod 4 meet a
// live tile, 15 or 16 each. Walking the live tiles, every block takes 3 or 4. The dispatch of record's
// layout (the same counts packed, a group of one tile row each, the capacity a worst case past them) walks
// its live tiles first in the capacity order: no skew there.
TEST(GroupedScheduler, FixedCapacityGroupsReachEveryBlock) {
  const int groups = 64, blocks = 132, tiles_n = 8;
  // The live tiles each block takes (those holding counted rows, by the definition), walking the capacity
  // (counted false) or the live tiles.
  auto shares = [&](const Groups& g, int tiles_m, bool counted) {
    const auto live = live_tiles(g.params(tiles_m, tiles_n, blocks, true));
    std::vector<int> share;
    for (const auto& block : walk_grouped(g.params(tiles_m, tiles_n, blocks, counted))) {
      int n = 0;
      for (const GroupTile& t : block) n += live.count({t.m, t.n}) ? 1 : 0;
      share.push_back(n);
    }
    return share;
  };
  auto busy = [](const std::vector<int>& share) {
    return static_cast<int>(std::count_if(share.begin(), share.end(), [](int n) { return n > 0; }));
  };
  auto most = [](const std::vector<int>& share) { return *std::max_element(share.begin(), share.end()); };
  auto least = [](const std::vector<int>& share) { return *std::min_element(share.begin(), share.end()); };

  const Groups fixed(std::vector<int>(groups, 4), std::vector<int32_t>(groups, 16));
  const std::vector<int> capacity = shares(fixed, 4 * groups, false), live = shares(fixed, 4 * groups, true);
  EXPECT_EQ(busy(capacity), 33);
  EXPECT_EQ(most(capacity), 16);
  EXPECT_EQ(busy(live), blocks);
  EXPECT_EQ(least(live), 3);
  EXPECT_EQ(most(live), 4);
  const Groups packed(std::vector<int>(groups, 1), std::vector<int32_t>(groups, 16));
  const std::vector<int> record = shares(packed, 96, false);
  EXPECT_EQ(busy(record), blocks);
  EXPECT_LE(most(record) - least(record), 1);
  std::printf(
      "  64 groups of 4 tile rows, 16 rows counted each, 8 tile columns, 132 blocks: walking the capacity "
      "%d blocks meet live tiles (at most %d each); walking the live tiles %d blocks, %d-%d each; "
      "the record's packed groups in the capacity's walk: %d blocks, %d-%d each\n",
      busy(capacity), most(capacity), busy(live), least(live), most(live), busy(record), least(record),
      most(record));
}
