// weft-bench gemm_fp8: weft's FP8 GEMM (weft::gemm_fp8) against cuBLASLt's (the engine of torch._scaled_mm)
// in the same run on GPU 0: e4m3 A [M,K] and B [N,K], fp32 accumulation with promotion on both sides
// (cuBLASLt's default, no fast accumulation; torch._scaled_mm's default too), bf16 out. weft per-tensor
// scales against cuBLASLt's per-tensor scales, and weft's block scales (1 x 128 / 128 x 128) against the
// same cuBLASLt call (the issue's target: block-scaled >= 0.95 of per-tensor), A's block scales row-major
// and M-major. Inputs rotated through copies
// larger than L2; candidates timed in turns; medians. Then the grouped FP8 GEMM against the same experts
// one GEMM each (weft's and cuBLASLt's).
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <tuple>

#include "bench.hpp"
#include "weft/ops/gemm.hpp"

namespace weft::bench {
namespace {

__global__ void fill_e4m3(uint8_t* p, uint64_t n, uint64_t seed) {
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < n;
       i += uint64_t(gridDim.x) * blockDim.x) {
    uint64_t x = (seed + 1) * 0x9e3779b97f4a7c15ull ^ (i * 0xbf58476d1ce4e5b9ull);
    x ^= x >> 31;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 29;
    const float v = (float(x >> 40) * (2.0f / 16777216.0f) - 1.0f) * 4.0f;
    p[i] = __nv_fp8_e4m3(v).__x;
  }
}
__global__ void fill_value(float* p, uint64_t n, float v) {
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < n;
       i += uint64_t(gridDim.x) * blockDim.x)
    p[i] = v;
}
template <class T>
T* as(const DeviceBuffer& b) {
  return static_cast<T*>(b.p);
}

struct Shape {
  int64_t m, n, k;
  double flops() const { return 2.0 * double(m) * double(n) * double(k); }
};

// cuBLASLt's FP8 GEMM, row-major C [M,N] = A [M,K] . B [N,K]^T with per-tensor scales: column-major
// C^T = B^T' A (the "TN" layout FP8 requires: its A is our B, transposed; its B is our A).
class LtFp8 {
 public:
  // a, b, c: operands of this shape to try the candidate algorithms on.
  LtFp8(const Shape& s, const float* scale_a, const float* scale_b, void* workspace, size_t workspace_bytes,
        const void* a, const void* b, void* c, cudaStream_t stream)
      : workspace_(workspace), workspace_bytes_(workspace_bytes) {
    WEFT_BLAS_CHECK(cublasLtCreate(&lt_));
    WEFT_BLAS_CHECK(cublasLtMatmulDescCreate(&desc_, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t t = CUBLAS_OP_T, n = CUBLAS_OP_N;
    WEFT_BLAS_CHECK(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)));
    WEFT_BLAS_CHECK(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSB, &n, sizeof(n)));
    // Its A is our B (scale_b), its B our A (scale_a).
    WEFT_BLAS_CHECK(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale_b,
                                                   sizeof(scale_b)));
    WEFT_BLAS_CHECK(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale_a,
                                                   sizeof(scale_a)));
    WEFT_BLAS_CHECK(cublasLtMatrixLayoutCreate(&a_, CUDA_R_8F_E4M3, s.k, s.n, s.k));
    WEFT_BLAS_CHECK(cublasLtMatrixLayoutCreate(&b_, CUDA_R_8F_E4M3, s.k, s.m, s.k));
    WEFT_BLAS_CHECK(cublasLtMatrixLayoutCreate(&c_, CUDA_R_16BF, s.n, s.m, s.n));
    cublasLtMatmulPreference_t pref;
    WEFT_BLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    WEFT_BLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                         &workspace_bytes_, sizeof(workspace_bytes_)));
    int found = 0;
    cublasLtMatmulHeuristicResult_t candidates[8] = {};
    WEFT_BLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(lt_, desc_, a_, b_, c_, c_, pref, 8, candidates, &found));
    cublasLtMatmulPreferenceDestroy(pref);
    // The heuristic's first answer can still be refused at the call (CUBLAS_STATUS_NOT_SUPPORTED): the
    // first candidate that runs on this shape is the baseline.
    for (int i = 0; i < found; ++i) {
      heuristic_ = candidates[i];
      if (try_run(a, b, c, stream) == CUBLAS_STATUS_SUCCESS) return;
    }
    throw_error(fmt("weft-bench: none of cuBLASLt's %d FP8 algorithms for this shape runs", found));
  }
  ~LtFp8() {
    cublasLtMatrixLayoutDestroy(a_);
    cublasLtMatrixLayoutDestroy(b_);
    cublasLtMatrixLayoutDestroy(c_);
    cublasLtMatmulDescDestroy(desc_);
    cublasLtDestroy(lt_);
  }
  void run(const void* a, const void* b, void* c, cudaStream_t stream) const {
    WEFT_BLAS_CHECK(try_run(a, b, c, stream));
  }

 private:
  cublasStatus_t try_run(const void* a, const void* b, void* c, cudaStream_t stream) const {
    const float one = 1.f, zero = 0.f;
    return cublasLtMatmul(lt_, desc_, &one, b, a_, a, b_, &zero, c, c_, c, c_, &heuristic_.algo, workspace_,
                          workspace_bytes_, stream);
  }

  cublasLtHandle_t lt_ = nullptr;
  cublasLtMatmulDesc_t desc_ = nullptr;
  cublasLtMatrixLayout_t a_ = nullptr, b_ = nullptr, c_ = nullptr;
  cublasLtMatmulHeuristicResult_t heuristic_{};
  void* workspace_;
  size_t workspace_bytes_;
};

