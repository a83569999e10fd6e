// GPU test of weft::context_attention_forward and _backward on a team (real or virtual ranks): a packed
// sequence of documents sharded in ring attention's layout (zigzag when causal), every rank's output and LSE
// against weft's single-GPU attention over the whole packed sequence on the same data (the same kernel, the
// same key blocks from each document's start: per row the same arithmetic, so the two agree to rounding or
// exactly); outputs poisoned first, NaN never passes; odd lengths, an empty document, GQA, both head dims.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <memory>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "ops/ring_attention_plan.hpp"
#include "attention_reference.hpp"
#include "harness.hpp"
#include "weft/ops/attention.hpp"
#include "weft/ops/context_attention.hpp"
#include "weft/runtime/communicator.hpp"
#include "weft/timeline.hpp"

using namespace weft;
using weft::test::DeviceBuffer;
using weft::test::TestContext;

namespace {

std::vector<__nv_bfloat16> random_rows(size_t n, uint64_t seed) {
  std::vector<__nv_bfloat16> v(n);
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (auto& x : v) x = __float2bfloat16(u(g));
  return v;
}

struct CpCase {
  std::vector<int64_t> docs;
  int64_t heads, kv_heads, dim;
  bool causal;
  bool contiguous = false;  // causal: contiguous shards (AttentionOptions::contiguous_shards), not zigzag
};

// The four methods behind one set of signatures; the hybrid's Ulysses size is hybrid_ulysses.
enum class Method { kAllGather, kUlysses, kRing, kHybrid };
int hybrid_ulysses = 1;
// Called by run_cp_case between its forward (synchronized) and its backward, where set.
std::function<void()> after_forward;
void hybrid_forward(Communicator& c, Rank& rank, const void* q, const void* k, const void* v, void* out,
                    float* lse, const std::vector<int64_t>& docs, int64_t h, int64_t kv, int64_t d, void* ws,
                    size_t ws_bytes, DType t, cudaStream_t s, const AttentionOptions& o) {
  hybrid_attention_forward(c, rank, q, k, v, out, lse, docs, h, kv, d, hybrid_ulysses, ws, ws_bytes, t, s, o);
}
void hybrid_backward(Communicator& c, Rank& rank, const void* q, const void* k, const void* v,
                     const void* out, const void* dout, const float* lse, void* dq, void* dk, void* dv,
                     const std::vector<int64_t>& docs, int64_t h, int64_t kv, int64_t d, void* ws,
                     size_t ws_bytes, DType t, cudaStream_t s, const AttentionOptions& o) {
  hybrid_attention_backward(c, rank, q, k, v, out, dout, lse, dq, dk, dv, docs, h, kv, d, hybrid_ulysses, ws,
                            ws_bytes, t, s, o);
}
Plan hybrid_forward_plan(Communicator& c, Rank& rank, const void* q, const void* k, const void* v, void* out,
                         float* lse, const std::vector<int64_t>& docs, int64_t h, int64_t kv, int64_t d,
                         void* ws, size_t ws_bytes, DType t, cudaStream_t s, const AttentionOptions& o) {
  return hybrid_attention_forward_plan(c, rank, q, k, v, out, lse, docs, h, kv, d, hybrid_ulysses, ws,
                                       ws_bytes, t, s, o);
}
Plan hybrid_backward_plan(Communicator& c, Rank& rank, const void* q, const void* k, const void* v,
                          const void* out, const void* dout, const float* lse, void* dq, void* dk, void* dv,
                          const std::vector<int64_t>& docs, int64_t h, int64_t kv, int64_t d, void* ws,
                          size_t ws_bytes, DType t, cudaStream_t s, const AttentionOptions& o) {
  return hybrid_attention_backward_plan(c, rank, q, k, v, out, dout, lse, dq, dk, dv, docs, h, kv, d,
                                        hybrid_ulysses, ws, ws_bytes, t, s, o);
}
size_t forward_workspace(Method m, int W, const CpCase& cc) {
  if (m == Method::kHybrid)
    return hybrid_attention_workspace_bytes(W, hybrid_ulysses, cc.docs, cc.causal, cc.heads, cc.kv_heads,
                                            cc.dim);
  if (m == Method::kRing) return ring_attention_workspace_bytes(W, cc.docs, cc.causal, cc.kv_heads, cc.dim);
  return m == Method::kUlysses
             ? ulysses_attention_workspace_bytes(W, cc.docs, cc.causal, cc.heads, cc.kv_heads, cc.dim)
             : context_attention_workspace_bytes(W, cc.docs, cc.causal, cc.kv_heads, cc.dim);
}
size_t backward_workspace(Method m, int W, const CpCase& cc) {
  if (m == Method::kHybrid)
    return hybrid_attention_backward_workspace_bytes(W, hybrid_ulysses, cc.docs, cc.causal, cc.heads,
                                                     cc.kv_heads, cc.dim);
  if (m == Method::kRing)
    return ring_attention_backward_workspace_bytes(W, cc.docs, cc.causal, cc.heads, cc.kv_heads, cc.dim);
  return m == Method::kUlysses ? ulysses_attention_backward_workspace_bytes(W, cc.docs, cc.causal, cc.heads,
                                                                            cc.kv_heads, cc.dim)
                               : context_attention_backward_workspace_bytes(W, cc.docs, cc.causal, cc.heads,
                                                                            cc.kv_heads, cc.dim);
}
decltype(&context_attention_forward) forward_of(Method m) {
  if (m == Method::kHybrid) return &hybrid_forward;
  if (m == Method::kRing) return &ring_attention_forward;
  return m == Method::kUlysses ? &ulysses_attention_forward : &context_attention_forward;
}
// The op's plan function: run before the call, whose workspace must stay within what it named.
decltype(&context_attention_forward_plan) forward_plan_of(Method m) {
  if (m == Method::kHybrid) return &hybrid_forward_plan;
  if (m == Method::kRing) return &ring_attention_forward_plan;
  return m == Method::kUlysses ? &ulysses_attention_forward_plan : &context_attention_forward_plan;
}
decltype(&context_attention_backward_plan) backward_plan_of(Method m) {
  if (m == Method::kHybrid) return &hybrid_backward_plan;
  if (m == Method::kRing) return &ring_attention_backward_plan;
  return m == Method::kUlysses ? &ulysses_attention_backward_plan : &context_attention_backward_plan;
}
decltype(&context_attention_backward) backward_of(Method m) {
  if (m == Method::kHybrid) return &hybrid_backward;
  if (m == Method::kRing) return &ring_attention_backward;
  return m == Method::kUlysses ? &ulysses_attention_backward : &context_attention_backward;
}

// Weft's single-GPU attention over the whole packed sequence: out, LSE, and the gradients for `go`.
struct Reference {
  std::vector<__nv_bfloat16> out, dq, dk, dv;
  std::vector<float> lse;
};
Reference single_gpu_reference(Communicator& c, const CpCase& cc, const std::vector<__nv_bfloat16>& q,
                               const std::vector<__nv_bfloat16>& k, const std::vector<__nv_bfloat16>& v,
                               const std::vector<__nv_bfloat16>& go) {
  WEFT_CUDA_CHECK(cudaSetDevice(c.local(0).device()));
  const int64_t H = cc.heads, KV = cc.kv_heads, D = cc.dim;
  std::vector<int32_t> cu(1, 0);
  for (int64_t d : cc.docs) cu.push_back(static_cast<int32_t>(cu.back() + d));
  const int64_t total = cu.back();
  DeviceBuffer dq(total * H * D * 2), dk(total * KV * D * 2), dv(total * KV * D * 2), dout(total * H * D * 2),
      dgo(total * H * D * 2), dlse(total * H * 4), dcu(cu.size() * 4), gq(total * H * D * 2),
      gk(total * KV * D * 2), gv(total * KV * D * 2);
  WEFT_CUDA_CHECK(cudaMemcpy(dq.p, q.data(), dq.bytes, cudaMemcpyHostToDevice));
  WEFT_CUDA_CHECK(cudaMemcpy(dk.p, k.data(), dk.bytes, cudaMemcpyHostToDevice));
  WEFT_CUDA_CHECK(cudaMemcpy(dv.p, v.data(), dv.bytes, cudaMemcpyHostToDevice));
  WEFT_CUDA_CHECK(cudaMemcpy(dgo.p, go.data(), dgo.bytes, cudaMemcpyHostToDevice));
  WEFT_CUDA_CHECK(cudaMemcpy(dcu.p, cu.data(), dcu.bytes, cudaMemcpyHostToDevice));
  AttentionOptions o;
  o.causal = cc.causal;
  const int32_t* cup = dcu.as<int32_t>();
  o.segments = varlen_segments(cup, cup, total, total);
  const int64_t longest = *std::max_element(cc.docs.begin(), cc.docs.end());
  const AttentionShape shape{int64_t(cc.docs.size()), longest, longest, H, KV, D};
  DeviceBuffer ws(flash_attention_backward_workspace_bytes(shape, o));
  flash_attention_forward(dq.p, dk.p, dv.p, dout.p, dlse.as<float>(), shape, DType::kBF16, nullptr, o);
  flash_attention_backward(dq.p, dk.p, dv.p, dout.p, dgo.p, dlse.as<float>(), gq.p, gk.p, gv.p, ws.p,
                           ws.bytes, shape, DType::kBF16, nullptr, o);
  WEFT_CUDA_CHECK(cudaDeviceSynchronize());
  Reference r{std::vector<__nv_bfloat16>(total * H * D), std::vector<__nv_bfloat16>(total * H * D),
              std::vector<__nv_bfloat16>(total * KV * D), std::vector<__nv_bfloat16>(total * KV * D),
              std::vector<float>(total * H)};
  WEFT_CUDA_CHECK(cudaMemcpy(r.out.data(), dout.p, dout.bytes, cudaMemcpyDeviceToHost));
  WEFT_CUDA_CHECK(cudaMemcpy(r.lse.data(), dlse.p, dlse.bytes, cudaMemcpyDeviceToHost));
  WEFT_CUDA_CHECK(cudaMemcpy(r.dq.data(), gq.p, gq.bytes, cudaMemcpyDeviceToHost));
  WEFT_CUDA_CHECK(cudaMemcpy(r.dk.data(), gk.p, gk.bytes, cudaMemcpyDeviceToHost));
  WEFT_CUDA_CHECK(cudaMemcpy(r.dv.data(), gv.p, gv.bytes, cudaMemcpyDeviceToHost));
  return r;
}

// Attention over the packed documents in fp64 on the host (small cases; attention_reference.hpp): out
// [total][H][D] and the gradients for out's gradient `go`.
weft::test::AttentionReference exact_attention(const CpCase& cc, const std::vector<__nv_bfloat16>& q,
                                               const std::vector<__nv_bfloat16>& k,
                                               const std::vector<__nv_bfloat16>& v,
                                               const std::vector<__nv_bfloat16>& go) {
  weft::test::AttentionRefShape s{
      0, 0, cc.heads, cc.kv_heads, cc.dim, cc.causal, 1.0 / std::sqrt(double(cc.dim)), {}};
  for (int64_t n : cc.docs) {
    s.seqs.push_back({s.rows_q, n, s.rows_q, n});
    s.rows_q += n;
  }
  s.rows_k = s.rows_q;
  return weft::test::attention_reference(s, q, k, v, go);
}

std::string run_cp_case(Communicator& c, Method method, const CpCase& cc, uint64_t seed) {
  const int W = c.world();
  int64_t total = 0;
  for (int64_t d : cc.docs) total += d;
  const int64_t H = cc.heads, KV = cc.kv_heads, D = cc.dim;
  const auto q = random_rows(total * H * D, seed), k = random_rows(total * KV * D, seed + 1),
             v = random_rows(total * KV * D, seed + 2);
  const ops::RingLayout L = ops::ring_layout(cc.docs, W, cc.causal, 1, !cc.contiguous);
  std::string failures;
  // Shard, run on every rank, compare.
  std::vector<std::vector<int64_t>> tokens(W);
  for (int r = 0; r < W; ++r) tokens[r] = ops::ring_tokens(L, r);
  struct Local {
    DeviceBuffer q, k, v, out, lse, ws;
    Local(int64_t n, int64_t H, int64_t KV, int64_t D, size_t ws_bytes)
        : q(n * H * D * 2),
          k(n * KV * D * 2),
          v(n * KV * D * 2),
          out(n * H * D * 2),
          lse(n * H * 4),
          ws(ws_bytes) {}
  };
  std::vector<std::unique_ptr<Local>> local;
  const size_t ws_bytes = forward_workspace(method, W, cc);
  for (int i = 0; i < c.num_local(); ++i) {
    Rank& rank = c.local(i);
    WEFT_CUDA_CHECK(cudaSetDevice(rank.device()));
    const std::vector<int64_t>& t = tokens[rank.rank()];
    const int64_t n = std::max<int64_t>(1, static_cast<int64_t>(t.size()));
    auto l = std::make_unique<Local>(n, H, KV, D, ws_bytes);
    std::vector<__nv_bfloat16> lq(n * H * D), lk(n * KV * D), lv(n * KV * D);
    for (size_t x = 0; x < t.size(); ++x) {
      std::copy_n(&q[t[x] * H * D], H * D, &lq[x * H * D]);
      std::copy_n(&k[t[x] * KV * D], KV * D, &lk[x * KV * D]);
      std::copy_n(&v[t[x] * KV * D], KV * D, &lv[x * KV * D]);
    }
    weft::test::upload(c, i, l->q.p, lq.data(), l->q.bytes);
    weft::test::upload(c, i, l->k.p, lk.data(), l->k.bytes);
    weft::test::upload(c, i, l->v.p, lv.data(), l->v.bytes);
    weft::test::poison(c, i, l->out.p, l->out.bytes);
    weft::test::poison(c, i, l->lse.p, l->lse.bytes);
    local.push_back(std::move(l));
  }
  c.host_barrier();
  AttentionOptions fo;
  fo.causal = cc.causal;
  fo.contiguous_shards = cc.contiguous;
  std::vector<Plan> plans;
  std::vector<weft::test::WorkspaceSizes> before;
  if (const auto plan_of = forward_plan_of(method))
    for (int i = 0; i < c.num_local(); ++i) {  // every rank's plan before any call grows a workspace
      plans.push_back(plan_of(c, c.local(i), local[i]->q.p, local[i]->k.p, local[i]->v.p, local[i]->out.p,
                              local[i]->lse.as<float>(), cc.docs, H, KV, D, local[i]->ws.p, ws_bytes,
                              DType::kBF16, nullptr, fo));
      before.push_back(weft::test::workspace_sizes(c, plans.back()));
    }
  for (int i = 0; i < c.num_local(); ++i) {
    Rank& rank = c.local(i);
    WEFT_CUDA_CHECK(cudaSetDevice(rank.device()));
    forward_of(method)(c, rank, local[i]->q.p, local[i]->k.p, local[i]->v.p, local[i]->out.p,
                       local[i]->lse.as<float>(), cc.docs, H, KV, D, local[i]->ws.p, ws_bytes, DType::kBF16,
                       nullptr, fo);
  }
  c.synchronize();
  if (after_forward) after_forward();
  for (size_t i = 0; i < plans.size(); ++i) {
    if (plans[i].op.empty() || plans[i].path.empty())
      return "forward: a plan without its op or path: " + describe(plans[i]);
    if (const std::string kept = weft::test::check_call_kept_plan(c, plans[i], before[i]); !kept.empty())
      return "forward: " + kept;
  }
  // The reference, on local rank 0's GPU (every process computes the same).
  const auto go = random_rows(total * H * D, seed + 3);
  const Reference reference = single_gpu_reference(c, cc, q, k, v, go);
  const std::vector<__nv_bfloat16>& ref = reference.out;
  const std::vector<float>& ref_lse = reference.lse;
  // The issue's bound on small cases: every rank's error against fp64 within 1.5x of the single call's.
  const weft::test::AttentionReference exact_all =
      total <= 2048 ? exact_attention(cc, q, k, v, go) : weft::test::AttentionReference{};
  const std::vector<double>& exact = exact_all.o;
  // The ring meets a document's keys in other blocks than the single call (ranges start at each rank's
  // part), so its fp32 sums differ in rounding and the bf16 outputs by up to one ulp; the other methods
  // run the single call's arithmetic per row.
  const double ulps = method == Method::kRing || method == Method::kHybrid ? 1.0 / 128 : 1e-3;
  for (int i = 0; i < c.num_local(); ++i) {
    const int r = c.local(i).rank();
    const std::vector<int64_t>& t = tokens[r];
    const int64_t n = static_cast<int64_t>(t.size());
    std::vector<__nv_bfloat16> got(std::max<int64_t>(n, 1) * H * D);
    std::vector<float> got_lse(std::max<int64_t>(n, 1) * H);
    weft::test::download(c, i, got.data(), local[i]->out.p, got.size() * 2);
    weft::test::download(c, i, got_lse.data(), local[i]->lse.p, got_lse.size() * 4);
    double worst = 0, worst_lse = 0, team_exact = 0, single_exact = 0;
    int64_t bad = 0;
    for (int64_t x = 0; x < n; ++x)
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t d = 0; d < D; ++d) {
          const double a = __bfloat162float(got[(x * H + h) * D + d]),
                       b = __bfloat162float(ref[(t[x] * H + h) * D + d]);
          const double e = std::isfinite(a) ? std::abs(a - b) : 1e30;
          worst = std::max(worst, e);
          bad += !(e <= 1e-3 + ulps * std::abs(b));
          if (!exact.empty()) {
            const double z = exact[(t[x] * H + h) * D + d];
            team_exact = std::max(team_exact, std::isfinite(a) ? std::abs(a - z) : 1e30);
            single_exact = std::max(single_exact, std::abs(b - z));
          }
        }
        const double a = got_lse[h * n + x], b = ref_lse[h * total + t[x]];
        const double e = a == b ? 0.0 : (std::isfinite(a) ? std::abs(a - b) : 1e30);
        worst_lse = std::max(worst_lse, e);
        bad += !(e <= 1e-4 * (1 + std::abs(b)));
      }
    std::string docs;
    for (int64_t d : cc.docs) docs += std::to_string(d) + " ";
    std::fprintf(stderr,
                 "  rank %d/%d docs %sH=%lld/%lld D=%lld%s: max |O diff| %.2e, max |LSE diff| %.2e, max |O - "
                 "fp64| %.2e (single GPU %.2e)\n",
                 r, W, docs.c_str(), (long long)H, (long long)KV, (long long)D, cc.causal ? " causal" : "",
                 worst, worst_lse, team_exact, single_exact);
    if (team_exact > 1.5 * single_exact + 1e-6)
      failures += "\n    rank " + std::to_string(r) + " docs " + docs + ": error against fp64 " +
                  std::to_string(team_exact) + " above 1.5x the single call's " +
                  std::to_string(single_exact);
    if (bad)
      failures += "\n    rank " + std::to_string(r) + " docs " + docs + (cc.causal ? "causal" : "") + ": " +
                  std::to_string(bad) + " values differ from single-GPU attention";
  }
  if (!failures.empty()) return failures;

  // Backward: each rank's dq, dk, dv against the single-GPU backward over the whole sequence (dQ and the
  // team's fp32 sums of dK / dV come in another order: agreement to bf16 rounding).
  const std::vector<__nv_bfloat16>&ref_dq = reference.dq, &ref_dk = reference.dk, &ref_dv = reference.dv;
  struct Grads {
    DeviceBuffer go, dq, dk, dv, ws;
    Grads(int64_t n, int64_t H, int64_t KV, int64_t D, size_t ws_bytes)
        : go(n * H * D * 2), dq(n * H * D * 2), dk(n * KV * D * 2), dv(n * KV * D * 2), ws(ws_bytes) {}
  };
  const size_t bws_bytes = backward_workspace(method, W, cc);
  std::vector<std::unique_ptr<Grads>> grads;
  for (int i = 0; i < c.num_local(); ++i) {
    Rank& rank = c.local(i);
    WEFT_CUDA_CHECK(cudaSetDevice(rank.device()));
    const std::vector<int64_t>& t = tokens[rank.rank()];
    const int64_t n = std::max<int64_t>(1, static_cast<int64_t>(t.size()));
    auto gr = std::make_unique<Grads>(n, H, KV, D, bws_bytes);
    std::vector<__nv_bfloat16> lgo(n * H * D);
    for (size_t x = 0; x < t.size(); ++x) std::copy_n(&go[t[x] * H * D], H * D, &lgo[x * H * D]);
    weft::test::upload(c, i, gr->go.p, lgo.data(), gr->go.bytes);
    for (DeviceBuffer* b : {&gr->dq, &gr->dk, &gr->dv}) weft::test::poison(c, i, b->p, b->bytes);
    grads.push_back(std::move(gr));
  }
  c.host_barrier();
  plans.clear();
  before.clear();
  if (const auto plan_of = backward_plan_of(method))
    for (int i = 0; i < c.num_local(); ++i) {  // every rank's plan before any call grows a workspace
      plans.push_back(plan_of(c, c.local(i), local[i]->q.p, local[i]->k.p, local[i]->v.p, local[i]->out.p,
                              grads[i]->go.p, local[i]->lse.as<float>(), grads[i]->dq.p, grads[i]->dk.p,
                              grads[i]->dv.p, cc.docs, H, KV, D, grads[i]->ws.p, bws_bytes, DType::kBF16,
                              nullptr, fo));
      before.push_back(weft::test::workspace_sizes(c, plans.back()));
    }
  for (int i = 0; i < c.num_local(); ++i) {
    Rank& rank = c.local(i);
    WEFT_CUDA_CHECK(cudaSetDevice(rank.device()));
    backward_of(method)(c, rank, local[i]->q.p, local[i]->k.p, local[i]->v.p, local[i]->out.p, grads[i]->go.p,
                        local[i]->lse.as<float>(), grads[i]->dq.p, grads[i]->dk.p, grads[i]->dv.p, cc.docs, H,
                        KV, D, grads[i]->ws.p, bws_bytes, DType::kBF16, nullptr, fo);
  }
  c.synchronize();
  for (size_t i = 0; i < plans.size(); ++i) {
    if (plans[i].op.empty() || plans[i].path.empty())
      return "backward: a plan without its op or path: " + describe(plans[i]);
    if (const std::string kept = weft::test::check_call_kept_plan(c, plans[i], before[i]); !kept.empty())
      return "backward: " + kept;
  }
  // Small cases also against fp64: every rank's max error within 1.5x of the single call's (over the whole
  // sequence: the single call's worst row may sit on any rank).
  auto compare = [&](const char* name, const std::vector<__nv_bfloat16>& got,
                     const std::vector<__nv_bfloat16>& want, const std::vector<double>& exact_grad,
                     const std::vector<int64_t>& t, int64_t width, int r) {
    double top = 0, worst = 0, team_exact = 0, single_exact = 0;
    for (const auto& x : want) top = std::max(top, double(std::abs(__bfloat162float(x))));
    for (size_t x = 0; x < exact_grad.size(); ++x)
      single_exact = std::max(single_exact, std::abs(double(__bfloat162float(want[x])) - exact_grad[x]));
    int64_t bad = 0;
    for (size_t x = 0; x < t.size(); ++x)
      for (int64_t e = 0; e < width; ++e) {
        const double a = __bfloat162float(got[x * width + e]), b = __bfloat162float(want[t[x] * width + e]);
        const double err = std::isfinite(a) ? std::abs(a - b) : 1e30;
        worst = std::max(worst, err);
        bad += !(err <= 1e-5 + 1e-2 * top + 1e-2 * std::abs(b));
        if (!exact_grad.empty())
          team_exact =
              std::max(team_exact, std::isfinite(a) ? std::abs(a - exact_grad[t[x] * width + e]) : 1e30);
      }
    std::fprintf(stderr,
                 "  rank %d/%d %s max diff %.2e of max|ref| %.3g, max |diff - fp64| %.2e (single GPU %.2e)\n",
                 r, W, name, worst, top, team_exact, single_exact);
    if (bad)
      failures += "\n    rank " + std::to_string(r) + " " + name + ": " + std::to_string(bad) +
                  " values differ from the single-GPU backward";
    if (team_exact > 1.5 * single_exact + 1e-6)
      failures += "\n    rank " + std::to_string(r) + " " + name + ": error against fp64 " +
                  std::to_string(team_exact) + " above 1.5x the single call's " +
                  std::to_string(single_exact);
  };
  for (int i = 0; i < c.num_local(); ++i) {
    const int r = c.local(i).rank();
    const std::vector<int64_t>& t = tokens[r];
    const int64_t n = std::max<int64_t>(1, static_cast<int64_t>(t.size()));
    std::vector<__nv_bfloat16> gq(n * H * D), gk(n * KV * D), gv(n * KV * D);
    weft::test::download(c, i, gq.data(), grads[i]->dq.p, gq.size() * 2);
    weft::test::download(c, i, gk.data(), grads[i]->dk.p, gk.size() * 2);
    weft::test::download(c, i, gv.data(), grads[i]->dv.p, gv.size() * 2);
    compare("dq", gq, ref_dq, exact_all.dq, t, H * D, r);
    compare("dk", gk, ref_dk, exact_all.dk, t, KV * D, r);
    compare("dv", gv, ref_dv, exact_all.dv, t, KV * D, r);
  }
  return failures;
}

