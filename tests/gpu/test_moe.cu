// GPU test of weft::moe_dispatch and weft::moe_combine on a team (real or virtual ranks): the device layout
// against the host reference (src/ops/moe_layout.hpp) and every routed slot's row on its expert's rank
// against the source token, bit for bit; combine's weighted sums against the host's, bit for bit; top-k 1, 2,
// 8, dropped slots, repeated experts, skewed routing (half the slots to rank 0's experts), ranks with no
// token, two dispatches in a row on one area; the exact counts read back (moe_counts); the fused second GEMM
// + combine against the unfused pair (bit for bit); the dispatch inside the first GEMM against moe_dispatch +
// grouped_gemm (bit for bit); combine's backward
// (the expert rows' gradients bit for bit, zeros elsewhere; the weights' gradients against fp64); the FP8
// dispatch against quantize_fp8 of the bf16 dispatch's rows, and grouped_gemm_fp8 on its packed rows in place
// against dense copies (bit for bit).
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "harness.hpp"
#include "ops/moe_layout.hpp"
#include "weft/ops/gemm.hpp"
#include "weft/ops/moe.hpp"

using namespace weft;
using weft::test::DeviceBuffer;

namespace {

struct MoeCase {
  int experts_per_rank, top_k;
  int64_t hidden, base_tokens;
  bool skewed;
  int align;
  bool zero_padding = true;  // MoeShape::zero_padding: off, the padding rows are not checked
};

// moe_dispatch on every local rank of `base` with rank r's T[r] tokens, after its plan (which the call must
// keep); each Local holds the rank's tokens (tok), expert ids (exp) and workspace (ws). Then synchronizes.
template <class Local>
std::vector<MoeDispatched> dispatch_on_every_rank(Communicator& c, const MoeShape& base,
                                                  const std::vector<int64_t>& T,
                                                  const std::vector<std::unique_ptr<Local>>& local,
                                                  size_t ws_bytes) {
  std::vector<MoeDispatched> got(c.num_local());
  for (int i = 0; i < c.num_local(); ++i) {
    Rank& rank = c.local(i);
    WEFT_CUDA_CHECK(cudaSetDevice(rank.device()));
    MoeShape s = base;
    s.tokens = T[rank.rank()];
    const void* tok = local[i]->tok.p;
    const auto* experts = local[i]->exp.template as<int32_t>();
    void* ws = local[i]->ws.p;
    weft::test::keeping_plan(c, moe_dispatch_plan(c, rank, tok, experts, s, ws, ws_bytes, DType::kBF16), [&] {
      got[i] = moe_dispatch(c, rank, tok, experts, s, ws, ws_bytes, DType::kBF16);
    });
  }
  c.synchronize();
  return got;
}

// A rank's random routing of `tokens` tokens: top_k distinct experts of E a token, about one slot in 16
// dropped (-1), appended to `experts`; its rows' bf16 values k / scale (k in -1000..1000), one row where the
// rank has no token.
void random_routing(std::mt19937_64& g, int64_t tokens, int E, int top_k, int64_t hidden, float scale,
                    std::vector<int32_t>& experts, std::vector<__nv_bfloat16>& rows) {
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<int32_t> pick(E);
    for (int e = 0; e < E; ++e) pick[e] = e;
    std::shuffle(pick.begin(), pick.end(), g);
    for (int j = 0; j < top_k; ++j) experts.push_back(g() % 16 == 0 ? -1 : pick[j]);
  }
  rows.resize(std::max<int64_t>(tokens, 1) * hidden);
  for (auto& x : rows) x = __float2bfloat16(float(int64_t(g() % 2001) - 1000) / scale);
}

// Errors in destination rank d's low-latency groups: every slot of an expert of d (from each source whose
// slots are known here: every source in one process, d's own with one process per rank) at a row of its
// expert's group below the group's count, no row taken twice, and same_row(s, x, row) (the row holds slot x
// of source s's token); with every source known, each group's count equal to its slots. per experts a
// rank, `group` rows each.
template <class SameRow>
int64_t low_latency_group_errors(Communicator& c, int d, int per, int64_t group,
                                 const std::vector<std::vector<int32_t>>& experts,
                                 const std::vector<std::vector<int32_t>>& row_of,
                                 const std::vector<int32_t>& counts, SameRow same_row) {
  const int W = c.world();
  std::vector<int> want(per, 0);
  std::vector<char> taken(size_t(per * group), 0);
  int64_t bad = 0;
  for (int s = 0; s < W; ++s) {
    if (c.num_local() < W && s != d) continue;  // one process per rank: only this rank's own slots known
    for (size_t x = 0; x < experts[s].size(); ++x) {
      const int e = experts[s][x];
      if (e < 0 || e / per != d) continue;
      const int le = e % per, row = row_of[s][x];
      ++want[le];
      const bool in_group = row >= le * group && row < le * group + counts[le];
      bad += !in_group;
      if (!in_group) continue;
      bad += taken[row]++ != 0;
      bad += !same_row(s, x, row);
    }
  }
  if (c.num_local() == W)
    for (int le = 0; le < per; ++le) bad += counts[le] != want[le];
  return bad;
}