struct Row {
  float tensor_ms = 0, block_ms = 0, block_m_ms = 0, block_m1_ms = 0, lt_ms = 0;
  double rel_err = -1;
};

Row run_shape(const Shape& s, bool quick, cudaStream_t stream, void* workspace, size_t workspace_bytes) {
  const uint64_t a_bytes = uint64_t(s.m) * s.k, b_bytes = uint64_t(s.n) * s.k;
  const int sets = rotating_sets(a_bytes + b_bytes, 0, 2, 16);
  std::vector<std::unique_ptr<DeviceBuffer>> a_sets, b_sets;
  for (int i = 0; i < sets; ++i) {
    a_sets.push_back(std::make_unique<DeviceBuffer>(a_bytes));
    b_sets.push_back(std::make_unique<DeviceBuffer>(b_bytes));
    fill_e4m3<<<1024, 256, 0, stream>>>(as<uint8_t>(*a_sets.back()), a_bytes, 2 * i + 1);
    fill_e4m3<<<1024, 256, 0, stream>>>(as<uint8_t>(*b_sets.back()), b_bytes, 2 * i + 2);
  }
  const int64_t groups = (s.k + 127) / 128;
  const uint64_t na = uint64_t(s.m) * groups, nb = uint64_t((s.n + 127) / 128) * groups;
  DeviceBuffer ones(8 * sizeof(float)), block_a(na * 4), block_a_m((na + groups) * 4), block_b(nb * 4);
  fill_value<<<1, 32, 0, stream>>>(as<float>(ones), 8, 1.f);
  fill_value<<<256, 256, 0, stream>>>(as<float>(block_a), na, 1.f);
  fill_value<<<256, 256, 0, stream>>>(as<float>(block_a_m), na + groups, 1.f);
  fill_value<<<256, 256, 0, stream>>>(as<float>(block_b), nb, 1.f);
  WEFT_CUDA_CHECK(cudaGetLastError());
  DeviceBuffer c_weft(uint64_t(s.m) * s.n * 2), c_lt(uint64_t(s.m) * s.n * 2);
  // The two scales 16 bytes apart: cuBLASLt wants its scale pointers as aligned as its operands.
  const float* scale_a = as<float>(ones);
  const float* scale_b = as<float>(ones) + 4;
  const LtFp8 lt(s, scale_a, scale_b, workspace, workspace_bytes, a_sets[0]->p, b_sets[0]->p, c_lt.p, stream);
  const Fp8Scales tensor{Fp8Scaling::kTensor, scale_a, scale_b};
  const Fp8Scales block{Fp8Scaling::kBlock, as<float>(block_a), as<float>(block_b)};
  const Fp8Scales block_m{Fp8Scaling::kBlock, as<float>(block_a_m), as<float>(block_b), s.m};  // M-major
  // M-major with a stride of M + 1 floats: not whole 16 bytes (M a multiple of 4), so never staged by TMA.
  const Fp8Scales block_m1{Fp8Scaling::kBlock, as<float>(block_a_m), as<float>(block_b), s.m + 1};
  auto a = [&](int i) { return a_sets[i % sets]->p; };
  auto b = [&](int i) { return b_sets[i % sets]->p; };
  auto weft_tensor = [&](int i) {
    gemm_fp8(a(i), b(i), c_weft.p, s.m, s.n, s.k, Fp8Type::kE4M3, tensor, DType::kBF16, stream);
  };
  auto weft_block = [&](int i) {
    gemm_fp8(a(i), b(i), c_weft.p, s.m, s.n, s.k, Fp8Type::kE4M3, block, DType::kBF16, stream);
  };
  auto weft_block_m = [&](int i) {
    gemm_fp8(a(i), b(i), c_weft.p, s.m, s.n, s.k, Fp8Type::kE4M3, block_m, DType::kBF16, stream);
  };
  auto weft_block_m1 = [&](int i) {
    gemm_fp8(a(i), b(i), c_weft.p, s.m, s.n, s.k, Fp8Type::kE4M3, block_m1, DType::kBF16, stream);
  };
  auto cublaslt = [&](int i) { lt.run(a(i), b(i), c_lt.p, stream); };
  // In turns, each on another input set than the one before it just used.
  const double est_ms = s.flops() / 1200e12 * 1e3;
  const int iters = quick ? std::clamp(int(60 / est_ms), 5, 20) : std::clamp(int(400 / est_ms), 15, 200);
  const std::vector<float> ms =
      time_in_turns({weft_tensor, [&](int i) { weft_block(i + 1); }, [&](int i) { weft_block_m(i + 2); },
                     [&](int i) { weft_block_m1(i + 3); }, [&](int i) { cublaslt(i + 4); }},
                    iters, stream);
  Row r{ms[0], ms[1], ms[2], ms[3], ms[4]};
  weft_tensor(0);
  cublaslt(0);
  r.rel_err = rel_err_bf16(c_weft.p, c_lt.p, uint64_t(s.m) * s.n, stream);
  return r;
}

