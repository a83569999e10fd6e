// The schedule of the copy-engine pipeline's ring reduce-scatter (src/ops/fused.cu, pipelined_rs): which
// GEMM pieces run in which order and which arrival counts each one waits for. Host only and the same on
// every rank, so the counts that one rank writes are the counts its peers wait for (tests/host checks it by
// simulating the ring).
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

namespace weft::ops {

// Row bounds [0, .., rows] of `count` equal pieces, whole 64-row multiples where the rows allow; with
// `tail_rows`, the last piece halved again and again down to about tail_rows, so that what must follow the
// last GEMM (the all-reduce's fan-out of it) is short.
inline std::vector<int64_t> piece_bounds(int64_t rows, int count, int64_t tail_rows = 0) {
  count = static_cast<int>(std::clamp<int64_t>(count, 1, rows));
  int64_t per = (rows + count - 1) / count;
  if (rows >= 64 * int64_t(count)) per = (per + 63) / 64 * 64;
  std::vector<int64_t> b;
  for (int64_t r = 0; r < rows; r += per) b.push_back(r);
  if (tail_rows > 0)
    while (rows - b.back() >= 2 * tail_rows)
      b.push_back(b.back() + std::max<int64_t>((rows - b.back()) / 2 / 64 * 64, tail_rows));
  b.push_back(rows);
  return b;
}

struct RingItem {
  int step, piece;
};

// The order of a ring pipeline's GEMMs: piece j of step s for steps 0..steps-1, pieces 0..pieces-1, by
// diagonals s + j (within one, by step). Piece (s, j) needs the previous rank's (s - 1, j), which that rank
// made on the diagonal before, so at least one GEMM ran here while it was pushed. The last step's last piece
// comes last; it may stand for `last_extra` + 1 smaller ones (piece_bounds' tail).
inline std::vector<RingItem> ring_order(int steps, int pieces, int last_extra) {
  std::vector<RingItem> order;
  for (int d = 0; d < steps + pieces - 1; ++d)
    for (int s = std::max(0, d - pieces + 1); s <= std::min(steps - 1, d); ++s) order.push_back({s, d - s});
  for (int j = 1; j <= last_extra; ++j) order.push_back({steps - 1, pieces - 1 + j});
  return order;
}

// At step s = 0..W-1 rank r computes the rows of rank r - s - 1 (its own at the last step), from step 1 on
// adding the partial sum of those rows that rank r - 1 made at its step s - 1 and pushed here.
struct RingSchedule {
  int world = 0;
  std::vector<int64_t> ring, last;  // row bounds of a step's pieces; `last`: the last step's (AR: tail split)
  std::vector<RingItem> order;      // the GEMM pieces in the order every rank runs them
  // Arrival counts, numbered in `order`: the pushes to the next rank (every piece below the last step, and
  // with all-reduce the final ones too) and the final pieces (the all-reduce's fan-out to the other peers);
  // pushed_to_next[i] / finals[i] count them up to and including item i.
  std::vector<uint32_t> pushed_to_next, finals;
  // Item i with step > 0: the pushes from the previous rank that must have landed here first (those up to
  // its piece of step - 1 that holds item i's rows); 0 for step 0.
  std::vector<uint32_t> needs;

  const std::vector<int64_t>& bounds(int step) const { return step == world - 1 ? last : ring; }
  int64_t first_row(size_t i) const { return bounds(order[i].step)[order[i].piece]; }
  int64_t row_count(size_t i) const { return bounds(order[i].step)[order[i].piece + 1] - first_row(i); }
};

// `rows` per rank, `pieces` per ring step (at least 1), `tail_rows` as in piece_bounds for the last step
// (0: none).
inline RingSchedule ring_schedule(int world, int64_t rows, int pieces, int64_t tail_rows, bool all_reduce) {
  RingSchedule r;
  r.world = world;
  r.ring = piece_bounds(rows, pieces);
  r.last = tail_rows > 0 ? piece_bounds(rows, int(r.ring.size()) - 1, tail_rows) : r.ring;
  const int ring_pieces = int(r.ring.size()) - 1;
  r.order = ring_order(world, ring_pieces, int(r.last.size() - r.ring.size()));
  const size_t n = r.order.size();
  r.pushed_to_next.resize(n);
  r.finals.resize(n);
  r.needs.resize(n);
  std::vector<size_t> index_of(size_t(world) * ring_pieces);  // of the ring steps' items
  for (size_t i = 0, to_next = 0, final = 0; i < n; ++i) {
    const bool is_final = r.order[i].step == world - 1;
    to_next += !is_final || all_reduce;
    final += is_final;
    r.pushed_to_next[i] = uint32_t(to_next);
    r.finals[i] = uint32_t(final);
    if (!is_final) index_of[size_t(r.order[i].step) * ring_pieces + r.order[i].piece] = i;
  }
  for (size_t i = 0; i < n; ++i) {
    const int s = r.order[i].step;
    if (s == 0) continue;
    const int64_t end = r.first_row(i) + r.row_count(i);
    const auto holding = std::lower_bound(r.ring.begin(), r.ring.end(), end) - r.ring.begin() - 1;
    r.needs[i] = r.pushed_to_next[index_of[size_t(s - 1) * ring_pieces + holding]];
  }
  return r;
}

}  // namespace weft::ops