std::string run_moe_case(Communicator& c, const MoeCase& mc, uint64_t seed) {
  const int W = c.world();
  const int E = mc.experts_per_rank * W, per = mc.experts_per_rank;
  std::vector<int64_t> T(W);
  for (int r = 0; r < W; ++r) T[r] = r % 3 == 2 ? 0 : (r % 3 == 1 ? 1 : mc.base_tokens + r);
  const int64_t max_tokens = *std::max_element(T.begin(), T.end());
  std::mt19937_64 g(seed);
  std::vector<ops::MoeRouting> routing(W);
  std::vector<std::vector<__nv_bfloat16>> tokens(W);
  for (int r = 0; r < W; ++r) {
    routing[r].tokens = static_cast<int>(T[r]);
    routing[r].top_k = mc.top_k;
    for (int64_t i = 0; i < T[r] * mc.top_k; ++i) {
      int e = static_cast<int>(g() % E);
      if (mc.skewed && g() % 2) e = static_cast<int>(g() % per);  // rank 0's experts
      if (g() % 20 == 0) e = -1;                                  // a dropped slot
      routing[r].experts.push_back(e);
    }
    tokens[r].resize(std::max<int64_t>(T[r], 1) * mc.hidden);
    for (auto& x : tokens[r]) x = __float2bfloat16(float(int64_t(g() % 2001) - 1000) / 64.f);
  }
  const ops::MoeLayout L = ops::moe_layout(routing, E, mc.align);
  MoeShape base{0, max_tokens, mc.hidden, E, mc.top_k, mc.align};
  base.zero_padding = mc.zero_padding;
  const size_t ws_bytes = moe_dispatch_workspace_bytes(W, base);
  struct Local {
    DeviceBuffer tok, exp, ws;
    Local(size_t t, size_t e, size_t w) : tok(t), exp(e), ws(w) {}
  };
  std::vector<std::unique_ptr<Local>> local;
  for (int i = 0; i < c.num_local(); ++i) {
    const int r = c.local(i).rank();
    WEFT_CUDA_CHECK(cudaSetDevice(c.local(i).device()));
    auto l = std::make_unique<Local>(tokens[r].size() * 2, std::max<size_t>(routing[r].experts.size(), 1) * 4,
                                     ws_bytes);
    weft::test::upload(c, i, l->tok.p, tokens[r].data(), l->tok.bytes);
    if (!routing[r].experts.empty())
      weft::test::upload(c, i, l->exp.p, routing[r].experts.data(), routing[r].experts.size() * 4);
    local.push_back(std::move(l));
  }
  c.host_barrier();
  const std::vector<MoeDispatched> got = dispatch_on_every_rank(c, base, T, local, ws_bytes);
  std::string failures;
  const std::string label = "E=" + std::to_string(E) + " top_k=" + std::to_string(mc.top_k) +
                            " hidden=" + std::to_string(mc.hidden) + (mc.skewed ? " skewed" : "");
  for (int i = 0; i < c.num_local(); ++i) {
    const int d = c.local(i).rank();
    // This rank as a source: its row_of.
    const size_t slots = routing[d].experts.size();
    std::vector<int32_t> row_of(std::max<size_t>(slots, 1));
    if (slots) weft::test::download(c, i, row_of.data(), got[i].row_of, slots * 4);
    int64_t bad_rows = 0;
    for (size_t x = 0; x < slots; ++x) bad_rows += row_of[x] != L.row_of[d][x];
    // This rank as a destination: group ends and rows.
    std::vector<int32_t> ends(per);
    weft::test::download(c, i, ends.data(), got[i].group_end, per * 4);
    int64_t bad_ends = 0;
    MoeShape shape_d = base;
    shape_d.tokens = T[d];
    const MoeCounts counts = moe_counts(c.local(i), got[i], shape_d);  // the exact-count mode's read-back
    for (int e = 0; e < per; ++e) {
      const int want = L.group_offset[d][e] + (L.group_rows[d][e] + mc.align - 1) / mc.align * mc.align;
      bad_ends += ends[e] != want;
      bad_ends += counts.group_end[e] != want || counts.expert_rows[e] != L.group_rows[d][e];
    }
    bad_ends += counts.rows != L.rows[d];
    std::vector<__nv_bfloat16> rows(std::max(L.rows[d], 1) * mc.hidden);
    if (L.rows[d] > got[i].capacity) {
      failures += "\n    " + label + ": rank " + std::to_string(d) + " needs " + std::to_string(L.rows[d]) +
                  " rows, capacity " + std::to_string(got[i].capacity);
      continue;
    }
    weft::test::download(c, i, rows.data(), got[i].rows, size_t(L.rows[d]) * mc.hidden * 2);
    int64_t bad_data = 0;
    for (int s = 0; s < W; ++s)
      for (int64_t t = 0; t < T[s]; ++t)
        for (int j = 0; j < mc.top_k; ++j) {
          const int e = routing[s].experts[t * mc.top_k + j];
          if (e < 0 || e / per != d) continue;
          const int64_t row = L.row_of[s][t * mc.top_k + j];
          bad_data += std::memcmp(&rows[row * mc.hidden], &tokens[s][t * mc.hidden], mc.hidden * 2) != 0;
        }
    // Each group's padding rows: zeros (unless left as they are).
    for (int e = 0; e < per && mc.zero_padding; ++e)
      for (int64_t r = L.group_offset[d][e] + L.group_rows[d][e];
           r < L.group_offset[d][e] + (L.group_rows[d][e] + mc.align - 1) / mc.align * mc.align; ++r)
        for (int64_t h = 0; h < mc.hidden; ++h) bad_data += __bfloat162float(rows[r * mc.hidden + h]) != 0.f;
    if (bad_rows || bad_ends || bad_data)
      failures += "\n    " + label + ": rank " + std::to_string(d) + ": " + std::to_string(bad_rows) +
                  " row_of entries, " + std::to_string(bad_ends) + " group ends, " +
                  std::to_string(bad_data) + " rows (or padding values) differ from the host layout";
  }
  if (!failures.empty()) return failures;

  // Combine: random expert outputs on every rank's rows, random weights; out[t] against the fp32 sum in
  // slot order, rounded once (the same fmas: bit for bit).
  std::vector<std::vector<__nv_bfloat16>> y(W);
  for (int d = 0; d < W; ++d) {
    y[d].resize(std::max(L.rows[d], 1) * mc.hidden);
    for (auto& x : y[d]) x = __float2bfloat16(float(int64_t(g() % 2001) - 1000) / 256.f);
  }
  std::vector<std::vector<float>> weights(W);
  for (int s = 0; s < W; ++s) {
    weights[s].resize(std::max<size_t>(routing[s].experts.size(), 1));
    for (auto& w : weights[s]) w = float(g() % 1000) / 1000.f;
  }
  struct Combine {
    DeviceBuffer w, out;
    Combine(size_t wb, size_t ob) : w(wb), out(ob) {}
  };
  std::vector<std::unique_ptr<Combine>> comb;
  std::vector<void*> inputs(c.num_local());
  for (int i = 0; i < c.num_local(); ++i) {
    Rank& rank = c.local(i);
    const int r = rank.rank();
    WEFT_CUDA_CHECK(cudaSetDevice(rank.device()));
    MoeShape s = base;
    s.tokens = T[r];
    inputs[i] = moe_combine_input(c, rank, s, DType::kBF16);
    if (L.rows[r] > 0) weft::test::upload(c, i, inputs[i], y[r].data(), size_t(L.rows[r]) * mc.hidden * 2);
    auto cb = std::make_unique<Combine>(weights[r].size() * 4, std::max<int64_t>(T[r], 1) * mc.hidden * 2);
    weft::test::upload(c, i, cb->w.p, weights[r].data(), cb->w.bytes);
    weft::test::poison(c, i, cb->out.p, cb->out.bytes);
    comb.push_back(std::move(cb));
  }
  c.host_barrier();
  for (int i = 0; i < c.num_local(); ++i) {
    Rank& rank = c.local(i);
    WEFT_CUDA_CHECK(cudaSetDevice(rank.device()));
    MoeShape s = base;
    s.tokens = T[rank.rank()];
    const float* w = comb[i]->w.as<float>();
    weft::test::keeping_plan(
        c, moe_combine_plan(c, rank, inputs[i], got[i], w, comb[i]->out.p, s, DType::kBF16),
        [&] { moe_combine(c, rank, inputs[i], got[i], w, comb[i]->out.p, s, DType::kBF16); });
  }
  c.synchronize();
  for (int i = 0; i < c.num_local(); ++i) {
    const int s = c.local(i).rank();
    std::vector<__nv_bfloat16> out(std::max<int64_t>(T[s], 1) * mc.hidden);
    weft::test::download(c, i, out.data(), comb[i]->out.p, out.size() * 2);
    int64_t bad = 0;
    for (int64_t t = 0; t < T[s]; ++t)
      for (int64_t h = 0; h < mc.hidden; ++h) {
        float acc = 0.f;
        for (int j = 0; j < mc.top_k; ++j) {
          const int e = routing[s].experts[t * mc.top_k + j];
          if (e < 0) continue;
          const int64_t row = L.row_of[s][t * mc.top_k + j];
          acc =
              std::fma(weights[s][t * mc.top_k + j], __bfloat162float(y[e / per][row * mc.hidden + h]), acc);
        }
        const float a = __bfloat162float(out[t * mc.hidden + h]), b = __bfloat162float(__float2bfloat16(acc));
        bad += !(a == b);
      }
    if (bad)
      failures += "\n    " + label + ": rank " + std::to_string(s) + " combine: " + std::to_string(bad) +
                  " values differ from the host's weighted sum";
  }
  if (!failures.empty()) return failures;

  // Combine's backward on random dout: every expert row's gradient against weights x dout rounded once (bit
  // for bit) and zeros in the rows no slot fills (the buffer poisoned first), the weights' gradient against
  // the fp64 dot.
  std::vector<std::vector<__nv_bfloat16>> dout(W);
  for (int r = 0; r < W; ++r) {
    dout[r].resize(std::max<int64_t>(T[r], 1) * mc.hidden);
    for (auto& x : dout[r]) x = __float2bfloat16(float(int64_t(g() % 2001) - 1000) / 512.f);
  }
  // expert_out as the caller's own buffer on even ranks, of the rows in use only, with the combine area
  // poisoned (only the op's copy, after its first meeting, puts the outputs where the peers read them), the
  // combine area itself on odd ones (no copy).
  struct Backward {
    DeviceBuffer dout, dw, expert_out;
    Backward(size_t ob, size_t wb, size_t eb) : dout(ob), dw(wb), expert_out(eb) {}
  };
  std::vector<std::unique_ptr<Backward>> back;
  std::vector<void*> grads(c.num_local());
  const size_t grad_bytes = size_t(got[0].capacity) * mc.hidden * 2;
  c.host_barrier();  // every rank's combine over: its reads of the areas poisoned below are done
  for (int i = 0; i < c.num_local(); ++i) {
    Rank& rank = c.local(i);
    const int r = rank.rank();
    WEFT_CUDA_CHECK(cudaSetDevice(rank.device()));
    MoeShape s = base;
    s.tokens = T[r];
    grads[i] = moe_combine_grad_input(c, rank, s, DType::kBF16);
    weft::test::poison(c, i, grads[i], grad_bytes);
    auto b = std::make_unique<Backward>(dout[r].size() * 2, weights[r].size() * 4, grad_bytes);
    weft::test::upload(c, i, b->dout.p, dout[r].data(), b->dout.bytes);
    if (r % 2 == 0) {
      if (L.rows[r] > 0)
        weft::test::upload(c, i, b->expert_out.p, y[r].data(), size_t(L.rows[r]) * mc.hidden * 2);
      weft::test::poison(c, i, inputs[i], grad_bytes);
    }
    weft::test::poison(c, i, b->dw.p, b->dw.bytes);
    back.push_back(std::move(b));
  }
  c.host_barrier();
  for (int i = 0; i < c.num_local(); ++i) {
    Rank& rank = c.local(i);
    WEFT_CUDA_CHECK(cudaSetDevice(rank.device()));
    MoeShape s = base;
    s.tokens = T[rank.rank()];
    const float* w = comb[i]->w.as<float>();
    float* dw = back[i]->dw.as<float>();
    const bool own = rank.rank() % 2 == 0;
    const void* expert_out = own ? back[i]->expert_out.p : inputs[i];
    const int64_t rows = own ? L.rows[rank.rank()] : got[i].capacity;
    weft::test::keeping_plan(c,
                             moe_combine_backward_plan(c, rank, expert_out, rows, got[i], w, back[i]->dout.p,
                                                       grads[i], dw, s, DType::kBF16),
                             [&] {
                               moe_combine_backward(c, rank, expert_out, rows, got[i], w, back[i]->dout.p,
                                                    grads[i], dw, s, DType::kBF16);
                             });
  }
  c.synchronize();
  for (int i = 0; i < c.num_local(); ++i) {
    const int d = c.local(i).rank();
    // This rank's experts' gradient rows: the slot that filled each row, or zeros.
    std::vector<__nv_bfloat16> want(size_t(got[i].capacity) * mc.hidden, __float2bfloat16(0.f));
    for (int s = 0; s < W; ++s)
      for (int64_t t = 0; t < T[s]; ++t)
        for (int j = 0; j < mc.top_k; ++j) {
          const int e = routing[s].experts[t * mc.top_k + j];
          if (e < 0 || e / per != d) continue;
          const int64_t row = L.row_of[s][t * mc.top_k + j];
          for (int64_t h = 0; h < mc.hidden; ++h)
            want[row * mc.hidden + h] =
                __float2bfloat16(weights[s][t * mc.top_k + j] * __bfloat162float(dout[s][t * mc.hidden + h]));
        }
    std::vector<__nv_bfloat16> grad(want.size());
    weft::test::download(c, i, grad.data(), grads[i], grad_bytes);
    int64_t bad_grad = 0;
    for (size_t k = 0; k < grad.size(); ++k) bad_grad += std::memcmp(&grad[k], &want[k], 2) != 0;
    // This rank's tokens' weight gradients.
    std::vector<float> dw(std::max<size_t>(routing[d].experts.size(), 1));
    weft::test::download(c, i, dw.data(), back[i]->dw.p, dw.size() * 4);
    int64_t bad_dw = 0;
    for (int64_t t = 0; t < T[d]; ++t)
      for (int j = 0; j < mc.top_k; ++j) {
        const int e = routing[d].experts[t * mc.top_k + j];
        double dot = 0, scale = 0;
        if (e >= 0) {
          const int64_t row = L.row_of[d][t * mc.top_k + j];
          for (int64_t h = 0; h < mc.hidden; ++h) {
            const double p = double(__bfloat162float(dout[d][t * mc.hidden + h])) *
                             __bfloat162float(y[e / per][row * mc.hidden + h]);
            dot += p;
            scale += std::abs(p);
          }
        }
        const float x = dw[t * mc.top_k + j];
        bad_dw += !(std::abs(x - dot) <= 1e-5 * scale + 1e-30);
      }
    if (bad_grad || bad_dw)
      failures += "\n    " + label + ": rank " + std::to_string(d) +
                  " combine backward: " + std::to_string(bad_grad) + " expert-gradient values, " +
                  std::to_string(bad_dw) + " weight gradients wrong";
  }
  if (!failures.empty() || mc.align % 128 != 0) return failures;  // the GEMMs need whole 128-row tiles

  // The second expert GEMM fused with the combine against grouped_gemm + moe_combine on the same rows and
  // weights (the same tiles, the same sums): bit for bit. The outputs poisoned first.
  const int64_t inter = 136;  // a partial K block
  struct Fused {
    DeviceBuffer a, b, ref, out;
    Fused(size_t ab, size_t bb, size_t ob) : a(ab), b(bb), ref(ob), out(ob) {}
  };
  std::vector<std::unique_ptr<Fused>> fused;
  for (int i = 0; i < c.num_local(); ++i) {
    Rank& rank = c.local(i);
    const int r = rank.rank();
    WEFT_CUDA_CHECK(cudaSetDevice(rank.device()));
    std::vector<__nv_bfloat16> a(size_t(got[i].capacity) * inter), b(size_t(per) * mc.hidden * inter);
    for (auto& x : a) x = __float2bfloat16(float(int64_t(g() % 2001) - 1000) / 1024.f);
    for (auto& x : b) x = __float2bfloat16(float(int64_t(g() % 2001) - 1000) / 1024.f);
    auto f = std::make_unique<Fused>(a.size() * 2, b.size() * 2, std::max<int64_t>(T[r], 1) * mc.hidden * 2);
    weft::test::upload(c, i, f->a.p, a.data(), f->a.bytes);
    weft::test::upload(c, i, f->b.p, b.data(), f->b.bytes);
    weft::test::poison(c, i, f->ref.p, f->ref.bytes);
    weft::test::poison(c, i, f->out.p, f->out.bytes);
    fused.push_back(std::move(f));
  }
  c.host_barrier();
  for (int i = 0; i < c.num_local(); ++i) {
    Rank& rank = c.local(i);
    WEFT_CUDA_CHECK(cudaSetDevice(rank.device()));
    MoeShape s = base;
    s.tokens = T[rank.rank()];
    GemmOptions o;
    o.max_blocks = rank.sm_budget();
    grouped_gemm(fused[i]->a.p, fused[i]->b.p, inputs[i], got[i].group_end, per, got[i].capacity, mc.hidden,
                 inter, BLayout::kNK, DType::kBF16, rank.stream(), o);
    moe_combine(c, rank, inputs[i], got[i], comb[i]->w.as<float>(), fused[i]->ref.p, s, DType::kBF16);
  }
  for (int i = 0; i < c.num_local(); ++i) {
    Rank& rank = c.local(i);
    WEFT_CUDA_CHECK(cudaSetDevice(rank.device()));
    MoeShape s = base;
    s.tokens = T[rank.rank()];
    const float* w = comb[i]->w.as<float>();
    weft::test::keeping_plan(
        c,
        moe_grouped_gemm_combine_plan(c, rank, fused[i]->a.p, fused[i]->b.p, BLayout::kNK, got[i].capacity,
                                      inter, got[i], w, fused[i]->out.p, s),
        [&] {
          moe_grouped_gemm_combine(c, rank, fused[i]->a.p, fused[i]->b.p, BLayout::kNK, got[i].capacity,
                                   inter, got[i], w, fused[i]->out.p, s);
        });
  }
  c.synchronize();
  for (int i = 0; i < c.num_local(); ++i) {
    const int r = c.local(i).rank();
    const size_t bytes = size_t(T[r]) * mc.hidden * 2;
    std::vector<uint8_t> ref(std::max<size_t>(bytes, 1)), out(std::max<size_t>(bytes, 1));
    weft::test::download(c, i, ref.data(), fused[i]->ref.p, bytes);
    weft::test::download(c, i, out.data(), fused[i]->out.p, bytes);
    int64_t bad = 0;
    for (size_t k = 0; k < bytes; k += 2) bad += std::memcmp(&ref[k], &out[k], 2) != 0;
    if (bad)
      failures += "\n    " + label + ": rank " + std::to_string(r) +
                  " fused GEMM + combine: " + std::to_string(bad) +
                  " values differ from grouped_gemm + moe_combine";
  }
  if (!failures.empty()) return failures;

  // The dispatch inside the first expert GEMM against moe_dispatch + grouped_gemm on the same routing: the
  // same rows and row sources, and the same GEMM outputs bit for bit over every group's rows (plain and
  // SwiGLU epilogues, one call after the other on one area; the outputs poisoned first).
  for (const Activation act : {Activation::kNone, Activation::kSwiGLU}) {
    const bool swiglu = act == Activation::kSwiGLU;
    const int64_t n = swiglu ? 512 : 200, c_cols = swiglu ? n / 2 : n;
    struct Up {
      DeviceBuffer b, ref, out;
      std::vector<uint8_t> rows, sources;
      Up(size_t bb, size_t cb) : b(bb), ref(cb), out(cb) {}
    };
    std::vector<std::unique_ptr<Up>> up;
    const size_t c_bytes = size_t(got[0].capacity) * c_cols * 2;
    for (int i = 0; i < c.num_local(); ++i) {
      Rank& rank = c.local(i);
      const int r = rank.rank();
      WEFT_CUDA_CHECK(cudaSetDevice(rank.device()));
      std::vector<__nv_bfloat16> b(size_t(per) * n * mc.hidden);
      for (auto& x : b) x = __float2bfloat16(float(int64_t(g() % 2001) - 1000) / 1024.f);
      auto u = std::make_unique<Up>(b.size() * 2, c_bytes);
      weft::test::upload(c, i, u->b.p, b.data(), u->b.bytes);
      weft::test::poison(c, i, u->ref.p, c_bytes);
      weft::test::poison(c, i, u->out.p, c_bytes);
      // The plain dispatch's rows and sources (still in the area: nothing has dispatched since).
      u->rows.resize(std::max<size_t>(size_t(L.rows[r]) * mc.hidden * 2, 1));
      u->sources.resize(std::max<size_t>(size_t(L.rows[r]) * 4, 1));
      weft::test::download(c, i, u->rows.data(), got[i].rows, size_t(L.rows[r]) * mc.hidden * 2);
      weft::test::download(c, i, u->sources.data(), got[i].row_source, size_t(L.rows[r]) * 4);
      GemmOptions o;
      o.activation = act;
      o.max_blocks = rank.sm_budget();
      grouped_gemm(got[i].rows, u->b.p, u->ref.p, got[i].group_end, per, got[i].capacity, n, mc.hidden,
                   BLayout::kNK, DType::kBF16, rank.stream(), o);
      up.push_back(std::move(u));
    }
    c.synchronize();
    c.host_barrier();
    std::vector<MoeDispatched> again(c.num_local());
    for (int i = 0; i < c.num_local(); ++i) {
      Rank& rank = c.local(i);
      WEFT_CUDA_CHECK(cudaSetDevice(rank.device()));
      MoeShape s = base;
      s.tokens = T[rank.rank()];
      const auto* experts = local[i]->exp.as<int32_t>();
      weft::test::keeping_plan(
          c,
          moe_dispatch_grouped_gemm_plan(c, rank, local[i]->tok.p, experts, s, local[i]->ws.p, ws_bytes,
                                         up[i]->b.p, BLayout::kNK, n, act, up[i]->out.p),
          [&] {
            again[i] = moe_dispatch_grouped_gemm(c, rank, local[i]->tok.p, experts, s, local[i]->ws.p,
                                                 ws_bytes, up[i]->b.p, BLayout::kNK, n, act, up[i]->out.p);
          });
    }
    c.synchronize();
    for (int i = 0; i < c.num_local(); ++i) {
      const int r = c.local(i).rank();
      std::vector<uint8_t> rows(up[i]->rows.size()), sources(up[i]->sources.size());
      weft::test::download(c, i, rows.data(), again[i].rows, size_t(L.rows[r]) * mc.hidden * 2);
      weft::test::download(c, i, sources.data(), again[i].row_source, size_t(L.rows[r]) * 4);
      const size_t bytes = size_t(L.rows[r]) * c_cols * 2;
      std::vector<uint8_t> ref(std::max<size_t>(bytes, 1)), out(std::max<size_t>(bytes, 1));
      weft::test::download(c, i, ref.data(), up[i]->ref.p, bytes);
      weft::test::download(c, i, out.data(), up[i]->out.p, bytes);
      int64_t bad_rows = 0, bad_sources = 0, bad_out = 0;
      for (size_t k = 0; k < size_t(L.rows[r]) * mc.hidden * 2; k += 2)
        bad_rows += std::memcmp(&rows[k], &up[i]->rows[k], 2) != 0;
      for (size_t k = 0; k < size_t(L.rows[r]) * 4; k += 4)
        bad_sources += std::memcmp(&sources[k], &up[i]->sources[k], 4) != 0;
      for (size_t k = 0; k < bytes; k += 2) bad_out += std::memcmp(&ref[k], &out[k], 2) != 0;
      if (bad_rows || bad_sources || bad_out)
        failures += "\n    " + label + (swiglu ? " swiglu" : "") + ": rank " + std::to_string(r) +
                    " dispatch inside the GEMM: " + std::to_string(bad_rows) + " row values, " +
                    std::to_string(bad_sources) + " row sources, " + std::to_string(bad_out) +
                    " GEMM outputs differ from moe_dispatch + grouped_gemm";
    }
  }
  return failures;
}

}  // namespace