std::string tflops(const Shape& s, float ms) {
  return fmt("%.0f", s.flops() / (double(ms) * 1e-3) / 1e12);
}

// The grouped FP8 GEMM (an MoE rank's experts, equal groups of `rows`, DeepSeek-V3's block scales) against
// the same experts one GEMM each: weft's dense kernel on the same staged path (what the grouped one should
// match) and cuBLASLt's with per-tensor scales (its FP8 engine; no block scales), E launches in a row.
struct GroupedShape {
  int experts;
  int64_t rows, k, n;  // rows a group
};

std::vector<std::string> grouped_row(const GroupedShape& g, bool quick, cudaStream_t stream, void* workspace,
                                     size_t workspace_bytes) {
  const int64_t total = g.experts * g.rows, kb = (g.k + 127) / 128, nb = (g.n + 127) / 128;
  DeviceBuffer a(uint64_t(total) * g.k), b(uint64_t(g.experts) * g.n * g.k), c(uint64_t(total) * g.n * 2),
      sa(uint64_t(total) * kb * 4), sb(uint64_t(g.experts) * nb * kb * 4), ends(g.experts * 4),
      counts(g.experts * 4), ones(8 * sizeof(float));
  fill_e4m3<<<1024, 256, 0, stream>>>(as<uint8_t>(a), a.bytes, 11);
  fill_e4m3<<<1024, 256, 0, stream>>>(as<uint8_t>(b), b.bytes, 12);
  fill_value<<<256, 256, 0, stream>>>(as<float>(sa), sa.bytes / 4, 1.f);  // (row-major and M-major alike)
  fill_value<<<256, 256, 0, stream>>>(as<float>(sb), sb.bytes / 4, 1.f);
  fill_value<<<1, 32, 0, stream>>>(as<float>(ones), 8, 1.f);
  WEFT_CUDA_CHECK(cudaGetLastError());
  std::vector<int32_t> h_ends(g.experts);
  for (int e = 0; e < g.experts; ++e) h_ends[e] = int32_t((e + 1) * g.rows);
  WEFT_CUDA_CHECK(cudaMemcpyAsync(ends.p, h_ends.data(), ends.bytes, cudaMemcpyHostToDevice, stream));
  const std::vector<int32_t> h_counts(g.experts, int32_t(g.rows));  // every row counted
  WEFT_CUDA_CHECK(cudaMemcpyAsync(counts.p, h_counts.data(), counts.bytes, cudaMemcpyHostToDevice, stream));
  WEFT_CUDA_CHECK(cudaStreamSynchronize(stream));  // (the host vectors)
  const Fp8Scales row_major{Fp8Scaling::kBlock, as<float>(sa), as<float>(sb)};
  Fp8Scales m_major = row_major;
  m_major.a_m_stride = total;
  auto expert = [&](int e) {  // expert e's A, B, C and (M-major) scales
    Fp8Scales sc{Fp8Scaling::kBlock, as<float>(sa) + e * g.rows, as<float>(sb) + int64_t(e) * nb * kb};
    sc.a_m_stride = total;
    return std::make_tuple(as<uint8_t>(a) + e * g.rows * g.k, as<uint8_t>(b) + int64_t(e) * g.n * g.k,
                           as<char>(c) + e * g.rows * g.n * 2, sc);
  };
  const Shape one{g.rows, g.n, g.k};
  const float* scale = as<float>(ones);
  const LtFp8 lt(one, scale, scale + 4, workspace, workspace_bytes, a.p, b.p, c.p, stream);
  auto grouped = [&](const Fp8Scales& sc, bool counted = false) {
    GemmOptions o;
    if (counted) o.group_rows = as<int32_t>(counts);
    grouped_gemm_fp8(a.p, b.p, c.p, as<int32_t>(ends), g.experts, total, g.n, g.k, Fp8Type::kE4M3, sc,
                     DType::kBF16, stream, o);
  };
  auto per_expert = [&](bool cublas) {
    for (int e = 0; e < g.experts; ++e) {
      const auto [ae, be, ce, sc] = expert(e);
      if (cublas)
        lt.run(ae, be, ce, stream);
      else
        gemm_fp8(ae, be, ce, g.rows, g.n, g.k, Fp8Type::kE4M3, sc, DType::kBF16, stream);
    }
  };
  const double flops = 2.0 * double(total) * double(g.n) * double(g.k);
  const int iters = quick ? std::clamp(int(60 / (flops / 1200e9)), 5, 20)
                          : std::clamp(int(400 / (flops / 1200e9)), 15, 100);
  const std::vector<float> ms = time_in_turns(
      {[&](int) { grouped(row_major); }, [&](int) { grouped(m_major); }, [&](int) { per_expert(false); },
       [&](int) { per_expert(true); }, [&](int) { grouped(m_major, true); }},
      iters, stream);
  auto tf = [&](float t) { return fmt("%.0f", flops / (double(t) * 1e-3) / 1e12); };
  return {fmt("%d x %lld", g.experts, (long long)g.rows),
          std::to_string(g.k),
          std::to_string(g.n),
          tf(ms[0]),
          tf(ms[1]),
          tf(ms[2]),
          tf(ms[3]),
          fmt("%.3f", ms[2] / ms[1]),
          fmt("%.3f", ms[3] / ms[1]),
          tf(ms[4]),
          fmt("%.3f", ms[1] / ms[4])};
}