std::string run_cp_cases(Communicator& c, Method method, const std::vector<CpCase>& cases, uint64_t seed) {
  std::string failures;
  for (const CpCase& cc : cases) failures += run_cp_case(c, method, cc, seed += 10);
  return failures;
}

}  // namespace

WEFT_GPU_TEST(context_attention_matches_single_gpu) {
  Communicator& c = ctx.comm();
  std::vector<CpCase> cases = {
      {{1000}, 4, 2, 128, true},
      {{1000}, 4, 4, 64, false},
      {{300, 0, 17, 777}, 8, 2, 64, true},
      {{129, 64, 1}, 2, 1, 128, false},
  };
  if (!ctx.quick) cases.push_back({{4099, 2000}, 4, 1, 128, true});
  cases.push_back({{1000}, 4, 2, 128, true, true});  // contiguous shards
  cases.push_back({{300, 0, 17, 777}, 8, 2, 64, true, true});
  const std::string failures = run_cp_cases(c, Method::kAllGather, cases, 501);
  WEFT_EXPECT(failures.empty(), failures);
}

// The ring kernel: the same cases as all-gather, then the first again (the pass's flags and call count
// carry over between calls of different sizes).
WEFT_GPU_TEST(ring_attention_matches_single_gpu) {
  Communicator& c = ctx.comm();
  std::vector<CpCase> cases = {
      {{1000}, 4, 2, 128, true},        {{1000}, 4, 4, 64, false}, {{300, 0, 17, 777}, 8, 2, 64, true},
      {{129, 64, 1}, 2, 1, 128, false}, {{3, 1}, 2, 2, 64, true},
  };
  if (!ctx.quick) cases.push_back({{4099, 2000}, 4, 1, 128, true});
  cases.push_back({{1000}, 4, 2, 128, true, true});  // contiguous shards
  cases.push_back({{300, 0, 17, 777}, 8, 2, 64, true, true});
  cases.push_back(cases.front());
  const std::string failures = run_cp_cases(c, Method::kRing, cases, 901);
  WEFT_EXPECT(failures.empty(), failures);
}

