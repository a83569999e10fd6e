// GPU tests of teams spanning nodes (weft/runtime/multi_node.hpp, weft/ops/hierarchical.hpp), one process
// per GPU under a launcher, nodes real or fake (WEFT_NODE_SIZE=k splits one host into nodes of k ranks):
//
//   NCCL_NVLS_ENABLE=0 NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 WEFT_NODE_SIZE=2 \
//   MASTER_ADDR=127.0.0.1 WEFT_RENDEZVOUS_PORT=29611 build/weft-launch -n 4
//   build/tests/gpu/weft-multinode-tests
//
// (NCCL forced onto sockets, so the legs between fake nodes take the network path.) The hierarchical
// all-reduce (also in place), all-gather, reduce-scatter and all-to-all against the host's fp64 result over
// every rank's inputs, bf16 and fp32, sum and max, sizes straddling the node size (and 8 Mi + 5 elements for
// the all-reduce's pipelined pieces); outputs poisoned first, inputs checked unchanged; each rank's node team
// is its node's ranks only. Pass: max, all-gather and all-to-all exact, sums within 1e-6 (fp32) / 1e-2
// (bf16) of the magnitudes summed; no NaN. The
// tensor-parallel GEMMs across nodes (all_gather_matmul with its gathered A, matmul_reduce_scatter; bf16, odd
// rows per rank) against the host's fp64 products, the MoE dispatch + combine across nodes (an expert
// function applied on the host between them) against the host's weighted sums, and context-parallel
// attention across nodes (forward and backward, two causal documents) against the host's fp64 attention:
// relative error within 2e-2.
// Exit 0 pass, 1 fail, 77 skipped (no GPU, no NCCL, or not enough GPUs for one rank each).
//
// WEFT_TEST_RANK_DEATH=1: instead of the tests, the last rank exits (status 0) after a first all-reduce while
// the others go on calling all-reduces: every other rank, on its node or another, must report the loss within
// 20 s ("saw after S s: ...") rather than wait in NCCL or in weft's kernels until the launcher's grace kill.
//
// --bench: after the tests, device us per call of each hierarchical collective and of NCCL's flat one over
// every rank (bf16 sums, 1 MiB .. 256 MiB of output per rank; median of 20 after 3 warm-ups, slowest rank),
// as a markdown table, then the tensor-parallel GEMMs across nodes against NCCL's flat collective with weft's
// GEMM in sequence. On fake nodes that is NCCL over loopback sockets, not a network: label it so. Buffers
// from cudaMalloc (weft's collectives then go through the node team's workspace, not the zero-copy path).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "attention_reference.hpp"
#include "runtime/nccl_api.hpp"
#include "weft/ops/context_attention.hpp"
#include "weft/ops/hierarchical.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/multi_node.hpp"