Table grouped_table(const Context& ctx, cudaStream_t stream, void* workspace, size_t workspace_bytes) {
  std::vector<GroupedShape> shapes = {{32, 1024, 7168, 4096}, {32, 1024, 2048, 7168}, {2, 8192, 4096, 28672}};
  if (ctx.quick) shapes = {{32, 1024, 7168, 4096}, {2, 8192, 4096, 28672}};
  Table t("grouped_gemm_fp8: an MoE rank's experts (equal groups), e4m3 in, bf16 out, GPU 0",
          {"experts x rows", "K", "N", "grouped, A's scales row-major TFLOP/s", "grouped, M-major TFLOP/s",
           "weft gemm_fp8 per expert, M-major TFLOP/s", "cuBLASLt per expert, per-tensor TFLOP/s",
           "grouped M-major / weft per expert", "grouped M-major / cuBLASLt per expert",
           "M-major, every row counted (group_rows) TFLOP/s", "counted / grouped M-major"},
          "Block scales (A 1 x 128, B 128 x 128) for weft, per-tensor for cuBLASLt (it has no block scales "
          "here); per expert: one launch an expert, in a row. The grouped kernel should match weft's own "
          "per-expert GEMMs on the same staged path. Counted: the same call with group_rows (every row), the "
          "kernel a low-latency dispatch's counts run (the scheduler's walk of live tiles).");
  for (const GroupedShape& g : shapes) {
    ctx.progress("gemm_fp8 grouped: %d x %lld, K %lld, N %lld", g.experts, (long long)g.rows, (long long)g.k,
                 (long long)g.n);
    t.add(grouped_row(g, ctx.quick, stream, workspace, workspace_bytes));
  }
  return t;
}