// The backward's dQ parts through the accumulator slots that peers on other GPUs take (WEFT_RING_DQ_SLOTS=1
// takes them for every peer): the multi-GPU route, on virtual ranks too.
WEFT_GPU_TEST(ring_attention_backward_through_slots) {
  Communicator& c = ctx.comm();
  const std::vector<CpCase> cases = {
      {{1000}, 4, 2, 128, true}, {{300, 0, 17, 777}, 8, 2, 64, true}, {{129, 64, 1}, 2, 1, 128, false}};
  std::string failures;
  {
    const weft::test::ScopedEnv slots("WEFT_RING_DQ_SLOTS", "1");
    failures = run_cp_cases(c, Method::kRing, cases, 951);
  }
  WEFT_EXPECT(failures.empty(), failures);
}

WEFT_GPU_TEST(ring_attention_argument_errors) {
  Communicator& c = ctx.comm();
  Rank& rank = c.local(0);
  WEFT_CUDA_CHECK(cudaSetDevice(rank.device()));
  DeviceBuffer ws(1 << 20), x(1 << 20);
  const std::vector<int64_t> docs = {64};
  auto call = [&](int64_t h, int64_t kv, int64_t d, size_t ws_bytes, const AttentionOptions& o = {}) {
    ring_attention_forward(c, rank, x.p, x.p, x.p, x.p, nullptr, docs, h, kv, d, ws.p, ws_bytes, DType::kBF16,
                           nullptr, o);
  };
  WEFT_EXPECT_ERROR(call(4, 3, 64, ws.bytes), "must be a multiple of kv_heads");
  WEFT_EXPECT_ERROR(call(4, 4, 96, ws.bytes), "head_dim must be 64 or 128");
  WEFT_EXPECT_ERROR(call(4, 4, 64, 16), "the workspace must hold");
  AttentionOptions packed;
  packed.segments.q_begin = ws.as<int32_t>();
  WEFT_EXPECT_ERROR(call(4, 4, 64, ws.bytes, packed), "set by the op itself");
  auto backward = [&](size_t ws_bytes, const AttentionOptions& o = {}) {
    ring_attention_backward(c, rank, x.p, x.p, x.p, x.p, x.p, x.as<float>(), x.p, x.p, x.p, docs, 4, 4, 64,
                            ws.p, ws_bytes, DType::kBF16, nullptr, o);
  };
  WEFT_EXPECT_ERROR(backward(16), "the workspace must hold");
  AttentionOptions deterministic;
  deterministic.deterministic = true;
  WEFT_EXPECT_ERROR(backward(ws.bytes, deterministic), "deterministic is not supported");
  WEFT_EXPECT_ERROR(backward(ws.bytes, packed), "set by the op itself");
  AttentionOptions timed;  // (only compared: the team ops record into their rank's timeline instead)
  timed.timeline = reinterpret_cast<TimelineBuffer*>(ws.p);
  WEFT_EXPECT_ERROR(call(4, 4, 64, ws.bytes, timed), "record into their rank's timeline");
  WEFT_EXPECT_ERROR(backward(ws.bytes, timed), "record into their rank's timeline");
}

