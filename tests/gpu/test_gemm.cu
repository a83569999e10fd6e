// GPU tests of weft::gemm against cuBLAS: random bf16 inputs, outputs poisoned with NaN before the run, a
// shape sweep with partial tiles, both B layouts, bf16 and f32 outputs, scheduler options, leading
// dimensions, reduce-add, stores and reduce-adds into peers, and the errors for what TMA cannot do.
// Pass: relative Frobenius error <= 1e-2 against cuBLAS (fp32 output), and not a single non-finite value.
#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "harness.hpp"
#include "weft/ops/gemm.hpp"
#include "weft/tile/wgmma.cuh"

using namespace weft;
using weft::test::DeviceBuffer;
using weft::test::error_of;
using weft::test::TestContext;

// The FP8 wgmma wrappers (tools/gen_wgmma.py) before any kernel uses them: compiled here for sm_90a, so
// ptxas checks the instructions the generator writes. Never launched.
__global__ void fp8_wgmma_compiles(float* out, uint64_t a, uint64_t b) {
  float d256[128] = {}, d128[64] = {}, d64[32] = {};
  weft::wgmma::fence();
  weft::wgmma::mma_fp8_m64n256k32<false>(d256, a, b, 0);
  weft::wgmma::mma_fp8_m64n128k32<true>(d128, a, b, 1);
  weft::wgmma::mma_fp8_m64n64k32<false>(d64, a, b, 1);
  weft::wgmma::commit();
  weft::wgmma::wait<0>();
  out[threadIdx.x] = d256[0] + d128[0] + d64[0];
}

namespace {

constexpr double kTolerance = 1e-2;

#define CUBLAS_OK(expr)                                                                         \
  do {                                                                                          \
    cublasStatus_t st_ = (expr);                                                                \
    WEFT_EXPECT(st_ == CUBLAS_STATUS_SUCCESS, #expr " failed with cuBLAS status " << int(st_)); \
  } while (0)

// ---- device helpers ----------------------------------------------------------------------------
__device__ __forceinline__ uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
// Uniform in [-1, 1), a function of (seed, index) only, so every rank can make the same matrix.
__device__ __forceinline__ float uniform(uint64_t seed, uint64_t i) {
  return static_cast<float>(mix64(seed * 0x100000001b3ull + i) >> 40) * (2.0f / 16777216.0f) - 1.0f;
}
__global__ void fill_bf16_kernel(__nv_bfloat16* p, uint64_t count, uint64_t seed) {
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < count;
       i += uint64_t(gridDim.x) * blockDim.x)
    p[i] = __float2bfloat16(uniform(seed, i));
}
__global__ void fill_f32_kernel(float* p, uint64_t count, uint64_t seed) {
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < count;
       i += uint64_t(gridDim.x) * blockDim.x)
    p[i] = uniform(seed, i);
}
__global__ void f32_to_bf16_kernel(const float* in, __nv_bfloat16* out, uint64_t count) {
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < count;
       i += uint64_t(gridDim.x) * blockDim.x)
    out[i] = __float2bfloat16(in[i]);
}
__global__ void bf16_to_f32_kernel(const __nv_bfloat16* in, float* out, uint64_t count) {
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < count;
       i += uint64_t(gridDim.x) * blockDim.x)
    out[i] = __bfloat162float(in[i]);
}

// sums[0] += (out - ref)^2, sums[1] += ref^2 over the finite outputs; bad counts the non-finite ones.
// `padding` counts the elements of columns [n, ldc) that are no longer the 0xFF poison pattern.
__global__ void compare_kernel(const void* out, bool f32, int64_t ldc, const float* ref, int64_t m, int64_t n,
                               double* sums, unsigned long long* bad, unsigned long long* padding) {
  double e2 = 0, r2 = 0;
  unsigned long long nonfinite = 0, touched = 0;
  const uint64_t total = uint64_t(m) * ldc;
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < total;
       i += uint64_t(gridDim.x) * blockDim.x) {
    const int64_t row = int64_t(i / ldc), col = int64_t(i % ldc);
    if (col >= n) {
      const bool poison = f32 ? reinterpret_cast<const uint32_t*>(out)[i] == 0xffffffffu
                              : reinterpret_cast<const uint16_t*>(out)[i] == 0xffffu;
      touched += poison ? 0 : 1;
      continue;
    }
    const float v = f32 ? reinterpret_cast<const float*>(out)[i]
                        : __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(out)[i]);
    const float r = ref[row * n + col];
    if (!isfinite(v)) {
      ++nonfinite;
      continue;
    }
    e2 += double(v - r) * double(v - r);
    r2 += double(r) * double(r);
  }
  for (int o = 16; o > 0; o /= 2) {
    e2 += __shfl_down_sync(0xffffffffu, e2, o);
    r2 += __shfl_down_sync(0xffffffffu, r2, o);
    nonfinite += __shfl_down_sync(0xffffffffu, nonfinite, o);
    touched += __shfl_down_sync(0xffffffffu, touched, o);
  }
  if (threadIdx.x % 32 == 0) {
    atomicAdd(&sums[0], e2);
    atomicAdd(&sums[1], r2);
    atomicAdd(bad, nonfinite);
    atomicAdd(padding, touched);
  }
}

