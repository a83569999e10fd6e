// The ring pipeline's schedule (src/ops/ring_schedule.hpp) run on the host: W ranks play one call of
// matmul_reduce_scatter / matmul_all_reduce, each taking its GEMM pieces in order once its arrival count
// allows, pushing as the GPU code does. Every piece must find the rows it adds to already landed and
// summed over the right ranks, no rank may wait forever, each rank must end with its rows summed over all
// ranks (all-reduce: every rank's rows), and the counts the final waits expect must be the ones written.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "ops/ring_schedule.hpp"

namespace {

using weft::ops::ring_schedule;
using weft::ops::RingSchedule;

// A row's value is the set of ranks whose products it holds (bit q: rank q's); 0 = not landed.
using Rows = std::vector<uint32_t>;

std::string play(int W, int64_t rows, int pieces, int64_t tail_rows, bool all_reduce) {
  const RingSchedule plan = ring_schedule(W, rows, pieces, tail_rows, all_reduce);
  const size_t n = plan.order.size();
  const uint32_t everyone = (1u << W) - 1;
  // inbox[r][s]: rank r's slot for the previous rank's step s (its step s + 1 adds to it).
  std::vector<std::vector<Rows>> inbox(W, std::vector<Rows>(W, Rows(rows, 0)));
  std::vector<Rows> own(W, Rows(rows, 0));                                          // final: rank r's rows
  std::vector<std::vector<Rows>> gathered(W, std::vector<Rows>(W, Rows(rows, 0)));  // AR: rank q's rows
  std::vector<std::vector<uint32_t>> arrived(W, std::vector<uint32_t>(W, 0));       // [at][from]
  std::vector<size_t> pos(W, 0);
  auto set_count = [&](int at, int from, uint32_t count) -> std::string {
    if (count != arrived[at][from] + 1)
      return "count from " + std::to_string(from) + " at " + std::to_string(at) + " jumps from " +
             std::to_string(arrived[at][from]) + " to " + std::to_string(count);
    arrived[at][from] = count;
    return "";
  };
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < W; ++r)
      while (pos[r] < n) {
        const size_t i = pos[r];
        const int s = plan.order[i].step, prev = (r + W - 1) % W, next = (r + 1) % W;
        if (s > 0 && arrived[r][prev] < plan.needs[i]) break;
        const int64_t r0 = plan.first_row(i), nr = plan.row_count(i);
        const int chunk = (r + W - s - 1) % W;
        // The partial of these rows holds ranks r - 1, ..., r - s (each added its product on the way).
        uint32_t expect = 0;
        for (int t = 1; t <= s; ++t) expect |= 1u << ((r + W - t) % W);
        for (int64_t row = r0; row < r0 + nr; ++row) {
          const uint32_t partial = s == 0 ? 0 : inbox[r][s - 1][row];
          if (partial != expect)
            return "rank " + std::to_string(r) + " item " + std::to_string(i) + " (step " +
                   std::to_string(s) + ") row " + std::to_string(row) + ": partial holds " +
                   std::to_string(partial) + ", expected " + std::to_string(expect);
          const uint32_t sum = partial | 1u << r;
          if (s < W - 1) {
            inbox[next][s][row] = sum;
          } else {
            if (chunk != r || sum != everyone)
              return "last step is not rank " + std::to_string(r) + "'s total";
            own[r][row] = sum;
            if (all_reduce)
              for (int q = 0; q < W; ++q)
                if (q != r) gathered[q][r][row] = sum;
          }
        }
        std::string err;
        if (s < W - 1) {
          err = set_count(next, r, plan.pushed_to_next[i]);
        } else if (all_reduce) {
          for (int t = 1; t < W && err.empty(); ++t) {
            const int to = (r + t) % W;
            err = set_count(to, r, to == next ? plan.pushed_to_next[i] : plan.finals[i]);
          }
        }
        if (!err.empty()) return err;
        ++pos[r];
        progress = true;
      }
  }
  for (int r = 0; r < W; ++r) {
    if (pos[r] < n) return "rank " + std::to_string(r) + " waits forever at item " + std::to_string(pos[r]);
    for (int64_t row = 0; row < rows; ++row)
      if (own[r][row] != everyone)
        return "rank " + std::to_string(r) + " row " + std::to_string(row) + " unsummed";
    if (!all_reduce) continue;
    for (int q = 0; q < W; ++q) {
      if (q == r) continue;
      const uint32_t expected_count = q == (r + W - 1) % W ? plan.pushed_to_next.back() : plan.finals.back();
      if (arrived[r][q] != expected_count)
        return "rank " + std::to_string(r) + " got " + std::to_string(arrived[r][q]) + " pushes from " +
               std::to_string(q) + ", its final wait expects " + std::to_string(expected_count);
      for (int64_t row = 0; row < rows; ++row)
        if (gathered[r][q][row] != everyone)
          return "rank " + std::to_string(r) + " lacks rank " + std::to_string(q) + "'s rows";
    }
  }
  return "";
}

TEST(RingSchedule, EveryWorldSizePiecesAndTail) {
  for (int W = 2; W <= 8; ++W)
    for (int64_t rows : {1, 7, 64, 200, 1024, 4096})
      for (int pieces = 1; pieces <= 4; ++pieces)
        for (int64_t tail : {0, 64, 512})
          for (bool all_reduce : {false, true}) {
            const std::string err = play(W, rows, pieces, tail, all_reduce);
            EXPECT_TRUE(err.empty()) << "W " << W << " rows " << rows << " pieces " << pieces << " tail "
                                     << tail << (all_reduce ? " all-reduce" : " reduce-scatter") << ": "
                                     << err;
          }
}

TEST(RingSchedule, PiecesCoverTheRowsInOrder) {
  for (int64_t rows : {1, 63, 64, 65, 1000, 8192})
    for (int count = 1; count <= 5; ++count)
      for (int64_t tail : {0, 64, 1024}) {
        const auto b = weft::ops::piece_bounds(rows, count, tail);
        ASSERT_GE(b.size(), 2u);
        EXPECT_EQ(b.front(), 0);
        EXPECT_EQ(b.back(), rows);
        for (size_t i = 1; i < b.size(); ++i)
          EXPECT_LT(b[i - 1], b[i]) << "rows " << rows << " count " << count;
      }
}

}  // namespace