WEFT_GPU_TEST(moe_dispatch_and_combine_match_host_layout) {
  Communicator& c = ctx.comm();
  std::vector<MoeCase> cases = {
      {1, 1, 64, 100, false, 1},           {4, 2, 136, 257, true, 128}, {8, 8, 1024, 64, false, 128},
      {2, 8, 256, 300, true, 16},           // fewer experts per rank than top_k: tokens fill several groups
      {8, 8, 1024, 64, false, 128, false},  // inference: padding rows left as they are, combine unaffected
  };
  if (!ctx.quick) {
    cases.push_back({4, 8, 2048, 1000, true, 128});
    cases.push_back({2, 2, 128, 16384, true, 128});  // 16k tokens on a rank beside ranks of 1 and 0
  }
  std::string failures;
  uint64_t seed = 900;
  for (const MoeCase& mc : cases)
    for (int round = 0; round < 2; ++round) failures += run_moe_case(c, mc, seed += 7);
  WEFT_EXPECT(failures.empty(), failures);
}

// The no-host-synchronisation mode in CUDA graphs: dispatch, the rows as the experts' outputs (identity
// experts), combine, captured once per rank and replayed on new tokens, routing and weights: out[t] against
// the host's fp32 weighted sum of x[t] in slot order (bit for bit). The layout is computed on the device at
// every replay. With the dispatch of record and the low-latency one (its groups' counters re-armed on the
// device between replays).
static std::string replay_in_cuda_graphs(Communicator& c, bool low_latency) {
  const int W = c.world(), E = 4 * W, k = 2;
  const int64_t hidden = 256, max_tokens = 100 + W - 1;
  MoeShape base{0, max_tokens, hidden, E, k, 128};
  base.low_latency = low_latency;
  const size_t ws_bytes = moe_dispatch_workspace_bytes(W, base);
  struct Local {
    int64_t tokens;
    DeviceBuffer x, experts, weights, out, ws;
    void* combine_in = nullptr;
    MoeDispatched d;
    cudaGraphExec_t exec = nullptr;
    Local(int64_t t, size_t ws_bytes)
        : tokens(t),
          x(t * hidden * 2),
          experts(t * k * 4),
          weights(t * k * 4),
          out(t * hidden * 2),
          ws(ws_bytes) {}
  };
  std::vector<std::unique_ptr<Local>> local;
  for (int i = 0; i < c.num_local(); ++i) {
    WEFT_CUDA_CHECK(cudaSetDevice(c.local(i).device()));
    local.push_back(std::make_unique<Local>(100 + c.local(i).rank(), ws_bytes));
  }
  // Inputs of a round: tokens, routing (some slots dropped) and weights, from the seed and the rank.
  struct Inputs {
    std::vector<__nv_bfloat16> x;
    std::vector<int32_t> experts;
    std::vector<float> weights;
  };
  auto inputs = [&](int r, int64_t tokens, uint64_t seed) {
    std::mt19937_64 g(seed * 131 + r);
    Inputs in;
    in.x.resize(tokens * hidden);
    for (auto& v : in.x) v = __float2bfloat16(float(int64_t(g() % 2001) - 1000) / 64.f);
    for (int64_t s = 0; s < tokens * k; ++s) {
      in.experts.push_back(g() % 10 == 0 ? -1 : static_cast<int32_t>(g() % E));
      in.weights.push_back(float(g() % 1000) / 1000.f);
    }
    return in;
  };
  auto upload_round = [&](uint64_t seed) {
    for (int i = 0; i < c.num_local(); ++i) {
      Local& l = *local[i];
      const Inputs in = inputs(c.local(i).rank(), l.tokens, seed);
      weft::test::upload(c, i, l.x.p, in.x.data(), l.x.bytes);
      weft::test::upload(c, i, l.experts.p, in.experts.data(), l.experts.bytes);
      weft::test::upload(c, i, l.weights.p, in.weights.data(), l.weights.bytes);
      weft::test::poison(c, i, l.out.p, l.out.bytes);
    }
    c.host_barrier();
  };
  // One layer on every rank's stream; the first call (outside capture) sizes the workspace areas.
  auto layer = [&](int i) {
    Rank& rank = c.local(i);
    Local& l = *local[i];
    MoeShape s = base;
    s.tokens = l.tokens;
    l.d = moe_dispatch(c, rank, l.x.p, l.experts.as<int32_t>(), s, l.ws.p, ws_bytes, DType::kBF16);
    l.combine_in = moe_combine_input(c, rank, s, DType::kBF16);
    WEFT_CUDA_CHECK(cudaMemcpyAsync(l.combine_in, l.d.rows, size_t(l.d.capacity) * hidden * 2,
                                    cudaMemcpyDeviceToDevice, rank.stream()));
    moe_combine(c, rank, l.combine_in, l.d, l.weights.as<float>(), l.out.p, s, DType::kBF16);
  };
  upload_round(1);
  for (int i = 0; i < c.num_local(); ++i) {
    WEFT_CUDA_CHECK(cudaSetDevice(c.local(i).device()));
    layer(i);
  }
  c.synchronize();
  for (int i = 0; i < c.num_local(); ++i) {
    Rank& rank = c.local(i);
    WEFT_CUDA_CHECK(cudaSetDevice(rank.device()));
    cudaGraph_t graph;
    WEFT_CUDA_CHECK(cudaStreamBeginCapture(rank.stream(), cudaStreamCaptureModeThreadLocal));
    layer(i);
    WEFT_CUDA_CHECK(cudaStreamEndCapture(rank.stream(), &graph));
    WEFT_CUDA_CHECK(cudaGraphInstantiate(&local[i]->exec, graph, 0));
    WEFT_CUDA_CHECK(cudaGraphDestroy(graph));
  }
  std::string failures;
  for (int replay = 0; replay < 3; ++replay) {
    const uint64_t seed = 40 + replay;
    upload_round(seed);
    for (int i = 0; i < c.num_local(); ++i) {
      WEFT_CUDA_CHECK(cudaSetDevice(c.local(i).device()));
      WEFT_CUDA_CHECK(cudaGraphLaunch(local[i]->exec, c.local(i).stream()));
    }
    c.synchronize();
    for (int i = 0; i < c.num_local(); ++i) {
      const Local& l = *local[i];
      const Inputs in = inputs(c.local(i).rank(), l.tokens, seed);
      std::vector<__nv_bfloat16> out(l.tokens * hidden);
      weft::test::download(c, i, out.data(), l.out.p, l.out.bytes);
      int64_t bad = 0;
      for (int64_t t = 0; t < l.tokens; ++t)
        for (int64_t h = 0; h < hidden; ++h) {
          const float x = __bfloat162float(in.x[t * hidden + h]);
          const int32_t* e = &in.experts[t * k];
          const float* w = &in.weights[t * k];
          float acc = 0.f;
          for (int j = 0; j < k; ++j)
            if (e[j] >= 0) acc = std::fma(w[j], x, acc);
          bad += !(__bfloat162float(out[t * hidden + h]) == __bfloat162float(__float2bfloat16(acc)));
        }
      if (bad)
        failures += std::string("\n    ") + (low_latency ? "low latency, " : "") + "replay " +
                    std::to_string(replay) + ", rank " + std::to_string(c.local(i).rank()) + ": " +
                    std::to_string(bad) + " values differ from the host's weighted sum";
    }
    c.host_barrier();
  }
  for (auto& l : local) WEFT_CUDA_CHECK(cudaGraphExecDestroy(l->exec));
  return failures;
}