// ---- host helpers ------------------------------------------------------------------------------
void fill_bf16(void* p, uint64_t count, uint64_t seed, cudaStream_t s) {
  fill_bf16_kernel<<<264, 256, 0, s>>>(static_cast<__nv_bfloat16*>(p), count, seed);
  WEFT_CUDA_CHECK(cudaGetLastError());
}
void fill_f32(void* p, uint64_t count, uint64_t seed, cudaStream_t s) {
  fill_f32_kernel<<<264, 256, 0, s>>>(static_cast<float*>(p), count, seed);
  WEFT_CUDA_CHECK(cudaGetLastError());
}

struct Shape {
  int64_t m, n, k;
};
std::string str(const Shape& s) {
  return std::to_string(s.m) + "x" + std::to_string(s.n) + "x" + std::to_string(s.k);
}
const char* str(BLayout l) {
  return l == BLayout::kNK ? "B[N,K]" : "B[K,N]";
}
const char* str(DType t) {
  return t == DType::kFP32 ? "f32" : "bf16";
}

// cuBLAS reference in fp32: C = alpha A.B + beta C (C dense [m,n] row-major). Row-major C = A.B is the
// column-major C^T = B^T A^T.
void reference(cublasHandle_t h, const void* a, const void* b, float* c, const Shape& s, BLayout lay,
               int64_t lda, int64_t ldb, float alpha = 1.0f, float beta = 0.0f) {
  CUBLAS_OK(cublasGemmEx(h, lay == BLayout::kNK ? CUBLAS_OP_T : CUBLAS_OP_N, CUBLAS_OP_N, int(s.n), int(s.m),
                         int(s.k), &alpha, b, CUDA_R_16BF, int(ldb), a, CUDA_R_16BF, int(lda), &beta, c,
                         CUDA_R_32F, int(s.n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

struct Verdict {
  double rel = 0;
  unsigned long long nonfinite = 0, padding_touched = 0;
};
Verdict compare(const void* out, DType t, int64_t ldc, const float* ref, const Shape& s,
                cudaStream_t stream) {
  DeviceBuffer acc(2 * sizeof(double) + 2 * sizeof(unsigned long long));
  WEFT_CUDA_CHECK(cudaMemsetAsync(acc.p, 0, acc.bytes, stream));
  double* sums = acc.as<double>();
  auto* counts = reinterpret_cast<unsigned long long*>(sums + 2);
  compare_kernel<<<264, 256, 0, stream>>>(out, t == DType::kFP32, ldc, ref, s.m, s.n, sums, counts,
                                          counts + 1);
  WEFT_CUDA_CHECK(cudaGetLastError());
  double host_sums[2];
  unsigned long long host_counts[2];
  WEFT_CUDA_CHECK(cudaMemcpyAsync(host_sums, sums, sizeof(host_sums), cudaMemcpyDeviceToHost, stream));
  WEFT_CUDA_CHECK(cudaMemcpyAsync(host_counts, counts, sizeof(host_counts), cudaMemcpyDeviceToHost, stream));
  WEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
  Verdict v;
  v.rel = host_sums[1] > 0 ? std::sqrt(host_sums[0] / host_sums[1]) : std::sqrt(host_sums[0]);
  v.nonfinite = host_counts[0];
  v.padding_touched = host_counts[1];
  return v;
}

// One GPU for the whole file: the first local rank of the shared team.
struct Gpu {
  Rank& rank;
  cudaStream_t stream;
  cublasHandle_t blas = nullptr;
  explicit Gpu(TestContext& ctx) : rank(ctx.comm().local(0)), stream(rank.stream()) {
    WEFT_CUDA_CHECK(cudaSetDevice(rank.device()));
    CUBLAS_OK(cublasCreate(&blas));
    CUBLAS_OK(cublasSetStream(blas, stream));
  }
  ~Gpu() { cublasDestroy(blas); }
};

struct Case {
  Shape s;
  BLayout lay = BLayout::kNK;
  DType out = DType::kBF16;
  GemmOptions opt{};
  uint64_t seed = 1;
};

// Runs one case end to end and checks it; returns the relative error.
double check_case(Gpu& g, const Case& c) {
  const Shape& s = c.s;
  const bool nk = c.lay == BLayout::kNK;
  const int64_t lda = c.opt.lda ? c.opt.lda : s.k;
  const int64_t ldb = c.opt.ldb ? c.opt.ldb : (nk ? s.k : s.n);
  const int64_t ldc = c.opt.ldc ? c.opt.ldc : s.n;
  const size_t es = c.out == DType::kFP32 ? 4 : 2;
  const uint64_t a_elems = uint64_t(s.m) * lda, b_elems = uint64_t(nk ? s.n : s.k) * ldb;
  DeviceBuffer a(a_elems * 2), b(b_elems * 2), out(uint64_t(s.m) * ldc * es), ref(uint64_t(s.m) * s.n * 4);
  fill_bf16(a.p, a_elems, c.seed * 2 + 1, g.stream);
  fill_bf16(b.p, b_elems, c.seed * 2 + 2, g.stream);
  WEFT_CUDA_CHECK(cudaMemsetAsync(out.p, 0xff, out.bytes, g.stream));  // NaN in bf16 and f32
  const std::string what =
      str(s) + " " + str(c.lay) + " -> " + str(c.out) + " (tile_n " + std::to_string(c.opt.tile_n) +
      ", cluster " + std::to_string(c.opt.cluster) + ", max_blocks " + std::to_string(c.opt.max_blocks) +
      ", start " + std::to_string(c.opt.start_tile) + ", group " + std::to_string(c.opt.group_m) + ")";
  // Each kernel waited for on its own, so a hang (the test's watchdog) names weft's GEMM or the reference.
  weft::test::note_step("weft::gemm " + what);
  gemm(a.p, b.p, out.p, s.m, s.n, s.k, c.lay, c.out, g.stream, c.opt);
  WEFT_CUDA_CHECK(cudaGetLastError());
  WEFT_CUDA_CHECK(cudaStreamSynchronize(g.stream));
  weft::test::note_step("cuBLAS reference " + what);
  reference(g.blas, a.p, b.p, ref.as<float>(), s, c.lay, lda, ldb);
  WEFT_CUDA_CHECK(cudaStreamSynchronize(g.stream));
  weft::test::note_step("compare " + what);
  const Verdict v = compare(out.p, c.out, ldc, ref.as<float>(), s, g.stream);
  WEFT_EXPECT(v.nonfinite == 0, what << ": " << v.nonfinite << " outputs are not finite (unwritten or NaN)");
  WEFT_EXPECT(v.rel <= kTolerance, what << ": relative Frobenius error " << v.rel << " > " << kTolerance);
  WEFT_EXPECT(v.padding_touched == 0,
              what << ": " << v.padding_touched << " elements past column N were written");
  return v.rel;
}

std::vector<Shape> sweep(bool quick) {
  std::vector<Shape> v = {{128, 256, 64},  {1000, 1000, 1000}, {257, 384, 4096}, {4096, 4096, 4096},
                          {1, 8, 8},       {130, 264, 72},     {2000, 520, 136}, {64, 4096, 24},
                          {3000, 3000, 8}, {129, 264, 88},     {640, 768, 1032}, {384, 256, 2048}};
  if (!quick) {
    v.push_back({8192, 8192, 8192});
    v.push_back({8192, 1024, 4096});
    v.push_back({1024, 8192, 1000});
  }
  return v;
}

// Every shape with both tile widths (auto picks one of them).
void run_sweep(TestContext& ctx, DType out) {
  Gpu g(ctx);
  for (const Shape& s : sweep(ctx.quick))
    for (BLayout lay : {BLayout::kNK, BLayout::kKN})
      for (int tile_n : {256, 128}) {
        Case c;
        c.s = s;
        c.lay = lay;
        c.out = out;
        c.opt.tile_n = tile_n;
        const double rel = check_case(g, c);
        std::printf("    %-16s %-7s -> %-4s 128x%d rel err %.2e\n", str(s).c_str(), str(lay), str(out),
                    tile_n, rel);
      }
}

// Fixed-capacity groups that fill partly (options.group_rows): group e spans [e x cap, (e + 1) x cap) and
// only its first counts[e] rows count, so only the tile rows holding them are computed, spread over the
// blocks (lcsc/grouped_scheduler.cuh). Each case against the same call without group_rows (which computes
// every tile): the computed tiles bit for bit; without an activation also against cuBLAS over the counted
// rows; the tiles wholly past a count keep the poison. The rows past a count inside a computed tile are not
// looked at. Cases: empty, partial, full and one-row groups with fewer live tiles than blocks; a low-latency
// dispatch's decode layout (a live tile row in every 4th, more live tiles than blocks); more groups than the
// scheduler's table has chunks, counts past the span, few blocks, a rotated and regrouped order; SwiGLU.
void check_counted_groups(Gpu& g) {
  struct CountedCase {
    int cap;
    std::vector<int32_t> counts;
    int64_t n, k;
    BLayout lay;
    DType out;
    GemmOptions opt;
  };
  std::vector<CountedCase> cases;
  for (BLayout lay : {BLayout::kNK, BLayout::kKN})
    cases.push_back({384, {0, 130, 384, 1}, 264, 200, lay, DType::kBF16, {}});
  {
    CountedCase c{512, {}, 1024, 128, BLayout::kNK, DType::kBF16, {}};
    for (int e = 0; e < 64; ++e) c.counts.push_back(e % 11 == 3 ? 0 : e % 13 == 5 ? 512 : 1 + (e * 37) % 140);
    c.opt.tile_n = 256;
    cases.push_back(c);
  }
  {
    CountedCase c{128, {}, 128, 64, BLayout::kKN, DType::kFP32, {}};
    const int32_t pick[] = {0, 1, 77, 128, 200};
    for (int e = 0; e < 300; ++e) c.counts.push_back(pick[(e * 7 + e / 5) % 5]);
    c.opt.tile_n = 128;
    c.opt.max_blocks = 7;
    c.opt.start_tile = 5;
    c.opt.group_m = 3;
    cases.push_back(c);
  }
  for (DType out : {DType::kFP32, DType::kBF16}) {
    CountedCase c{
        256, {256, 0, 129, 3, 0, 200}, 512, 192, out == DType::kFP32 ? BLayout::kNK : BLayout::kKN, out, {}};
    c.opt.activation = Activation::kSwiGLU;
    c.opt.max_blocks = out == DType::kFP32 ? 2 : 0;
    cases.push_back(c);
  }
  uint64_t seed = 171;
  for (const CountedCase& cc : cases) {
    const int groups = static_cast<int>(cc.counts.size()), cap = cc.cap;
    const bool swiglu = cc.opt.activation == Activation::kSwiGLU;
    const int64_t rows = int64_t(cap) * groups, n = cc.n, k = cc.k, cols = swiglu ? n / 2 : n;
    const size_t es = cc.out == DType::kFP32 ? 4 : 2, row_bytes = size_t(cols) * es;
    std::vector<int32_t> ends(groups);
    for (int e = 0; e < groups; ++e) ends[e] = (e + 1) * cap;
    DeviceBuffer a(uint64_t(rows) * k * 2), b(uint64_t(groups) * n * k * 2), full(rows * row_bytes),
        counted(rows * row_bytes), ref(uint64_t(cap) * n * 4), dend(groups * 4), drows(groups * 4);
    fill_bf16(a.p, uint64_t(rows) * k, ++seed, g.stream);
    fill_bf16(b.p, uint64_t(groups) * n * k, ++seed, g.stream);
    WEFT_CUDA_CHECK(cudaMemsetAsync(full.p, 0xff, full.bytes, g.stream));
    WEFT_CUDA_CHECK(cudaMemsetAsync(counted.p, 0xff, counted.bytes, g.stream));
    WEFT_CUDA_CHECK(cudaMemcpyAsync(dend.p, ends.data(), groups * 4, cudaMemcpyHostToDevice, g.stream));
    WEFT_CUDA_CHECK(cudaMemcpyAsync(drows.p, cc.counts.data(), groups * 4, cudaMemcpyHostToDevice, g.stream));
    GemmOptions opt = cc.opt;
    grouped_gemm(a.p, b.p, full.p, dend.as<int32_t>(), groups, rows, n, k, cc.lay, cc.out, g.stream, opt);
    opt.group_rows = drows.as<int32_t>();
    grouped_gemm(a.p, b.p, counted.p, dend.as<int32_t>(), groups, rows, n, k, cc.lay, cc.out, g.stream, opt);
    WEFT_CUDA_CHECK(cudaGetLastError());
    std::vector<unsigned char> want(full.bytes), got(counted.bytes);
    WEFT_CUDA_CHECK(cudaMemcpyAsync(want.data(), full.p, full.bytes, cudaMemcpyDeviceToHost, g.stream));
    WEFT_CUDA_CHECK(cudaMemcpyAsync(got.data(), counted.p, counted.bytes, cudaMemcpyDeviceToHost, g.stream));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(g.stream));
    const std::string what = "grouped, " + std::to_string(groups) + " groups of capacity " +
                             std::to_string(cap) + ", N " + std::to_string(n) + " K " + std::to_string(k) +
                             " " + str(cc.lay) + " -> " + str(cc.out) + (swiglu ? " SwiGLU" : "") +
                             " tile_n " + std::to_string(cc.opt.tile_n) + " max_blocks " +
                             std::to_string(cc.opt.max_blocks);
    size_t differ = 0, written = 0;
    double worst = 0;
    for (int e = 0; e < groups; ++e) {
      const int64_t lo = int64_t(e) * cap, counted_rows = std::min(cc.counts[e], cap);
      const int64_t computed = std::min<int64_t>((cc.counts[e] + 127) / 128 * 128, cap);
      differ += std::memcmp(&want[lo * row_bytes], &got[lo * row_bytes], computed * row_bytes) != 0;
      for (size_t i = (lo + computed) * row_bytes; i < (lo + cap) * row_bytes; ++i) written += got[i] != 0xff;
      if (swiglu || counted_rows <= 0) continue;
      const Shape s{counted_rows, n, k};
      reference(g.blas, static_cast<char*>(a.p) + lo * k * 2,
                static_cast<char*>(b.p) + int64_t(e) * n * k * 2, ref.as<float>(), s, cc.lay, k,
                cc.lay == BLayout::kNK ? k : n);
      const Verdict v =
          compare(static_cast<char*>(counted.p) + lo * row_bytes, cc.out, n, ref.as<float>(), s, g.stream);
      WEFT_EXPECT(v.nonfinite == 0, what << ", group " << e << " (" << cc.counts[e]
                                         << " rows): " << v.nonfinite << " outputs are not finite");
      worst = std::max(worst, v.rel);
    }
    WEFT_EXPECT(differ == 0, what << ": " << differ << " groups' computed tiles differ from the call without "
                                  << "group_rows");
    WEFT_EXPECT(written == 0, what << ": " << written << " bytes of tiles past the counts were written");
    WEFT_EXPECT(worst <= kTolerance, what << ": relative Frobenius error " << worst);
    std::printf("    %s, counted rows: %s\n", what.c_str(),
                swiglu ? "as without group_rows" : ("rel err " + std::to_string(worst)).c_str());
  }
}

}  // namespace

// Grouped GEMM: groups of rows (multiples of 128, some empty) each times its own B, against cuBLAS per
// group; rows past the last group untouched (still the NaN poison); both B layouts, both outputs, K and N
// that leave partial tiles (a K tail reads the next expert's B rows: they must meet zeros), several tiles per
// block.
WEFT_GPU_TEST_ONE_GPU(grouped_gemm_matches_cublas_per_group) {
  Gpu g(ctx);
  struct GroupedCase {
    std::vector<int> sizes;
    int64_t n, k;
    int tile_n, max_blocks;
  };
  const std::vector<GroupedCase> cases = {
      {{256, 0, 128, 384, 128}, 512, 256, 256, 0},
      {{128, 128, 0, 0, 640}, 264, 200, 128, 3},
      {{0, 1024, 128}, 1000, 1032, 256, 5},
      {{128}, 64, 64, 128, 0},
  };
  uint64_t seed = 71;
  for (const GroupedCase& gc : cases)
    for (BLayout lay : {BLayout::kNK, BLayout::kKN})
      for (DType out : {DType::kBF16, DType::kFP32}) {
        const int groups = static_cast<int>(gc.sizes.size());
        std::vector<int32_t> ends(groups);
        int64_t last = 0;
        for (int e = 0; e < groups; ++e) ends[e] = static_cast<int32_t>(last += gc.sizes[e]);
        const int64_t rows = last + 128, n = gc.n, k = gc.k;  // 128 rows past the last group
        const size_t es = out == DType::kFP32 ? 4 : 2;
        DeviceBuffer a(uint64_t(rows) * k * 2), b(uint64_t(groups) * n * k * 2), c(uint64_t(rows) * n * es),
            ref(uint64_t(std::max<int64_t>(last, 1)) * n * 4), dend(groups * 4);
        fill_bf16(a.p, uint64_t(rows) * k, ++seed, g.stream);
        fill_bf16(b.p, uint64_t(groups) * n * k, ++seed, g.stream);
        WEFT_CUDA_CHECK(cudaMemsetAsync(c.p, 0xff, c.bytes, g.stream));
        WEFT_CUDA_CHECK(cudaMemcpyAsync(dend.p, ends.data(), groups * 4, cudaMemcpyHostToDevice, g.stream));
        GemmOptions opt;
        opt.tile_n = gc.tile_n;
        opt.max_blocks = gc.max_blocks;
        grouped_gemm(a.p, b.p, c.p, dend.as<int32_t>(), groups, rows, n, k, lay, out, g.stream, opt);
        WEFT_CUDA_CHECK(cudaGetLastError());
        for (int e = 0, lo = 0; e < groups; lo = ends[e++]) {
          if (ends[e] == lo) continue;
          const Shape s{ends[e] - lo, n, k};
          reference(g.blas, static_cast<char*>(a.p) + int64_t(lo) * k * 2,
                    static_cast<char*>(b.p) + int64_t(e) * n * k * 2, ref.as<float>() + int64_t(lo) * n, s,
                    lay, k, lay == BLayout::kNK ? k : n);
        }
        std::string what = "grouped " + std::to_string(groups) + " groups, " + std::to_string(rows) +
                           " rows, N " + std::to_string(n) + " K " + std::to_string(k) + " " + str(lay) +
                           " -> " + str(out) + " tile_n " + std::to_string(gc.tile_n);
        if (last > 0) {
          const Verdict v = compare(c.p, out, n, ref.as<float>(), Shape{last, n, k}, g.stream);
          WEFT_EXPECT(v.nonfinite == 0, what << ": " << v.nonfinite << " outputs are not finite");
          WEFT_EXPECT(v.rel <= kTolerance, what << ": relative Frobenius error " << v.rel);
          std::printf("    %s: rel err %.2e\n", what.c_str(), v.rel);
        }
        std::vector<unsigned char> tail(uint64_t(rows - last) * n * es);
        WEFT_CUDA_CHECK(cudaMemcpyAsync(tail.data(), static_cast<char*>(c.p) + uint64_t(last) * n * es,
                                        tail.size(), cudaMemcpyDeviceToHost, g.stream));
        WEFT_CUDA_CHECK(cudaStreamSynchronize(g.stream));
        size_t written = 0;
        for (unsigned char x : tail) written += x != 0xff;
        WEFT_EXPECT(written == 0, what << ": " << written << " bytes past the last group were written");
      }
  check_counted_groups(g);
  // Errors: a capacity that is not whole tiles, no groups, reduce-add.
  DeviceBuffer buf(1 << 20);
  const int32_t* ends = buf.as<int32_t>();
  auto expect_error = [&](const std::function<void()>& f, const char* part) {
    const std::string e = error_of(f);
    WEFT_EXPECT(e.find(part) != std::string::npos,
                "expected an error naming '" << part << "', got '" << e << "'");
  };
  expect_error(
      [&] { grouped_gemm(buf.p, buf.p, buf.p, ends, 2, 200, 64, 64, BLayout::kNK, DType::kBF16, g.stream); },
      "multiple of 128");
  expect_error(
      [&] { grouped_gemm(buf.p, buf.p, buf.p, ends, 0, 256, 64, 64, BLayout::kNK, DType::kBF16, g.stream); },
      "groups must be at least 1");
  GemmOptions add;
  add.store = GemmStore::kReduceAdd;
  expect_error(
      [&] {
        grouped_gemm(buf.p, buf.p, buf.p, ends, 2, 256, 64, 64, BLayout::kNK, DType::kBF16, g.stream, add);
      },
      "no reduce-add");
  GemmOptions misaligned;
  misaligned.group_rows = reinterpret_cast<const int32_t*>(static_cast<char*>(buf.p) + 2);
  expect_error(
      [&] {
        grouped_gemm(buf.p, buf.p, buf.p, ends, 2, 256, 64, 64, BLayout::kNK, DType::kBF16, g.stream,
                     misaligned);
      },
      "group_rows is not 4-byte aligned");
  GemmOptions counted;
  counted.group_rows = ends;
  expect_error([&] { gemm(buf.p, buf.p, buf.p, 64, 64, 64, BLayout::kNK, DType::kBF16, g.stream, counted); },
               "for grouped_gemm only");
}

WEFT_GPU_TEST_ONE_GPU(gemm_matches_cublas_bf16_out) {
  run_sweep(ctx, DType::kBF16);
}

WEFT_GPU_TEST_ONE_GPU(gemm_matches_cublas_f32_out) {
  run_sweep(ctx, DType::kFP32);
  // f32 rows only need N % 4 == 0 (with a K-major B, whose rows are K long).
  Gpu g(ctx);
  Case c;
  c.s = {300, 1004, 72};
  c.out = DType::kFP32;
  check_case(g, c);
}

// Persistent-grid corners: few blocks (each walks many tiles, so the pipeline phase wraps across tiles),
// rotated and regrouped tile orders, forced cluster sizes with an odd number of tile rows.
WEFT_GPU_TEST_ONE_GPU(gemm_schedule_options) {
  Gpu g(ctx);
  const Shape shapes[] = {{1000, 1000, 1000}, {1160, 520, 200}, {130, 4000, 136}};
  for (const Shape& s : shapes)
    for (int cluster : {1, 2})
      for (int max_blocks : {1, 3, 8, 0}) {
        Case c;
        c.s = s;
        c.lay = (max_blocks % 2) ? BLayout::kKN : BLayout::kNK;
        c.out = cluster == 2 ? DType::kBF16 : DType::kFP32;
        c.opt.cluster = cluster;
        c.opt.max_blocks = max_blocks;
        c.opt.start_tile = max_blocks * 5 - 7;
        c.opt.group_m = max_blocks == 3 ? 3 : (max_blocks == 8 ? 1 : 0);
        check_case(g, c);
        if (cluster == 1) {  // the narrow tile too (cluster 1 only)
          c.opt.tile_n = 128;
          check_case(g, c);
        }
      }
}

// Sub-matrices: row strides larger than the rows; columns past N of C stay untouched.
WEFT_GPU_TEST_ONE_GPU(gemm_leading_dimensions) {
  Gpu g(ctx);
  for (BLayout lay : {BLayout::kNK, BLayout::kKN})
    for (DType out : {DType::kBF16, DType::kFP32}) {
      Case c;
      c.s = {520, 264, 200};
      c.lay = lay;
      c.out = out;
      c.opt.lda = 200 + 56;
      c.opt.ldb = lay == BLayout::kNK ? 200 + 8 : 264 + 72;
      c.opt.ldc = 264 + 24;
      check_case(g, c);
    }
}

// Same inputs, same bits: the kernel has no atomics, so any difference is a race. Per tile width (the two
// use different wgmma shapes, whose sums need not agree to the bit).
WEFT_GPU_TEST_ONE_GPU(gemm_is_deterministic) {
  Gpu g(ctx);
  const Shape s{2000, 2048, 1032};
  const uint64_t a_elems = uint64_t(s.m) * s.k, b_elems = uint64_t(s.n) * s.k, c_elems = uint64_t(s.m) * s.n;
  DeviceBuffer a(a_elems * 2), b(b_elems * 2), c0(c_elems * 2), c1(c_elems * 2);
  fill_bf16(a.p, a_elems, 11, g.stream);
  fill_bf16(b.p, b_elems, 12, g.stream);
  std::vector<uint16_t> first(c_elems), again(c_elems);
  for (int tile_n : {256, 128}) {
    GemmOptions base;
    base.tile_n = tile_n;
    gemm(a.p, b.p, c0.p, s.m, s.n, s.k, BLayout::kNK, DType::kBF16, g.stream, base);
    WEFT_CUDA_CHECK(cudaMemcpyAsync(first.data(), c0.p, c_elems * 2, cudaMemcpyDeviceToHost, g.stream));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(g.stream));
    const int rounds = ctx.quick ? 3 : 20;
    for (int i = 0; i < rounds; ++i) {
      GemmOptions o = base;
      o.max_blocks = (i % 4 == 3) ? 5 : 0;
      o.cluster = tile_n == 256 ? 1 + i % 2 : 1;
      WEFT_CUDA_CHECK(cudaMemsetAsync(c1.p, 0xff, c1.bytes, g.stream));
      gemm(a.p, b.p, c1.p, s.m, s.n, s.k, BLayout::kNK, DType::kBF16, g.stream, o);
      WEFT_CUDA_CHECK(cudaMemcpyAsync(again.data(), c1.p, c_elems * 2, cudaMemcpyDeviceToHost, g.stream));
      WEFT_CUDA_CHECK(cudaStreamSynchronize(g.stream));
      WEFT_EXPECT(std::memcmp(first.data(), again.data(), c_elems * 2) == 0,
                  "tile 128x" << tile_n << ", round " << i << " (cluster " << o.cluster << ", max_blocks "
                              << o.max_blocks << ") differs from the first run");
    }
  }
}

// C += A.B with TMA reduce-add, locally, for both output types.
WEFT_GPU_TEST_ONE_GPU(gemm_reduce_add_local) {
  Gpu g(ctx);
  const Shape s{1000, 776, 520};
  for (DType out : {DType::kFP32, DType::kBF16}) {
    const uint64_t c_elems = uint64_t(s.m) * s.n;
    DeviceBuffer a(uint64_t(s.m) * s.k * 2), b(uint64_t(s.n) * s.k * 2), c(c_elems * 4), ref(c_elems * 4);
    fill_bf16(a.p, uint64_t(s.m) * s.k, 21, g.stream);
    fill_bf16(b.p, uint64_t(s.n) * s.k, 22, g.stream);
    fill_f32(ref.p, c_elems, 23, g.stream);  // X
    if (out == DType::kFP32) {
      WEFT_CUDA_CHECK(cudaMemcpyAsync(c.p, ref.p, c_elems * 4, cudaMemcpyDeviceToDevice, g.stream));
    } else {
      f32_to_bf16_kernel<<<264, 256, 0, g.stream>>>(ref.as<float>(), c.as<__nv_bfloat16>(), c_elems);
      bf16_to_f32_kernel<<<264, 256, 0, g.stream>>>(c.as<__nv_bfloat16>(), ref.as<float>(),
                                                    c_elems);  // X as bf16
    }
    GemmOptions o;
    o.store = GemmStore::kReduceAdd;
    o.tile_n = out == DType::kFP32 ? 256 : 128;  // both tile widths
    gemm(a.p, b.p, c.p, s.m, s.n, s.k, BLayout::kNK, out, g.stream, o);
    reference(g.blas, a.p, b.p, ref.as<float>(), s, BLayout::kNK, s.k, s.k, 1.0f, 1.0f);  // X + A.B
    const Verdict v = compare(c.p, out, s.n, ref.as<float>(), s, g.stream);
    WEFT_EXPECT(v.nonfinite == 0, str(out) << " (tile_n " << o.tile_n << "): non-finite outputs");
    WEFT_EXPECT(v.rel <= kTolerance, str(out) << " (tile_n " << o.tile_n << "): relative error " << v.rel);
  }
}

// The storer writing into peers: every rank stores A.B into the next rank's C (bf16), then every rank
// reduce-adds A.B into rank 0's C (f32), which must end up X + world * A.B.
WEFT_GPU_TEST(gemm_into_peers) {
  Communicator& comm = ctx.comm();
  const int W = comm.world();
  const Shape s{1000, 520, 264};
  const uint64_t a_elems = uint64_t(s.m) * s.k, b_elems = uint64_t(s.n) * s.k, c_elems = uint64_t(s.m) * s.n;
  SymmetricBuffer cbuf = comm.alloc(c_elems * 4);
  struct Local {
    std::unique_ptr<DeviceBuffer> a, b, ref;
    cublasHandle_t blas = nullptr;
  };
  std::vector<Local> loc(comm.num_local());
  for (int i = 0; i < comm.num_local(); ++i) {
    Rank& r = comm.local(i);
    WEFT_CUDA_CHECK(cudaSetDevice(r.device()));
    loc[i].a = std::make_unique<DeviceBuffer>(a_elems * 2);
    loc[i].b = std::make_unique<DeviceBuffer>(b_elems * 2);
    loc[i].ref = std::make_unique<DeviceBuffer>(c_elems * 4);
    fill_bf16(loc[i].a->p, a_elems, 31, r.stream());  // the same matrices on every rank
    fill_bf16(loc[i].b->p, b_elems, 32, r.stream());
    WEFT_CUDA_CHECK(cudaMemsetAsync(cbuf.local[i], 0xff, c_elems * 4, r.stream()));
    CUBLAS_OK(cublasCreate(&loc[i].blas));
    CUBLAS_OK(cublasSetStream(loc[i].blas, r.stream()));
  }
  auto everyone_done = [&] {
    comm.synchronize();
    comm.host_barrier();
  };
  auto cleanup = [&] {
    for (int i = 0; i < comm.num_local(); ++i) {
      WEFT_CUDA_CHECK(cudaSetDevice(comm.local(i).device()));
      cublasDestroy(loc[i].blas);
    }
  };
  try {
    everyone_done();
    // 1. Store into the next rank.
    for (int i = 0; i < comm.num_local(); ++i) {
      Rank& r = comm.local(i);
      WEFT_CUDA_CHECK(cudaSetDevice(r.device()));
      gemm(loc[i].a->p, loc[i].b->p, r.at(cbuf, (r.rank() + 1) % W), s.m, s.n, s.k, BLayout::kNK,
           DType::kBF16, r.stream());
    }
    everyone_done();
    for (int i = 0; i < comm.num_local(); ++i) {
      Rank& r = comm.local(i);
      WEFT_CUDA_CHECK(cudaSetDevice(r.device()));
      reference(loc[i].blas, loc[i].a->p, loc[i].b->p, loc[i].ref->as<float>(), s, BLayout::kNK, s.k, s.k);
      const Verdict v = compare(cbuf.local[i], DType::kBF16, s.n, loc[i].ref->as<float>(), s, r.stream());
      WEFT_EXPECT(v.nonfinite == 0 && v.rel <= kTolerance,
                  "rank " << r.rank() << ": store from rank " << (r.rank() + W - 1) % W << ": " << v.nonfinite
                          << " non-finite, error " << v.rel);
    }
    // 2. Everyone reduce-adds into rank 0.
    for (int i = 0; i < comm.num_local(); ++i) {
      Rank& r = comm.local(i);
      WEFT_CUDA_CHECK(cudaSetDevice(r.device()));
      fill_f32(cbuf.local[i], c_elems, 33, r.stream());  // X
    }
    everyone_done();
    GemmOptions o;
    o.store = GemmStore::kReduceAdd;
    for (int i = 0; i < comm.num_local(); ++i) {
      Rank& r = comm.local(i);
      WEFT_CUDA_CHECK(cudaSetDevice(r.device()));
      o.start_tile = r.rank() * 7;  // ranks add in different tile orders
      gemm(loc[i].a->p, loc[i].b->p, r.at(cbuf, 0), s.m, s.n, s.k, BLayout::kNK, DType::kFP32, r.stream(), o);
    }
    everyone_done();
    for (int i = 0; i < comm.num_local(); ++i) {
      Rank& r = comm.local(i);
      if (r.rank() != 0) continue;
      WEFT_CUDA_CHECK(cudaSetDevice(r.device()));
      fill_f32(loc[i].ref->p, c_elems, 33, r.stream());
      reference(loc[i].blas, loc[i].a->p, loc[i].b->p, loc[i].ref->as<float>(), s, BLayout::kNK, s.k, s.k,
                float(W), 1.0f);
      const Verdict v = compare(cbuf.local[i], DType::kFP32, s.n, loc[i].ref->as<float>(), s, r.stream());
      WEFT_EXPECT(v.nonfinite == 0 && v.rel <= kTolerance,
                  "rank 0 after " << W << " reduce-adds: " << v.nonfinite << " non-finite, error " << v.rel);
    }
    everyone_done();
  } catch (...) {
    cleanup();
    throw;
  }
  cleanup();
  comm.free(cbuf);
}

// What TMA cannot do is refused before anything runs, naming the operand and the fix.
WEFT_GPU_TEST_ONE_GPU(gemm_rejects_unsupported) {
  Gpu g(ctx);
  DeviceBuffer buf(64 << 20);
  char* p = buf.as<char>();
  const void* a = p;
  const void* b = p + (16 << 20);
  void* c = p + (32 << 20);
  struct Bad {
    const char* why;
    std::function<void()> call;
    std::vector<std::string> expect;
  };
  // A valid 256^3 call with some options set: the options are what is wrong.
  auto with_options = [&](void (*set)(GemmOptions&)) {
    return [&, set] {
      GemmOptions o;
      set(o);
      gemm(a, b, c, 256, 256, 256, BLayout::kNK, DType::kBF16, g.stream, o);
    };
  };
  const std::vector<Bad> cases = {
      {"K not a multiple of 8",
       [&] { gemm(a, b, c, 256, 256, 1001, BLayout::kNK, DType::kBF16, g.stream); },
       {"lda = 1001", "multiple of 16 bytes", "K"}},
      {"N not a multiple of 8 with B [K,N]",
       [&] { gemm(a, b, c, 256, 1001, 256, BLayout::kKN, DType::kBF16, g.stream); },
       {"B is row-major [K,N]", "ldb = 1001"}},
      {"bf16 C rows of 2004 bytes",
       [&] { gemm(a, b, c, 256, 1002, 256, BLayout::kNK, DType::kBF16, g.stream); },
       {"C is row-major [M,N] bf16", "ldc = 1002"}},
      {"f32 C rows of 4008 bytes",
       [&] { gemm(a, b, c, 256, 1002, 256, BLayout::kNK, DType::kFP32, g.stream); },
       {"C is row-major [M,N] f32", "multiple of 4"}},
      {"misaligned A",
       [&] { gemm(p + 2, b, c, 256, 256, 256, BLayout::kNK, DType::kBF16, g.stream); },
       {"A = ", "16-byte aligned"}},
      {"misaligned C",
       [&] { gemm(a, b, p + (32 << 20) + 8, 256, 256, 256, BLayout::kNK, DType::kFP32, g.stream); },
       {"C = ", "16-byte aligned"}},
      {"M = 0", [&] { gemm(a, b, c, 0, 256, 256, BLayout::kNK, DType::kBF16, g.stream); }, {"at least 1"}},
      {"null B", [&] { gemm(a, nullptr, c, 256, 256, 256, BLayout::kNK, DType::kBF16, g.stream); }, {"null"}},
      {"lda < K", with_options([](GemmOptions& o) { o.lda = 128; }), {"lda = 128", "smaller than K"}},
      {"cluster 3", with_options([](GemmOptions& o) { o.cluster = 3; }), {"options.cluster"}},
      {"tile_n 64", with_options([](GemmOptions& o) { o.tile_n = 64; }), {"options.tile_n", "got 64"}},
      {"tile_n 128 with cluster 2",
       with_options([](GemmOptions& o) {
         o.tile_n = 128;
         o.cluster = 2;
       }),
       {"tile_n = 128", "cluster 1"}},
  };
  for (const Bad& bad : cases) {
    const std::string msg = error_of(bad.call);
    WEFT_EXPECT(!msg.empty(), bad.why << ": accepted");
    for (const std::string& part : bad.expect)
      WEFT_EXPECT(msg.find(part) != std::string::npos,
                  bad.why << ": message lacks '" << part << "': " << msg);
  }
  WEFT_CUDA_CHECK(cudaStreamSynchronize(g.stream));  // nothing was launched, nothing failed
}