// Heads a multiple of W; K / V heads a multiple of W, or shared (fewer than W). For the pipelined forward's
// head chunks: one (W heads), two, eight (a K / V head per chunk, or one for all), and 33 heads per rank in
// 32 chunks; then the first case again (the flags and call count carry over between calls of other chunk
// counts).
static std::vector<CpCase> ulysses_cases(int64_t W, bool quick) {
  std::vector<CpCase> cases = {
      {{1000}, 2 * W, 2 * W, 128, true},       {{1000}, 2 * W, W, 64, false},
      {{300, 0, 17, 777}, 2 * W, 1, 64, true}, {{129, 64, 1}, W, W, 128, false},
      {{700, 45}, 8 * W, 8 * W, 64, true},     {{500, 3}, 8 * W, 1, 128, false},
  };
  if (!quick) cases.push_back({{4099, 2000}, 4 * W, W % 2 == 0 ? 2 : W, 128, true});
  if (!quick && W <= 4) cases.push_back({{300, 77}, 33 * W, W, 64, true});
  cases.push_back({{1000}, 2 * W, W, 128, true, true});  // contiguous shards
  cases.push_back(cases.front());
  return cases;
}

WEFT_GPU_TEST(ulysses_attention_matches_single_gpu) {
  Communicator& c = ctx.comm();
  const std::string failures = run_cp_cases(c, Method::kUlysses, ulysses_cases(c.world(), ctx.quick), 701);
  WEFT_EXPECT(failures.empty(), failures);
}

