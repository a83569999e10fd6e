// GPU tests of weft::flash_attention_forward against an fp64 host reference computed from the same bf16
// inputs: odd lengths, seq_q < seq_k and seq_q > seq_k (bottom-right causal, rows that see no key), GQA and
// MQA, both head dims, a custom softmax scale. Outputs and LSE are poisoned (NaN) first; NaN never passes.
// Pass: |O - ref| <= 5e-3 + 5e-3 |ref| per element (P and O are rounded to bf16 once each: at most 2^-9
// relative each on values bounded by max |V| = 1), |LSE - ref| <= 1e-3 (1 + |ref|).
#include <cuda_bf16.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "harness.hpp"
#include "weft/ops/attention.hpp"

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
  for (auto& x : v) x = __float2bfloat16(u(g));
  return v;
}
float to_f(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

std::string run_case(const Case& c, uint64_t seed) {
  const int64_t qn = c.batch * c.seq_q * c.heads * c.dim, kn = c.batch * c.seq_k * c.kv_heads * c.dim;
  const auto q = random_bf16(qn, seed), k = random_bf16(kn, seed + 1), v = random_bf16(kn, seed + 2);
  DeviceBuffer dq(qn * 2), dk(kn * 2), dv(kn * 2), dout(qn * 2), dlse(c.batch * c.heads * c.seq_q * 4);
  WEFT_CUDA_CHECK(cudaMemcpy(dq.p, q.data(), qn * 2, cudaMemcpyHostToDevice));
  WEFT_CUDA_CHECK(cudaMemcpy(dk.p, k.data(), kn * 2, cudaMemcpyHostToDevice));
  WEFT_CUDA_CHECK(cudaMemcpy(dv.p, v.data(), kn * 2, cudaMemcpyHostToDevice));
  WEFT_CUDA_CHECK(cudaMemset(dout.p, 0xff, qn * 2));
  WEFT_CUDA_CHECK(cudaMemset(dlse.p, 0xff, dlse.bytes));
  AttentionOptions o;
  o.causal = c.causal;
  o.softmax_scale = c.scale;
  o.max_blocks = c.max_blocks;
  const AttentionShape shape{c.batch, c.seq_q, c.seq_k, c.heads, c.kv_heads, c.dim};
  flash_attention_forward(dq.p, dk.p, dv.p, dout.p, dlse.as<float>(), shape, DType::kBF16, nullptr, o);
  WEFT_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<__nv_bfloat16> out(qn);
  std::vector<float> lse(c.batch * c.heads * c.seq_q);
  WEFT_CUDA_CHECK(cudaMemcpy(out.data(), dout.p, qn * 2, cudaMemcpyDeviceToHost));
  WEFT_CUDA_CHECK(cudaMemcpy(lse.data(), dlse.p, lse.size() * 4, cudaMemcpyDeviceToHost));

  const double scale = c.scale > 0 ? c.scale : 1.0 / std::sqrt(double(c.dim));
  const int64_t group = c.heads / c.kv_heads, rows = c.batch * c.heads * c.seq_q;
  std::vector<double> worst(rows, 0.0), worst_lse(rows, 0.0);
  std::vector<int> bad(rows, 0);
  weft::test::parallel_for(size_t(rows), [&](size_t r0, size_t r1) {
    std::vector<double> p(c.seq_k), acc(c.dim);
    for (size_t r = r0; r < r1; ++r) {
      const int64_t i = int64_t(r) % c.seq_q, h = int64_t(r) / c.seq_q % c.heads,
                    b = int64_t(r) / c.seq_q / c.heads;
      const int64_t hk = h / group;
      const __nv_bfloat16* qr = &q[((b * c.seq_q + i) * c.heads + h) * c.dim];
      int64_t last = c.seq_k - 1;
      if (c.causal) last = std::min(last, i + c.seq_k - c.seq_q);
      double mx = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j <= last; ++j) {
        const __nv_bfloat16* kr = &k[((b * c.seq_k + j) * c.kv_heads + hk) * c.dim];
        double s = 0;
        for (int64_t d = 0; d < c.dim; ++d) s += double(to_f(qr[d])) * to_f(kr[d]);
        p[j] = s * scale;
        mx = std::max(mx, p[j]);
      }
      double sum = 0;
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t j = 0; j <= last; ++j) {
        p[j] = std::exp(p[j] - mx);
        sum += p[j];
        const __nv_bfloat16* vr = &v[((b * c.seq_k + j) * c.kv_heads + hk) * c.dim];
        for (int64_t d = 0; d < c.dim; ++d) acc[d] += p[j] * to_f(vr[d]);
      }
      const double ref_lse = last >= 0 ? mx + std::log(sum) : -std::numeric_limits<double>::infinity();
      const float got_lse = lse[(b * c.heads + h) * c.seq_q + i];
      if (std::isinf(ref_lse)) {
        if (!(std::isinf(got_lse) && got_lse < 0)) bad[r] |= 2;
      } else {
        const double e = std::abs(double(got_lse) - ref_lse);
        if (!(e <= 1e-3 * (1 + std::abs(ref_lse)))) bad[r] |= 2;
        worst_lse[r] = std::isfinite(got_lse) ? e : 1e30;
      }
      for (int64_t d = 0; d < c.dim; ++d) {
        const double ref = last >= 0 ? acc[d] / sum : 0.0;
        const double got = to_f(out[((b * c.seq_q + i) * c.heads + h) * c.dim + d]);
        const double e = std::isfinite(got) ? std::abs(got - ref) : 1e30;
        worst[r] = std::max(worst[r], e);
        if (!(e <= 5e-3 + 5e-3 * std::abs(ref))) bad[r] |= 1;
      }
    }
  });
  double w = 0, wl = 0;
  int64_t bad_rows = 0, first_bad = -1;
  for (int64_t r = 0; r < rows; ++r) {
    w = std::max(w, worst[r]);
    wl = std::max(wl, worst_lse[r]);
    if (bad[r]) {
      ++bad_rows;
      if (first_bad < 0) first_bad = r;
    }
  }
  std::string what = "B=" + std::to_string(c.batch) + " Sq=" + std::to_string(c.seq_q) +
                     " Sk=" + std::to_string(c.seq_k) + " H=" + std::to_string(c.heads) + "/" +
                     std::to_string(c.kv_heads) + " D=" + std::to_string(c.dim) +
                     (c.causal ? " causal" : "") + ": max |O err| " + std::to_string(w) + ", max |LSE err| " +
                     std::to_string(wl);
  std::fprintf(stderr, "  %s\n", what.c_str());
  if (bad_rows == 0) return {};
  return what + "; " + std::to_string(bad_rows) + " rows out of tolerance, first row " +
         std::to_string(first_bad) + (bad[first_bad] & 1 ? " (O)" : "") +
         (bad[first_bad] & 2 ? " (LSE)" : "");
}

}  // namespace

