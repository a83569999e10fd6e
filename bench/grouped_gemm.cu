// weft-bench grouped_gemm: weft::grouped_gemm (experts' rows back to back, one B per expert) on GPU 0 at MoE
// shapes, against cuBLAS on the dense GEMM of the same FLOPs ([E rows, K] x [K, N], one B) in the same run.
// bf16 in, fp32 accumulate, bf16 out; each call timed alone (CUDA events), the median of 30 counts. torch's
// _grouped_mm on the same shapes: python/benchmarks/grouped_gemm.py.
#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <vector>

#include "bench.hpp"
#include "weft/ops/gemm.hpp"

namespace weft::bench {
namespace {

struct Mem {
  void* p = nullptr;
  explicit Mem(size_t n) { WEFT_CUDA_CHECK(cudaMalloc(&p, n)); }
  ~Mem() { cudaFree(p); }
};

void run_grouped_gemm(Context& ctx) {
  WEFT_CUDA_CHECK(cudaSetDevice(0));
  cudaStream_t stream = nullptr;
  WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cublasHandle_t blas = nullptr;
  if (cublasCreate(&blas) != CUBLAS_STATUS_SUCCESS) throw_error("weft-bench: cublasCreate failed");
  cublasSetStream(blas, stream);
  Table t("grouped GEMM (MoE experts), bf16, GPU 0: weft vs cuBLAS dense GEMM of the same FLOPs",
          {"experts", "rows each", "K", "N", "B", "weft ms", "weft TFLOP/s", "cuBLAS dense TFLOP/s",
           "weft / dense"},
          "B [E, N, K] (nn.Linear weights, 'nk') or [E, K, N] ('kn'); dense: one [E rows, K] x [K, N] GEMM.");
  struct Shape {
    int experts, rows;
    int64_t k, n;
  };
  for (const Shape& s :
       {Shape{32, 1024, 7168, 4096}, Shape{32, 1024, 2048, 7168}, Shape{2, 8192, 4096, 28672}})
    for (BLayout lay : {BLayout::kNK, BLayout::kKN}) {
      const int64_t rows = int64_t(s.experts) * s.rows;
      Mem a(rows * s.k * 2), b(int64_t(s.experts) * s.k * s.n * 2), c(rows * s.n * 2), ends(s.experts * 4);
      fill_uniform_bf16(a.p, rows * s.k, 1, stream);
      fill_uniform_bf16(b.p, int64_t(s.experts) * s.k * s.n, 2, stream);
      std::vector<int32_t> e(s.experts);
      for (int i = 0; i < s.experts; ++i) e[i] = (i + 1) * s.rows;
      WEFT_CUDA_CHECK(cudaMemcpyAsync(ends.p, e.data(), e.size() * 4, cudaMemcpyHostToDevice, stream));
      auto grouped = [&] {
        grouped_gemm(a.p, b.p, c.p, static_cast<int32_t*>(ends.p), s.experts, rows, s.n, s.k, lay,
                     DType::kBF16, stream);
      };
      const float alpha = 1.f, beta = 0.f;
      auto dense = [&] {
        cublasGemmEx(blas, lay == BLayout::kNK ? CUBLAS_OP_T : CUBLAS_OP_N, CUBLAS_OP_N, int(s.n), int(rows),
                     int(s.k), &alpha, b.p, CUDA_R_16BF, int(lay == BLayout::kNK ? s.k : s.n), a.p,
                     CUDA_R_16BF, int(s.k), &beta, c.p, CUDA_R_16BF, int(s.n), CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT);
      };
      const int iters = ctx.quick ? 10 : 30;
      const float ms = median_call_ms(grouped, iters, stream);
      const float dense_ms = median_call_ms(dense, iters, stream);
      const double flops = 2.0 * rows * s.n * s.k;
      t.add({std::to_string(s.experts), std::to_string(s.rows), std::to_string(s.k), std::to_string(s.n),
             lay == BLayout::kNK ? "nk" : "kn", fmt("%.3f", ms), fmt("%.1f", flops / (ms * 1e9)),
             fmt("%.1f", flops / (dense_ms * 1e9)), fmt("%.2f", dense_ms / ms)});
      ctx.progress("grouped_gemm: %d x %d, K %lld, N %lld: %.3f ms", s.experts, s.rows, (long long)s.k,
                   (long long)s.n, ms);
    }
  ctx.add(std::move(t));

  // The tile order and width at the DeepSeek-V3 up-projection shape, against weft's dense GEMM of the same
  // FLOPs: which of the grouped GEMM's choices cost it.
  Table o("grouped GEMM options, 32 experts x 1024 rows, K 7168, N 4096, B [E, N, K], GPU 0",
          {"kernel", "group_m", "tile_n", "ms", "TFLOP/s"},
          "group_m: tile rows (128 each) per band of the tile order (8 = one expert's rows); tile_n: the "
          "output tile's width. weft dense: weft::gemm over all rows with expert 0's B.");
  {
    const int experts = 32, each = 1024;
    const int64_t k = 7168, n = 4096, rows = int64_t(experts) * each;
    Mem a(rows * k * 2), b(int64_t(experts) * k * n * 2), c(rows * n * 2), ends(experts * 4);
    fill_uniform_bf16(a.p, rows * k, 1, stream);
    fill_uniform_bf16(b.p, int64_t(experts) * k * n, 2, stream);
    std::vector<int32_t> e(experts);
    for (int i = 0; i < experts; ++i) e[i] = (i + 1) * each;
    WEFT_CUDA_CHECK(cudaMemcpyAsync(ends.p, e.data(), e.size() * 4, cudaMemcpyHostToDevice, stream));
    const double flops = 2.0 * rows * n * k;
    const int iters = ctx.quick ? 10 : 30;
    for (int tile_n : {256, 128})
      for (int group_m : {4, 8, 16, 32}) {
        GemmOptions opt;
        opt.group_m = group_m;
        opt.tile_n = tile_n;
        for (bool grouped : {true, false}) {
          const float ms = median_call_ms(
              [&] {
                if (grouped)
                  grouped_gemm(a.p, b.p, c.p, static_cast<int32_t*>(ends.p), experts, rows, n, k,
                               BLayout::kNK, DType::kBF16, stream, opt);
                else
                  gemm(a.p, b.p, c.p, rows, n, k, BLayout::kNK, DType::kBF16, stream, opt);
              },
              iters, stream);
          o.add({grouped ? "weft grouped" : "weft dense", std::to_string(group_m), std::to_string(tile_n),
                 fmt("%.3f", ms), fmt("%.1f", flops / (ms * 1e9))});
        }
      }
  }
  ctx.add(std::move(o));
  cublasDestroy(blas);
  cudaStreamDestroy(stream);
}

ModeRegistrar reg("grouped_gemm",
                  "weft grouped GEMM (MoE experts) on GPU 0 vs cuBLAS dense of the same FLOPs",
                  &run_grouped_gemm, 1);

}  // namespace
}  // namespace weft::bench