// The same through the one-kernel forward (head chunks pushed and pulled beside the attention).
WEFT_GPU_TEST(ulysses_attention_pipelined_matches_single_gpu) {
  Communicator& c = ctx.comm();
  std::string failures;
  {
    const weft::test::ScopedEnv pipelined("WEFT_ULYSSES_FORWARD", "pipelined");
    failures = run_cp_cases(c, Method::kUlysses, ulysses_cases(c.world(), ctx.quick), 751);
  }
  WEFT_EXPECT(failures.empty(), failures);
}

// A timeline on every rank (Communicator::timeline_start) records the team attention ops' bf16 kernels, the
// timed ones: the ring's forward and backward, Ulysses' one-kernel forward and its single-GPU core (forward
// in passes, backward), context attention's core, the hybrid's (on its sub-teams, at W = 4, 8): each pass
// checked alone, on every rank mainloop and store spans, each closed, none dropped; the results still match
// single-GPU attention.
WEFT_GPU_TEST(team_attention_timeline) {
  Communicator& c = ctx.comm();
  const int64_t W = c.world();
  std::string failures;
  // Each rank's timeline since its start, checked, then (restart) started again.
  auto check = [&](const std::string& what, bool restart) {
    for (int i = 0; i < c.num_local(); ++i) {
      const TimelineRecord rec = c.timeline_take(c.local(i));
      if (const std::string bad = weft::test::lcsc_timeline_problem(rec); !bad.empty())
        failures += "\n    " + what + ", rank " + std::to_string(rec.rank) + ": " + bad;
      if (restart) c.timeline_start(c.local(i), 1u << 20);
    }
  };
  struct Run {
    Method method;
    std::string name;
    int ulysses;  // the hybrid's Ulysses size
    std::vector<CpCase> cases;
  };
  const std::vector<CpCase> cases = {{{1000}, 2 * W, W, 128, true}, {{300, 17}, 2 * W, 2 * W, 64, false}};
  std::vector<Run> runs = {{Method::kRing, "ring", 1, cases},
                           {Method::kUlysses, "ulysses", 1, cases},
                           {Method::kUlysses, "ulysses, one-kernel forward", 1, cases},
                           {Method::kAllGather, "all-gather", 1, cases}};
  if (W >= 4 && W % 2 == 0)
    runs.push_back(
        {Method::kHybrid, "hybrid, Ulysses 2", 2, {{{1000}, 4, 4, 128, true}, {{1000}, 4, 2, 64, false}}});
  uint64_t seed = 971;
  for (const Run& run : runs) {
    const bool pipelined = run.name.find("one-kernel") != std::string::npos;
    const weft::test::ScopedEnv forward("WEFT_ULYSSES_FORWARD", pipelined ? "pipelined" : "in passes");
    hybrid_ulysses = run.ulysses;
    for (const CpCase& cc : run.cases) {
      const std::string what = run.name + (cc.causal ? ", causal" : "") + " D=" + std::to_string(cc.dim);
      c.host_barrier();
      for (int i = 0; i < c.num_local(); ++i) c.timeline_start(c.local(i), 1u << 20);
      after_forward = [&] { check(what + ", forward", true); };
      failures += run_cp_case(c, run.method, cc, seed += 10);
      after_forward = nullptr;
      check(what + ", backward", false);
    }
  }
  hybrid_ulysses = 1;
  WEFT_EXPECT(failures.empty(), failures);
}