WEFT_GPU_TEST_ONE_GPU(flash_attention_forward_matches_fp64_reference) {
  WEFT_CUDA_CHECK(cudaSetDevice(ctx.comm().local(0).device()));
  std::vector<Case> cases = {
      {2, 256, 256, 4, 4, 128, false, 0.f}, {2, 256, 256, 4, 4, 128, true, 0.f},
      {1, 1, 1, 2, 1, 128, false, 0.f},     {1, 1, 1, 2, 2, 64, true, 0.f},
      {2, 17, 1000, 8, 1, 128, true, 0.f},  {1, 300, 129, 4, 2, 64, true, 0.f},
      {1, 1000, 1000, 2, 1, 64, true, 0.f}, {1, 1000, 1000, 8, 2, 128, false, 1.0f},
      {3, 129, 383, 4, 4, 64, false, 0.3f}, {1, 200, 200, 4, 1, 128, true, 1.0f},
      // An SM budget below the item count: each persistent block takes several items in turn.
      {2, 256, 256, 4, 4, 128, false, 0.f, 3}, {1, 1000, 1000, 2, 1, 64, true, 0.f, 5},
      {2, 300, 700, 8, 2, 128, true, 0.f, 7}, {4, 1000, 1000, 8, 8, 128, true, 0.f, 1},
  };
  if (!ctx.quick) {
    cases.push_back({1, 4099, 4099, 1, 1, 128, true, 0.f});
    cases.push_back({1, 4099, 4099, 2, 1, 64, false, 0.f});
  }
  uint64_t seed = 7;
  std::string failures;
  for (const Case& c : cases) {
    const std::string e = run_case(c, seed += 10);
    if (!e.empty()) failures += "\n    " + e;
  }
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
}