namespace {

using weft::DType;
using weft::ReduceOp;

struct Device {
  void* p = nullptr;
  explicit Device(size_t bytes) { WEFT_CUDA_CHECK(cudaMalloc(&p, bytes ? bytes : 1)); }
  ~Device() { cudaFree(p); }
};

// Rank r's n values (as floats), the same sequence whenever asked.
std::vector<float> values(int rank, size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed * 1000003 + rank);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

void upload(void* dst, const std::vector<float>& v, DType t) {
  if (t == DType::kFP32) {
    WEFT_CUDA_CHECK(cudaMemcpy(dst, v.data(), v.size() * 4, cudaMemcpyHostToDevice));
    return;
  }
  std::vector<__nv_bfloat16> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = __float2bfloat16(v[i]);
  WEFT_CUDA_CHECK(cudaMemcpy(dst, b.data(), b.size() * 2, cudaMemcpyHostToDevice));
}

std::vector<float> download(const void* src, size_t n, DType t) {
  std::vector<float> v(n);
  if (t == DType::kFP32) {
    WEFT_CUDA_CHECK(cudaMemcpy(v.data(), src, n * 4, cudaMemcpyDeviceToHost));
    return v;
  }
  std::vector<__nv_bfloat16> b(n);
  WEFT_CUDA_CHECK(cudaMemcpy(b.data(), src, n * 2, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < n; ++i) v[i] = __bfloat162float(b[i]);
  return v;
}

// Rank r's inputs as the GPU holds them (rounded to the dtype).
std::vector<float> held(int rank, size_t n, uint64_t seed, DType t) {
  std::vector<float> v = values(rank, n, seed);
  if (t == DType::kBF16)
    for (float& x : v) x = __bfloat162float(__float2bfloat16(x));
  return v;
}

enum class Op { kAllReduce, kAllGather, kReduceScatter, kAllToAll };

// Elements of a rank's input and output for `count` of the op.
size_t in_count(const weft::MultiNodeTeam& t, Op op, size_t count) {
  return op == Op::kReduceScatter || op == Op::kAllToAll ? t.world() * count : count;
}
size_t out_count(const weft::MultiNodeTeam& t, Op op, size_t count) {
  return op == Op::kAllGather || op == Op::kAllToAll ? t.world() * count : count;
}

// "" when got matches the host's fp64 result of the op over every rank's held inputs, else why not: max and
// all_gather exactly; sums within the dtype's tolerance of the magnitudes summed (the norm of sum |x| over
// ranks: two orders of summation differ by rounding of the partial sums, whatever the sum itself is).
std::string check_against_host(const std::vector<float>& got, weft::MultiNodeTeam& t, Op op, size_t count,
                               DType dtype, ReduceOp red, uint64_t seed) {
  const int W = t.world();
  const size_t in_n = in_count(t, op, count);
  std::vector<double> want(got.size(), red == ReduceOp::kMax ? -1e300 : 0.0), scale(got.size(), 0.0);
  for (int r = 0; r < W; ++r) {
    const std::vector<float> x = held(r, in_n, seed, dtype);
    for (size_t i = 0; i < got.size(); ++i) {
      if (op == Op::kAllGather || op == Op::kAllToAll) {  // block r: rank r's input (its block for us)
        if (i / count == size_t(r)) want[i] = x[(op == Op::kAllToAll ? t.rank() * count : 0) + i % count];
        continue;
      }
      const double v = x[op == Op::kReduceScatter ? t.rank() * count + i : i];
      want[i] = red == ReduceOp::kMax ? std::max(want[i], v) : want[i] + v;
      scale[i] += std::fabs(v);
    }
  }
  const bool exact = op == Op::kAllGather || op == Op::kAllToAll || red == ReduceOp::kMax;
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return "non-finite value at " + std::to_string(i) + " (not written?)";
    const double w =
        exact && dtype == DType::kBF16 ? __bfloat162float(__float2bfloat16(float(want[i]))) : want[i];
    if (exact && double(got[i]) != w)
      return "element " + std::to_string(i) + ": " + std::to_string(got[i]) + ", want " + std::to_string(w);
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += scale[i] * scale[i];
  }
  const double err = std::sqrt(num / std::max(den, 1e-30)), tol = dtype == DType::kFP32 ? 1e-6 : 1e-2;
  return err > tol ? "error " + std::to_string(err) + " of the magnitudes summed" : std::string();
}

// One case: the hierarchical op on every rank's inputs, against the host's result; all_reduce in place on odd
// seeds (out = a copy of the input).
std::string run_case(weft::MultiNodeTeam& t, Op op, size_t count, DType dtype, ReduceOp red, uint64_t seed) {
  const size_t in_n = in_count(t, op, count), out_n = out_count(t, op, count);
  const size_t es = weft::dtype_size(dtype);
  Device in(in_n * es), got(out_n * es);
  upload(in.p, values(t.rank(), in_n, seed), dtype);
  WEFT_CUDA_CHECK(cudaMemset(got.p, 0xff, out_n * es));  // NaN in bf16 and fp32: an unwritten element shows
  WEFT_CUDA_CHECK(cudaDeviceSynchronize());
  cudaStream_t s = t.node_rank().stream();
  const bool in_place = op == Op::kAllReduce && seed % 2 == 1;
  if (op == Op::kAllReduce) {
    if (in_place) WEFT_CUDA_CHECK(cudaMemcpyAsync(got.p, in.p, count * es, cudaMemcpyDeviceToDevice, s));
    weft::hierarchical_all_reduce(t, in_place ? got.p : in.p, got.p, count, dtype, red, s);
  } else if (op == Op::kAllGather) {
    weft::hierarchical_all_gather(t, in.p, got.p, count, dtype, s);
  } else if (op == Op::kAllToAll) {
    weft::hierarchical_all_to_all(t, in.p, got.p, count, dtype, s);
  } else {
    weft::hierarchical_reduce_scatter(t, in.p, got.p, count, dtype, red, s);
  }
  WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
  t.node_team().synchronize();
  t.check_alive();
  std::string err = check_against_host(download(got.p, out_n, dtype), t, op, count, dtype, red, seed);
  if (err.empty() && !in_place) {  // the input left as it was
    const std::vector<float> after = download(in.p, in_n, dtype), before = held(t.rank(), in_n, seed, dtype);
    if (after != before) err = "the op wrote into its input";
  }
  return err;
}

// The tensor-parallel GEMMs across nodes against the host's fp64 products of the bf16 inputs (B [K, N]):
// all_gather_matmul's out and gathered A, matmul_reduce_scatter's rows of the sum. "" or why not: relative
// error (Frobenius) within 2e-2, no NaN, gathered A exact.
std::string relative_error(const std::vector<float>& got, const std::vector<double>& want, double tol) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return "non-finite value at " + std::to_string(i) + " (not written?)";
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  const double err = std::sqrt(num / std::max(den, 1e-30));
  return err > tol ? "relative error " + std::to_string(err) : std::string();
}

