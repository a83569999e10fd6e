// weft-bench gemm: weft's GEMM (weft::gemm) against cuBLAS (cublasGemmEx) in the same run on GPU 0: bf16
// inputs, fp32 accumulation, bf16 output. Inputs are random and rotated through enough copies that no
// iteration finds its operands in L2; each iteration is timed with its own CUDA events, weft and cuBLAS
// interleaved so clock and thermal drift hit both alike; the median counts.
#include <cublas_v2.h>
#include <cuda.h>
#include <cuda_bf16.h>

#include <cmath>
#include <functional>
#include <memory>

#include "bench.hpp"
#include "runtime/driver.hpp"
#include "weft/ops/gemm.hpp"

namespace weft::bench {
namespace {

struct DevMem {
  void* p = nullptr;
  explicit DevMem(size_t bytes) { WEFT_CUDA_CHECK(cudaMalloc(&p, bytes)); }
  ~DevMem() { cudaFree(p); }
};

struct Shape {
  int64_t m, n, k;
  double flops() const { return 2.0 * double(m) * double(n) * double(k); }
};

struct Result {
  float weft_ms = 0, cublas_ms = 0;
  double rel_err = -1;  // weft vs cuBLAS output, when checked
};

class GemmBench {
 public:
  explicit GemmBench(bool quick) : quick_(quick) {
    WEFT_CUDA_CHECK(cudaSetDevice(0));
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    WEFT_BLAS_CHECK(cublasCreate(&blas_));
    WEFT_BLAS_CHECK(cublasSetStream(blas_, stream_));
    workspace_ = std::make_unique<DevMem>(kWorkspace);
    WEFT_BLAS_CHECK(cublasSetWorkspace(blas_, workspace_->p, kWorkspace));
  }
  ~GemmBench() {
    cublasDestroy(blas_);
    cudaStreamDestroy(stream_);
  }

  std::vector<float> time_in_turns(const std::vector<std::function<void(int)>>& candidates, int iters) {
    return bench::time_in_turns(candidates, iters, stream_);
  }
  cudaStream_t stream() const { return stream_; }
  cublasHandle_t blas() const { return blas_; }
  // Random A [M,K] and B operands (a_bytes, b_bytes each), in enough copies that together they exceed L2
  // three times (2..16): a rotation through them never finds its operands in L2. a(i), b(i): copy i mod n.
  struct Operands {
    std::vector<std::unique_ptr<DevMem>> as, bs;
    void* a(int i) const { return as[i % as.size()]->p; }
    void* b(int i) const { return bs[i % bs.size()]->p; }
  };
  Operands rotating_operands(uint64_t a_bytes, uint64_t b_bytes, uint64_t seed) const {
    const int sets = rotating_sets(a_bytes + b_bytes, 0, 2, 16);
    Operands o;
    for (int i = 0; i < sets; ++i) {
      o.as.push_back(std::make_unique<DevMem>(a_bytes));
      o.bs.push_back(std::make_unique<DevMem>(b_bytes));
      fill_uniform_bf16(o.as.back()->p, a_bytes / 2, seed + 2 * i, stream_);
      fill_uniform_bf16(o.bs.back()->p, b_bytes / 2, seed + 2 * i + 1, stream_);
    }
    return o;
  }