// The hybrid at every Ulysses size U with 1 < U < W that divides W (W = 4: 2; W = 8: 2 and 4): heads a
// multiple of U, K / V heads split over the group or shared (fewer than U); odd lengths, empty and tiny
// documents; then the first case again. Each U runs on sub-teams of its own (U consecutive ranks, and rings
// of W / U ranks U apart). Without such a U (W = 2, 3), U = W and U = 1 are Ulysses and the ring: one case
// each through the hybrid's entry points.
WEFT_GPU_TEST(hybrid_attention_matches_single_gpu) {
  Communicator& c = ctx.comm();
  const int W = c.world();
  std::string failures;
  uint64_t seed = 1101;
  bool any = false;
  for (int U = 2; U < W; ++U) {
    if (W % U != 0) continue;
    any = true;
    std::vector<CpCase> cases = {
        {{1000}, 2 * U, 2 * U, 128, true},
        {{1000}, 2 * U, U, 64, false},
        {{300, 0, 17, 777}, 2 * U, 1, 64, true},
        {{129, 64, 1}, U, U, 128, false},
        {{3, 1}, U, U, 64, true},
        {{1000, 33}, 2 * U, U, 128, true, true},  // contiguous shards
    };
    if (!ctx.quick) cases.push_back({{4099, 2000}, 4 * U, 2, 128, true});
    cases.push_back(cases.front());
    hybrid_ulysses = U;
    const std::string f = run_cp_cases(c, Method::kHybrid, cases, seed += 100);
    if (!f.empty()) failures += "\n  Ulysses size " + std::to_string(U) + ":" + f;
  }
  if (!any)
    for (int U : {W, 1}) {
      hybrid_ulysses = U;
      const std::string f = run_cp_cases(c, Method::kHybrid, {{{1000}, 2 * W, W, 64, true}}, seed += 100);
      if (!f.empty()) failures += "\n  Ulysses size " + std::to_string(U) + ":" + f;
    }
  hybrid_ulysses = 1;
  WEFT_EXPECT(failures.empty(), failures);
}

