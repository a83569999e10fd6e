// Ring attention's layout and schedule (src/ops/ring_attention_plan.hpp): every query-key pair that attention
// over the whole sequence computes is computed exactly once over all ranks and steps (brute force on small
// sequences of several documents, any lengths), the ranks' rows partition the tokens, and zigzag keeps every
// step's work even.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <utility>

#include "ops/ring_attention_plan.hpp"

using weft::ops::RingBlock;
using weft::ops::RingLayout;
using weft::ops::RingMask;
using weft::ops::RingStep;

namespace {

// Counts, for every (query token, key token) of the packed sequence, how often the schedules of all ranks
// compute it, and checks the counts against attention over the whole sequence.
void expect_every_pair_once(const std::vector<int64_t>& docs, int W, bool causal, bool zigzag = true) {
  const RingLayout L = weft::ops::ring_layout(docs, W, causal, 1, zigzag);
  int64_t total = 0;
  std::vector<int> doc_of, pos_of;
  for (size_t d = 0; d < docs.size(); ++d)
    for (int64_t i = 0; i < docs[d]; ++i) {
      doc_of.push_back(static_cast<int>(d));
      pos_of.push_back(static_cast<int>(i));
      ++total;
    }
  std::vector<int> count(total * total, 0);
  std::vector<std::vector<int64_t>> tokens(W);
  for (int r = 0; r < W; ++r) tokens[r] = weft::ops::ring_tokens(L, r);
  for (int r = 0; r < W; ++r) {
    const std::vector<RingStep> steps = weft::ops::ring_schedule_of(L, r);
    ASSERT_EQ(static_cast<int>(steps.size()), W);
    for (int s = 0; s < W; ++s) {
      EXPECT_EQ(steps[s].source, (r - s + W) % W);
      for (const RingBlock& b : steps[s].blocks) {
        ASSERT_LE(b.q_row + b.q_rows, static_cast<int64_t>(tokens[r].size()));
        ASSERT_LE(b.k_row + b.k_rows, static_cast<int64_t>(tokens[steps[s].source].size()));
        if (b.mask == RingMask::kCausal) ASSERT_EQ(b.q_rows, b.k_rows);
        for (int64_t i = 0; i < b.q_rows; ++i)
          for (int64_t j = 0; j < b.k_rows; ++j) {
            if (b.mask == RingMask::kCausal && j > i) continue;
            const int64_t q = tokens[r][b.q_row + i], k = tokens[steps[s].source][b.k_row + j];
            ASSERT_EQ(doc_of[q], b.doc);
            ASSERT_EQ(doc_of[k], b.doc);
            ++count[q * total + k];
          }
      }
    }
  }
  for (int64_t q = 0; q < total; ++q)
    for (int64_t k = 0; k < total; ++k) {
      const bool sees = doc_of[q] == doc_of[k] && (!causal || pos_of[k] <= pos_of[q]);
      ASSERT_EQ(count[q * total + k], sees ? 1 : 0)
          << "query " << q << " key " << k << ", W " << W << (causal ? " causal" : "") << ", " << docs.size()
          << " documents";
    }
}

}  // namespace

TEST(RingAttentionPlan, EveryPairOnceForAnyLengths) {
  std::mt19937 rng(7);
  for (int W : {1, 2, 3, 4, 8})
    for (auto [causal, zigzag] : {std::pair{false, true}, {true, true}, {true, false}}) {
      expect_every_pair_once({1}, W, causal, zigzag);
      expect_every_pair_once({2 * W}, W, causal, zigzag);
      expect_every_pair_once({2 * W + 3}, W, causal, zigzag);
      expect_every_pair_once({0, 5, 1}, W, causal, zigzag);
      for (int trial = 0; trial < 6; ++trial) {
        std::vector<int64_t> docs(1 + rng() % 4);
        for (int64_t& n : docs) n = 1 + rng() % 40;
        expect_every_pair_once(docs, W, causal, zigzag);
      }
    }
}