std::string tp_case(weft::MultiNodeTeam& t, bool gather, int64_t m, int64_t n, int64_t k, uint64_t seed) {
  const int W = t.world(), r = t.rank();
  const int64_t a_rows = gather ? m : W * m, out_rows = gather ? W * m : m;
  // B: the same on every rank for the all-gather's GEMM (a replicated weight), each rank's own for the
  // reduce-scatter's (a row-parallel weight shard).
  const auto b_of = [&](int q) { return held(gather ? 1000 : 1000 + q, size_t(k * n), seed, DType::kBF16); };
  Device a(a_rows * k * 2), b(k * n * 2), out(out_rows * n * 2), ga(gather ? W * m * k * 2 : 2);
  upload(a.p, values(r, size_t(a_rows * k), seed), DType::kBF16);
  upload(b.p, gather ? values(1000, size_t(k * n), seed) : values(1000 + r, size_t(k * n), seed),
         DType::kBF16);
  WEFT_CUDA_CHECK(cudaMemset(out.p, 0xff, out_rows * n * 2));
  WEFT_CUDA_CHECK(cudaDeviceSynchronize());
  cudaStream_t s = t.node_rank().stream();
  if (gather)
    weft::hierarchical_all_gather_matmul(t, a.p, b.p, out.p, ga.p, m, n, k, weft::BLayout::kKN, s);
  else
    weft::hierarchical_matmul_reduce_scatter(t, a.p, b.p, out.p, m, n, k, weft::BLayout::kKN, s);
  WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
  t.node_team().synchronize();
  t.check_alive();
  std::vector<double> want(size_t(out_rows * n), 0.0);
  for (int q = 0; q < W; ++q) {
    // gather: rank q's shard is out's rows [q m, +m); reduce-scatter: rank q's rows [r m, +m) of its a.
    const std::vector<float> aq = held(q, size_t((gather ? m : W * m) * k), seed, DType::kBF16);
    const std::vector<float> bq = b_of(q);
    const int64_t a_first = gather ? 0 : r * m, o_first = gather ? q * m : 0;
    for (int64_t i = 0; i < m; ++i)
      for (int64_t kk = 0; kk < k; ++kk) {
        const double x = aq[size_t((a_first + i) * k + kk)];
        if (x == 0) continue;
        for (int64_t j = 0; j < n; ++j) want[size_t((o_first + i) * n + j)] += x * bq[size_t(kk * n + j)];
      }
  }
  std::string err = relative_error(download(out.p, size_t(out_rows * n), DType::kBF16), want, 2e-2);
  if (err.empty() && gather)
    for (int q = 0; q < W && err.empty(); ++q) {
      const std::vector<float> got =
          download(static_cast<char*>(ga.p) + q * m * k * 2, size_t(m * k), DType::kBF16);
      if (got != held(q, size_t(m * k), seed, DType::kBF16))
        err = "gathered A: rank " + std::to_string(q) + "'s rows differ";
    }
  return err;
}

