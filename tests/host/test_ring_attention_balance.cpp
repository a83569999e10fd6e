// The ring attention forward's work spread over its persistent blocks, on the host: a rank's pass
// (ring_pass_of), its segments in the launchers' order (ring_segment_order), the scheduler configured as the
// launcher configures it (ring_section_pairs) and every item costed in key blocks over its W steps
// (key_blocks, as the loader counts them) plus a fixed cost per item. The busiest block bounds the kernel: it
// must stay near the mean in the causal (zigzag) passes, whose segments differ in cost up to six-fold.
#include <cuda_runtime.h>  // __host__ / __device__ for the scheduler's header
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "ops/ring_attention_plan.hpp"
#include "weft/lcsc/attention_scheduler.cuh"
#include "weft/ops/attention_types.hpp"

namespace {

using weft::lcsc::AttentionScheduler;
using weft::lcsc::AttentionSchedulerParams;
using weft::lcsc::AttentionWork;
using namespace weft::ops;

constexpr int kBlockRows = 128;    // the D = 128 forward's query rows a block
constexpr double kItemCost = 1.6;  // an item's fixed cost in key blocks (timeline fits, RESULTS)
constexpr int kSms = 132;

struct Spread {
  double busiest, mean, ideal;  // ideal: the whole work over every SM
};

// Rank r's forward with `heads` query heads over `kv_heads`, sections of up to `wanted` pairs chosen as the
// launcher chooses them (old: true, the section capped at every pair only).
Spread forward_spread(int world, int r, int64_t tokens_per_rank, bool causal, int heads, int kv_heads,
                      int64_t wanted, bool old) {
  const RingLayout L = ring_layout({tokens_per_rank * world}, world, causal);
  const RingPass pass = ring_pass_of(L, r);
  const std::vector<int64_t> order = ring_segment_order(pass);
  const int64_t G = pass.segments();
  AttentionSchedulerParams p;
  p.batch = static_cast<int>(G);
  p.heads = heads;
  int64_t longest = 0;
  for (int64_t x = 0; x < G; ++x) longest = std::max(longest, pass.own_end[x] - pass.own_begin[x]);
  p.q_blocks = static_cast<int>((longest + kBlockRows - 1) / kBlockRows);
  p.paired = causal;
  const int64_t capped = std::min<int64_t>(wanted, G * heads);
  p.section_pairs = static_cast<int>(old ? capped : ring_section_pairs(capped, heads, G, heads / kv_heads));
  p.compute_blocks = static_cast<int>(std::min<int64_t>(kSms, p.units()));
  double most = 0, total = 0;
  for (int c = 0; c < p.compute_blocks; ++c) {
    AttentionScheduler s(p, c, 0);
    double cost = 0;
    for (AttentionWork w; s.next(w);) {
      const int64_t x = order[w.batch], q_len = pass.own_end[x] - pass.own_begin[x];
      if (int64_t(w.q_block) * kBlockRows >= q_len) continue;
      cost += kItemCost;
      for (int step = 0; step < pass.steps; ++step) {
        const int64_t k_len = pass.met_end[x * pass.steps + step] - pass.met_begin[x * pass.steps + step];
        cost += key_blocks(w.q_block, kBlockRows, static_cast<int>(q_len), static_cast<int>(k_len),
                           pass.causal && step == 0)
                    .end;
      }
    }
    most = std::max(most, cost);
    total += cost;
  }
  return {most, total / p.compute_blocks, total / kSms};
}

}  // namespace

TEST(RingAttentionBalance, SegmentsRunHeaviestFirstAndTheBlocksEndTogether) {
  // L2 sections as the forward's launcher sizes them for the L2 of an H100 (50 MB) and of an H200 (60 MB):
  // 2/3 of it over a GQA group's K / V of all W ranks, in query-head pairs.
  for (int64_t l2 : {50LL << 20, 60LL << 20})
    for (int world : {2, 3, 4, 8})
      for (int64_t tokens : {2048, 8192, 32768})
        for (bool causal : {true, false}) {
          const int heads = 32, kv_heads = 8, group = heads / kv_heads;
          const int64_t slot_rows = tokens, kv_bytes_per_group = 2 * slot_rows * world * 128 * 2;
          const int64_t wanted = std::max<int64_t>(1, l2 * 2 / 3 / kv_bytes_per_group) * group;
          double worst_new = 0, worst_old = 0, over_ideal = 0;
          for (int r = 0; r < world; ++r) {
            const Spread s = forward_spread(world, r, tokens, causal, heads, kv_heads, wanted, false);
            const Spread o = forward_spread(world, r, tokens, causal, heads, kv_heads, wanted, true);
            worst_new = std::max(worst_new, s.busiest / s.mean);
            worst_old = std::max(worst_old, o.busiest / o.mean);
            over_ideal = std::max(over_ideal, s.busiest / s.ideal);
          }
          std::printf(
              "  L2 %lld MiB, W %d, %6lld tokens a rank, %s: busiest block / mean %.3f (sections across "
              "segments: %.3f), "
              "/ the work over every SM %.3f\n",
              static_cast<long long>(l2 >> 20), world, static_cast<long long>(tokens),
              causal ? "causal    " : "not causal", worst_new, worst_old, over_ideal);
          // Few units a block (2k tokens: two) leave one unit's rounding; more units, less.
          EXPECT_LE(worst_new, tokens <= 2048 ? 1.30 : 1.12) << "W " << world << " tokens " << tokens;
          EXPECT_LE(worst_new, worst_old + 1e-9) << "W " << world << " tokens " << tokens;
        }
}
