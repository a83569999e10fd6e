// The MoE dispatch layout (src/ops/moe_layout.hpp): a worked example, the invariants on random routings
// (every (token, expert) pair gets its own row inside its expert's group, tokens travel once per destination
// rank), and the errors.
#include <gtest/gtest.h>

#include <random>
#include <set>

#include "ops/moe_layout.hpp"

using weft::ops::moe_layout;
using weft::ops::MoeLayout;
using weft::ops::MoeRouting;

TEST(MoeLayout, WorkedExample) {
  // 2 ranks, 4 experts (rank 0: experts 0, 1; rank 1: 2, 3), top-2, groups padded to 4 rows.
  std::vector<MoeRouting> r(2);
  r[0] = {3, 2, {0, 2, /**/ 1, 0, /**/ 3, -1}};  // token 1 goes to rank 0 once, for two experts
  r[1] = {2, 2, {2, 3, /**/ 0, 3}};
  const MoeLayout L = moe_layout(r, 4, 4);
  EXPECT_EQ(L.sent[0], (std::vector<int>{2, 2}));  // tokens 0, 1 to rank 0; tokens 0, 2 to rank 1
  EXPECT_EQ(L.sent[1], (std::vector<int>{1, 2}));
  EXPECT_EQ(L.group_rows[0], (std::vector<int>{3, 1}));  // expert 0: r0 t0, r0 t1, r1 t1; expert 1: r0 t1
  EXPECT_EQ(L.group_rows[1],
            (std::vector<int>{2, 3}));  // expert 2: r0 t0, r1 t0; expert 3: r0 t2, r1 t0, r1 t1
  EXPECT_EQ(L.group_offset[0], (std::vector<int>{0, 4}));
  EXPECT_EQ(L.rows, (std::vector<int>{8, 8}));
  // Within a group: source rank 0 first, then token order.
  EXPECT_EQ(L.row_of[0], (std::vector<int64_t>{0, 0, 4, 1, 4, -1}));
  EXPECT_EQ(L.row_of[1], (std::vector<int64_t>{1, 5, 2, 6}));
}

TEST(MoeLayout, RandomRoutingsKeepTheInvariants) {
  std::mt19937 rng(7);
  for (int W : {2, 3, 4, 8})
    for (int align : {1, 64, 128}) {
      const int E = W * 4, k = 3;
      std::vector<MoeRouting> r(W);
      for (int s = 0; s < W; ++s) {
        r[s].tokens = 50 + 13 * s;
        r[s].top_k = k;
        for (int t = 0; t < r[s].tokens; ++t) {
          std::set<int> chosen;  // distinct experts per token, as a router picks them
          while (int(chosen.size()) < k) chosen.insert(int(rng() % E));
          for (int e : chosen) r[s].experts.push_back(rng() % 10 == 0 ? -1 : e);
        }
      }
      const MoeLayout L = moe_layout(r, E, align);
      std::vector<std::set<int64_t>> used(W);
      for (int s = 0; s < W; ++s)
        for (int t = 0; t < r[s].tokens; ++t) {
          for (int j = 0; j < k; ++j) {
            const int e = r[s].experts[t * k + j];
            const int64_t row = L.row_of[s][t * k + j];
            if (e < 0) {
              EXPECT_EQ(row, -1);
              continue;
            }
            const int d = e / L.experts_per_rank, le = e % L.experts_per_rank;
            EXPECT_GE(row, L.group_offset[d][le]);
            EXPECT_LT(row, L.group_offset[d][le] + L.group_rows[d][le]);
            EXPECT_TRUE(used[d].insert(row).second) << "row " << row << " of rank " << d << " twice";
          }
        }
      for (int d = 0; d < W; ++d) {
        for (int e = 0; e < L.experts_per_rank; ++e) EXPECT_EQ(L.group_offset[d][e] % align, 0);
        EXPECT_EQ(L.rows[d] % align, 0);
        int64_t pairs = 0;
        for (int e = 0; e < L.experts_per_rank; ++e) pairs += L.group_rows[d][e];
        EXPECT_EQ(int64_t(used[d].size()), pairs);
      }
      // Each token travels once per destination: at most top-k sends per token, at least one if routed.
      for (int s = 0; s < W; ++s) {
        int64_t sends = 0;
        for (int d = 0; d < W; ++d) sends += L.sent[s][d];
        EXPECT_LE(sends, int64_t(r[s].tokens) * k);
      }
    }
}

TEST(MoeLayout, ErrorsSayWhat) {
  std::vector<MoeRouting> r(2, MoeRouting{1, 1, {5}});
  EXPECT_THROW(moe_layout(r, 3, 1), std::invalid_argument);  // 3 experts over 2 ranks
  try {
    moe_layout(r, 4, 1);
    FAIL() << "expert 5 of 4 accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("expert 5 of 4"), std::string::npos) << e.what();
  }
  r[0].experts = {0, 1};
  EXPECT_THROW(moe_layout(r, 4, 1), std::invalid_argument);  // 2 ids for 1 token x top-1
}