// Context-parallel attention across nodes (hierarchical_context_attention_*): two causal documents of odd
// lengths over every rank of the job in the zigzag layout, GQA 4 / 2 heads, head_dim 64, bf16; this rank's
// rows of out, lse, dq, dk and dv against the host's fp64 attention over the whole documents (the same
// inputs on every rank). Outputs poisoned first.
std::string context_attention_case(weft::MultiNodeTeam& t, uint64_t seed) {
  const int W = t.world(), r = t.rank();
  const int64_t H = 4, KV = 2, D = 64;
  const std::vector<int64_t> docs = {37 * W + 5, 23 * W + 3};
  const int64_t total = docs[0] + docs[1];
  weft::AttentionOptions o;
  o.causal = true;
  // The whole problem (every rank alike), rounded to bf16.
  const auto whole = [&](int which, int64_t heads) {
    const std::vector<float> f = held(2000 + which, size_t(total * heads * D), seed, DType::kBF16);
    std::vector<__nv_bfloat16> b(f.size());
    for (size_t i = 0; i < f.size(); ++i) b[i] = __float2bfloat16(f[i]);
    return b;
  };
  const std::vector<__nv_bfloat16> q = whole(0, H), k = whole(1, KV), v = whole(2, KV), go = whole(3, H);
  // This rank's rows: the natural positions of the layout's local rows.
  const std::vector<int64_t> tokens = weft::context_attention_local_tokens(W, r, docs, true, false);
  const int64_t n = static_cast<int64_t>(tokens.size());
  const auto rows_of = [&](const std::vector<__nv_bfloat16>& x, int64_t heads) {
    std::vector<__nv_bfloat16> y(size_t(std::max<int64_t>(n, 1) * heads * D));
    for (int64_t i = 0; i < n; ++i)
      std::copy_n(&x[size_t(tokens[i] * heads * D)], heads * D, &y[size_t(i * heads * D)]);
    return y;
  };
  const size_t qb = size_t(std::max<int64_t>(n, 1) * H * D * 2),
               kb = size_t(std::max<int64_t>(n, 1) * KV * D * 2);
  Device dq_in(qb), dk_in(kb), dv_in(kb), dgo(qb), out(qb), lse(size_t(H * std::max<int64_t>(n, 1) * 4)),
      dq(qb), dk(kb), dv(kb);
  const auto put = [](void* dst, const std::vector<__nv_bfloat16>& x) {
    WEFT_CUDA_CHECK(cudaMemcpy(dst, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
  };
  put(dq_in.p, rows_of(q, H));
  put(dk_in.p, rows_of(k, KV));
  put(dv_in.p, rows_of(v, KV));
  put(dgo.p, rows_of(go, H));
  const size_t lse_bytes = size_t(H * std::max<int64_t>(n, 1) * 4);
  for (const auto& [d, bytes] : {std::pair{&out, qb}, {&lse, lse_bytes}, {&dq, qb}, {&dk, kb}, {&dv, kb}})
    WEFT_CUDA_CHECK(cudaMemset(d->p, 0xff, bytes));  // NaN in bf16 and fp32: a row not written fails
  const size_t ws_bytes = std::max(weft::context_attention_workspace_bytes(W, docs, true, KV, D),
                                   weft::context_attention_backward_workspace_bytes(W, docs, true, H, KV, D));
  Device ws(ws_bytes);
  WEFT_CUDA_CHECK(cudaDeviceSynchronize());
  cudaStream_t s = t.node_rank().stream();
  float* lse_p = static_cast<float*>(lse.p);
  weft::hierarchical_context_attention_forward(t, dq_in.p, dk_in.p, dv_in.p, out.p, lse_p, docs, H, KV, D,
                                               ws.p, ws_bytes, DType::kBF16, s, o);
  weft::hierarchical_context_attention_backward(t, dq_in.p, dk_in.p, dv_in.p, out.p, dgo.p, lse_p, dq.p, dk.p,
                                                dv.p, docs, H, KV, D, ws.p, ws_bytes, DType::kBF16, s, o);
  WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
  t.node_team().synchronize();
  t.check_alive();
  weft::test::AttentionRefShape shape;
  shape.rows_q = shape.rows_k = total;
  shape.heads = H;
  shape.kv_heads = KV;
  shape.dim = D;
  shape.causal = true;
  shape.scale = 1.0 / std::sqrt(double(D));
  shape.seqs = {{0, docs[0], 0, docs[0]}, {docs[0], docs[1], docs[0], docs[1]}};
  const weft::test::AttentionReference ref = weft::test::attention_reference(shape, q, k, v, go);
  // This rank's rows of a reference tensor [total][heads][D] (or lse: [heads][n] from [total][heads]).
  const auto want_rows = [&](const std::vector<double>& x, int64_t heads) {
    std::vector<double> y(size_t(n * heads * D));
    for (int64_t i = 0; i < n; ++i)
      std::copy_n(&x[size_t(tokens[i] * heads * D)], heads * D, &y[size_t(i * heads * D)]);
    return y;
  };
  std::vector<double> want_lse(size_t(H * n));
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < n; ++i) want_lse[size_t(h * n + i)] = ref.lse[size_t(tokens[i] * H + h)];
  struct Check {
    const char* name;
    const void* got;
    DType dtype;
    std::vector<double> want;
  };
  const Check checks[] = {{"out", out.p, DType::kBF16, want_rows(ref.o, H)},
                          {"lse", lse.p, DType::kFP32, want_lse},
                          {"dq", dq.p, DType::kBF16, want_rows(ref.dq, H)},
                          {"dk", dk.p, DType::kBF16, want_rows(ref.dk, KV)},
                          {"dv", dv.p, DType::kBF16, want_rows(ref.dv, KV)}};
  for (const Check& c : checks) {
    const std::string err = relative_error(download(c.got, c.want.size(), c.dtype), c.want, 2e-2);
    if (!err.empty()) return std::string(c.name) + ": " + err;
  }
  return {};
}

// The MoE across nodes: dispatch, an expert function on the host (expert e scales its rows by (e + 1) / 8),
// combine; against the host's sum over each token's slots of weight x (e + 1) / 8 x the token (slots of
// expert -1 dropped). Each rank its own token count.
std::string moe_case(weft::MultiNodeTeam& t, uint64_t seed) {
  using weft::MoeShape;
  const int W = t.world(), r = t.rank();
  MoeShape s;
  s.max_tokens = 96;
  s.tokens = (37 + 29 * r) % 97;
  s.hidden = 64;
  s.num_experts = 4 * W;
  s.top_k = 3;
  s.align = 8;
  const size_t slots = size_t(s.tokens) * s.top_k;
  const std::vector<float> x = held(r, size_t(s.tokens * s.hidden), seed, DType::kBF16);
  std::vector<int32_t> experts(std::max<size_t>(slots, 1));
  std::vector<float> weights(std::max<size_t>(slots, 1));
  std::mt19937_64 g(seed * 7919 + r);
  for (size_t i = 0; i < slots; ++i) {
    experts[i] = int32_t(g() % (s.num_experts + 1)) - 1;  // -1: a dropped slot
    weights[i] = float(g() % 1000) / 1000.f;
  }
  Device tok(size_t(s.tokens) * s.hidden * 2 + 16), ex(experts.size() * 4), wt(weights.size() * 4),
      out(size_t(s.tokens) * s.hidden * 2 + 16);
  upload(tok.p, x, DType::kBF16);
  WEFT_CUDA_CHECK(cudaMemcpy(ex.p, experts.data(), experts.size() * 4, cudaMemcpyHostToDevice));
  WEFT_CUDA_CHECK(cudaMemcpy(wt.p, weights.data(), weights.size() * 4, cudaMemcpyHostToDevice));
  WEFT_CUDA_CHECK(cudaMemset(out.p, 0xff, size_t(s.tokens) * s.hidden * 2 + 16));
  const size_t ws_bytes = weft::hierarchical_moe_workspace_bytes(t, s, DType::kBF16);
  Device ws(ws_bytes);
  cudaStream_t st = t.node_rank().stream();
  WEFT_CUDA_CHECK(cudaDeviceSynchronize());
  const weft::HierarchicalMoeDispatched d =
      weft::hierarchical_moe_dispatch(t, tok.p, static_cast<const int32_t*>(ex.p),
                                      static_cast<const float*>(wt.p), s, ws.p, ws_bytes, DType::kBF16, st);
  // The experts on the host: this rank's groups (node m's rank i holds experts (m node_size + i) x per of
  // the job's).
  const weft::MoeCounts c = weft::moe_counts(t.node_rank(), d.node, d.node_shape, st);
  const int per = s.num_experts / W;
  std::vector<float> rows = download(d.node.rows, size_t(c.rows * s.hidden), DType::kBF16);
  int64_t begin = 0;
  for (int e = 0; e < per; ++e) {
    const double f = (r * per + e + 1) / 8.0;
    for (int64_t i = begin; i < begin + c.expert_rows[e]; ++i)
      for (int64_t h = 0; h < s.hidden; ++h) rows[size_t(i * s.hidden + h)] *= float(f);
    begin = c.group_end[e];
  }
  void* expert_out = weft::moe_combine_input(t.node_team(), t.node_rank(), d.node_shape, DType::kBF16);
  upload(expert_out, rows, DType::kBF16);
  // cudaMemcpy from pageable memory may return before its DMA lands, and the combine's stream (non-blocking)
  // does not wait for the legacy stream: the rows in place before any rank reads them.
  WEFT_CUDA_CHECK(cudaDeviceSynchronize());
  weft::hierarchical_moe_combine(t, expert_out, d, out.p, s, DType::kBF16, st);
  WEFT_CUDA_CHECK(cudaStreamSynchronize(st));
  t.node_team().synchronize();
  t.check_alive();
  std::vector<double> want(size_t(s.tokens * s.hidden), 0.0);
  for (int64_t tk = 0; tk < s.tokens; ++tk)
    for (int j = 0; j < s.top_k; ++j) {
      const int e = experts[size_t(tk * s.top_k + j)];
      if (e < 0) continue;
      // The expert's output was rounded to bf16 before the combine: so is the reference's term.
      for (int64_t h = 0; h < s.hidden; ++h) {
        const float y =
            __bfloat162float(__float2bfloat16(x[size_t(tk * s.hidden + h)] * float((e + 1) / 8.0)));
        want[size_t(tk * s.hidden + h)] += double(weights[size_t(tk * s.top_k + j)]) * y;
      }
    }
  return s.tokens == 0
             ? std::string()
             : relative_error(download(out.p, size_t(s.tokens * s.hidden), DType::kBF16), want, 2e-2);
}

int run(weft::MultiNodeTeam& t) {
  const char* names[] = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all"};
  int passed = 0, failed = 0;
  const auto tally = [&](const std::string& what, const std::string& err) {
    if (err.empty()) {
      ++passed;
      return;
    }
    ++failed;
    std::printf("[rank %d] FAILED %s: %s\n", t.rank(), what.c_str(), err.c_str());
  };
  uint64_t seed = 1;
  for (Op op : {Op::kAllReduce, Op::kAllGather, Op::kReduceScatter, Op::kAllToAll})
    for (DType dtype : {DType::kFP32, DType::kBF16})
      for (ReduceOp red : {ReduceOp::kSum, ReduceOp::kMax}) {
        const bool moves_only = op == Op::kAllGather || op == Op::kAllToAll;  // no reduction
        if (moves_only && red == ReduceOp::kMax) continue;
        // All-reduces from 16 MiB on run in pipelined pieces: one such size for them.
        std::vector<size_t> counts = {1, 7, 1000, 65536 + 3, size_t(1) << 20};
        if (op == Op::kAllReduce && red == ReduceOp::kSum) counts.push_back((size_t(1) << 23) + 5);
        for (size_t count : counts) {
          const std::string what = std::string(names[int(op)]) + " " + weft::dtype_name(dtype) +
                                   (moves_only              ? ""
                                    : red == ReduceOp::kMax ? " max"
                                                            : " sum") +
                                   " count " + std::to_string(count);
          tally(what, run_case(t, op, count, dtype, red, seed++));
        }
      }
  for (bool gather : {true, false})
    for (int64_t m : {int64_t(64), int64_t(200)}) {
      const int64_t n = 264, k = 256;
      const std::string what = std::string(gather ? "all_gather_matmul" : "matmul_reduce_scatter") + " m " +
                               std::to_string(m) + " n " + std::to_string(n) + " k " + std::to_string(k);
      tally(what, tp_case(t, gather, m, n, k, seed++));
    }
  for (int rep = 0; rep < 2; ++rep)  // twice: the in-node areas reused
    tally("moe dispatch + combine across nodes (call " + std::to_string(rep) + ")", moe_case(t, seed++));
  for (int rep = 0; rep < 2; ++rep)  // twice: the in-node area and the layout reused
    tally("context attention across nodes, forward + backward (call " + std::to_string(rep) + ")",
          context_attention_case(t, seed++));
  std::printf("[rank %d] summary: %d passed, %d failed (%d nodes of %d ranks)\n", t.rank(), passed, failed,
              t.nodes(), t.node_size());
  return failed == 0 ? 0 : 1;
}

// The median over `iters` calls of call(stream) in device us, the slowest rank's (an NCCL max over every
// rank).
template <class Call>
float time_us(weft::MultiNodeTeam& t, cudaStream_t s, Call&& call, int iters = 20) {
  cudaEvent_t a, b;
  WEFT_CUDA_CHECK(cudaEventCreate(&a));
  WEFT_CUDA_CHECK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) call();
  std::vector<float> us;
  for (int i = 0; i < iters; ++i) {
    WEFT_CUDA_CHECK(cudaEventRecord(a, s));
    call();
    WEFT_CUDA_CHECK(cudaEventRecord(b, s));
    WEFT_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    WEFT_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    us.push_back(ms * 1000.f);
  }
  std::sort(us.begin(), us.end());
  Device m(4);
  WEFT_CUDA_CHECK(cudaMemcpy(m.p, &us[us.size() / 2], 4, cudaMemcpyHostToDevice));
  weft::nccl::check(weft::nccl::api().AllReduce(m.p, m.p, 1, weft::nccl::kFloat32, weft::nccl::kMax,
                                                static_cast<weft::nccl::Comm>(t.nccl_all()), s),
                    "timing max");
  float slowest = 0;
  WEFT_CUDA_CHECK(cudaMemcpyAsync(&slowest, m.p, 4, cudaMemcpyDeviceToHost, s));
  WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return slowest;
}