  Result run(const Shape& s, BLayout lay, const GemmOptions& opt = {}, bool check = false) {
    const uint64_t a_bytes = uint64_t(s.m) * s.k * 2, b_bytes = uint64_t(s.n) * s.k * 2;
    const uint64_t c_elems = uint64_t(s.m) * s.n;
    const Operands ops = rotating_operands(a_bytes, b_bytes, 1);
    DevMem c_weft(c_elems * 2), c_blas(c_elems * 2);
    const bool nk = lay == BLayout::kNK;
    auto weft_op = [&](int i) {
      gemm(ops.a(i), ops.b(i), c_weft.p, s.m, s.n, s.k, lay, DType::kBF16, stream_, opt);
    };
    auto blas_op = [&](int i) {
      const float alpha = 1.0f, beta = 0.0f;
      WEFT_BLAS_CHECK(cublasGemmEx(blas_, nk ? CUBLAS_OP_T : CUBLAS_OP_N, CUBLAS_OP_N, int(s.n), int(s.m),
                                   int(s.k), &alpha, ops.b(i), CUDA_R_16BF, int(nk ? s.k : s.n), ops.a(i),
                                   CUDA_R_16BF, int(s.k), &beta, c_blas.p, CUDA_R_16BF, int(s.n),
                                   CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    };
    const double est_ms = s.flops() / 650e12 * 1e3;
    const int iters = quick_ ? std::clamp(int(60 / est_ms), 5, 20) : std::clamp(int(400 / est_ms), 15, 200);
    // cuBLAS gets a different input set than weft just used.
    const std::vector<float> ms = time_in_turns({weft_op, [&](int i) { blas_op(i + 1); }}, iters);
    Result r;
    r.weft_ms = ms[0];
    r.cublas_ms = ms[1];
    if (check) {  // same inputs for both, then compare the bf16 outputs
      weft_op(0);
      blas_op(0);
      r.rel_err = rel_err_bf16(c_weft.p, c_blas.p, c_elems, stream_);
    }
    return r;
  }

 private:
  static constexpr size_t kWorkspace = 64ull << 20;
  bool quick_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  std::unique_ptr<DevMem> workspace_;
};

const char* layout_name(BLayout l) {
  return l == BLayout::kNK ? "B [N,K]" : "B [K,N]";
}
std::string plan_text(const Shape& s, BLayout lay, const GemmOptions& o = {}) {
  const Plan p = gemm_plan(s.m, s.n, s.k, lay, DType::kBF16, o);
  return fmt("%dx%dx%d, %d stages, cluster %d, group %d, %d blocks", p.tiles.m, p.tiles.n, p.tiles.k,
             p.tiles.stages, p.cluster, p.tiles.group_m, p.blocks);
}
std::string tflops(const Shape& s, float ms) {
  return fmt("%.1f", s.flops() / (double(ms) * 1e9));
}

// The copy-engine pipeline's per-piece stream operations (src/ops/fused.cu, Pipeline) without their data:
// before a piece that adds a peer's partial, a wait on an arrival flag (already satisfied here) on the
// waits stream and an event edge from it into the GEMM stream; after a piece that is pushed on, an event
// edge from the GEMM stream into the copy stream and a flag write there. On one GPU this measures what the
// bookkeeping costs the GEMM stream when nothing has to be waited for.
class PipelineStreamOps {
 public:
  explicit PipelineStreamOps(cudaStream_t gemm_stream) : gemm_(gemm_stream) {
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&waits_, cudaStreamNonBlocking));
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
    for (cudaEvent_t* e : {&arrived_, &done_, &join_})
      WEFT_CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
    WEFT_CUDA_CHECK(cudaMalloc(&flag_, sizeof(uint32_t)));
    const uint32_t one = 1;
    WEFT_CUDA_CHECK(cudaMemcpy(flag_, &one, sizeof(one), cudaMemcpyHostToDevice));
  }
  ~PipelineStreamOps() {
    cudaStreamSynchronize(side_);
    cudaStreamSynchronize(waits_);
    for (cudaEvent_t e : {arrived_, done_, join_}) cudaEventDestroy(e);
    cudaStreamDestroy(waits_);
    cudaStreamDestroy(side_);
    cudaFree(flag_);
  }
  void before_piece() {  // wait_arrivals
    WEFT_CU_CHECK(driver().cuStreamWaitValue32(waits_, reinterpret_cast<CUdeviceptr>(flag_), 1,
                                               CU_STREAM_WAIT_VALUE_GEQ));
    WEFT_CUDA_CHECK(cudaEventRecord(arrived_, waits_));
    WEFT_CUDA_CHECK(cudaStreamWaitEvent(gemm_, arrived_));
  }
  void after_piece() {  // side_waits + the push's arrival write
    WEFT_CUDA_CHECK(cudaEventRecord(done_, gemm_));
    WEFT_CUDA_CHECK(cudaStreamWaitEvent(side_, done_));
    WEFT_CU_CHECK(driver().cuStreamWriteValue32(side_, reinterpret_cast<CUdeviceptr>(flag_), 1,
                                                CU_STREAM_WRITE_VALUE_DEFAULT));
  }
  void finish() {  // join the side streams back into the GEMM stream
    for (cudaStream_t st : {side_, waits_}) {
      WEFT_CUDA_CHECK(cudaEventRecord(join_, st));
      WEFT_CUDA_CHECK(cudaStreamWaitEvent(gemm_, join_));
    }
  }