// Contiguous causal sharding: rank r holds positions [r n / W, (r + 1) n / W) of a document, in order.
TEST(RingAttentionPlan, ContiguousLayoutHoldsConsecutivePositions) {
  const RingLayout L = weft::ops::ring_layout({10}, 4, true, 1, false);
  EXPECT_TRUE(L.causal);
  EXPECT_FALSE(L.zigzag);
  EXPECT_EQ(weft::ops::ring_tokens(L, 0), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(weft::ops::ring_tokens(L, 1), (std::vector<int64_t>{3, 4, 5}));
  EXPECT_EQ(weft::ops::ring_tokens(L, 3), (std::vector<int64_t>{8, 9}));
}

TEST(RingAttentionPlan, RanksPartitionTheTokens) {
  for (int W : {2, 3, 8})
    for (bool causal : {false, true}) {
      const std::vector<int64_t> docs = {17, 1, 64, 3};
      const RingLayout L = weft::ops::ring_layout(docs, W, causal);
      std::vector<int64_t> all;
      for (int r = 0; r < W; ++r) {
        const std::vector<int64_t> t = weft::ops::ring_tokens(L, r);
        EXPECT_EQ(static_cast<int64_t>(t.size()), L.local_rows(r));
        all.insert(all.end(), t.begin(), t.end());
      }
      std::sort(all.begin(), all.end());
      ASSERT_EQ(all.size(), 85u);
      for (size_t i = 0; i < all.size(); ++i) EXPECT_EQ(all[i], static_cast<int64_t>(i));
    }
  // The runs say the same as the token lists.
  for (int W : {1, 2, 5})
    for (bool causal : {false, true}) {
      const RingLayout L = weft::ops::ring_layout({17, 0, 1, 64, 3}, W, causal);
      std::vector<std::vector<int64_t>> t(W);
      for (const weft::ops::RowRun& run : weft::ops::ring_runs(L)) {
        ASSERT_GT(run.length, 0);
        auto& tokens = t[run.rank];
        if (static_cast<int64_t>(tokens.size()) < run.local + run.length)
          tokens.resize(run.local + run.length, -1);
        for (int64_t i = 0; i < run.length; ++i) tokens[run.local + i] = run.natural + i;
      }
      for (int r = 0; r < W; ++r) EXPECT_EQ(t[r], weft::ops::ring_tokens(L, r));
    }
  // Zigzag: rank 1 of 2 holds parts 1 and 2 of an 8-token document.
  const RingLayout L = weft::ops::ring_layout({8}, 2, true);
  EXPECT_EQ(weft::ops::ring_tokens(L, 1), (std::vector<int64_t>{2, 3, 4, 5}));
  EXPECT_EQ(weft::ops::ring_tokens(L, 0), (std::vector<int64_t>{0, 1, 6, 7}));
}

// With zigzag, every rank's work at every step is the same (equal parts), or within a few rows' worth of it.
TEST(RingAttentionPlan, ZigzagKeepsEveryStepEven) {
  for (int W : {2, 4, 8}) {
    const int64_t n = 2 * W * 1024;
    const RingLayout L = weft::ops::ring_layout({n}, W, true);
    const int64_t part = n / (2 * W);
    for (int r = 0; r < W; ++r) {
      const std::vector<RingStep> steps = weft::ops::ring_schedule_of(L, r);
      for (int s = 0; s < W; ++s) {
        // Step 0: two diagonal blocks and one full; later steps two full blocks.
        const int64_t want = s == 0 ? part * part + part * (part + 1) : 2 * part * part;
        EXPECT_EQ(steps[s].pairs(), want) << "W " << W << " rank " << r << " step " << s;
      }
    }
  }
  std::mt19937 rng(11);
  for (int W : {3, 4, 8})
    for (int trial = 0; trial < 5; ++trial) {
      std::vector<int64_t> docs(1 + rng() % 3);
      for (int64_t& n : docs) n = 1000 + rng() % 30000;
      const RingLayout L = weft::ops::ring_layout(docs, W, true);
      std::vector<std::vector<RingStep>> steps(W);
      for (int r = 0; r < W; ++r) steps[r] = weft::ops::ring_schedule_of(L, r);
      for (int s = 0; s < W; ++s) {
        int64_t most = 0, sum = 0;
        for (int r = 0; r < W; ++r) {
          most = std::max(most, steps[r][s].pairs());
          sum += steps[r][s].pairs();
        }
        EXPECT_LE(double(most) * W / double(sum), 1.01) << "W " << W << " step " << s;
      }
    }
}

// One to four documents of 0..39 tokens.
static std::vector<int64_t> random_documents(std::mt19937& g) {
  std::vector<int64_t> docs;
  const int n = 1 + static_cast<int>(g() % 4);
  for (int d = 0; d < n; ++d) docs.push_back(static_cast<int64_t>(g() % 40));
  return docs;
}

// Calls f(docs, L) for W = 1, 2, 3, 4 and 8, not causal, causal zigzag and causal contiguous, on six random
// packings each, and for W = 1,
// 2, 4 with grains 2 and 3 (the layouts the hybrid's rings run over: parts of unequal pieces).
template <class F>
void for_random_layouts(uint32_t seed, F f) {
  std::mt19937 g(seed);
  for (auto [W, grain] : {std::pair{1, 1}, {2, 1}, {3, 1}, {4, 1}, {8, 1}, {1, 2}, {2, 2}, {4, 2}, {2, 3}})
    for (auto [causal, zigzag] : {std::pair{false, true}, {true, true}, {true, false}})
      for (int trial = 0; trial < 6; ++trial) {
        const std::vector<int64_t> docs = random_documents(g);
        f(docs, weft::ops::ring_layout(docs, W, causal, grain, zigzag));
      }
}

// The hybrid's merged layout: the runs of ranks g U .. g U + U - 1 of the team's layout cover coarse rank
// g's rows once, each row holding the same token in both.
TEST(RingAttentionPlan, MergedRunsTileTheCoarseRanks) {
  std::mt19937 g(5);
  for (auto [W, U] : {std::pair{4, 2}, {6, 2}, {6, 3}, {8, 2}, {8, 4}, {4, 4}, {4, 1}})
    for (auto [causal, zigzag] : {std::pair{false, true}, {true, true}, {true, false}})
      for (int trial = 0; trial < 8; ++trial) {
        std::vector<int64_t> docs = random_documents(g);
        if (trial == 0) docs = {100003, 7, 0, 1};
        const RingLayout L = weft::ops::ring_layout(docs, W, causal, 1, zigzag);
        const RingLayout M = weft::ops::ring_layout(docs, W / U, causal, U, zigzag);
        for (int c = 0; c < W / U; ++c) {
          const std::vector<int64_t> coarse = weft::ops::ring_tokens(M, c);
          std::vector<int> seen(coarse.size(), 0);
          for (int r = c * U; r < (c + 1) * U; ++r) {
            const std::vector<int64_t> fine = weft::ops::ring_tokens(L, r);
            int64_t covered = 0;
            for (const weft::ops::RowRun& run : weft::ops::merged_runs(L, M, r)) {
              ASSERT_EQ(run.local, covered) << "runs in local order, back to back";
              for (int64_t i = 0; i < run.length; ++i) {
                ASSERT_LT(run.natural + i, static_cast<int64_t>(coarse.size()));
                ASSERT_EQ(coarse[run.natural + i], fine[run.local + i]) << "W " << W << " U " << U;
                ++seen[run.natural + i];
              }
              covered += run.length;
            }
            EXPECT_EQ(covered, static_cast<int64_t>(fine.size()));
          }
          for (size_t x = 0; x < seen.size(); ++x) ASSERT_EQ(seen[x], 1) << "coarse row " << x;
        }
      }
  EXPECT_THROW(weft::ops::merged_runs(weft::ops::ring_layout({8}, 4, true),
                                      weft::ops::ring_layout({8}, 2, false, 2), 0),
               std::invalid_argument);
}

// The packed sequence's tokens (document and position of each) and a count per (query, key) token pair;
// expect_every_pair_counted_once checks the counts against attention over the whole sequence.
struct PairCounts {
  int64_t total = 0;
  std::vector<int> doc_of, pos_of, count;
  explicit PairCounts(const std::vector<int64_t>& docs) {
    for (size_t d = 0; d < docs.size(); ++d)
      for (int64_t i = 0; i < docs[d]; ++i, ++total) {
        doc_of.push_back(static_cast<int>(d));
        pos_of.push_back(static_cast<int>(i));
      }
    count.assign(total * total, 0);
  }
  void add(int64_t q, int64_t k) { ++count[q * total + k]; }
  void expect_every_pair_counted_once(bool causal, int W) const {
    for (int64_t q = 0; q < total; ++q)
      for (int64_t k = 0; k < total; ++k) {
        const bool sees = doc_of[q] == doc_of[k] && (!causal || pos_of[k] <= pos_of[q]);
        ASSERT_EQ(count[q * total + k], sees ? 1 : 0)
            << "query " << q << " key " << k << ", W " << W << (causal ? " causal" : "");
      }
  }
};

// Each step as one attention call (ring_call_of): the pairs the call's segments see under its one mask
// (bottom-right causal per segment, as the attention kernel applies it) are exactly the step's blocks'.
TEST(RingAttentionPlan, EachStepIsOneCall) {
  for_random_layouts(11, [](const std::vector<int64_t>& docs, const RingLayout& L) {
    const int W = L.world;
    const bool causal = L.causal;
    for (int r = 0; r < W; ++r) {
      const std::vector<RingStep> steps = weft::ops::ring_schedule_of(L, r);
      for (int s = 0; s < W; ++s) {
        const weft::ops::RingCall call = weft::ops::ring_call_of(steps[s]);
        EXPECT_TRUE(!call.causal || s == 0) << "only the rank's own K / V needs the mask";
        const int64_t rows = L.local_rows(r), keys = L.local_rows(steps[s].source);
        std::vector<int> want(rows * keys, 0), got(rows * keys, 0);
        for (const RingBlock& b : steps[s].blocks)
          for (int64_t i = 0; i < b.q_rows; ++i)
            for (int64_t j = 0; j < b.k_rows; ++j)
              if (b.mask == RingMask::kFull || j <= i) ++want[(b.q_row + i) * keys + b.k_row + j];
        for (size_t x = 0; x < call.segments.size(); ++x) {
          const weft::ops::RingSegment& seg = call.segments[x];
          if (x > 0) EXPECT_GE(seg.q_begin, call.segments[x - 1].q_end) << "segments overlap";
          const int64_t ql = seg.q_end - seg.q_begin, kl = seg.k_end - seg.k_begin;
          for (int64_t i = 0; i < ql; ++i)
            for (int64_t j = 0; j < kl; ++j)
              if (!call.causal || j <= i + kl - ql) ++got[(seg.q_begin + i) * keys + seg.k_begin + j];
        }
        ASSERT_EQ(got, want) << "W " << W << (causal ? " causal" : "") << " rank " << r << " step " << s;
      }
    }
  });
}

// Attention over all-gathered K / V (gathered_call_of): over all ranks, every (query token, key token) pair
// of attention over the whole sequence is computed exactly once, under each call's one mask.
TEST(RingAttentionPlan, GatheredCallsCoverEveryPairOnce) {
  for_random_layouts(5, [](const std::vector<int64_t>& docs, const RingLayout& L) {
    const int W = L.world;
    const bool causal = L.causal;
    PairCounts pairs(docs);
    const int64_t total = pairs.total;
    for (int r = 0; r < W; ++r) {
      const std::vector<int64_t> tokens = weft::ops::ring_tokens(L, r);
      const weft::ops::RingCall call = weft::ops::gathered_call_of(L, r);
      EXPECT_EQ(call.causal, causal);
      for (size_t x = 0; x < call.segments.size(); ++x) {
        const weft::ops::RingSegment& seg = call.segments[x];
        if (x > 0) EXPECT_GE(seg.q_begin, call.segments[x - 1].q_end) << "query ranges overlap";
        ASSERT_LE(seg.q_end, static_cast<int64_t>(tokens.size()));
        ASSERT_LE(seg.k_end, total);
        const int64_t ql = seg.q_end - seg.q_begin, kl = seg.k_end - seg.k_begin;
        ASSERT_GE(kl, causal ? ql : 0);
        for (int64_t i = 0; i < ql; ++i)
          for (int64_t j = 0; j < kl; ++j)
            if (!call.causal || j <= i + kl - ql) pairs.add(tokens[seg.q_begin + i], seg.k_begin + j);
      }
    }
    pairs.expect_every_pair_counted_once(causal, W);
  });
}

// The ring kernels' passes: every segment meets W ranges (step 0 under the causal mask when causal: a key
// visible iff its local row is not after the query's), and over all ranks every pair of attention over the
// whole sequence is met exactly once, with K / V travelling (forward) and with the queries travelling
// (backward).
void expect_pass_covers_every_pair_once(weft::ops::RingTravel travel) {
  const bool queries_travel = travel == weft::ops::RingTravel::kQueries;
  for_random_layouts(7, [&](const std::vector<int64_t>& docs, const RingLayout& L) {
    const int W = L.world;
    const bool causal = L.causal;
    PairCounts pairs(docs);
    std::vector<std::vector<int64_t>> tokens(W);
    for (int r = 0; r < W; ++r) tokens[r] = weft::ops::ring_tokens(L, r);
    for (int r = 0; r < W; ++r) {
      const weft::ops::RingPass pass = weft::ops::ring_pass_of(L, r, travel);
      EXPECT_EQ(pass.steps, W);
      EXPECT_EQ(pass.causal, causal);
      ASSERT_EQ(pass.met_begin.size(), pass.own_begin.size() * W);
      for (int64_t x = 0; x < pass.segments(); ++x) {
        if (x > 0) EXPECT_GE(pass.own_begin[x], pass.own_end[x - 1]) << "segments overlap";
        ASSERT_LT(pass.own_begin[x], pass.own_end[x]) << "an empty segment";
        ASSERT_LE(pass.own_end[x], static_cast<int64_t>(tokens[r].size()));
        for (int s = 0; s < W; ++s) {
          const int src = (r - s + W) % W;
          const int64_t mb = pass.met_begin[x * W + s], me = pass.met_end[x * W + s];
          ASSERT_LE(mb, me);
          ASSERT_LE(me, static_cast<int64_t>(tokens[src].size()));
          if (queries_travel && me > mb) {  // a range whose per-row terms the source has prepared
            const auto ranges = weft::ops::ring_query_ranges(L, src);
            EXPECT_NE(std::find(ranges.begin(), ranges.end(), std::make_pair(mb, me)), ranges.end())
                << "rank " << r << " step " << s << " meets rows [" << mb << ", " << me << ") of rank "
                << src;
          }
          for (int64_t own = pass.own_begin[x]; own < pass.own_end[x]; ++own)
            for (int64_t met = mb; met < me; ++met) {
              const int64_t q = queries_travel ? met : own, k = queries_travel ? own : met;
              if (causal && s == 0 && k > q) continue;  // local rows of this rank on both sides
              const int q_rank = queries_travel ? src : r, k_rank = queries_travel ? r : src;
              pairs.add(tokens[q_rank][q], tokens[k_rank][k]);
            }
        }
      }
    }
    pairs.expect_every_pair_counted_once(causal, W);
  });
}
// The term rows of a rank's query ranges (range [b, e) at term rows [4 b, 4 b + e - b)): no term row holds
// two different rows.
TEST(RingAttentionPlan, QueryRangeTermsNeverCollide) {
  for_random_layouts(13, [](const std::vector<int64_t>&, const RingLayout& L) {
    for (int r = 0; r < L.world; ++r) {
      std::map<int64_t, int64_t> row_at;
      for (const auto& [b, e] : weft::ops::ring_query_ranges(L, r))
        for (int64_t x = b; x < e; ++x) {
          const auto [it, fresh] = row_at.insert({4 * b + x - b, x});
          EXPECT_TRUE(fresh || it->second == x) << "term row " << 4 * b + x - b << " of rank " << r;
        }
    }
  });
}

TEST(RingAttentionPlan, ForwardPassCoversEveryPairOnce) {
  expect_pass_covers_every_pair_once(weft::ops::RingTravel::kKeys);
}
TEST(RingAttentionPlan, BackwardPassCoversEveryPairOnce) {
  expect_pass_covers_every_pair_once(weft::ops::RingTravel::kQueries);
}

// The pushes of a slot cover every row its receiver's loads read (each met range extended to whole boxes,
// within the slot), and a causal zigzag pass skips about a quarter of the bytes.
TEST(RingAttentionPlan, PushRowsCoverEveryLoad) {
  for (weft::ops::RingTravel travel : {weft::ops::RingTravel::kKeys, weft::ops::RingTravel::kQueries})
    for_random_layouts(11, [&](const std::vector<int64_t>&, const RingLayout& L) {
      const int W = L.world;
      int64_t slot_rows = 1;
      for (int r = 0; r < W; ++r) slot_rows = std::max(slot_rows, L.local_rows(r));
      for (int box : {64, 128}) {
        for (int r = 0; r < W; ++r) {
          const auto push = weft::ops::ring_push_rows(L, r, travel, box, slot_rows);
          ASSERT_EQ(push.size(), static_cast<size_t>(std::max(1, W - 1)));
          for (int slot = 0; slot + 1 < W; ++slot) {
            const int dst = (r + slot + 1) % W;
            const weft::ops::RingPass there = weft::ops::ring_pass_of(L, dst, travel);
            for (int64_t x = 0; x < there.segments(); ++x) {
              const int64_t b = there.met_begin[x * W + slot + 1], e = there.met_end[x * W + slot + 1];
              if (e <= b) continue;
              const int64_t read_end = std::min(slot_rows, b + (e - b + box - 1) / box * box);
              EXPECT_LE(push[slot].first, b) << "rank " << r << " slot " << slot;
              EXPECT_GE(push[slot].second, read_end) << "rank " << r << " slot " << slot;
            }
          }
        }
      }
    });
  // One causal document of 32k tokens on 8 ranks: each rank's later receivers skip one of its parts.
  const RingLayout L = weft::ops::ring_layout({32768}, 8, true);
  for (weft::ops::RingTravel travel : {weft::ops::RingTravel::kKeys, weft::ops::RingTravel::kQueries}) {
    int64_t pushed = 0;
    for (int r = 0; r < 8; ++r)
      for (const auto& [b, e] : weft::ops::ring_push_rows(L, r, travel, 64, L.local_rows(r))) pushed += e - b;
    EXPECT_EQ(pushed, 8 * 7 * 4096 - 28 * 2048);
  }
}

// The forward kernel takes step 0 under a bottom-right mask (query row i of a segment sees key j of its
// range iff j <= i + keys - queries): the same as the local-row rule above, since its ranges end together.
TEST(RingAttentionPlan, ForwardStepZeroIsBottomRight) {
  for_random_layouts(3, [](const std::vector<int64_t>&, const RingLayout& L) {
    if (!L.causal) return;
    for (int r = 0; r < L.world; ++r) {
      const weft::ops::RingPass pass = weft::ops::ring_pass_of(L, r);
      for (int64_t x = 0; x < pass.segments(); ++x) {
        const int64_t kb = pass.met_begin[x * L.world], ke = pass.met_end[x * L.world];
        if (ke > kb) EXPECT_EQ(ke, pass.own_end[x]) << "rank " << r << " segment " << x;
      }
    }
  });
}

TEST(RingAttentionPlan, Errors) {
  EXPECT_THROW(weft::ops::ring_layout({8}, 0, true), std::invalid_argument);
  EXPECT_THROW(weft::ops::ring_layout({}, 2, true), std::invalid_argument);
  EXPECT_THROW(weft::ops::ring_layout({4, -1}, 2, false), std::invalid_argument);
  EXPECT_THROW(weft::ops::ring_schedule_of(weft::ops::ring_layout({8}, 2, true), 2), std::invalid_argument);
  EXPECT_THROW(weft::ops::doc_lengths_from_offsets({1, 4}), std::invalid_argument);
  EXPECT_THROW(weft::ops::doc_lengths_from_offsets({0, 4, 3}), std::invalid_argument);
  EXPECT_EQ(weft::ops::doc_lengths_from_offsets({0, 4, 4, 9}), (std::vector<int64_t>{4, 0, 5}));
}