// The tensor-parallel GEMMs across nodes against NCCL's flat collective and weft's GEMM in sequence: m rows
// a rank, N = K = 4096, bf16.
void bench_gemms(weft::MultiNodeTeam& t) {
  const int W = t.world();
  cudaStream_t s = t.node_rank().stream();
  const auto& n = weft::nccl::api();
  const auto all = static_cast<weft::nccl::Comm>(t.nccl_all());
  const int64_t nk = 4096;
  if (t.rank() == 0)
    std::printf(
        "\n## tensor-parallel GEMMs across nodes, bf16, N = K = %lld, %d nodes x %d ranks (fake nodes: "
        "loopback, "
        "not a network): device us per call, slowest rank\n"
        "| op | rows per rank | weft hierarchical us | NCCL flat + weft GEMM us | ratio "
        "|\n|---|---|---|---|---|\n",
        (long long)nk, t.nodes(), t.node_size());
  for (int64_t m : {int64_t(512), int64_t(2048)}) {
    Device a(W * m * nk * 2), b(nk * nk * 2), out(W * m * nk * 2), tmp(W * m * nk * 2);
    WEFT_CUDA_CHECK(cudaMemset(a.p, 0, W * m * nk * 2));
    WEFT_CUDA_CHECK(cudaMemset(b.p, 0, nk * nk * 2));
    const float ag = time_us(t, s, [&] {
      weft::hierarchical_all_gather_matmul(t, a.p, b.p, out.p, nullptr, m, nk, nk, weft::BLayout::kNK, s);
    });
    const float ag_flat = time_us(t, s, [&] {
      weft::nccl::check(n.AllGather(a.p, tmp.p, size_t(m * nk), weft::nccl::kBfloat16, all, s), "AG");
      weft::gemm(tmp.p, b.p, out.p, W * m, nk, nk, weft::BLayout::kNK, DType::kBF16, s);
    });
    const float rs = time_us(t, s, [&] {
      weft::hierarchical_matmul_reduce_scatter(t, a.p, b.p, out.p, m, nk, nk, weft::BLayout::kNK, s);
    });
    const float rs_flat = time_us(t, s, [&] {
      weft::gemm(a.p, b.p, tmp.p, W * m, nk, nk, weft::BLayout::kNK, DType::kBF16, s);
      weft::nccl::check(
          n.ReduceScatter(tmp.p, out.p, size_t(m * nk), weft::nccl::kBfloat16, weft::nccl::kSum, all, s),
          "RS");
    });
    if (t.rank() == 0) {
      std::printf("| all_gather_matmul | %lld | %.1f | %.1f | %.2fx |\n", (long long)m, ag, ag_flat,
                  ag_flat / ag);
      std::printf("| matmul_reduce_scatter | %lld | %.1f | %.1f | %.2fx |\n", (long long)m, rs, rs_flat,
                  rs_flat / rs);
    }
  }
}

