// Attention in fp64 on the host: the reference of the attention tests (single-GPU flash attention, the
// sequence-parallel methods). One packed problem: q [rows_q][heads][dim], k / v [rows_k][kv_heads][dim];
// sequence b is query rows [q0, q0 + q_len) against key rows [k0, k0 + k_len), causal masks aligned at the
// bottom right (query i sees keys up to i + k_len - q_len). Rows of no sequence stay 0.
#pragma once

#include <cuda_bf16.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "harness.hpp"

namespace weft::test {

struct AttentionSpan {
  int64_t q0, q_len, k0, k_len;
};
struct AttentionRefShape {
  int64_t rows_q = 0, rows_k = 0, heads = 0, kv_heads = 0, dim = 0;
  bool causal = false;
  double scale = 0;
  std::vector<AttentionSpan> seqs;
  int64_t last_key(const AttentionSpan& s, int64_t i) const {  // of query i of sequence s (-1: none)
    return causal ? std::min(s.k_len - 1, i + s.k_len - s.q_len) : s.k_len - 1;
  }
};

// o [rows_q][heads][dim]; lse [rows_q][heads] (-inf where a row sees no key); with an output gradient, dq
// like o and dk, dv like k (empty without one).
struct AttentionReference {
  std::vector<double> o, lse, dq, dk, dv;
};

namespace attention_reference_detail {
inline std::vector<double> widened(const std::vector<__nv_bfloat16>& x) {
  std::vector<double> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = __bfloat162float(x[i]);
  return y;
}
// a . b in four interleaved sums (independent chains the compiler keeps in vector registers).
inline double dot(const double* a, const double* b, int64_t n) {
  double s[4] = {0, 0, 0, 0};
  int64_t d = 0;
  for (; d + 4 <= n; d += 4)
    for (int u = 0; u < 4; ++u) s[u] += a[d + u] * b[d + u];
  for (; d < n; ++d) s[0] += a[d] * b[d];
  return (s[0] + s[1]) + (s[2] + s[3]);
}
// The i-th of n work items taken from both ends in turn (0, n-1, 1, n-2, ...): the contiguous parts
// parallel_for hands each thread mix short and long causal rows alike.
inline size_t from_both_ends(size_t i, size_t n) {
  return i % 2 == 0 ? i / 2 : n - 1 - i / 2;
}
}  // namespace attention_reference_detail

// Two passes, each spread over the host's cores: per (query row, head) the softmax, o, the log-sum-exp and
// (backward) dO . O and dq; then per (key row, K / V head) dk and dv over the query rows of the group's heads
// that see the key.
inline AttentionReference attention_reference(const AttentionRefShape& s,
                                              const std::vector<__nv_bfloat16>& q_in,
                                              const std::vector<__nv_bfloat16>& k_in,
                                              const std::vector<__nv_bfloat16>& v_in,
                                              const std::vector<__nv_bfloat16>& go_in = {}) {
  using namespace attention_reference_detail;
  const int64_t H = s.heads, KV = s.kv_heads, D = s.dim, group = H / KV;
  const bool backward = !go_in.empty();
  const std::vector<double> q = widened(q_in), k = widened(k_in), v = widened(v_in), go = widened(go_in);
  AttentionReference r;
  r.o.assign(s.rows_q * H * D, 0.0);
  r.lse.assign(s.rows_q * H, -std::numeric_limits<double>::infinity());
  std::vector<double> row_dot(backward ? s.rows_q * H : 0);  // dO . O per (query row, head)
  if (backward) {
    r.dq.assign(s.rows_q * H * D, 0.0);
    r.dk.assign(s.rows_k * KV * D, 0.0);
    r.dv.assign(s.rows_k * KV * D, 0.0);
  }
  // Work items (sequence, head, row): query rows with the query heads, key rows with the K / V heads.
  std::vector<std::array<int64_t, 3>> q_items, k_items;
  for (int64_t b = 0; b < int64_t(s.seqs.size()); ++b) {
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < s.seqs[b].q_len; ++i) q_items.push_back({b, h, i});
    if (backward)
      for (int64_t h = 0; h < KV; ++h)
        for (int64_t j = 0; j < s.seqs[b].k_len; ++j) k_items.push_back({b, h, j});
  }
  parallel_for(
      q_items.size(),
      [&](size_t i0, size_t i1) {
        std::vector<double> p;
        for (size_t it = i0; it < i1; ++it) {
          const auto [b, h, i] = q_items[from_both_ends(it, q_items.size())];
          const AttentionSpan& sq = s.seqs[b];
          const int64_t hk = h / group, last = s.last_key(sq, i), x = (sq.q0 + i) * H + h;
          if (last < 0) continue;
          const double* qr = &q[x * D];
          const auto kv_row = [&](int64_t j) { return ((sq.k0 + j) * KV + hk) * D; };
          p.assign(last + 1, 0.0);
          double top = -std::numeric_limits<double>::infinity(), sum = 0;
          for (int64_t j = 0; j <= last; ++j) top = std::max(top, p[j] = s.scale * dot(qr, &k[kv_row(j)], D));
          for (double& y : p) sum += (y = std::exp(y - top));
          double* o = &r.o[x * D];
          for (int64_t j = 0; j <= last; ++j) {
            p[j] /= sum;
            const double* vr = &v[kv_row(j)];
            for (int64_t d = 0; d < D; ++d) o[d] += p[j] * vr[d];
          }
          r.lse[x] = top + std::log(sum);
          if (!backward) continue;
          // dS_ij = P_ij (dO_i . v_j - dO_i . O_i); dQ_i += scale dS_ij k_j.
          const double* gr = &go[x * D];
          const double rd = row_dot[x] = dot(gr, o, D);
          double* dq = &r.dq[x * D];
          for (int64_t j = 0; j <= last; ++j) {
            const double ds = s.scale * p[j] * (dot(gr, &v[kv_row(j)], D) - rd);
            const double* kr = &k[kv_row(j)];
            for (int64_t d = 0; d < D; ++d) dq[d] += ds * kr[d];
          }
        }
      },
      1);
  if (!backward) return r;
  // dK_j += scale dS_ij q_i, dV_j += P_ij dO_i over the query rows i that see key j.
  parallel_for(
      k_items.size(),
      [&](size_t i0, size_t i1) {
        for (size_t it = i0; it < i1; ++it) {
          const auto [b, hk, j] = k_items[from_both_ends(it, k_items.size())];
          const AttentionSpan& sq = s.seqs[b];
          const int64_t y = ((sq.k0 + j) * KV + hk) * D;
          const double *kr = &k[y], *vr = &v[y];
          double* dk = &r.dk[y];
          double* dv = &r.dv[y];
          // Query i sees key j when j <= last_key(i): causal from i = j - (k_len - q_len) on.
          const int64_t first = s.causal ? std::max<int64_t>(0, j - (sq.k_len - sq.q_len)) : 0;
          for (int64_t h = hk * group; h < (hk + 1) * group; ++h)
            for (int64_t i = first; i < sq.q_len; ++i) {
              const int64_t x = (sq.q0 + i) * H + h;
              const double *qr = &q[x * D], *gr = &go[x * D];
              const double pij = std::exp(s.scale * dot(qr, kr, D) - r.lse[x]);
              const double ds = s.scale * pij * (dot(gr, vr, D) - row_dot[x]);
              for (int64_t d = 0; d < D; ++d) {
                dk[d] += ds * qr[d];
                dv[d] += pij * gr[d];
              }
            }
        }
      },
      1);
  return r;
}

}  // namespace weft::test
