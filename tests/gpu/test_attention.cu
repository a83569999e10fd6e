// GPU tests of weft::flash_attention_forward and flash_attention_backward against fp64 host references
// computed from the same bf16 inputs: odd lengths, seq_q < seq_k and seq_q > seq_k (bottom-right causal, rows
// that see no key), GQA and MQA, both head dims, a custom softmax scale. Outputs and LSE are poisoned (NaN)
// first; NaN never passes. Pass: |O - ref| <= 5e-3 + 5e-3 |ref| per element (P and O are rounded to bf16 once
// each: at most 2^-9 relative each on values bounded by max |V| = 1), |LSE - ref| <= 1e-3 (1 + |ref|).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "attention_reference.hpp"
#include "harness.hpp"
#include "weft/ops/attention.hpp"
#include "weft/runtime/communicator.hpp"
#include "weft/timeline.hpp"

using namespace weft;
using weft::test::DeviceBuffer;
using weft::test::TestContext;

namespace {

struct Case {
  int64_t batch, seq_q, seq_k, heads, kv_heads, dim;
  bool causal;
  float scale;         // 0: 1 / sqrt(dim)
  int max_blocks = 0;  // > 0: that many persistent blocks, each taking several work items
};

std::vector<__nv_bfloat16> random_bf16(size_t n, uint64_t seed) {
  std::vector<__nv_bfloat16> v(n);
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (auto& x : v) {
    const float f = u(g);
    x = __float2bfloat16(std::abs(f) < 0x1p-10f ? 0.f : f);
  }
  return v;
}
float to_f(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
// Tensors travel as 16-bit patterns of the call's type: inputs are generated in bf16 with no magnitude below
// 2^-10 (see random_bf16), so fp16 holds them exactly and one fp64 reference serves both types.
float bits_f(uint16_t b, DType t) {
  if (t == DType::kFP16) return __half2float(__ushort_as_half(b));
  return __bfloat162float(__ushort_as_bfloat16(b));
}
void upload(const DeviceBuffer& dst, const std::vector<__nv_bfloat16>& v, DType t) {
  std::vector<uint16_t> bits(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    if (t == DType::kFP16)
      bits[i] = __half_as_ushort(__float2half_rn(to_f(v[i])));
    else
      bits[i] = __bfloat16_as_ushort(v[i]);
  }
  WEFT_CUDA_CHECK(cudaMemcpy(dst.p, bits.data(), bits.size() * 2, cudaMemcpyHostToDevice));
}
std::vector<uint16_t> download(const DeviceBuffer& src, size_t n) {
  std::vector<uint16_t> bits(n);
  WEFT_CUDA_CHECK(cudaMemcpy(bits.data(), src.p, n * 2, cudaMemcpyDeviceToHost));
  return bits;
}

// The attention problem in its packed view: q [rows_q, heads, dim], k / v [rows_k, kv_heads, dim]; sequence
// b is query rows [q0, q0 + q_len) and key rows [k0, k0 + k_len). Dense [batch, seq, heads, dim] tensors
// are the packed view with sequence b at rows b * seq.
struct Seq {
  int64_t q0, q_len, k0, k_len;
};
struct Problem {
  int64_t rows_q = 0, rows_k = 0, heads = 0, kv_heads = 0, dim = 0;
  bool causal = false, packed = false;  // packed: LSE [heads, rows_q]; dense: [batch, heads, seq_q]
  DType dtype = DType::kBF16;
  bool deterministic = false;  // backward: also checks that a second run gives the same bits
  double scale = 0;
  int64_t seq_q = 0;  // dense: each sequence's rows
  std::vector<Seq> seqs;
  int query_rows = 0;  // forward: AttentionOptions::query_rows
  TimelineBuffer* timeline = nullptr;  // AttentionOptions::timeline (both passes)
  int64_t lse_index(int64_t b, int64_t h, int64_t i) const {
    return packed ? h * rows_q + seqs[b].q0 + i : (b * heads + h) * seq_q + i;
  }
};

Problem dense_problem(const Case& c) {
  Problem pr;
  pr.rows_q = c.batch * c.seq_q;
  pr.rows_k = c.batch * c.seq_k;
  pr.heads = c.heads;
  pr.kv_heads = c.kv_heads;
  pr.dim = c.dim;
  pr.causal = c.causal;
  pr.scale = c.scale > 0 ? c.scale : 1.0 / std::sqrt(double(c.dim));
  pr.seq_q = c.seq_q;
  for (int64_t b = 0; b < c.batch; ++b) pr.seqs.push_back({b * c.seq_q, c.seq_q, b * c.seq_k, c.seq_k});
  return pr;
}

// The problem as the fp64 reference (attention_reference.hpp) takes it.
weft::test::AttentionRefShape ref_shape(const Problem& pr) {
  weft::test::AttentionRefShape r{pr.rows_q, pr.rows_k, pr.heads, pr.kv_heads,
                                  pr.dim,    pr.causal, pr.scale, {}};
  for (const Seq& s : pr.seqs) r.seqs.push_back({s.q0, s.q_len, s.k0, s.k_len});
  return r;
}
weft::test::AttentionReference reference_forward(const Problem& pr, const std::vector<__nv_bfloat16>& q,
                                                 const std::vector<__nv_bfloat16>& k,
                                                 const std::vector<__nv_bfloat16>& v) {
  return weft::test::attention_reference(ref_shape(pr), q, k, v);
}

// Compares a forward's out (bf16, or fp32 when out_f32) and LSE with the reference over the covered rows;
// rows of no sequence must still hold the poison (0xff bytes). Pass: |O - ref| <= 5e-3 + 5e-3 |ref|, |LSE -
// ref| <= 1e-3 (1 + |ref|), -inf exactly where the reference has it.
std::string check_forward(const Problem& pr, const weft::test::AttentionReference& ref,
                          const std::vector<uint16_t>& out, const std::vector<float>& out_f32,
                          const std::vector<float>& lse, const std::string& label) {
  const int64_t H = pr.heads, D = pr.dim;
  double w = 0, wl = 0;
  int64_t bad_o = 0, bad_lse = 0, bad_untouched = 0;
  std::string first;
  std::vector<char> covered(pr.rows_q, 0);  // the query rows of some sequence
  for (const Seq& s : pr.seqs) std::fill_n(covered.begin() + s.q0, s.q_len, 1);
  for (int64_t row = 0; row < pr.rows_q; ++row)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < D; ++d) {
        const int64_t e = (row * H + h) * D + d;
        if (!covered[row]) {
          if (!out.empty() && out[e] != 0xffff) ++bad_untouched;
          continue;
        }
        const double got = out_f32.empty() ? double(bits_f(out[e], pr.dtype)) : double(out_f32[e]);
        const double err = std::isfinite(got) ? std::abs(got - ref.o[e]) : 1e30;
        w = std::max(w, err);
        if (!(err <= 5e-3 + 5e-3 * std::abs(ref.o[e]))) {
          if (bad_o++ == 0)
            first = " first O error at row " + std::to_string(row) + " head " + std::to_string(h);
        }
      }
  for (int64_t b = 0; b < int64_t(pr.seqs.size()); ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < pr.seqs[b].q_len; ++i) {
        const double rl = ref.lse[(pr.seqs[b].q0 + i) * H + h], gl = lse[pr.lse_index(b, h, i)];
        if (std::isinf(rl)) {
          if (!(std::isinf(gl) && gl < 0)) ++bad_lse;
          continue;
        }
        const double e = std::isfinite(gl) ? std::abs(gl - rl) : 1e30;
        wl = std::max(wl, e);
        if (!(e <= 1e-3 * (1 + std::abs(rl)))) ++bad_lse;
      }
  const std::string what =
      label + ": max |O err| " + std::to_string(w) + ", max |LSE err| " + std::to_string(wl);
  std::fprintf(stderr, "  %s\n", what.c_str());
  if (bad_o + bad_lse + bad_untouched == 0) return {};
  return what + "; " + std::to_string(bad_o) + " O elements and " + std::to_string(bad_lse) +
         " LSE rows out of tolerance, " + std::to_string(bad_untouched) +
         " elements of rows in no sequence written;" + first;
}

std::string case_label(const Case& c) {
  return "B=" + std::to_string(c.batch) + " Sq=" + std::to_string(c.seq_q) +
         " Sk=" + std::to_string(c.seq_k) + " H=" + std::to_string(c.heads) + "/" +
         std::to_string(c.kv_heads) + " D=" + std::to_string(c.dim) + (c.causal ? " causal" : "") +
         (c.max_blocks ? " blocks=" + std::to_string(c.max_blocks) : std::string());
}

// Packed sequences on the device: the four range arrays.
struct DeviceSegments {
  DeviceBuffer buf;
  AttentionSegments seg;
  DeviceSegments(const Problem& pr) : buf(pr.seqs.size() * 16) {
    const size_t n = pr.seqs.size();
    std::vector<int32_t> h(4 * n);
    for (size_t b = 0; b < n; ++b) {
      const Seq& s = pr.seqs[b];
      h[b] = int32_t(s.q0);
      h[n + b] = int32_t(s.q0 + s.q_len);
      h[2 * n + b] = int32_t(s.k0);
      h[3 * n + b] = int32_t(s.k0 + s.k_len);
    }
    WEFT_CUDA_CHECK(cudaMemcpy(buf.p, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
    const int32_t* a = buf.as<int32_t>();
    seg = {a, a + n, a + 2 * n, a + 3 * n, pr.rows_q, pr.rows_k};
  }
};

// The call's shape: dense [batch, seq, ...], or packed with the longest sequences.
AttentionShape shape_of(const Problem& pr) {
  if (!pr.packed)
    return {int64_t(pr.seqs.size()),
            pr.seq_q,
            pr.rows_k / int64_t(pr.seqs.size()),
            pr.heads,
            pr.kv_heads,
            pr.dim};
  int64_t mq = 1, mk = 1;
  for (const Seq& s : pr.seqs) mq = std::max(mq, s.q_len), mk = std::max(mk, s.k_len);
  return {int64_t(pr.seqs.size()), mq, mk, pr.heads, pr.kv_heads, pr.dim};
}

std::string run_forward(const Problem& pr, uint64_t seed, int max_blocks, const std::string& label) {
  const int64_t qn = pr.rows_q * pr.heads * pr.dim, kn = pr.rows_k * pr.kv_heads * pr.dim;
  const auto q = random_bf16(qn, seed), k = random_bf16(kn, seed + 1), v = random_bf16(kn, seed + 2);
  DeviceBuffer dq(qn * 2), dk(kn * 2), dv(kn * 2), dout(qn * 2), dlse(pr.rows_q * pr.heads * 4);
  upload(dq, q, pr.dtype);
  upload(dk, k, pr.dtype);
  upload(dv, v, pr.dtype);
  WEFT_CUDA_CHECK(cudaMemset(dout.p, 0xff, qn * 2));
  WEFT_CUDA_CHECK(cudaMemset(dlse.p, 0xff, dlse.bytes));
  AttentionOptions o;
  o.causal = pr.causal;
  o.softmax_scale = float(pr.scale);
  o.max_blocks = max_blocks;
  o.query_rows = pr.query_rows;
  o.timeline = pr.timeline;
  std::unique_ptr<DeviceSegments> segs;
  if (pr.packed) o.segments = (segs = std::make_unique<DeviceSegments>(pr))->seg;
  flash_attention_forward(dq.p, dk.p, dv.p, dout.p, dlse.as<float>(), shape_of(pr), pr.dtype, nullptr, o);
  WEFT_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint16_t> out = download(dout, qn);
  std::vector<float> lse(pr.rows_q * pr.heads);
  WEFT_CUDA_CHECK(cudaMemcpy(lse.data(), dlse.p, lse.size() * 4, cudaMemcpyDeviceToHost));
  return check_forward(pr, reference_forward(pr, q, k, v), out, {}, lse, label);
}

std::string run_case(const Case& c, uint64_t seed) {
  return run_forward(dense_problem(c), seed, c.max_blocks, case_label(c));
}

// Packed sequences: (query rows, key rows) per sequence, `gap` rows of no sequence before each one (they
// must come out untouched).
struct PackedCase {
  std::vector<std::array<int64_t, 2>> lengths;
  int64_t gap, heads, kv_heads, dim;
  bool causal;
  int max_blocks = 0;
};
Problem packed_problem(const PackedCase& c) {
  Problem pr;
  pr.heads = c.heads;
  pr.kv_heads = c.kv_heads;
  pr.dim = c.dim;
  pr.causal = c.causal;
  pr.packed = true;
  pr.scale = 1.0 / std::sqrt(double(c.dim));
  for (const auto& [lq, lk] : c.lengths) {
    pr.seqs.push_back({pr.rows_q + c.gap, lq, pr.rows_k + c.gap, lk});
    pr.rows_q += c.gap + lq;
    pr.rows_k += c.gap + lk;
  }
  pr.rows_q += c.gap;  // rows after the last sequence, too
  pr.rows_k += c.gap;
  return pr;
}
std::string packed_label(const PackedCase& c) {
  std::string s = "packed";
  for (const auto& [lq, lk] : c.lengths)
    s += " " + std::to_string(lq) + (lq == lk ? "" : "/" + std::to_string(lk));
  return s + " gap=" + std::to_string(c.gap) + " H=" + std::to_string(c.heads) + "/" +
         std::to_string(c.kv_heads) + " D=" + std::to_string(c.dim) + (c.causal ? " causal" : "") +
         (c.max_blocks ? " blocks=" + std::to_string(c.max_blocks) : std::string());
}

// Partial attention: the keys of each sequence (dense [batch, seq, heads, dim], seq_q = seq_k) cut into
// `parts` blocks, merged call by call into a running fp32 O and LSE as ring attention's steps would: without
// a causal mask one call per block (every query against the block); with one, per block [c0, c1) the
// diagonal (queries [c0, c1), causal) and the rows below it (queries [c1, seq), no mask). The fp32 result and
// the bf16 `out` of the last call against the fp64 reference over all keys at once.
std::string run_accumulate_case(const Case& c, int parts, uint64_t seed) {
  Problem pr = dense_problem(c);
  pr.packed = true;  // the calls see the batch as one packed sequence of ranges; LSE [heads, rows]
  const int64_t qn = pr.rows_q * pr.heads * pr.dim, kn = pr.rows_k * pr.kv_heads * pr.dim;
  const auto q = random_bf16(qn, seed), k = random_bf16(kn, seed + 1), v = random_bf16(kn, seed + 2);
  DeviceBuffer dq(qn * 2), dk(kn * 2), dv(kn * 2), dout(qn * 2), acc_o(qn * 4),
      acc_lse(pr.rows_q * pr.heads * 4);
  WEFT_CUDA_CHECK(cudaMemcpy(dq.p, q.data(), qn * 2, cudaMemcpyHostToDevice));
  WEFT_CUDA_CHECK(cudaMemcpy(dk.p, k.data(), kn * 2, cudaMemcpyHostToDevice));
  WEFT_CUDA_CHECK(cudaMemcpy(dv.p, v.data(), kn * 2, cudaMemcpyHostToDevice));
  WEFT_CUDA_CHECK(cudaMemset(dout.p, 0xff, qn * 2));
  WEFT_CUDA_CHECK(cudaMemset(acc_o.p, 0, acc_o.bytes));
  {
    std::vector<float> minf(pr.rows_q * pr.heads, -std::numeric_limits<float>::infinity());
    WEFT_CUDA_CHECK(cudaMemcpy(acc_lse.p, minf.data(), acc_lse.bytes, cudaMemcpyHostToDevice));
  }
  struct Call {
    Problem pr;
    bool causal;
  };
  std::vector<Call> calls;
  const int64_t S = c.seq_q;
  for (int part = 0; part < parts; ++part) {
    const int64_t c0 = S * part / parts, c1 = S * (part + 1) / parts;
    Problem diag = pr, below = pr;
    diag.seqs.clear();
    below.seqs.clear();
    for (int64_t b = 0; b < c.batch; ++b) {
      if (c.causal) {
        diag.seqs.push_back({b * S + c0, c1 - c0, b * S + c0, c1 - c0});
        below.seqs.push_back({b * S + c1, S - c1, b * S + c0, c1 - c0});
      } else {
        diag.seqs.push_back({b * S, S, b * S + c0, c1 - c0});
      }
    }
    calls.push_back({diag, c.causal});
    if (c.causal && c1 < S) calls.push_back({below, false});
  }
  std::vector<std::unique_ptr<DeviceSegments>> keep;
  for (size_t i = 0; i < calls.size(); ++i) {
    AttentionOptions o;
    o.causal = calls[i].causal;
    o.softmax_scale = float(pr.scale);
    o.max_blocks = c.max_blocks;
    keep.push_back(std::make_unique<DeviceSegments>(calls[i].pr));
    o.segments = keep.back()->seg;
    o.accumulate = {acc_o.as<float>(), acc_lse.as<float>()};
    // Without a mask the last call covers every row: it also writes the merged result in bf16.
    const bool last = i + 1 == calls.size() && !c.causal;
    flash_attention_forward(dq.p, dk.p, dv.p, last ? dout.p : nullptr, nullptr, shape_of(calls[i].pr),
                            DType::kBF16, nullptr, o);
  }
  WEFT_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint16_t> out = download(dout, qn);
  std::vector<float> o32(qn), lse(pr.rows_q * pr.heads);
  WEFT_CUDA_CHECK(cudaMemcpy(o32.data(), acc_o.p, qn * 4, cudaMemcpyDeviceToHost));
  WEFT_CUDA_CHECK(cudaMemcpy(lse.data(), acc_lse.p, lse.size() * 4, cudaMemcpyDeviceToHost));
  const weft::test::AttentionReference ref = reference_forward(pr, q, k, v);
  const std::string label = case_label(c) + " in " + std::to_string(parts) + " accumulated parts (" +
                            std::to_string(calls.size()) + " calls)";
  std::string e = check_forward(pr, ref, {}, o32, lse, label + ", fp32");
  if (e.empty() && !c.causal) e = check_forward(pr, ref, out, {}, lse, label + ", bf16 out");
  return e;
}

// Backward: weft's forward gives out and lse, weft's backward dq, dk, dv for a random dout; the fp64
// reference recomputes everything from the bf16 q, k, v, dout. Per tensor, pass when every element is within
// 1e-5 + 2e-2 max|ref| + 2e-2 |ref| (P and dS are rounded to bf16 before their products, as in flash-attn;
// the gradients sum up to seq terms each); the report gives the largest error relative to max|ref|. Rows of
// no sequence: dq there must be 0, dk / dv untouched (the poison).
std::string run_backward(const Problem& pr, uint64_t seed, int max_blocks, const std::string& label) {
  const int64_t H = pr.heads, KV = pr.kv_heads, D = pr.dim;
  const int64_t qn = pr.rows_q * H * D, kn = pr.rows_k * KV * D;
  const auto q = random_bf16(qn, seed), k = random_bf16(kn, seed + 1), v = random_bf16(kn, seed + 2),
             go = random_bf16(qn, seed + 3);
  const AttentionShape shape = shape_of(pr);
  AttentionOptions o;
  o.causal = pr.causal;
  o.softmax_scale = float(pr.scale);
  o.max_blocks = max_blocks;
  o.deterministic = pr.deterministic;
  o.timeline = pr.timeline;
  std::unique_ptr<DeviceSegments> segs;
  if (pr.packed) o.segments = (segs = std::make_unique<DeviceSegments>(pr))->seg;
  DeviceBuffer dq(qn * 2), dk(kn * 2), dv(kn * 2), dout(qn * 2), dgo(qn * 2), dlse(pr.rows_q * H * 4),
      ddq(qn * 2), ddk(kn * 2), ddv(kn * 2), ws(flash_attention_backward_workspace_bytes(shape, o));
  upload(dq, q, pr.dtype);
  upload(dk, k, pr.dtype);
  upload(dv, v, pr.dtype);
  upload(dgo, go, pr.dtype);
  for (DeviceBuffer* b : {&ddq, &ddk, &ddv, &ws, &dout}) WEFT_CUDA_CHECK(cudaMemset(b->p, 0xff, b->bytes));
  AttentionOptions forward = o;  // a timeline records the backward alone
  forward.timeline = nullptr;
  flash_attention_forward(dq.p, dk.p, dv.p, dout.p, dlse.as<float>(), shape, pr.dtype, nullptr, forward);
  flash_attention_backward(dq.p, dk.p, dv.p, dout.p, dgo.p, dlse.as<float>(), ddq.p, ddk.p, ddv.p, ws.p,
                           ws.bytes, shape, pr.dtype, nullptr, o);
  WEFT_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint16_t> gq = download(ddq, qn), gk = download(ddk, kn), gv = download(ddv, kn);
  std::string failures;
  if (pr.deterministic) {  // a second run: the same bits
    for (int run = 0; run < 2; ++run) {
      for (DeviceBuffer* b : {&ddq, &ddk, &ddv, &ws}) WEFT_CUDA_CHECK(cudaMemset(b->p, 0xff, b->bytes));
      flash_attention_backward(dq.p, dk.p, dv.p, dout.p, dgo.p, dlse.as<float>(), ddq.p, ddk.p, ddv.p, ws.p,
                               ws.bytes, shape, pr.dtype, nullptr, o);
      WEFT_CUDA_CHECK(cudaDeviceSynchronize());
      if (download(ddq, qn) != gq || download(ddk, kn) != gk || download(ddv, kn) != gv)
        failures += " deterministic: run " + std::to_string(run + 2) + " gave other bits than the first;";
    }
  }

  const weft::test::AttentionReference ref = weft::test::attention_reference(ref_shape(pr), q, k, v, go);
  const std::vector<double>&ref_dq = ref.dq, &ref_dk = ref.dk, &ref_dv = ref.dv;
  std::vector<char> q_covered(pr.rows_q, 0), k_covered(pr.rows_k, 0);
  for (const Seq& s : pr.seqs) {
    std::fill_n(q_covered.begin() + s.q0, s.q_len, 1);
    std::fill_n(k_covered.begin() + s.k0, s.k_len, 1);
  }
  std::string what = label + (pr.deterministic ? " deterministic:" : ":");
  auto compare = [&](const char* name, const std::vector<uint16_t>& got, const std::vector<double>& ref,
                     const std::vector<char>& covered, int64_t heads, bool zero_outside) {
    double top = 0, worst = 0;
    for (double x : ref) top = std::max(top, std::abs(x));
    int64_t bad = 0, first = -1, outside = 0;
    for (size_t e = 0; e < ref.size(); ++e) {
      if (!covered[e / D / heads]) {
        if (zero_outside ? bits_f(got[e], pr.dtype) != 0.f : got[e] != 0xffff) ++outside;
        continue;
      }
      const double g = bits_f(got[e], pr.dtype);
      const double err = std::isfinite(g) ? std::abs(g - ref[e]) : 1e30;
      worst = std::max(worst, err);
      if (!(err <= 1e-5 + 2e-2 * top + 2e-2 * std::abs(ref[e]))) {
        if (first < 0) first = int64_t(e);
        ++bad;
      }
    }
    char buf[160];
    std::snprintf(buf, sizeof buf, " %s max err %.2e of max|ref| %.3g (%.4f)", name, worst, top,
                  top > 0 ? worst / top : worst);
    what += buf;
    if (bad)
      failures += std::string(" ") + name + ": " + std::to_string(bad) +
                  " elements out of tolerance, first " + std::to_string(first) + " got " +
                  std::to_string(bits_f(got[first], pr.dtype)) + " ref " + std::to_string(ref[first]) + ";";
    if (outside)
      failures += std::string(" ") + name + ": " + std::to_string(outside) +
                  " elements of rows in no sequence " + (zero_outside ? "not 0;" : "written;");
  };
  compare("dq", gq, ref_dq, q_covered, H, true);
  compare("dk", gk, ref_dk, k_covered, KV, false);
  compare("dv", gv, ref_dv, k_covered, KV, false);
  std::fprintf(stderr, "  %s\n", what.c_str());
  return failures.empty() ? std::string() : what + failures;
}

std::string run_backward_case(const Case& c, uint64_t seed) {
  return run_backward(dense_problem(c), seed, c.max_blocks, case_label(c));
}

}  // namespace

// Shapes both passes are tested on: odd lengths, seq_q < seq_k and seq_q > seq_k, GQA and MQA, both head
// dims, custom scales.
std::vector<Case> common_cases() {
  return {
      {2, 256, 256, 4, 4, 128, false, 0.f},
      {2, 256, 256, 4, 4, 128, true, 0.f},
      {1, 1, 1, 2, 1, 128, false, 0.f},
      {1, 1, 1, 2, 2, 64, true, 0.f},
      {2, 17, 1000, 8, 1, 128, true, 0.f},
      {1, 300, 129, 4, 2, 64, true, 0.f},
      {1, 1000, 1000, 2, 1, 64, true, 0.f},
      {1, 1000, 1000, 8, 2, 128, false, 1.0f},
      {3, 129, 383, 4, 4, 64, false, 0.3f},
      {1, 200, 200, 4, 1, 128, true, 1.0f},
      // An SM budget below the item count: each persistent block takes several items in turn.
      {2, 256, 256, 4, 4, 128, false, 0.f, 3},
      {1, 1000, 1000, 2, 1, 64, true, 0.f, 5},
  };
}

template <class Run>
std::string run_cases(const std::vector<Case>& cases, uint64_t seed, Run&& run) {
  std::string failures;
  for (const Case& c : cases) {
    const std::string e = run(c, seed += 10);
    if (!e.empty()) failures += "\n    " + e;
  }
  return failures;
}

WEFT_GPU_TEST_ONE_GPU(flash_attention_forward_matches_fp64_reference) {
  WEFT_CUDA_CHECK(cudaSetDevice(ctx.comm().local(0).device()));
  std::vector<Case> cases = common_cases();
  cases.push_back({2, 300, 700, 8, 2, 128, true, 0.f, 7});
  cases.push_back({4, 1000, 1000, 8, 8, 128, true, 0.f, 1});
  if (!ctx.quick) {
    cases.push_back({1, 4099, 4099, 1, 1, 128, true, 0.f});
    cases.push_back({1, 4099, 4099, 2, 1, 64, false, 0.f});
  }
  const std::string failures = run_cases(cases, 7, run_case);
  WEFT_EXPECT(failures.empty(), failures);
}

WEFT_GPU_TEST_ONE_GPU(flash_attention_backward_matches_fp64_reference) {
  WEFT_CUDA_CHECK(cudaSetDevice(ctx.comm().local(0).device()));
  std::vector<Case> cases = common_cases();
  cases.push_back({2, 256, 256, 4, 4, 64, false, 0.f});
  cases.push_back({1, 600, 300, 4, 4, 128, true, 0.f});
  cases.push_back({2, 256, 256, 4, 4, 128, true, 0.f, 3});
  cases.push_back({1, 1000, 1000, 4, 1, 64, true, 0.f, 5});
  if (!ctx.quick) {
    cases.push_back({1, 4099, 4099, 2, 1, 128, true, 0.f});
    // Queries a short suffix of long keys (context parallelism's calls over gathered K / V).
    cases.push_back({1, 256, 4099, 4, 1, 128, true, 0.f});
    cases.push_back({1, 1025, 2050, 4, 1, 128, true, 0.f});
    cases.push_back({1, 1025, 4099, 2, 1, 64, true, 0.f});
    // D = 64 from 4096 queries on: the kernel of 128 query rows per step.
    cases.push_back({1, 4099, 4099, 2, 1, 64, true, 0.f});
    cases.push_back({1, 4096, 4500, 2, 2, 64, false, 0.f, 5});
  }
  const std::string failures = run_cases(cases, 11, run_backward_case);
  WEFT_EXPECT(failures.empty(), failures);
}

// Packed variable-length sequences (flash-attn's varlen layout, with rows of no sequence between them):
// lengths 1 to 4k, empty sequences, seq_q != seq_k per sequence, GQA, both head dims, causal and not.
std::vector<PackedCase> packed_cases(bool quick) {
  std::vector<PackedCase> v = {
      {{{1, 1}, {17, 17}, {300, 300}, {129, 129}, {64, 64}}, 0, 4, 4, 128, false},
      {{{1, 1}, {17, 17}, {300, 300}, {129, 129}, {64, 64}}, 3, 4, 2, 64, true},
      {{{200, 70}, {70, 200}, {0, 5}, {5, 0}, {1000, 1000}}, 7, 8, 1, 128, true},
      {{{1000, 1000}, {1, 1000}, {333, 333}}, 0, 2, 2, 64, false, 3},
      {{{130, 130}, {63, 63}, {65, 65}, {127, 129}}, 1, 8, 2, 128, true, 2},
  };
  if (!quick) {
    v.push_back({{{4099, 4099}, {1, 1}, {2000, 2000}, {17, 17}}, 0, 2, 1, 128, true});
    v.push_back({{{4096, 4096}, {3000, 3000}, {1, 1}}, 5, 4, 1, 64, false});
    v.push_back({{{1025, 2050}, {1025, 4099}, {256, 4099}}, 0, 4, 1, 128, true});
  }
  return v;
}

WEFT_GPU_TEST_ONE_GPU(flash_attention_packed_sequences) {
  WEFT_CUDA_CHECK(cudaSetDevice(ctx.comm().local(0).device()));
  std::string failures;
  uint64_t seed = 101;
  for (const PackedCase& c : packed_cases(ctx.quick)) {
    const Problem pr = packed_problem(c);
    std::string e = run_forward(pr, seed += 10, c.max_blocks, packed_label(c));
    if (e.empty()) e = run_backward(pr, seed + 5, c.max_blocks, packed_label(c));
    if (!e.empty()) failures += "\n    " + e;
  }
  WEFT_EXPECT(failures.empty(), failures);
}

// Partial attention merged in fp32 across calls (ring attention's steps) equals attention over all keys.
WEFT_GPU_TEST_ONE_GPU(flash_attention_accumulates_in_fp32) {
  WEFT_CUDA_CHECK(cudaSetDevice(ctx.comm().local(0).device()));
  struct Item {
    Case c;
    int parts;
  };
  std::vector<Item> items = {
      {{2, 256, 256, 4, 4, 128, false, 0.f}, 2}, {{2, 256, 256, 4, 4, 128, true, 0.f}, 2},
      {{1, 1000, 1000, 4, 1, 64, true, 0.f}, 3}, {{2, 700, 700, 8, 2, 128, false, 0.f, 5}, 8},
      {{1, 1000, 1000, 2, 2, 64, true, 0.f}, 8},
  };
  if (!ctx.quick) items.push_back({{1, 4099, 4099, 2, 1, 128, true, 0.f}, 4});
  std::string failures;
  uint64_t seed = 201;
  for (const Item& it : items) {
    const std::string e = run_accumulate_case(it.c, it.parts, seed += 10);
    if (!e.empty()) failures += "\n    " + e;
  }
  WEFT_EXPECT(failures.empty(), failures);
}

// fp16 inputs: the same kernels with fp16 MMAs (P and dS rounded to fp16), dense and packed, both passes.
WEFT_GPU_TEST_ONE_GPU(flash_attention_fp16) {
  WEFT_CUDA_CHECK(cudaSetDevice(ctx.comm().local(0).device()));
  std::string failures;
  uint64_t seed = 301;
  std::vector<Problem> problems;
  for (const Case& c : std::vector<Case>{{2, 256, 256, 4, 4, 128, true, 0.f},
                                         {1, 1000, 1000, 8, 2, 64, false, 0.f},
                                         {2, 17, 300, 4, 1, 128, true, 0.f, 3}})
    problems.push_back(dense_problem(c));
  problems.push_back(packed_problem({{{1, 1}, {300, 300}, {129, 64}}, 2, 4, 2, 64, true}));
  problems.push_back(packed_problem({{{1000, 1000}, {17, 17}}, 0, 2, 1, 128, false}));
  for (Problem& pr : problems) {
    pr.dtype = DType::kFP16;
    const std::string label = std::string("fp16 ") + (pr.packed ? "packed " : "") +
                              std::to_string(pr.rows_q) + " rows, H=" + std::to_string(pr.heads) + "/" +
                              std::to_string(pr.kv_heads) + " D=" + std::to_string(pr.dim) +
                              (pr.causal ? " causal" : "");
    std::string e = run_forward(pr, seed += 10, 0, label);
    if (e.empty()) e = run_backward(pr, seed + 5, 0, label);
    if (!e.empty()) failures += "\n    " + e;
  }
  WEFT_EXPECT(failures.empty(), failures);
}

// The deterministic backward: within tolerance, and the same bits in three runs (with several persistent
// blocks per item order, causal and not, GQA, packed, D = 64 from 4096 queries on: 128 query rows a step).
WEFT_GPU_TEST_ONE_GPU(flash_attention_deterministic_backward) {
  WEFT_CUDA_CHECK(cudaSetDevice(ctx.comm().local(0).device()));
  std::string failures;
  uint64_t seed = 401;
  std::vector<std::pair<Problem, int>> problems;
  for (const Case& c : std::vector<Case>{{2, 1000, 1000, 8, 2, 128, true, 0.f},
                                         {1, 700, 700, 4, 4, 64, false, 0.f},
                                         {2, 300, 1000, 4, 1, 128, true, 0.f, 7},
                                         {1, 1000, 300, 2, 2, 64, true, 0.f},
                                         {1, 4099, 4099, 2, 1, 64, true, 0.f},
                                         {1, 4500, 4100, 2, 1, 64, true, 0.f},
                                         {1, 4096, 4500, 2, 2, 64, false, 0.f, 5}})
    problems.push_back({dense_problem(c), c.max_blocks});
  problems.push_back({packed_problem({{{1, 1}, {900, 900}, {129, 64}, {300, 300}}, 2, 4, 2, 64, true}), 0});
  problems.push_back({packed_problem({{{1000, 1000}, {17, 500}}, 0, 2, 1, 128, false}), 5});
  problems.push_back({packed_problem({{{4100, 4100}, {300, 4500}, {1, 1}}, 0, 2, 1, 64, true}), 0});
  for (auto& [pr, blocks] : problems) {
    pr.deterministic = true;
    const std::string label = std::string(pr.packed ? "packed " : "") + std::to_string(pr.rows_q) +
                              " rows, H=" + std::to_string(pr.heads) + "/" + std::to_string(pr.kv_heads) +
                              " D=" + std::to_string(pr.dim) + (pr.causal ? " causal" : "") +
                              (blocks ? " blocks=" + std::to_string(blocks) : std::string());
    const std::string e = run_backward(pr, seed += 10, blocks, label);
    if (!e.empty()) failures += "\n    " + e;
  }
  WEFT_EXPECT(failures.empty(), failures);
}

// The forward at D = 64 with either query block forced (AttentionOptions::query_rows: 128 rows, which the
// call picks for a causal mask up to 2048 query rows, and 192 otherwise), against the fp64 reference: partial
// blocks, causal with seq_q != seq_k, GQA, a sequence past 2048 rows, packed sequences, an SM budget; the
// plan's tile; the refusals (192 at D = 128, a size of no kernel).
WEFT_GPU_TEST_ONE_GPU(flash_attention_query_rows) {
  WEFT_CUDA_CHECK(cudaSetDevice(ctx.comm().local(0).device()));
  std::string failures;
  uint64_t seed = 501;
  std::vector<std::pair<Problem, int>> problems;
  for (const Case& c : std::vector<Case>{{2, 1000, 1000, 4, 2, 64, true, 0.f},
                                         {3, 129, 383, 4, 4, 64, false, 0.f},
                                         {1, 300, 129, 4, 1, 64, true, 0.f, 3},
                                         {1, 2100, 2100, 2, 1, 64, true, 0.f}})
    problems.push_back({dense_problem(c), c.max_blocks});
  problems.push_back({packed_problem({{{1, 1}, {300, 300}, {129, 64}}, 2, 4, 2, 64, true}), 0});
  for (int rows : {128, 192})
    for (auto& [pr, blocks] : problems) {
      pr.query_rows = rows;
      const std::string label = std::to_string(rows) + "-row blocks, " + (pr.packed ? "packed " : "") +
                                std::to_string(pr.rows_q) + " rows, H=" + std::to_string(pr.heads) + "/" +
                                std::to_string(pr.kv_heads) + (pr.causal ? " causal" : "") +
                                (blocks ? " blocks=" + std::to_string(blocks) : std::string());
      const std::string e = run_forward(pr, seed += 10, blocks, label);
      if (!e.empty()) failures += "\n    " + e;
    }
  AttentionOptions o;
  for (const bool causal : {false, true})
    for (int rows : {0, 128, 192}) {
      o.causal = causal;
      o.query_rows = rows;
      const Plan short_seq = flash_attention_forward_plan({16, 1024, 1024, 32, 32, 64}, DType::kBF16, o);
      const Plan long_seq = flash_attention_forward_plan({2, 8192, 8192, 32, 32, 64}, DType::kBF16, o);
      WEFT_EXPECT(short_seq.tiles.m == (rows     ? rows
                                        : causal ? 128
                                                 : 192) &&
                      long_seq.tiles.m == (rows ? rows : 192),
                  "query_rows " << rows << (causal ? ", causal" : "") << ": plan tiles " << short_seq.tiles.m
                                << " (S 1024), " << long_seq.tiles.m << " (S 8192)");
    }
  o.causal = false;
  for (auto [rows, dim] : {std::pair{192, 128}, std::pair{64, 64}, std::pair{256, 64}}) {
    o.query_rows = rows;
    std::string msg;
    try {
      flash_attention_forward_plan({1, 16, 16, 2, 2, dim}, DType::kBF16, o);
    } catch (const Error& e) {
      msg = e.what();
    }
    WEFT_EXPECT(msg.find("query_rows") != std::string::npos,
                "query_rows " << rows << " at D = " << dim << ": expected a refusal, got '" << msg << "'");
  }
  WEFT_EXPECT(failures.empty(), failures);
}

// AttentionOptions::timeline (the bf16 kernels of their own): the forward, the backward and the
// deterministic backward with a timeline attached (the backward's alone: run_backward's forward records
// none) still match the fp64 reference, and record each block's span and each work item's mainloop and
// store, every span closed, none dropped; fp16 with a timeline is refused.
WEFT_GPU_TEST_ONE_GPU(flash_attention_timeline) {
  WEFT_CUDA_CHECK(cudaSetDevice(ctx.comm().local(0).device()));
  constexpr uint32_t kEvents = 1u << 18;
  DeviceBuffer buffer(offsetof(TimelineBuffer, events) + sizeof(TimelineEvent) * kEvents);
  auto* tl = static_cast<TimelineBuffer*>(buffer.p);
  std::string failures;
  uint64_t seed = 601;
  // (D = 64 from 4096 queries: the backward's 128-row steps.)
  const std::vector<Case> cases = {{2, 300, 300, 4, 2, 128, true, 0.f},
                                   {1, 1000, 700, 2, 2, 64, false, 0.f},
                                   {1, 300, 300, 2, 1, 64, true, 0.f, 3},
                                   {1, 4100, 4100, 1, 1, 64, true, 0.f}};
  for (const Case& c : cases)
    for (const char* pass : {"forward", "backward", "deterministic backward"}) {
      Problem pr = dense_problem(c);
      pr.deterministic = pass[0] == 'd';
      pr.timeline = tl;
      const TimelineBuffer header{0, kEvents, 0, {}};
      WEFT_CUDA_CHECK(cudaMemcpy(tl, &header, offsetof(TimelineBuffer, events), cudaMemcpyHostToDevice));
      const std::string label = case_label(c) + " " + pass + " with a timeline";
      const std::string e = pass[0] == 'f' ? run_forward(pr, seed += 10, c.max_blocks, label)
                                           : run_backward(pr, seed += 10, c.max_blocks, label);
      if (!e.empty()) failures += "\n    " + e;
      if (const std::string bad = weft::test::lcsc_timeline_problem(read_timeline(tl)); !bad.empty())
        failures += "\n    " + label + ": " + bad;
    }
  AttentionOptions o;
  o.timeline = tl;
  for (const bool backward : {false, true}) {
    std::string msg;
    try {
      const AttentionShape s{1, 64, 64, 2, 2, 64};
      if (backward)
        flash_attention_backward_plan(s, DType::kFP16, o);
      else
        flash_attention_forward_plan(s, DType::kFP16, o);
    } catch (const Error& e) {
      msg = e.what();
    }
    WEFT_EXPECT(msg.find("timeline") != std::string::npos,
                (backward ? "backward" : "forward")
                    << ", fp16 with a timeline: expected a refusal, got '" << msg << "'");
  }
  WEFT_EXPECT(failures.empty(), failures);
}

// Small cases of both passes, for compute-sanitizer (tests/gpu/run.sh runs this one under memcheck,
// racecheck and synccheck): partial blocks, causal with seq_q != seq_k, GQA, both head dims, 2 blocks.
WEFT_GPU_TEST_ONE_GPU(flash_attention_small) {
  WEFT_CUDA_CHECK(cudaSetDevice(ctx.comm().local(0).device()));
  const std::vector<Case> cases = {
      {1, 130, 200, 2, 1, 128, true, 0.f, 2},
      {2, 70, 129, 2, 2, 64, false, 0.f, 2},
      {1, 200, 70, 4, 2, 64, true, 0.f},
  };
  std::string failures = run_cases(cases, 3, [](const Case& c, uint64_t seed) {
    const std::string e = run_case(c, seed);
    return e.empty() ? run_backward_case(c, seed + 5) : e;
  });
  const PackedCase packed{{{70, 70}, {1, 3}, {130, 65}}, 2, 2, 1, 64, true, 2};
  std::string e = run_forward(packed_problem(packed), 41, 2, packed_label(packed));
  if (e.empty()) e = run_backward(packed_problem(packed), 43, 2, packed_label(packed));
  if (e.empty()) e = run_accumulate_case({1, 200, 200, 2, 1, 128, true, 0.f, 2}, 3, 47);
  if (e.empty()) {
    Problem d = dense_problem({1, 200, 200, 2, 1, 64, true, 0.f});
    d.deterministic = true;
    e = run_backward(d, 53, 2, "small deterministic D=64 causal blocks=2");
  }
  // The backward's kernel of 128 query rows per step (D = 64 from 4096 queries on), on two blocks; and
  // deterministic.
  if (e.empty())
    e = run_backward(dense_problem({1, 4100, 4100, 1, 1, 64, true, 0.f}), 59, 2, "D=64 4100 causal");
  if (e.empty()) {
    Problem d = dense_problem({1, 4100, 4100, 1, 1, 64, true, 0.f});
    d.deterministic = true;
    e = run_backward(d, 61, 2, "deterministic D=64 4100 causal blocks=2");
  }
  if (!e.empty()) failures += "\n    " + e;
  WEFT_EXPECT(failures.empty(), failures);
}

WEFT_GPU_TEST_ONE_GPU(flash_attention_argument_errors) {
  WEFT_CUDA_CHECK(cudaSetDevice(ctx.comm().local(0).device()));
  DeviceBuffer buf(1 << 20);
  auto error_of = [&](AttentionShape s, DType t, const void* q) {
    try {
      flash_attention_forward(q, buf.p, buf.p, buf.p, nullptr, s, t, nullptr);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  const AttentionShape ok{1, 16, 16, 2, 2, 128};
  auto expect = [&](const std::string& msg, const char* part) {
    WEFT_EXPECT(msg.find(part) != std::string::npos,
                "expected an error naming '" << part << "', got '" << msg << "'");
  };
  expect(error_of({1, 16, 16, 2, 2, 96}, DType::kBF16, buf.p), "head_dim must be 64 or 128");
  expect(error_of({1, 16, 16, 6, 4, 128}, DType::kBF16, buf.p), "multiple of kv_heads");
  expect(error_of({1, 0, 16, 2, 2, 128}, DType::kBF16, buf.p), "at least 1");
  expect(error_of(ok, DType::kFP32, buf.p), "must be bf16");
  expect(error_of(ok, DType::kBF16, static_cast<char*>(buf.p) + 8), "16-byte aligned");
  std::vector<char> host(1 << 16);
  expect(error_of(ok, DType::kBF16, host.data()), "not device memory");
  auto backward_error_of = [&](const float* lse, size_t ws_bytes) {
    try {
      flash_attention_backward(buf.p, buf.p, buf.p, buf.p, buf.p, lse, buf.p, buf.p, buf.p, buf.p, ws_bytes,
                               ok, DType::kBF16, nullptr);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  const size_t need = flash_attention_backward_workspace_bytes(ok);
  expect(backward_error_of(nullptr, need), "lse");
  expect(backward_error_of(buf.as<float>(), need - 1), "workspace must hold");
  auto options_error_of = [&](const AttentionOptions& o, float* lse) {
    try {
      flash_attention_forward(buf.p, buf.p, buf.p, buf.p, lse, ok, DType::kBF16, nullptr, o);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  const int32_t* cu = buf.as<int32_t>();
  AttentionOptions o;
  o.segments = varlen_segments(cu, cu, 0, 16);
  expect(options_error_of(o, nullptr), "total_q");
  o.segments = varlen_segments(cu, cu, 8, 16);
  expect(options_error_of(o, nullptr), "cannot exceed total_q");
  o.segments = varlen_segments(cu, cu, 16, 16);
  o.segments.k_end = nullptr;
  expect(options_error_of(o, nullptr), "need all four");
  o.segments = varlen_segments(reinterpret_cast<const int32_t*>(host.data()), cu, 16, 16);
  expect(options_error_of(o, nullptr), "segments.q_begin is not device memory");
  o.segments = {};
  o.accumulate.o = buf.as<float>();
  expect(options_error_of(o, nullptr), "needs both o and lse");
  o.accumulate.lse = buf.as<float>();
  expect(options_error_of(o, buf.as<float>()), "pass lse = null");
  try {
    flash_attention_backward(buf.p, buf.p, buf.p, buf.p, buf.p, buf.as<float>(), buf.p, buf.p, buf.p, buf.p,
                             need, ok, DType::kBF16, nullptr, o);
    expect("", "options.accumulate is for the forward");
  } catch (const Error& e) {
    expect(e.what(), "options.accumulate is for the forward");
  }
}