void bench(weft::MultiNodeTeam& t) {
  const int W = t.world();
  cudaStream_t s = t.node_rank().stream();
  const auto& n = weft::nccl::api();
  const auto all = static_cast<weft::nccl::Comm>(t.nccl_all());
  const int bf = weft::nccl::kBfloat16;
  if (t.rank() == 0)
    std::printf(
        "\n## hierarchical collectives, bf16 sum, %d nodes x %d ranks (between nodes: NCCL as configured; "
        "fake nodes: loopback, not a network): device us per call, slowest rank\n"
        "| op | bytes out per rank | weft hierarchical us | NCCL flat us | NCCL / weft "
        "|\n|---|---|---|---|---|\n",
        t.nodes(), t.node_size());
  for (size_t bytes = size_t(1) << 20; bytes <= (size_t(256) << 20); bytes *= 16) {
    const size_t count = bytes / 2;  // bf16 elements out per rank
    Device in(bytes * W), out(bytes * W);
    WEFT_CUDA_CHECK(cudaMemset(in.p, 0, bytes * W));
    struct Row {
      const char* name;
      float weft, nccl;
    };
    const size_t c_rs = count, c_ag = count / W;  // reduce-scatter: count out; all-gather: W x c_ag out
    Row rows[] = {
        {"all_reduce",
         time_us(
             t, s,
             [&] { weft::hierarchical_all_reduce(t, in.p, out.p, count, DType::kBF16, ReduceOp::kSum, s); }),
         time_us(t, s,
                 [&] {
                   weft::nccl::check(n.AllReduce(in.p, out.p, count, bf, weft::nccl::kSum, all, s), "AR");
                 })},
        {"all_gather",
         time_us(t, s, [&] { weft::hierarchical_all_gather(t, in.p, out.p, c_ag, DType::kBF16, s); }),
         time_us(t, s, [&] { weft::nccl::check(n.AllGather(in.p, out.p, c_ag, bf, all, s), "AG"); })},
        {"all_to_all",
         time_us(t, s, [&] { weft::hierarchical_all_to_all(t, in.p, out.p, c_ag, DType::kBF16, s); }),
         time_us(t, s,
                 [&] {
                   weft::nccl::check(n.GroupStart(), "A2A");
                   for (int p = 0; p < W; ++p) {
                     weft::nccl::check(n.Send(static_cast<char*>(in.p) + p * c_ag * 2, c_ag, bf, p, all, s),
                                       "A2A");
                     weft::nccl::check(n.Recv(static_cast<char*>(out.p) + p * c_ag * 2, c_ag, bf, p, all, s),
                                       "A2A");
                   }
                   weft::nccl::check(n.GroupEnd(), "A2A");
                 })},
        {"reduce_scatter",
         time_us(t, s,
                 [&] {
                   weft::hierarchical_reduce_scatter(t, in.p, out.p, c_rs, DType::kBF16, ReduceOp::kSum, s);
                 }),
         time_us(t, s,
                 [&] {
                   weft::nccl::check(n.ReduceScatter(in.p, out.p, c_rs, bf, weft::nccl::kSum, all, s), "RS");
                 })},
    };
    if (t.rank() == 0)
      for (const Row& r : rows)
        std::printf("| %s | %zu MiB | %.1f | %.1f | %.2fx |\n", r.name, bytes >> 20, r.weft, r.nccl,
                    r.nccl / r.weft);
  }
  bench_gemms(t);
}