void run_gemm_fp8(Context& ctx) {
  WEFT_CUDA_CHECK(cudaSetDevice(0));
  cudaStream_t stream;
  WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  constexpr size_t kWorkspace = 64ull << 20;
  DeviceBuffer workspace(kWorkspace);
  cudaDeviceProp prop{};
  WEFT_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::vector<Shape> shapes = {{8192, 8192, 8192}};
  for (int64_t m : {2048, 4096, 16384})
    for (int64_t nk : {4096, 8192, 16384}) shapes.push_back({m, nk, nk});
  shapes.push_back({16384, 7168, 2048});  // DeepSeek-V3-like projections
  shapes.push_back({4096, 2112, 7168});
  shapes.push_back({128, 7168, 16384});
  if (ctx.quick) shapes = {{8192, 8192, 8192}, {2048, 8192, 8192}, {16384, 7168, 2048}, {4096, 2112, 7168}};
  Table t(
      fmt("gemm_fp8: e4m3 in, bf16 out, fp32 accumulation with promotion, GPU 0 (%s, %d SMs)", prop.name,
          prop.multiProcessorCount),
      {"M", "N", "K", "cuBLASLt TFLOP/s", "weft per-tensor TFLOP/s", "weft block TFLOP/s",
       "weft block, A's scales M-major TFLOP/s", "M-major, stride M + 1 TFLOP/s", "per-tensor / cuBLASLt",
       "block / cuBLASLt", "block / per-tensor", "M-major block / per-tensor", "M + 1 / per-tensor",
       "rel err"},
      "cuBLASLt: cublasLtMatmul with per-tensor scale pointers, no fast accumulation (torch._scaled_mm's "
      "default). block: A's scales row-major [M, K / 128]; M-major: [K / 128][M] (Fp8Scales::a_m_stride, "
      "torch's layout); stride M + 1: the same with rows of M + 1 floats (the plan's path says how each is "
      "read). rel err: weft per-tensor's output against cuBLASLt's. Last rows: geometric means.");
  double log_t = 0, log_b = 0, log_bm = 0, log_bm1 = 0;
  for (const Shape& s : shapes) {
    ctx.progress("gemm_fp8: %lldx%lldx%lld", (long long)s.m, (long long)s.n, (long long)s.k);
    const Row r = run_shape(s, ctx.quick, stream, workspace.p, kWorkspace);
    log_t += std::log(double(r.lt_ms) / r.tensor_ms);
    log_b += std::log(double(r.lt_ms) / r.block_ms);
    log_bm += std::log(double(r.tensor_ms) / r.block_m_ms);
    log_bm1 += std::log(double(r.tensor_ms) / r.block_m1_ms);
    t.add({std::to_string(s.m), std::to_string(s.n), std::to_string(s.k), tflops(s, r.lt_ms),
           tflops(s, r.tensor_ms), tflops(s, r.block_ms), tflops(s, r.block_m_ms), tflops(s, r.block_m1_ms),
           fmt("%.1f%%", 100.0 * r.lt_ms / r.tensor_ms), fmt("%.1f%%", 100.0 * r.lt_ms / r.block_ms),
           fmt("%.1f%%", 100.0 * r.tensor_ms / r.block_ms), fmt("%.1f%%", 100.0 * r.tensor_ms / r.block_m_ms),
           fmt("%.1f%%", 100.0 * r.tensor_ms / r.block_m1_ms), fmt("%.1e", r.rel_err)});
  }
  const double n = double(shapes.size());
  t.add({"geomean", "", "", "", "", "", "", "", fmt("%.1f%%", 100.0 * std::exp(log_t / n)),
         fmt("%.1f%%", 100.0 * std::exp(log_b / n)), "", fmt("%.1f%%", 100.0 * std::exp(log_bm / n)),
         fmt("%.1f%%", 100.0 * std::exp(log_bm1 / n)), ""});
  ctx.add(std::move(t));
  ctx.add(grouped_table(ctx, stream, workspace.p, kWorkspace));
  cudaStreamDestroy(stream);
}

ModeRegistrar reg("gemm_fp8", "weft FP8 GEMM (per-tensor and block scales) vs cuBLASLt FP8 on GPU 0",
                  &run_gemm_fp8, 1, false,
                  /*by_default=*/true);

}  // namespace
}  // namespace weft::bench