WEFT_GPU_TEST(hybrid_attention_argument_errors) {
  Communicator& c = ctx.comm();
  Rank& rank = c.local(0);
  WEFT_CUDA_CHECK(cudaSetDevice(rank.device()));
  DeviceBuffer ws(1 << 20), x(1 << 20);
  const std::vector<int64_t> docs = {64};
  const int W = c.world();
  auto call = [&](int64_t h, int64_t kv, int U) {
    hybrid_attention_forward(c, rank, x.p, x.p, x.p, x.p, nullptr, docs, h, kv, 64, U, ws.p, ws.bytes,
                             DType::kBF16, nullptr);
  };
  WEFT_EXPECT_ERROR(call(4 * W, 4 * W, W + 1), "must divide the world size");
  WEFT_EXPECT_ERROR(call(4 * W, 4 * W, 0), "must divide the world size");
  if (W % 2 == 0 && W > 2) {
    WEFT_EXPECT_ERROR(call(3, 3, 2), "must be a multiple of the Ulysses size");
    if (W % 4 == 0 && W > 4) WEFT_EXPECT_ERROR(call(12, 3, 4), "must divide one another");
    WEFT_EXPECT_ERROR(hybrid_attention_forward(c, rank, x.p, x.p, x.p, x.p, nullptr, docs, 4, 4, 64, 2, ws.p,
                                               16, DType::kBF16),
                      "the workspace must hold");
  }
}

// Shapes Ulysses cannot split are refused on every rank, before anything is enqueued.
WEFT_GPU_TEST(ulysses_attention_argument_errors) {
  Communicator& c = ctx.comm();
  const int64_t W = c.world();
  Rank& rank = c.local(0);
  WEFT_CUDA_CHECK(cudaSetDevice(rank.device()));
  DeviceBuffer ws(1 << 20), x(1 << 20);
  const std::vector<int64_t> docs = {64};
  auto call = [&](int64_t h, int64_t kv, int64_t d, size_t ws_bytes) {
    ulysses_attention_forward(c, rank, x.p, x.p, x.p, x.p, nullptr, docs, h, kv, d, ws.p, ws_bytes,
                              DType::kBF16);
  };
  WEFT_EXPECT_ERROR(call(2 * W + 1, 1, 64, ws.bytes), "must be a multiple of the world size");
  if (W > 2) WEFT_EXPECT_ERROR(call(2 * W * (W - 1), W - 1, 64, ws.bytes), "must divide one another");
  WEFT_EXPECT_ERROR(call(W, W, 96, ws.bytes), "head_dim must be 64 or 128");
  WEFT_EXPECT_ERROR(call(W, W, 64, 16), "the workspace must hold");
}
