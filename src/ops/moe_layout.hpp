// The layout of an expert-parallel MoE dispatch, computed on the host for a whole team: the reference that
// the device layout kernel and the dispatch / combine tests compare against, and the definition of the
// layout in one place.
//
// Experts are split evenly over the W ranks (rank r holds experts [r * E / W, (r + 1) * E / W)). Each rank
// routes its T tokens to top-k experts. A token travels once to each rank holding any of its experts (not
// once per expert); there it is copied into the row group of each of its experts on that rank. Groups are
// laid out by local expert, each padded to a multiple of `align` rows (grouped-GEMM tiles), and within a
// group rows come from source rank 0, 1, ... and, per source, in token order: the same on every run, so
// combine and backward can reuse the layout and sums are deterministic.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace weft::ops {

struct MoeRouting {
  int tokens = 0;            // per rank
  int top_k = 0;             // experts per token
  std::vector<int> experts;  // [tokens * top_k] global expert ids; -1: no expert (a dropped slot)
};

struct MoeLayout {
  int world = 0, num_experts = 0, experts_per_rank = 0, align = 1;
  // sent[s][d]: tokens rank s sends to rank d (each token at most once per destination).
  std::vector<std::vector<int>> sent;
  // group_rows[d][e]: rows of local expert e on rank d before padding; group_offset[d][e]: its first row;
  // rows[d]: the padded total on rank d.
  std::vector<std::vector<int>> group_rows, group_offset;
  std::vector<int> rows;
  // row_of[s][t * top_k + j]: the row on the expert's rank that token t of rank s fills for its j-th expert
  // (-1 for a dropped slot).
  std::vector<std::vector<int64_t>> row_of;
};

inline MoeLayout moe_layout(const std::vector<MoeRouting>& routing, int num_experts, int align) {
  const int W = static_cast<int>(routing.size());
  if (W < 1 || num_experts < W || num_experts % W != 0)
    throw std::invalid_argument("moe_layout: the expert count (" + std::to_string(num_experts) +
                                ") must be a positive multiple of the world size (" + std::to_string(W) +
                                ")");
  if (align < 1) throw std::invalid_argument("moe_layout: align must be at least 1");
  MoeLayout L;
  L.world = W;
  L.num_experts = num_experts;
  L.experts_per_rank = num_experts / W;
  L.align = align;
  const int per = L.experts_per_rank;
  L.sent.assign(W, std::vector<int>(W, 0));
  L.group_rows.assign(W, std::vector<int>(per, 0));
  for (int s = 0; s < W; ++s) {
    const MoeRouting& r = routing[s];
    if (static_cast<int64_t>(r.experts.size()) != int64_t(r.tokens) * r.top_k)
      throw std::invalid_argument("moe_layout: rank " + std::to_string(s) + " gives " +
                                  std::to_string(r.experts.size()) + " expert ids for " +
                                  std::to_string(r.tokens) + " tokens x top-" + std::to_string(r.top_k));
    for (int t = 0; t < r.tokens; ++t) {
      std::vector<bool> to(W, false);
      for (int j = 0; j < r.top_k; ++j) {
        const int e = r.experts[size_t(t) * r.top_k + j];
        if (e < 0) continue;
        if (e >= num_experts)
          throw std::invalid_argument("moe_layout: rank " + std::to_string(s) + " token " +
                                      std::to_string(t) + " routes to expert " + std::to_string(e) + " of " +
                                      std::to_string(num_experts));
        to[e / per] = true;
        ++L.group_rows[e / per][e % per];
      }
      for (int d = 0; d < W; ++d) L.sent[s][d] += to[d];
    }
  }
  L.group_offset.assign(W, std::vector<int>(per, 0));
  L.rows.assign(W, 0);
  for (int d = 0; d < W; ++d) {
    int row = 0;
    for (int e = 0; e < per; ++e) {
      L.group_offset[d][e] = row;
      row += (L.group_rows[d][e] + align - 1) / align * align;
    }
    L.rows[d] = row;
  }
  // Rows within each group: by source rank, then token order.
  std::vector<std::vector<int>> next(W, std::vector<int>(per, 0));
  L.row_of.resize(W);
  for (int s = 0; s < W; ++s) {
    const MoeRouting& r = routing[s];
    L.row_of[s].assign(r.experts.size(), -1);
    for (int t = 0; t < r.tokens; ++t)
      for (int j = 0; j < r.top_k; ++j) {
        const int e = r.experts[size_t(t) * r.top_k + j];
        if (e < 0) continue;
        const int d = e / per, le = e % per;
        L.row_of[s][size_t(t) * r.top_k + j] = L.group_offset[d][le] + next[d][le]++;
      }
  }
  return L;
}

}  // namespace weft::ops