// The rank-death scenario (see the header): 0 when this rank saw the loss in time (or is the one that left).
int rank_death(weft::MultiNodeTeam& t) {
  const size_t count = size_t(1) << 20;
  Device buf(count * 4);
  WEFT_CUDA_CHECK(cudaMemset(buf.p, 0, count * 4));
  cudaStream_t s = t.node_rank().stream();
  weft::hierarchical_all_reduce(t, buf.p, buf.p, count, DType::kFP32, ReduceOp::kSum, s);
  WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
  if (t.rank() == t.world() - 1) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    std::printf("[rank %d] leaving without a word\n", t.rank());
    std::fflush(stdout);
    ::_exit(0);
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto seconds = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  std::string msg;
  while (msg.empty() && seconds() < 60) {
    try {
      weft::hierarchical_all_reduce(t, buf.p, buf.p, count, DType::kFP32, ReduceOp::kSum, s);
      // Polled, not a blocking synchronize: a rank stuck for good shows as a failure here, not a hang.
      cudaEvent_t done;
      WEFT_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
      WEFT_CUDA_CHECK(cudaEventRecord(done, s));
      while (cudaEventQuery(done) == cudaErrorNotReady && seconds() < 60)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      const bool finished = cudaEventQuery(done) == cudaSuccess;
      cudaEventDestroy(done);
      if (!finished) {
        msg = "nothing reported: the call was still waiting after 60 s";
        break;
      }
      t.node_team().synchronize();
      t.check_alive();
    } catch (const std::exception& e) {
      msg = e.what();
    }
  }
  std::printf("[rank %d] saw after %.2f s: %s\n", t.rank(), seconds(), msg.c_str());
  const bool ok = !msg.empty() && seconds() < 20 && msg.rfind("nothing reported", 0) != 0;
  std::printf("[rank %d] summary: %d passed, %d failed (rank death, %d nodes of %d ranks)\n", t.rank(),
              ok ? 1 : 0, ok ? 0 : 1, t.nodes(), t.node_size());
  std::fflush(stdout);
  ::_exit(ok ? 0 : 1);  // the team's teardown would wait for the rank that left
}

}  // namespace