WEFT_GPU_TEST(moe_dispatch_and_combine_replay_in_cuda_graphs) {
  Communicator& c = ctx.comm();
  std::string failures = replay_in_cuda_graphs(c, false);
  failures += replay_in_cuda_graphs(c, true);
  WEFT_EXPECT(failures.empty(), failures);
}

// The low-latency dispatch (MoeShape::low_latency): eight calls in a row on new routing each, top-k 1, 2, 8
// and 16 twice (at most the experts; the groups'
// counters zeroed and re-armed between calls), ranks with no token, dropped slots, distinct experts per
// token. Every slot's row lies in its expert's fixed group below the group's count, no two slots share a row,
// the row holds the token (bit for bit), each group's count is the slots routed to it; then moe_combine
// through the handle over the dispatched rows themselves (identity experts) against the host's fp32 sums.
WEFT_GPU_TEST(moe_low_latency_dispatch_and_combine) {
  Communicator& c = ctx.comm();
  const int W = c.world(), per = 3, E = per * W;
  const int64_t hidden = 328;  // a whole 256-column chunk and a short one
  std::vector<int64_t> T(W);
  for (int r = 0; r < W; ++r) T[r] = r == W - 1 ? 0 : 5 + 3 * r;  // the last rank has no token
  const int64_t max_tokens = *std::max_element(T.begin(), T.end());
  const int64_t group = (W * max_tokens + 127) / 128 * 128;
  std::mt19937_64 g(4242);
  for (int pass = 0; pass < 8; ++pass) {
    // Top-k 1, 2, 8 and 16 (a lane per slot, the whole warp's share), twice.
    const int call = pass % 4;
    const int top_k = std::min(call == 0 ? 1 : call == 1 ? 2 : call == 2 ? 8 : 16, E);
    MoeShape base{0, max_tokens, hidden, E, top_k, 128};
    base.low_latency = true;
    const size_t ws_bytes = moe_dispatch_workspace_bytes(W, base);
    std::vector<std::vector<int32_t>> experts(W);
    std::vector<std::vector<__nv_bfloat16>> tokens(W);
    std::vector<std::vector<float>> weights(W);
    for (int r = 0; r < W; ++r) {
      random_routing(g, T[r], E, top_k, hidden, 64.f, experts[r], tokens[r]);
      weights[r].resize(std::max<size_t>(experts[r].size(), 1));
      for (auto& w : weights[r]) w = float(g() % 1000) / 1000.f;
    }
    struct Local {
      DeviceBuffer tok, exp, ws, w, out;
      Local(size_t t, size_t e, size_t ws_, size_t wb, size_t ob) : tok(t), exp(e), ws(ws_), w(wb), out(ob) {}
    };
    std::vector<std::unique_ptr<Local>> local;
    for (int i = 0; i < c.num_local(); ++i) {
      const int r = c.local(i).rank();
      WEFT_CUDA_CHECK(cudaSetDevice(c.local(i).device()));
      auto l = std::make_unique<Local>(tokens[r].size() * 2, std::max<size_t>(experts[r].size(), 1) * 4,
                                       ws_bytes, weights[r].size() * 4, tokens[r].size() * 2);
      weft::test::upload(c, i, l->tok.p, tokens[r].data(), l->tok.bytes);
      if (!experts[r].empty()) weft::test::upload(c, i, l->exp.p, experts[r].data(), experts[r].size() * 4);
      weft::test::upload(c, i, l->w.p, weights[r].data(), l->w.bytes);
      weft::test::poison(c, i, l->out.p, l->out.bytes);
      local.push_back(std::move(l));
    }
    c.host_barrier();
    std::vector<MoeDispatched> got = dispatch_on_every_rank(c, base, T, local, ws_bytes);
    // Every rank's row_of (as a source), then each destination's counts and rows.
    std::vector<std::vector<int32_t>> row_of(W);
    for (int i = 0; i < c.num_local(); ++i) {
      const int r = c.local(i).rank();
      row_of[r].resize(std::max<size_t>(experts[r].size(), 1));
      if (!experts[r].empty())
        weft::test::download(c, i, row_of[r].data(), got[i].row_of, experts[r].size() * 4);
    }
    for (int i = 0; i < c.num_local(); ++i) {
      const int d = c.local(i).rank();
      WEFT_EXPECT(got[i].group_rows != nullptr && got[i].capacity == per * group,
                  "low latency: the handle's group_rows / capacity (" << got[i].capacity << ")");
      std::vector<int32_t> counts(per), ends(per);
      weft::test::download(c, i, counts.data(), got[i].group_rows, per * 4);
      weft::test::download(c, i, ends.data(), got[i].group_end, per * 4);
      std::vector<__nv_bfloat16> rows(size_t(per * group) * hidden);
      weft::test::download(c, i, rows.data(), got[i].rows, rows.size() * 2);
      int64_t bad =
          low_latency_group_errors(c, d, per, group, experts, row_of, counts, [&](int s, size_t x, int row) {
            return std::memcmp(&rows[size_t(row) * hidden], &tokens[s][(x / top_k) * hidden], hidden * 2) ==
                   0;
          });
      for (int le = 0; le < per; ++le) bad += ends[le] != (le + 1) * group;
      WEFT_EXPECT(bad == 0, "low latency, call " << call << ", rank " << d << ": " << bad
                                                 << " rows, counts or ends wrong");
    }
    // Combine over the dispatched rows as the experts' outputs: copied into the combine area on even passes;
    // on odd ones the dispatch's rows passed as they are, the area poisoned (NaN), so that the op's copy of
    // the received rows must fill every row the combine reads.
    const bool copied_by_op = pass % 2 == 1;
    for (int i = 0; i < c.num_local(); ++i) {
      Rank& rank = c.local(i);
      WEFT_CUDA_CHECK(cudaSetDevice(rank.device()));
      MoeShape s = base;
      s.tokens = T[rank.rank()];
      void* in = moe_combine_input(c, rank, s, DType::kBF16);
      const size_t bytes = size_t(got[i].capacity) * hidden * 2;
      if (copied_by_op)
        WEFT_CUDA_CHECK(cudaMemsetAsync(in, 0xff, bytes, rank.stream()));
      else
        WEFT_CUDA_CHECK(cudaMemcpyAsync(in, got[i].rows, bytes, cudaMemcpyDeviceToDevice, rank.stream()));
    }
    c.synchronize();
    c.host_barrier();
    for (int i = 0; i < c.num_local(); ++i) {
      Rank& rank = c.local(i);
      WEFT_CUDA_CHECK(cudaSetDevice(rank.device()));
      MoeShape s = base;
      s.tokens = T[rank.rank()];
      const void* expert_out = copied_by_op ? got[i].rows : moe_combine_input(c, rank, s, DType::kBF16);
      moe_combine(c, rank, expert_out, got[i], local[i]->w.as<float>(), local[i]->out.p, s, DType::kBF16);
    }
    c.synchronize();
    // The last call's routing again, four rounds of dispatch and combine back to back with no host wait: the
    // groups' counters re-armed between rounds on the device alone.
    for (int round = 0; round < 4 && call == 2; ++round)
      for (int i = 0; i < c.num_local(); ++i) {
        Rank& rank = c.local(i);
        WEFT_CUDA_CHECK(cudaSetDevice(rank.device()));
        MoeShape s = base;
        s.tokens = T[rank.rank()];
        if (round == 0) weft::test::poison(c, i, local[i]->out.p, local[i]->out.bytes);
        got[i] = moe_dispatch(c, rank, local[i]->tok.p, local[i]->exp.as<int32_t>(), s, local[i]->ws.p,
                              ws_bytes, DType::kBF16);
        void* in = moe_combine_input(c, rank, s, DType::kBF16);
        WEFT_CUDA_CHECK(cudaMemcpyAsync(in, got[i].rows, size_t(got[i].capacity) * hidden * 2,
                                        cudaMemcpyDeviceToDevice, rank.stream()));
        moe_combine(c, rank, in, got[i], local[i]->w.as<float>(), local[i]->out.p, s, DType::kBF16);
      }
    c.synchronize();
    for (int i = 0; i < c.num_local(); ++i) {
      const int r = c.local(i).rank();
      std::vector<__nv_bfloat16> out(tokens[r].size());
      weft::test::download(c, i, out.data(), local[i]->out.p, out.size() * 2);
      int64_t bad = 0;
      for (int64_t t = 0; t < T[r]; ++t)
        for (int64_t h = 0; h < hidden; ++h) {
          float acc = 0.f;
          for (int j = 0; j < top_k; ++j)
            if (experts[r][t * top_k + j] >= 0)
              acc += weights[r][t * top_k + j] * __bfloat162float(tokens[r][t * hidden + h]);
          const float o = __bfloat162float(out[t * hidden + h]);
          bad += !(std::fabs(o - acc) <= 1e-2f * std::max(1.f, std::fabs(acc)));
        }
      WEFT_EXPECT(bad == 0, "low latency combine, call " << call << ", rank " << r << ": " << bad
                                                         << " outputs off the host's sums");
    }
    c.host_barrier();
  }
}