 private:
  cudaStream_t gemm_, waits_ = nullptr, side_ = nullptr;
  cudaEvent_t arrived_ = nullptr, done_ = nullptr, join_ = nullptr;
  uint32_t* flag_ = nullptr;
};

// The copy-engine ring pipeline of matmul_reduce_scatter / matmul_all_reduce (src/ops/fused.cu) runs its
// per-rank GEMM [M, K/W] x [N, K/W]^T as W steps of M / W rows, two row pieces each, every step after the
// first adding into a partial. This table times that split alone on one GPU (no communication): the floor
// of the pipelined path's compute, against the whole GEMM (the bound's compute term). cuBLAS pieces add with
// beta = 1 (what the pipeline calls); weft pieces with a TMA reduce-add store.
void run_ring_pieces(Context& ctx, GemmBench& bench, const std::string& gpu) {
  PipelineStreamOps stream_ops(bench.stream());
  Table t(
      "gemm: the ring pipeline's GEMM pieces, B [N,K], bf16, GPU 0 (" + gpu + ")",
      {"W", "pieces / step", "M", "N", "K/W", "cuBLAS whole us", "cuBLAS pieces us", "pieces / whole",
       "weft whole us", "weft pieces us", "weft pieces / cuBLAS whole", "cuBLAS pieces + stream ops us",
       "stream ops us / piece"},
      "Per-rank GEMM of the pipelined RS / AR at world size W: M x N x K/W (K = 8192), as one call and as "
      "the ring's W steps of `pieces` row pieces each (beta = 1, or reduce-add, after the first step; the "
      "pipeline's default is 2 pieces). No communication: pieces / whole is the GEMM's own cost of the "
      "split. + stream ops: the pipeline's waits (satisfied), event edges and flag writes around each piece, "
      "no data moved; per piece: their cost over the plain pieces, divided by the pieces.");
  std::vector<int64_t> ms = {2048, 4096, 8192, 16384};
  if (ctx.quick) ms = {4096, 8192};
  for (int W : {2, 4})
    for (int kPieces : {1, 2})
      for (int64_t N : {8192, 28672})
        for (int64_t M : ms) {
          const int64_t K = 8192 / W, piece = M / W / kPieces;
          ctx.progress("gemm: ring pieces W=%d x %d M=%lld N=%lld", W, kPieces, (long long)M, (long long)N);
          const uint64_t a_bytes = uint64_t(M) * K * 2, b_bytes = uint64_t(N) * K * 2;
          const auto ops = bench.rotating_operands(a_bytes, b_bytes, 11);
          DevMem c(uint64_t(M) * N * 2);
          auto rows_of = [](void* x, int64_t row, int64_t width) {
            return static_cast<char*>(x) + row * width * 2;
          };
          auto blas = [&](int i, int64_t row, int64_t rows, bool add) {
            const float one = 1.f, beta = add ? 1.f : 0.f;
            WEFT_BLAS_CHECK(cublasGemmEx(bench.blas(), CUBLAS_OP_T, CUBLAS_OP_N, int(N), int(rows), int(K),
                                         &one, ops.b(i), CUDA_R_16BF, int(K), rows_of(ops.a(i), row, K),
                                         CUDA_R_16BF, int(K), &beta, rows_of(c.p, row % (M / W), N),
                                         CUDA_R_16BF, int(N), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
          };
          auto weft = [&](int i, int64_t row, int64_t rows, bool add) {
            GemmOptions o;
            o.store = add ? GemmStore::kReduceAdd : GemmStore::kStore;
            gemm(rows_of(ops.a(i), row, K), ops.b(i), rows_of(c.p, row % (M / W), N), rows, N, K,
                 BLayout::kNK, DType::kBF16, bench.stream(), o);
          };
          // Step s computes rows [s M / W, (s + 1) M / W) into the partial of rows (row mod M / W).
          auto pieces = [&](auto&& one) {
            return [&, one](int i) {
              for (int s = 0; s < W; ++s)
                for (int p = 0; p < kPieces; ++p) one(i, (s * kPieces + p) * piece, piece, s > 0);
            };
          };
          const double est_ms = 2.0 * M * N * K / 650e12 * 1e3;
          const int iters = std::clamp(int((ctx.quick ? 60 : 300) / est_ms), 10, 200);
          auto with_stream_ops = [&](int i) {
            for (int s = 0; s < W; ++s)
              for (int p = 0; p < kPieces; ++p) {
                if (s > 0) stream_ops.before_piece();
                blas(i, (s * kPieces + p) * piece, piece, s > 0);
                if (s < W - 1) stream_ops.after_piece();
              }
            stream_ops.finish();
          };
          const std::vector<float> r =
              bench.time_in_turns({[&](int i) { blas(i, 0, M, false); }, pieces(blas),
                                   [&](int i) { weft(i, 0, M, false); }, pieces(weft), with_stream_ops},
                                  iters);
          t.add({std::to_string(W), std::to_string(kPieces), std::to_string(M), std::to_string(N),
                 std::to_string(K), fmt("%.1f", r[0] * 1e3), fmt("%.1f", r[1] * 1e3),
                 fmt("%.3f", r[1] / r[0]), fmt("%.1f", r[2] * 1e3), fmt("%.1f", r[3] * 1e3),
                 fmt("%.3f", r[3] / r[0]), fmt("%.1f", r[4] * 1e3),
                 fmt("%.2f", (r[4] - r[1]) * 1e3 / (W * kPieces))});
        }
  ctx.add(std::move(t));
}

// weft::gemm's two tile widths on small and narrow problems (where 128 x 256 tiles leave SMs idle) and on
// large ones (the narrow tile's rate per tile), against cuBLAS: the data for auto_tile_n (src/ops/gemm.cu).
void run_tile_widths(Context& ctx, GemmBench& bench, const std::string& gpu) {
  Table t("gemm: tile width, B [N,K], bf16, GPU 0 (" + gpu + ")",
          {"M", "N", "K", "128x256 us", "128x128 us", "auto", "auto us", "cuBLAS us", "auto / cuBLAS"},
          "weft::gemm with options.tile_n = 256, 128 and 0 (auto: the width it picks), timed in turns with "
          "cuBLAS; auto / cuBLAS is cuBLAS's time over weft's (above 100%: weft faster).");
  std::vector<Shape> shapes;
  for (int64_t m : {128, 256, 512, 1024, 2048})
    for (int64_t n : {4096, 8192, 28672})
      for (int64_t k : {2048, 8192}) shapes.push_back({m, n, k});
  for (Shape s : {Shape{4096, 4096, 4096}, Shape{8192, 8192, 8192}, Shape{4096, 28672, 8192},
                  Shape{384, 2560, 8192}, Shape{1536, 3072, 4096}})
    shapes.push_back(s);
  if (ctx.quick) shapes = {{256, 8192, 2048}, {1024, 8192, 8192}, {8192, 8192, 8192}};
  for (const Shape& sh : shapes) {
    ctx.progress("gemm: tile width %lldx%lldx%lld", (long long)sh.m, (long long)sh.n, (long long)sh.k);
    const uint64_t a_bytes = uint64_t(sh.m) * sh.k * 2, b_bytes = uint64_t(sh.n) * sh.k * 2;
    const auto ops = bench.rotating_operands(a_bytes, b_bytes, 21);
    DevMem c(uint64_t(sh.m) * sh.n * 2);
    auto weft = [&](int tile_n) {
      return [&, tile_n](int i) {
        GemmOptions o;
        o.tile_n = tile_n;
        gemm(ops.a(i), ops.b(i), c.p, sh.m, sh.n, sh.k, BLayout::kNK, DType::kBF16, bench.stream(), o);
      };
    };
    auto blas = [&](int i) {
      const float one = 1.f, zero = 0.f;
      WEFT_BLAS_CHECK(cublasGemmEx(bench.blas(), CUBLAS_OP_T, CUBLAS_OP_N, int(sh.n), int(sh.m), int(sh.k),
                                   &one, ops.b(i), CUDA_R_16BF, int(sh.k), ops.a(i), CUDA_R_16BF, int(sh.k),
                                   &zero, c.p, CUDA_R_16BF, int(sh.n), CUBLAS_COMPUTE_32F,
                                   CUBLAS_GEMM_DEFAULT));
    };
    const double est_ms = sh.flops() / 650e12 * 1e3;
    const int iters = std::clamp(int((ctx.quick ? 40 : 200) / std::max(est_ms, 0.01)), 10, 200);
    const std::vector<float> r = bench.time_in_turns({weft(256), weft(128), weft(0), blas}, iters);
    const int chosen = gemm_plan(sh.m, sh.n, sh.k, BLayout::kNK, DType::kBF16).tiles.n;
    t.add({std::to_string(sh.m), std::to_string(sh.n), std::to_string(sh.k), fmt("%.1f", r[0] * 1e3),
           fmt("%.1f", r[1] * 1e3), fmt("128x%d", chosen), fmt("%.1f", r[2] * 1e3), fmt("%.1f", r[3] * 1e3),
           fmt("%.1f%%", 100.0 * r[3] / r[2])});
  }
  ctx.add(std::move(t));
}

// --gemm-shapes: the shapes given, B [N,K], under several band heights of the grouped tile order.
void run_gemm_shapes(Context& ctx, GemmBench& bench, const std::string& gpu) {
  Table t("gemm: the shapes asked for, B [N,K], bf16 out, GPU 0 (" + gpu + ")",
          {"M", "N", "K", "group_m", "weft ms", "weft TFLOP/s", "cuBLAS ms", "cuBLAS TFLOP/s", "weft / cuBLAS"},
          "group_m: tile rows per band of weft's tile order (default 16); each row times weft and cuBLAS "
          "in turns.");
  for (size_t i = 0; i + 2 < ctx.gemm_shapes.size(); i += 3) {
    const Shape s{ctx.gemm_shapes[i], ctx.gemm_shapes[i + 1], ctx.gemm_shapes[i + 2]};
    for (int group : {16, 4, 8, 32, 64}) {
      ctx.progress("gemm: %lldx%lldx%lld group_m %d", (long long)s.m, (long long)s.n, (long long)s.k, group);
      GemmOptions o;
      o.group_m = group;
      const Result r = bench.run(s, BLayout::kNK, o);
      t.add({std::to_string(s.m), std::to_string(s.n), std::to_string(s.k), std::to_string(group),
             fmt("%.3f", r.weft_ms), tflops(s, r.weft_ms), fmt("%.3f", r.cublas_ms), tflops(s, r.cublas_ms),
             fmt("%.1f%%", 100.0 * r.cublas_ms / r.weft_ms)});
    }
  }
  ctx.add(std::move(t));
}

void run_gemm(Context& ctx) {
  GemmBench bench(ctx.quick);
  cudaDeviceProp prop{};
  WEFT_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const std::string gpu = fmt("%s, %d SMs", prop.name, prop.multiProcessorCount);
  if (!ctx.gemm_shapes.empty()) return run_gemm_shapes(ctx, bench, gpu);

  // 1. The headline shape, both B layouts, with an output check against cuBLAS.
  {
    const Shape s{8192, 8192, 8192};
    Table t(
        "gemm: 8192^3, bf16 in / bf16 out, fp32 accumulate, GPU 0 (" + gpu + ")",
        {"B layout", "weft ms", "weft TFLOP/s", "cuBLAS ms", "cuBLAS TFLOP/s", "weft / cuBLAS", "rel err"},
        "Median over many iterations; inputs rotated through copies larger than L2. rel err: Frobenius "
        "distance of weft's output from cuBLAS's, relative. weft: " +
            plan_text(s, BLayout::kNK) + ".");
    for (BLayout lay : {BLayout::kNK, BLayout::kKN}) {
      ctx.progress("gemm: 8192^3 %s", layout_name(lay));
      const Result r = bench.run(s, lay, {}, true);
      t.add({layout_name(lay), fmt("%.3f", r.weft_ms), tflops(s, r.weft_ms), fmt("%.3f", r.cublas_ms),
             tflops(s, r.cublas_ms), fmt("%.1f%%", 100.0 * r.cublas_ms / r.weft_ms), fmt("%.1e", r.rel_err)});
    }
    ctx.add(std::move(t));
  }

  // 2. The sweep: M, N, K in {2048, 4096, 8192, 16384} with M N K >= 2^36.
  std::vector<Shape> shapes;
  for (int64_t m : {2048, 4096, 8192, 16384})
    for (int64_t n : {2048, 4096, 8192, 16384})
      for (int64_t k : {2048, 4096, 8192, 16384})
        if (double(m) * double(n) * double(k) >= 68719476736.0) shapes.push_back({m, n, k});
  if (ctx.quick)
    shapes = {{2048, 2048, 16384}, {16384, 16384, 2048}, {4096, 8192, 4096}, {16384, 16384, 16384}};
  for (BLayout lay : {BLayout::kNK, BLayout::kKN}) {
    Table t(
        std::string("gemm: sweep, ") + layout_name(lay) + ", bf16 out, GPU 0 (" + gpu + ")",
        {"M", "N", "K", "weft ms", "weft TFLOP/s", "cuBLAS TFLOP/s", "weft / cuBLAS"},
        "All M, N, K in {2048, 4096, 8192, 16384} with M*N*K >= 2^36; last rows: geometric mean and minimum "
        "of weft / cuBLAS.");
    double log_sum = 0, worst = 1e30;
    std::string worst_shape;
    for (const Shape& s : shapes) {
      ctx.progress("gemm: %s %lldx%lldx%lld", layout_name(lay), (long long)s.m, (long long)s.n,
                   (long long)s.k);
      const Result r = bench.run(s, lay);
      const double ratio = double(r.cublas_ms) / double(r.weft_ms);
      log_sum += std::log(ratio);
      if (ratio < worst) {
        worst = ratio;
        worst_shape = fmt("%lldx%lldx%lld", (long long)s.m, (long long)s.n, (long long)s.k);
      }
      t.add({std::to_string(s.m), std::to_string(s.n), std::to_string(s.k), fmt("%.3f", r.weft_ms),
             tflops(s, r.weft_ms), tflops(s, r.cublas_ms), fmt("%.1f%%", 100.0 * ratio)});
    }
    t.add({"geomean", "", "", "", "", "", fmt("%.1f%%", 100.0 * std::exp(log_sum / double(shapes.size())))});
    t.add({"min", worst_shape, "", "", "", "", fmt("%.1f%%", 100.0 * worst)});
    ctx.add(std::move(t));
  }

  // 3. The ring pipeline's GEMM split; 4. the two tile widths.
  run_ring_pieces(ctx, bench, gpu);
  run_tile_widths(ctx, bench, gpu);

  // 5. Tuning knobs at 8192^3 (not in --quick): cluster size and the grouped order's band height.
  if (!ctx.quick) {
    const Shape s{8192, 8192, 8192};
    Table t("gemm: 8192^3 " + std::string(layout_name(BLayout::kNK)) + ", weft options",
            {"cluster", "group_m", "blocks", "weft TFLOP/s", "cuBLAS TFLOP/s", "weft / cuBLAS"},
            "cluster: CTAs sharing their B tile by TMA multicast; group_m: tile rows per band of the tile "
            "order (defaults: cluster 1, group_m 16).");
    for (int cluster : {1, 2})
      for (int group : {4, 8, 16, 32}) {
        ctx.progress("gemm: options cluster %d group_m %d", cluster, group);
        GemmOptions o;
        o.cluster = cluster;
        o.group_m = group;
        const Result r = bench.run(s, BLayout::kNK, o);
        t.add({std::to_string(cluster), std::to_string(group),
               std::to_string(gemm_plan(s.m, s.n, s.k, BLayout::kNK, DType::kBF16, o).blocks),
               tflops(s, r.weft_ms), tflops(s, r.cublas_ms), fmt("%.1f%%", 100.0 * r.cublas_ms / r.weft_ms)});
      }
    ctx.add(std::move(t));
  }
}

ModeRegistrar reg("gemm",
                  "weft GEMM vs cuBLAS on GPU 0: 8192^3, the M,N,K sweep, the ring pipeline's pieces (bf16)",
                  &run_gemm, 1);

}  // namespace
}  // namespace weft::bench
