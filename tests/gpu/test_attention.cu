// GPU tests of weft::flash_attention_forward and flash_attention_backward against fp64 host references
// computed from the same bf16 inputs: odd lengths, seq_q < seq_k and seq_q > seq_k (bottom-right causal, rows
// that see no key), GQA and MQA, both head dims, a custom softmax scale. Outputs and LSE are poisoned (NaN)
// first; NaN never passes. Pass: |O - ref| <= 5e-3 + 5e-3 |ref| per element (P and O are rounded to bf16 once
// each: at most 2^-9 relative each on values bounded by max |V| = 1), |LSE - ref| <= 1e-3 (1 + |ref|).
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
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

// Backward: weft's forward gives out and lse, weft's backward dq, dk, dv for a random dout; the fp64
// reference recomputes everything from the bf16 q, k, v, dout. Per tensor, pass when every element is within
// 1e-5 + 2e-2 max|ref| + 2e-2 |ref| (P and dS are rounded to bf16 before their products, as in flash-attn;
// the gradients sum up to seq terms each); the report gives the largest error relative to max|ref|.
std::string run_backward_case(const Case& c, uint64_t seed) {
  const int64_t qn = c.batch * c.seq_q * c.heads * c.dim, kn = c.batch * c.seq_k * c.kv_heads * c.dim;
  const auto q = random_bf16(qn, seed), k = random_bf16(kn, seed + 1), v = random_bf16(kn, seed + 2),
             go = random_bf16(qn, seed + 3);
  const AttentionShape shape{c.batch, c.seq_q, c.seq_k, c.heads, c.kv_heads, c.dim};
  AttentionOptions o;
  o.causal = c.causal;
  o.softmax_scale = c.scale;
  o.max_blocks = c.max_blocks;
  DeviceBuffer dq(qn * 2), dk(kn * 2), dv(kn * 2), dout(qn * 2), dgo(qn * 2),
      dlse(c.batch * c.heads * c.seq_q * 4), ddq(qn * 2), ddk(kn * 2), ddv(kn * 2),
      ws(flash_attention_backward_workspace_bytes(shape));
  WEFT_CUDA_CHECK(cudaMemcpy(dq.p, q.data(), qn * 2, cudaMemcpyHostToDevice));
  WEFT_CUDA_CHECK(cudaMemcpy(dk.p, k.data(), kn * 2, cudaMemcpyHostToDevice));
  WEFT_CUDA_CHECK(cudaMemcpy(dv.p, v.data(), kn * 2, cudaMemcpyHostToDevice));
  WEFT_CUDA_CHECK(cudaMemcpy(dgo.p, go.data(), qn * 2, cudaMemcpyHostToDevice));
  for (DeviceBuffer* b : {&ddq, &ddk, &ddv, &ws}) WEFT_CUDA_CHECK(cudaMemset(b->p, 0xff, b->bytes));
  flash_attention_forward(dq.p, dk.p, dv.p, dout.p, dlse.as<float>(), shape, DType::kBF16, nullptr, o);
  flash_attention_backward(dq.p, dk.p, dv.p, dout.p, dgo.p, dlse.as<float>(), ddq.p, ddk.p, ddv.p, ws.p,
                           ws.bytes, shape, DType::kBF16, nullptr, o);
  WEFT_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<__nv_bfloat16> gq(qn), gk(kn), gv(kn);
  WEFT_CUDA_CHECK(cudaMemcpy(gq.data(), ddq.p, qn * 2, cudaMemcpyDeviceToHost));
  WEFT_CUDA_CHECK(cudaMemcpy(gk.data(), ddk.p, kn * 2, cudaMemcpyDeviceToHost));
  WEFT_CUDA_CHECK(cudaMemcpy(gv.data(), ddv.p, kn * 2, cudaMemcpyDeviceToHost));

  const double scale = c.scale > 0 ? c.scale : 1.0 / std::sqrt(double(c.dim));
  const int64_t group = c.heads / c.kv_heads, D = c.dim;
  auto at_q = [&](const std::vector<__nv_bfloat16>& t, int64_t b, int64_t i, int64_t h) {
    return &t[((b * c.seq_q + i) * c.heads + h) * D];
  };
  auto at_k = [&](const std::vector<__nv_bfloat16>& t, int64_t b, int64_t j, int64_t h) {
    return &t[((b * c.seq_k + j) * c.kv_heads + h) * D];
  };
  auto dot = [&](const __nv_bfloat16* x, const __nv_bfloat16* y) {
    double s = 0;
    for (int64_t d = 0; d < D; ++d) s += double(to_f(x[d])) * to_f(y[d]);
    return s;
  };
  auto last_key = [&](int64_t i) {
    return c.causal ? std::min(c.seq_k - 1, i + c.seq_k - c.seq_q) : c.seq_k - 1;
  };
  // Pass 1, per query row: LSE, D = dO . O, and dQ.
  const int64_t rows = c.batch * c.heads * c.seq_q;
  std::vector<double> lse(rows), dsum(rows), ref_dq(qn, 0.0), ref_dk(kn, 0.0), ref_dv(kn, 0.0);
  weft::test::parallel_for(
      size_t(rows),
      [&](size_t r0, size_t r1) {
        std::vector<double> p(c.seq_k), dp(c.seq_k), o(D);
        for (int64_t r = int64_t(r0); r < int64_t(r1); ++r) {
          const int64_t i = r % c.seq_q, h = r / c.seq_q % c.heads, b = r / c.seq_q / c.heads, hk = h / group;
          const int64_t last = last_key(i);
          if (last < 0) {
            lse[r] = std::numeric_limits<double>::infinity();  // P = 0
            continue;
          }
          double mx = -std::numeric_limits<double>::infinity();
          for (int64_t j = 0; j <= last; ++j)
            mx = std::max(mx, p[j] = scale * dot(at_q(q, b, i, h), at_k(k, b, j, hk)));
          double sum = 0;
          for (int64_t j = 0; j <= last; ++j) sum += (p[j] = std::exp(p[j] - mx));
          std::fill(o.begin(), o.end(), 0.0);
          for (int64_t j = 0; j <= last; ++j) {
            p[j] /= sum;
            const __nv_bfloat16* vr = at_k(v, b, j, hk);
            for (int64_t d = 0; d < D; ++d) o[d] += p[j] * to_f(vr[d]);
          }
          lse[r] = mx + std::log(sum);
          double dsr = 0;
          for (int64_t d = 0; d < D; ++d) dsr += o[d] * to_f(at_q(go, b, i, h)[d]);
          dsum[r] = dsr;
          double* dqr = &ref_dq[((b * c.seq_q + i) * c.heads + h) * D];
          for (int64_t j = 0; j <= last; ++j) {
            const double ds = p[j] * (dot(at_q(go, b, i, h), at_k(v, b, j, hk)) - dsr);
            const __nv_bfloat16* kr = at_k(k, b, j, hk);
            for (int64_t d = 0; d < D; ++d) dqr[d] += scale * ds * to_f(kr[d]);
          }
        }
      },
      1);
  // Pass 2, per key row: dK and dV over every query row of every head of the group.
  weft::test::parallel_for(
      size_t(c.batch * c.kv_heads * c.seq_k),
      [&](size_t r0, size_t r1) {
        for (int64_t r = int64_t(r0); r < int64_t(r1); ++r) {
          const int64_t j = r % c.seq_k, hk = r / c.seq_k % c.kv_heads, b = r / c.seq_k / c.kv_heads;
          double* dkr = &ref_dk[((b * c.seq_k + j) * c.kv_heads + hk) * D];
          double* dvr = &ref_dv[((b * c.seq_k + j) * c.kv_heads + hk) * D];
          for (int64_t h = hk * group; h < (hk + 1) * group; ++h)
            for (int64_t i = 0; i < c.seq_q; ++i) {
              if (j > last_key(i)) continue;
              const int64_t row = (b * c.heads + h) * c.seq_q + i;
              const double p = std::exp(scale * dot(at_q(q, b, i, h), at_k(k, b, j, hk)) - lse[row]);
              const double ds = p * (dot(at_q(go, b, i, h), at_k(v, b, j, hk)) - dsum[row]);
              const __nv_bfloat16 *qr = at_q(q, b, i, h), *gr = at_q(go, b, i, h);
              for (int64_t d = 0; d < D; ++d) {
                dkr[d] += scale * ds * to_f(qr[d]);
                dvr[d] += p * to_f(gr[d]);
              }
            }
        }
      },
      1);
  std::string what = "B=" + std::to_string(c.batch) + " Sq=" + std::to_string(c.seq_q) +
                     " Sk=" + std::to_string(c.seq_k) + " H=" + std::to_string(c.heads) + "/" +
                     std::to_string(c.kv_heads) + " D=" + std::to_string(c.dim) +
                     (c.causal ? " causal" : "") +
                     (c.max_blocks ? " blocks=" + std::to_string(c.max_blocks) : std::string()) + ":";
  std::string failures;
  auto compare = [&](const char* name, const std::vector<__nv_bfloat16>& got,
                     const std::vector<double>& ref) {
    double top = 0, worst = 0;
    for (double x : ref) top = std::max(top, std::abs(x));
    int64_t bad = 0, first = -1;
    for (size_t e = 0; e < ref.size(); ++e) {
      const double g = to_f(got[e]);
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
                  std::to_string(to_f(got[first])) + " ref " + std::to_string(ref[first]) + ";";
  };
  compare("dq", gq, ref_dq);
  compare("dk", gk, ref_dk);
  compare("dv", gv, ref_dv);
  std::fprintf(stderr, "  %s\n", what.c_str());
  return failures.empty() ? std::string() : what + failures;
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
  if (!ctx.quick) cases.push_back({1, 4099, 4099, 2, 1, 128, true, 0.f});
  const std::string failures = run_cases(cases, 11, run_backward_case);
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
  const std::string failures = run_cases(cases, 3, [](const Case& c, uint64_t seed) {
    const std::string e = run_case(c, seed);
    return e.empty() ? run_backward_case(c, seed + 5) : e;
  });
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
}