// Two micro-batches interleaved on two lanes of the team (Communicator::subteam(rank, W, 1, 1)): dispatch A,
// dispatch B, the experts (identity: each dispatch's rows into its lane's combine input), combine A, combine
// B, all queued with no host wait. Each lane has its own areas and flags, so B's rows and outputs do not land
// on A's; on one lane, dispatch B would overwrite A's rows before A's experts read them. Both outputs against
// the host's fp32 weighted sums of the tokens.
WEFT_GPU_TEST(moe_interleaved_micro_batches_on_lanes) {
  Communicator& c = ctx.comm();
  const int W = c.world(), per = 2, E = per * W, top_k = 2;
  const int64_t hidden = 264;  // a whole 256-column chunk and a short one
  std::mt19937_64 g(919);
  struct Batch {
    std::vector<int64_t> T;
    std::vector<std::vector<int32_t>> experts;
    std::vector<std::vector<__nv_bfloat16>> tokens;
    std::vector<std::vector<float>> weights;
  };
  Batch batch[2];
  for (int b = 0; b < 2; ++b) {
    Batch& x = batch[b];
    x.T.resize(W);
    x.experts.resize(W);
    x.tokens.resize(W);
    x.weights.resize(W);
    for (int r = 0; r < W; ++r) {
      x.T[r] = b == 0 ? 17 + 3 * r : 40 - 2 * r;
      for (int64_t t = 0; t < x.T[r] * top_k; ++t)
        x.experts[r].push_back(g() % 10 == 0 ? -1 : int32_t(g() % E));
      x.tokens[r].resize(std::max<int64_t>(x.T[r], 1) * hidden);
      for (auto& v : x.tokens[r]) v = __float2bfloat16(float(int64_t(g() % 2001) - 1000) / 64.f);
      x.weights[r].resize(std::max<int64_t>(x.T[r], 1) * top_k);
      for (auto& w : x.weights[r]) w = float(g() % 1000) / 1000.f;
    }
  }
  struct Local {
    DeviceBuffer tok, exp, ws, w, out;
  };
  std::vector<std::unique_ptr<Local>> local[2];
  std::vector<MoeShape> shapes[2];
  for (int b = 0; b < 2; ++b)
    for (int i = 0; i < c.num_local(); ++i) {
      const int r = c.local(i).rank();
      WEFT_CUDA_CHECK(cudaSetDevice(c.local(i).device()));
      const Batch& x = batch[b];
      MoeShape s{x.T[r], *std::max_element(x.T.begin(), x.T.end()), hidden, E, top_k, 128};
      shapes[b].push_back(s);
      local[b].push_back(std::unique_ptr<Local>(new Local{
          DeviceBuffer(x.tokens[r].size() * 2), DeviceBuffer(std::max<size_t>(x.experts[r].size(), 1) * 4),
          DeviceBuffer(moe_dispatch_workspace_bytes(W, s)), DeviceBuffer(x.weights[r].size() * 4),
          DeviceBuffer(x.tokens[r].size() * 2)}));
      Local& l = *local[b].back();
      weft::test::upload(c, i, l.tok.p, x.tokens[r].data(), l.tok.bytes);
      if (!x.experts[r].empty())
        weft::test::upload(c, i, l.exp.p, x.experts[r].data(), x.experts[r].size() * 4);
      weft::test::upload(c, i, l.w.p, x.weights[r].data(), l.w.bytes);
      weft::test::poison(c, i, l.out.p, l.out.bytes);
    }
  c.host_barrier();
  const auto lane_rank = [&](int i, int b) -> Rank& { return c.subteam(c.local(i), W, 1, b); };
  std::vector<MoeDispatched> got[2];
  for (int b = 0; b < 2; ++b)  // dispatch A on lane 0, then dispatch B on lane 1
    for (int i = 0; i < c.num_local(); ++i) {
      Rank& rank = lane_rank(i, b);
      WEFT_CUDA_CHECK(cudaSetDevice(rank.device()));
      Local& l = *local[b][i];
      got[b].push_back(moe_dispatch(c, rank, l.tok.p, l.exp.as<int32_t>(), shapes[b][i], l.ws.p, l.ws.bytes,
                                    DType::kBF16, rank.stream()));
    }
  for (int b = 0; b < 2; ++b)  // the experts: each lane's rows as its outputs
    for (int i = 0; i < c.num_local(); ++i) {
      Rank& rank = lane_rank(i, b);
      WEFT_CUDA_CHECK(cudaSetDevice(rank.device()));
      void* in = moe_combine_input(c, rank, shapes[b][i], DType::kBF16);
      WEFT_CUDA_CHECK(cudaMemcpyAsync(in, got[b][i].rows, size_t(got[b][i].capacity) * hidden * 2,
                                      cudaMemcpyDeviceToDevice, rank.stream()));
    }
  for (int b = 0; b < 2; ++b)  // combine A, then combine B
    for (int i = 0; i < c.num_local(); ++i) {
      Rank& rank = lane_rank(i, b);
      WEFT_CUDA_CHECK(cudaSetDevice(rank.device()));
      Local& l = *local[b][i];
      moe_combine(c, rank, moe_combine_input(c, rank, shapes[b][i], DType::kBF16), got[b][i], l.w.as<float>(),
                  l.out.p, shapes[b][i], DType::kBF16, rank.stream());
    }
  c.synchronize();
  for (int b = 0; b < 2; ++b)
    for (int i = 0; i < c.num_local(); ++i) {
      const int r = c.local(i).rank();
      const Batch& x = batch[b];
      std::vector<__nv_bfloat16> out(x.tokens[r].size());
      weft::test::download(c, i, out.data(), local[b][i]->out.p, out.size() * 2);
      int64_t bad = 0;
      for (int64_t t = 0; t < x.T[r]; ++t)
        for (int64_t h = 0; h < hidden; ++h) {
          float acc = 0.f;
          for (int j = 0; j < top_k; ++j)
            if (x.experts[r][t * top_k + j] >= 0)
              acc += x.weights[r][t * top_k + j] * __bfloat162float(x.tokens[r][t * hidden + h]);
          const float o = __bfloat162float(out[t * hidden + h]);
          bad += !(std::fabs(o - acc) <= 1e-2f * std::max(1.f, std::fabs(acc)));
        }
      WEFT_EXPECT(bad == 0, "micro-batch " << (b ? "B (lane 1)" : "A (lane 0)") << ", rank " << r << ": "
                                           << bad << " values differ from the host's weighted sums");
    }
}