int main(int argc, char** argv) {
  const bool want_bench = argc > 1 && std::string(argv[1]) == "--bench";
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  if (const std::string why = weft::cuda_unavailable_reason(); !why.empty()) {
    std::printf("SKIPPED: weft-multinode-tests: %s\n", why.c_str());
    return 77;
  }
  try {
    const auto env = weft::parse_launch_env(weft::process_env(), static_cast<long>(::getppid()));
    if (!env) {
      std::printf("SKIPPED: weft-multinode-tests: run under a launcher (weft-launch -n N), one rank a GPU\n");
      return 77;
    }
    try {
      weft::nccl::api();
    } catch (const std::exception& e) {
      std::printf("SKIPPED: weft-multinode-tests: %s\n", e.what());
      return 77;
    }
    int ndev = 0;
    WEFT_CUDA_CHECK(cudaGetDeviceCount(&ndev));
    if (ndev < env->local_world && !std::getenv("CUDA_VISIBLE_DEVICES")) {
      std::printf("SKIPPED: weft-multinode-tests: %d ranks on this host, %d GPUs\n", env->local_world, ndev);
      return 77;
    }
    auto team = weft::MultiNodeTeam::create_from_launcher(*env);
    if (std::getenv("WEFT_TEST_RANK_DEATH")) return rank_death(*team);
    const int rc = run(*team);
    if (rc == 0 && want_bench) bench(*team);
    return rc;
  } catch (const std::exception& e) {
    std::printf("[rank ?] FAILED: %s\n", e.what());
    return 1;
  }
}