WEFT_GPU_TEST(moe_dispatch_argument_errors) {
  Communicator& c = ctx.comm();
  Rank& rank = c.local(0);
  WEFT_CUDA_CHECK(cudaSetDevice(rank.device()));
  DeviceBuffer ws(1 << 20), x(1 << 20);
  const int W = c.world();
  auto call = [&](MoeShape s) {
    moe_dispatch(c, rank, x.p, x.as<int32_t>(), s, ws.p, ws.bytes, DType::kBF16);
  };
  WEFT_EXPECT_ERROR(call({4, 4, 64, W + 1, 2, 128}), "must be a positive multiple of the world size");
  WEFT_EXPECT_ERROR(call({4, 4, 64, W, 17, 128}), "top_k must be 1..16");
  WEFT_EXPECT_ERROR(call({4, 4, 60, W, 2, 128}), "hidden must be a positive multiple of 8");
  WEFT_EXPECT_ERROR(call({5, 4, 64, W, 2, 128}), "must be 0..max_tokens");
}

// The FP8 dispatch against the bf16 one on the same routing: every routed row's FP8 values and scales are
// quantize_fp8's of the bf16 dispatch's row, bit for bit (quantizing before the trip or after it is the same
// per row); and grouped_gemm_fp8 reading the packed rows in place (lda = row_bytes, block_scales():
// a_row_stride) gives the bits it gives on dense copies of them. hidden 256 (two scale blocks), top-k 2,
// align 128; ranks with no token.
WEFT_GPU_TEST(moe_dispatch_fp8_matches_quantized_dispatch) {
  Communicator& c = ctx.comm();
  const int W = c.world(), per = 2, E = per * W, top_k = 2;
  const int64_t hidden = 256, blocks = 2, n = 128;
  std::vector<int64_t> T(W);
  for (int r = 0; r < W; ++r) T[r] = r % 3 == 2 ? 0 : 40 + 9 * r;
  MoeShape base{0, *std::max_element(T.begin(), T.end()), hidden, E, top_k, 128};
  struct Local {
    DeviceBuffer tok, exp, ws, ws8, rows, q, s, b, sb, c8, cd;
  };
  std::vector<std::unique_ptr<Local>> local;
  std::vector<MoeShape> shapes;
  std::mt19937_64 g(515);
  for (int i = 0; i < c.num_local(); ++i) {
    Rank& rank = c.local(i);
    WEFT_CUDA_CHECK(cudaSetDevice(rank.device()));
    MoeShape s = base;
    s.tokens = T[rank.rank()];
    shapes.push_back(s);
    const int64_t cap = moe_capacity(W, s), rows_bytes = cap * hidden * 2;
    local.push_back(std::unique_ptr<Local>(new Local{
        DeviceBuffer(std::max<int64_t>(s.tokens, 1) * hidden * 2),
        DeviceBuffer(std::max<int64_t>(s.tokens, 1) * top_k * 4),
        DeviceBuffer(moe_dispatch_workspace_bytes(W, s)),
        DeviceBuffer(moe_dispatch_fp8_workspace_bytes(W, s)), DeviceBuffer(rows_bytes),
        DeviceBuffer(cap * hidden), DeviceBuffer(cap * blocks * 4), DeviceBuffer(per * n * hidden),
        DeviceBuffer(per * (n / 128) * blocks * 4), DeviceBuffer(cap * n * 2), DeviceBuffer(cap * n * 2)}));
    std::vector<__nv_bfloat16> x(std::max<int64_t>(s.tokens, 1) * hidden);
    for (auto& v : x) v = __float2bfloat16(float(int64_t(g() % 2001) - 1000) / 256.f);
    std::vector<int32_t> ids(std::max<int64_t>(s.tokens, 1) * top_k);
    for (auto& e : ids) e = g() % 10 == 0 ? -1 : int32_t(g() % E);
    weft::test::upload(c, i, local[i]->tok.p, x.data(), x.size() * 2);
    weft::test::upload(c, i, local[i]->exp.p, ids.data(), ids.size() * 4);
    // The experts' FP8 weights and their block scales (any values: the two GEMMs must agree).
    std::vector<uint8_t> wb(per * n * hidden);
    for (auto& v : wb) v = uint8_t(g() % 0x78) | uint8_t(g() % 2 ? 0x80 : 0);  // finite e4m3
    std::vector<float> ws(per * (n / 128) * blocks);
    for (auto& v : ws) v = float(1 + g() % 4) / 64.f;
    weft::test::upload(c, i, local[i]->b.p, wb.data(), wb.size());
    weft::test::upload(c, i, local[i]->sb.p, ws.data(), ws.size() * 4);
  }
  c.host_barrier();
  std::vector<MoeDispatched> bf(c.num_local());
  for (int i = 0; i < c.num_local(); ++i) {
    WEFT_CUDA_CHECK(cudaSetDevice(c.local(i).device()));
    bf[i] = moe_dispatch(c, c.local(i), local[i]->tok.p, local[i]->exp.as<int32_t>(), shapes[i],
                         local[i]->ws.p, local[i]->ws.bytes, DType::kBF16);
  }
  for (int i = 0; i < c.num_local(); ++i) {  // the bf16 rows kept before the next dispatch reuses the area
    WEFT_CUDA_CHECK(cudaSetDevice(c.local(i).device()));
    WEFT_CUDA_CHECK(cudaMemcpyAsync(local[i]->rows.p, bf[i].rows, local[i]->rows.bytes,
                                    cudaMemcpyDeviceToDevice, c.local(i).stream()));
  }
  c.synchronize();
  c.host_barrier();
  std::vector<MoeDispatchedFp8> f8(c.num_local());
  for (int i = 0; i < c.num_local(); ++i) {
    WEFT_CUDA_CHECK(cudaSetDevice(c.local(i).device()));
    Rank& rank = c.local(i);
    const void* tok = local[i]->tok.p;
    const int32_t* experts = local[i]->exp.as<int32_t>();
    void* ws = local[i]->ws8.p;
    const size_t ws_bytes = local[i]->ws8.bytes;
    const Plan plan = weft::test::keeping_plan(
        c, moe_dispatch_fp8_plan(c, rank, tok, experts, shapes[i], ws, ws_bytes, DType::kBF16),
        [&] { f8[i] = moe_dispatch_fp8(c, rank, tok, experts, shapes[i], ws, ws_bytes, DType::kBF16); });
    WEFT_EXPECT(plan.op == "moe_dispatch_fp8", describe(plan));
  }
  c.synchronize();
  for (int i = 0; i < c.num_local(); ++i) {  // on every rank's stream, then one synchronisation
    Local& l = *local[i];
    WEFT_CUDA_CHECK(cudaSetDevice(c.local(i).device()));
    const cudaStream_t st = c.local(i).stream();
    const int64_t cap = moe_capacity(W, shapes[i]);
    quantize_fp8(l.rows.p, DType::kBF16, l.q.p, Fp8Type::kE4M3, l.s.as<float>(), cap, hidden,
                 Fp8Scaling::kBlock, Fp8Operand::kA, st);
    grouped_gemm_fp8(f8[i].values, l.b.p, l.c8.p, f8[i].dispatched.group_end, per, cap, n, hidden,
                     Fp8Type::kE4M3, f8[i].block_scales(l.sb.as<float>()), DType::kBF16, st,
                     GemmOptions{.lda = f8[i].row_bytes});
    grouped_gemm_fp8(l.q.p, l.b.p, l.cd.p, f8[i].dispatched.group_end, per, cap, n, hidden, Fp8Type::kE4M3,
                     Fp8Scales{Fp8Scaling::kBlock, l.s.as<float>(), l.sb.as<float>()}, DType::kBF16, st);
  }
  c.synchronize();
  for (int i = 0; i < c.num_local(); ++i) {
    Rank& rank = c.local(i);
    Local& l = *local[i];
    const int64_t cap = moe_capacity(W, shapes[i]);
    std::vector<uint8_t> packed(cap * f8[i].row_bytes), q(cap * hidden), c8(cap * n * 2), cd(cap * n * 2);
    std::vector<float> s(cap * blocks);
    std::vector<int32_t> source(cap), ends(per);
    weft::test::download(c, i, packed.data(), f8[i].values, packed.size());
    weft::test::download(c, i, q.data(), l.q.p, q.size());
    weft::test::download(c, i, s.data(), l.s.p, s.size() * 4);
    weft::test::download(c, i, c8.data(), l.c8.p, c8.size());
    weft::test::download(c, i, cd.data(), l.cd.p, cd.size());
    // The FP8 dispatch's own row sources and group ends (the same routing as the bf16 one's; its area holds
    // the bf16 dispatch's no more).
    weft::test::download(c, i, source.data(), f8[i].dispatched.row_source, source.size() * 4);
    weft::test::download(c, i, ends.data(), f8[i].dispatched.group_end, ends.size() * 4);
    int64_t routed = 0, bad_values = 0, bad_scales = 0, bad_gemm = 0;
    for (int64_t r = 0; r < ends.back(); ++r) {  // rows past the last group's end: written by no dispatch
      if (source[r] < 0) continue;               // padding
      ++routed;
      const uint8_t* row = packed.data() + r * f8[i].row_bytes;
      bad_values += std::memcmp(row, q.data() + r * hidden, hidden) != 0;
      bad_scales += std::memcmp(row + hidden, s.data() + r * blocks, blocks * 4) != 0;
      bad_gemm += std::memcmp(c8.data() + r * n * 2, cd.data() + r * n * 2, n * 2) != 0;
    }
    WEFT_EXPECT(bad_values == 0 && bad_scales == 0,
                "rank " << rank.rank() << ": of " << routed << " routed rows, " << bad_values
                        << " differ in their FP8 values and " << bad_scales << " in their scales");
    WEFT_EXPECT(bad_gemm == 0, "rank "
                                   << rank.rank() << ": " << bad_gemm << " of " << routed
                                   << " rows of the GEMM on the packed rows differ from the dense copy's");
  }
  c.host_barrier();
}

// The FP8 dispatch in low-latency mode: every routed slot's packed row, wherever its group's atomic put it,
// holds quantize_fp8's values and scales of the slot's token, bit for bit, below its group's count (the
// slots routed there); no two slots share a row. Then grouped_gemm_fp8 over the filled rows only
// (options.group_rows) on the packed rows in place, against the same GEMM over every row: the same bits in
// the tiles holding counted rows. hidden 256 (two scale blocks), top-k 2 and 8 (at most the experts); the
// last rank has no token.
WEFT_GPU_TEST(moe_dispatch_fp8_low_latency) {
  Communicator& c = ctx.comm();
  const int W = c.world(), per = 3, E = per * W;
  const int64_t hidden = 256, blocks = 2, n = 128;
  std::vector<int64_t> T(W);
  for (int r = 0; r < W; ++r) T[r] = r == W - 1 ? 0 : 6 + 5 * r;
  const int64_t max_tokens = *std::max_element(T.begin(), T.end());
  const int64_t group = (W * max_tokens + 127) / 128 * 128, cap = per * group;
  std::mt19937_64 g(616);
  for (int top_k : {2, std::min(8, E)}) {
    MoeShape base{0, max_tokens, hidden, E, top_k, 128};
    base.low_latency = true;
    std::vector<std::vector<int32_t>> experts(W);
    std::vector<std::vector<__nv_bfloat16>> tokens(W);
    for (int r = 0; r < W; ++r) random_routing(g, T[r], E, top_k, hidden, 128.f, experts[r], tokens[r]);
    struct Local {
      DeviceBuffer tok, exp, ws, q, s, b, sb, c8, cd;
    };
    std::vector<std::unique_ptr<Local>> local;
    for (int i = 0; i < c.num_local(); ++i) {
      Rank& rank = c.local(i);
      const int r = rank.rank();
      WEFT_CUDA_CHECK(cudaSetDevice(rank.device()));
      MoeShape s = base;
      s.tokens = T[r];
      const int64_t t1 = std::max<int64_t>(T[r], 1);
      local.push_back(std::unique_ptr<Local>(
          new Local{DeviceBuffer(t1 * hidden * 2), DeviceBuffer(std::max<size_t>(experts[r].size(), 1) * 4),
                    DeviceBuffer(moe_dispatch_fp8_workspace_bytes(W, s)), DeviceBuffer(t1 * hidden),
                    DeviceBuffer(t1 * blocks * 4), DeviceBuffer(per * n * hidden),
                    DeviceBuffer(per * blocks * 4), DeviceBuffer(cap * n * 2), DeviceBuffer(cap * n * 2)}));
      Local& l = *local.back();
      weft::test::upload(c, i, l.tok.p, tokens[r].data(), l.tok.bytes);
      if (!experts[r].empty()) weft::test::upload(c, i, l.exp.p, experts[r].data(), experts[r].size() * 4);
      std::vector<uint8_t> wb(per * n * hidden);
      for (auto& v : wb) v = uint8_t(g() % 0x78) | uint8_t(g() % 2 ? 0x80 : 0);  // finite e4m3
      std::vector<float> ws(per * blocks);
      for (auto& v : ws) v = float(1 + g() % 4) / 64.f;
      weft::test::upload(c, i, l.b.p, wb.data(), wb.size());
      weft::test::upload(c, i, l.sb.p, ws.data(), ws.size() * 4);
      if (T[r] > 0)  // the reference: this rank's tokens quantized where they are
        quantize_fp8(l.tok.p, DType::kBF16, l.q.p, Fp8Type::kE4M3, l.s.as<float>(), T[r], hidden,
                     Fp8Scaling::kBlock, Fp8Operand::kA, rank.stream());
    }
    c.synchronize();
    c.host_barrier();
    std::vector<MoeDispatchedFp8> f8(c.num_local());
    for (int i = 0; i < c.num_local(); ++i) {
      Rank& rank = c.local(i);
      WEFT_CUDA_CHECK(cudaSetDevice(rank.device()));
      MoeShape s = base;
      s.tokens = T[rank.rank()];
      Local& l = *local[i];
      weft::test::keeping_plan(
          c,
          moe_dispatch_fp8_plan(c, rank, l.tok.p, l.exp.as<int32_t>(), s, l.ws.p, l.ws.bytes, DType::kBF16),
          [&] {
            f8[i] =
                moe_dispatch_fp8(c, rank, l.tok.p, l.exp.as<int32_t>(), s, l.ws.p, l.ws.bytes, DType::kBF16);
          });
    }
    c.synchronize();
    for (int i = 0; i < c.num_local(); ++i) {  // the packed rows in place, over the filled rows and over all
      Local& l = *local[i];
      WEFT_CUDA_CHECK(cudaSetDevice(c.local(i).device()));
      const cudaStream_t st = c.local(i).stream();
      WEFT_CUDA_CHECK(cudaMemsetAsync(l.c8.p, 0xff, l.c8.bytes, st));
      GemmOptions o{.lda = f8[i].row_bytes};
      grouped_gemm_fp8(f8[i].values, l.b.p, l.cd.p, f8[i].dispatched.group_end, per, cap, n, hidden,
                       Fp8Type::kE4M3, f8[i].block_scales(l.sb.as<float>()), DType::kBF16, st, o);
      o.group_rows = f8[i].dispatched.group_rows;
      grouped_gemm_fp8(f8[i].values, l.b.p, l.c8.p, f8[i].dispatched.group_end, per, cap, n, hidden,
                       Fp8Type::kE4M3, f8[i].block_scales(l.sb.as<float>()), DType::kBF16, st, o);
    }
    c.synchronize();
    // Every local rank's own slots' rows on their experts' ranks, its quantized tokens.
    std::vector<std::vector<int32_t>> row_of(W);
    std::vector<std::vector<uint8_t>> q(W);
    std::vector<std::vector<float>> sc(W);
    for (int i = 0; i < c.num_local(); ++i) {
      const int r = c.local(i).rank();
      row_of[r].resize(std::max<size_t>(experts[r].size(), 1));
      if (!experts[r].empty())
        weft::test::download(c, i, row_of[r].data(), f8[i].dispatched.row_of, experts[r].size() * 4);
      q[r].resize(std::max<int64_t>(T[r], 1) * hidden);
      sc[r].resize(std::max<int64_t>(T[r], 1) * blocks);
      weft::test::download(c, i, q[r].data(), local[i]->q.p, q[r].size());
      weft::test::download(c, i, sc[r].data(), local[i]->s.p, sc[r].size() * 4);
    }
    for (int i = 0; i < c.num_local(); ++i) {
      const int d = c.local(i).rank();
      WEFT_EXPECT(
          f8[i].dispatched.group_rows != nullptr && f8[i].dispatched.capacity == cap,
          "FP8 low latency: the handle's group_rows / capacity (" << f8[i].dispatched.capacity << ")");
      std::vector<int32_t> counts(per);
      weft::test::download(c, i, counts.data(), f8[i].dispatched.group_rows, per * 4);
      std::vector<uint8_t> packed(cap * f8[i].row_bytes), c8(cap * n * 2), cd(cap * n * 2);
      weft::test::download(c, i, packed.data(), f8[i].values, packed.size());
      weft::test::download(c, i, c8.data(), local[i]->c8.p, c8.size());
      weft::test::download(c, i, cd.data(), local[i]->cd.p, cd.size());
      const int64_t bad =
          low_latency_group_errors(c, d, per, group, experts, row_of, counts, [&](int s, size_t x, int row) {
            const uint8_t* got = packed.data() + size_t(row) * f8[i].row_bytes;
            const size_t t = x / top_k;
            return std::memcmp(got, q[s].data() + t * hidden, hidden) == 0 &&
                   std::memcmp(got + hidden, sc[s].data() + t * blocks, blocks * 4) == 0;
          });
      int64_t bad_gemm = 0;
      for (int le = 0; le < per; ++le) {
        for (int64_t t = 0; t * 128 < counts[le]; ++t) {  // the tiles holding counted rows
          const size_t at = size_t(le * group + t * 128) * n * 2;
          bad_gemm += std::memcmp(c8.data() + at, cd.data() + at, size_t(128) * n * 2) != 0;
        }
      }
      WEFT_EXPECT(bad == 0, "FP8 low latency, top_k " << top_k << ", rank " << d << ": " << bad
                                                      << " rows, values, scales or counts wrong");
      WEFT_EXPECT(bad_gemm == 0, "FP8 low latency, top_k "
                                     << top_k << ", rank " << d << ": " << bad_gemm
                                     << " tiles of grouped_gemm_fp8 with group_rows differ");
    }
    c.host_barrier();
  }
}
