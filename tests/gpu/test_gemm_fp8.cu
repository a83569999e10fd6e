// GPU tests of weft::gemm_fp8: random e4m3 / e5m2 operands and fp32 scales of each kind (per tensor, per
// row / column, DeepSeek-V3's 1 x 128 and 128 x 128 blocks); the reference is cuBLAS's fp32 GEMM of the
// operands decoded and scaled to fp32 (so it is the exact scaled product up to fp32 rounding); outputs
// poisoned with NaN first; partial tiles in M, N and K, a long K (16k: the promotion keeps it accurate),
// bf16 and f32 outputs, reduce-add, leading dimensions; and the errors for what it refuses.
// weft::quantize_fp8 is checked against host amaxes and rounding, and end to end (quantize, gemm_fp8) against
// a bf16 GEMM; weft::grouped_gemm_fp8 bit for bit against gemm_fp8 on each group's rows; M-major block
// scales of A bit for bit against row-major ones.
// Pass: relative Frobenius error <= 1e-2 (bf16 out) or 2e-3 (f32 out), no non-finite value, nothing written
// past column N.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "harness.hpp"
#include "weft/ops/gemm.hpp"

using namespace weft;
using weft::test::DeviceBuffer;
using weft::test::error_of;
using weft::test::TestContext;

namespace {

__device__ __forceinline__ float unit(uint64_t seed, uint64_t i) {  // uniform in [-1, 1)
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + i + 0x632be59bd9b4e019ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  x ^= x >> 31;
  return static_cast<float>(x >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

// FP8 values spread over the format's range (|x| up to 2^3 for e4m3, 2^6 for e5m2, sign random).
template <bool kE5M2>
__global__ void fill_fp8(uint8_t* p, uint64_t count, uint64_t seed) {
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < count;
       i += uint64_t(gridDim.x) * blockDim.x) {
    const float v = unit(seed, i) * (kE5M2 ? 64.f : 8.f);
    if constexpr (kE5M2)
      p[i] = __nv_fp8_e5m2(v).__x;
    else
      p[i] = __nv_fp8_e4m3(v).__x;
  }
}
// Positive scales in [2^-4, 2^-2): the scaled products stay near 1.
__global__ void fill_scales(float* p, uint64_t count, uint64_t seed) {
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < count;
       i += uint64_t(gridDim.x) * blockDim.x)
    p[i] = exp2f(-3.f + unit(seed, i));
}
// out[r][c] (dense [rows, cols] fp32) = decode(in[r][c]) x scale(r, c), in with row stride ld.
template <bool kE5M2>
__global__ void decode_scaled(const uint8_t* in, int64_t ld, float* out, int64_t rows, int64_t cols,
                              Fp8Scaling kind, const float* scale, bool is_b) {
  const int64_t groups = (cols + kFp8ScaleBlock - 1) / kFp8ScaleBlock;
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < uint64_t(rows * cols);
       i += uint64_t(gridDim.x) * blockDim.x) {
    const int64_t r = int64_t(i / cols), c = int64_t(i % cols);
    float v;
    if constexpr (kE5M2) {
      __nv_fp8_e5m2 x;
      x.__x = in[r * ld + c];
      v = float(x);
    } else {
      __nv_fp8_e4m3 x;
      x.__x = in[r * ld + c];
      v = float(x);
    }
    const float s = kind == Fp8Scaling::kTensor   ? scale[0]
                    : kind == Fp8Scaling::kRowCol ? scale[r]
                    : is_b                        ? scale[(r / kFp8ScaleBlock) * groups + c / kFp8ScaleBlock]
                                                  : scale[r * groups + c / kFp8ScaleBlock];
    out[i] = v * s;
  }
}

#define CUBLAS_OK(expr)                                                                         \
  do {                                                                                          \
    cublasStatus_t st_ = (expr);                                                                \
    WEFT_EXPECT(st_ == CUBLAS_STATUS_SUCCESS, #expr " failed with cuBLAS status " << int(st_)); \
  } while (0)

struct Case {
  int64_t m, n, k;
  Fp8Scaling kind = Fp8Scaling::kTensor;
  Fp8Type type = Fp8Type::kE4M3;
  DType out = DType::kBF16;
  GemmOptions opt{};
  uint64_t seed = 1;
};

const char* str(Fp8Scaling s) {
  return s == Fp8Scaling::kTensor ? "tensor" : s == Fp8Scaling::kRowCol ? "row/col" : "block";
}

// Scale counts of A and B for a kind.
std::pair<int64_t, int64_t> scale_counts(const Case& c) {
  const int64_t g = (c.k + kFp8ScaleBlock - 1) / kFp8ScaleBlock;
  if (c.kind == Fp8Scaling::kTensor) return {1, 1};
  if (c.kind == Fp8Scaling::kRowCol) return {c.m, c.n};
  return {c.m * g, ((c.n + kFp8ScaleBlock - 1) / kFp8ScaleBlock) * g};
}

template <bool kE5M2>
void decode(const Case& c, const DeviceBuffer& a, int64_t lda, const DeviceBuffer& sa, const DeviceBuffer& b,
            int64_t ldb, const DeviceBuffer& sb, float* af, float* bf, cudaStream_t s) {
  decode_scaled<kE5M2><<<264, 256, 0, s>>>(a.as<uint8_t>(), lda, af, c.m, c.k, c.kind, sa.as<float>(), false);
  decode_scaled<kE5M2><<<264, 256, 0, s>>>(b.as<uint8_t>(), ldb, bf, c.n, c.k, c.kind, sb.as<float>(), true);
  WEFT_CUDA_CHECK(cudaGetLastError());
}

// Runs one case and checks it against cuBLAS's fp32 GEMM of the decoded, scaled operands; returns the
// relative Frobenius error.
double check_case(cublasHandle_t blas, cudaStream_t s, const Case& c) {
  const int64_t lda = c.opt.lda ? c.opt.lda : c.k, ldb = c.opt.ldb ? c.opt.ldb : c.k;
  const int64_t ldc = c.opt.ldc ? c.opt.ldc : c.n;
  const size_t es = c.out == DType::kFP32 ? 4 : 2;
  const auto [na, nb] = scale_counts(c);
  DeviceBuffer a(c.m * lda), b(c.n * ldb), sa(na * 4), sb(nb * 4), out(c.m * ldc * es), af(c.m * c.k * 4),
      bf(c.n * c.k * 4), ref(c.m * c.n * 4);
  const bool e5m2 = c.type == Fp8Type::kE5M2;
  if (e5m2) {
    fill_fp8<true><<<264, 256, 0, s>>>(a.as<uint8_t>(), c.m * lda, c.seed * 4 + 1);
    fill_fp8<true><<<264, 256, 0, s>>>(b.as<uint8_t>(), c.n * ldb, c.seed * 4 + 2);
  } else {
    fill_fp8<false><<<264, 256, 0, s>>>(a.as<uint8_t>(), c.m * lda, c.seed * 4 + 1);
    fill_fp8<false><<<264, 256, 0, s>>>(b.as<uint8_t>(), c.n * ldb, c.seed * 4 + 2);
  }
  fill_scales<<<64, 256, 0, s>>>(sa.as<float>(), na, c.seed * 4 + 3);
  fill_scales<<<64, 256, 0, s>>>(sb.as<float>(), nb, c.seed * 4 + 4);
  WEFT_CUDA_CHECK(cudaGetLastError());
  // Reduce-add adds into what is there: zeros (the product is then the whole result); else NaN poison.
  WEFT_CUDA_CHECK(cudaMemsetAsync(out.p, c.opt.store == GemmStore::kReduceAdd ? 0 : 0xff, out.bytes, s));
  gemm_fp8(a.p, b.p, out.p, c.m, c.n, c.k, c.type, Fp8Scales{c.kind, sa.as<float>(), sb.as<float>()}, c.out,
           s, c.opt);
  WEFT_CUDA_CHECK(cudaGetLastError());
  if (e5m2)
    decode<true>(c, a, lda, sa, b, ldb, sb, af.as<float>(), bf.as<float>(), s);
  else
    decode<false>(c, a, lda, sa, b, ldb, sb, af.as<float>(), bf.as<float>(), s);
  // Row-major ref [m,n] = af [m,k] . bf [n,k]^T: column-major ref^T = bf . af^T.
  const float one = 1.f, zero = 0.f;
  CUBLAS_OK(cublasSgemm(blas, CUBLAS_OP_T, CUBLAS_OP_N, int(c.n), int(c.m), int(c.k), &one, bf.as<float>(),
                        int(c.k), af.as<float>(), int(c.k), &zero, ref.as<float>(), int(c.n)));
  std::vector<float> r(c.m * c.n);
  std::vector<uint8_t> o(out.bytes);
  WEFT_CUDA_CHECK(cudaMemcpyAsync(r.data(), ref.p, r.size() * 4, cudaMemcpyDeviceToHost, s));
  WEFT_CUDA_CHECK(cudaMemcpyAsync(o.data(), out.p, o.size(), cudaMemcpyDeviceToHost, s));
  WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
  double e2 = 0, r2 = 0;
  int64_t nonfinite = 0, padding = 0;
  for (int64_t i = 0; i < c.m; ++i)
    for (int64_t j = 0; j < ldc; ++j) {
      const size_t at = size_t(i * ldc + j);
      float v;
      if (c.out == DType::kFP32) {
        std::memcpy(&v, o.data() + 4 * at, 4);
      } else {
        uint16_t h;
        std::memcpy(&h, o.data() + 2 * at, 2);
        const uint32_t w = uint32_t(h) << 16;
        std::memcpy(&v, &w, 4);
      }
      if (j >= c.n) {  // stride padding: still the poison (or the zeros of reduce-add)
        uint8_t first = o[es * at];
        padding += first != (c.opt.store == GemmStore::kReduceAdd ? 0 : 0xff);
        continue;
      }
      if (!std::isfinite(v)) {
        ++nonfinite;
        continue;
      }
      const double d = double(v) - r[i * c.n + j];
      e2 += d * d;
      r2 += double(r[i * c.n + j]) * r[i * c.n + j];
    }
  const double rel = r2 > 0 ? std::sqrt(e2 / r2) : std::sqrt(e2);
  const double tol = c.out == DType::kFP32 ? 2e-3 : 1e-2;
  const std::string what = std::to_string(c.m) + "x" + std::to_string(c.n) + "x" + std::to_string(c.k) + " " +
                           (e5m2 ? "e5m2" : "e4m3") + " " + str(c.kind) + " -> " +
                           (c.out == DType::kFP32 ? "f32" : "bf16") +
                           (c.opt.store == GemmStore::kReduceAdd ? " (reduce-add)" : "");
  WEFT_EXPECT(nonfinite == 0, what << ": " << nonfinite << " outputs are not finite (unwritten or NaN)");
  WEFT_EXPECT(rel <= tol, what << ": relative Frobenius error " << rel << " > " << tol);
  WEFT_EXPECT(padding == 0, what << ": " << padding << " elements past column N were written");
  std::printf("    %-28s rel err %.2e\n", what.c_str(), rel);
  return rel;
}

struct Blas {
  cublasHandle_t h = nullptr;
  explicit Blas(cudaStream_t s) {
    CUBLAS_OK(cublasCreate(&h));
    CUBLAS_OK(cublasSetStream(h, s));
  }
  ~Blas() { cublasDestroy(h); }
};

}  // namespace

WEFT_GPU_TEST_ONE_GPU(gemm_fp8_matches_reference) {
  Rank& rank = ctx.comm().local(0);
  WEFT_CUDA_CHECK(cudaSetDevice(rank.device()));
  const cudaStream_t s = rank.stream();
  Blas blas(s);
  struct Shape {
    int64_t m, n, k;
  };
  std::vector<Shape> shapes = {{128, 128, 128},  {200, 136, 144}, {1, 16, 16},     {1000, 1000, 1040},
                               {129, 264, 4096}, {64, 384, 16},   {517, 200, 1008}};
  if (!ctx.quick) shapes.push_back({4096, 4096, 4096});
  uint64_t seed = 1;
  for (const Shape& sh : shapes)
    for (Fp8Scaling kind : {Fp8Scaling::kTensor, Fp8Scaling::kRowCol, Fp8Scaling::kBlock})
      for (DType out : {DType::kBF16, DType::kFP32}) {
        Case c{sh.m, sh.n, sh.k, kind};
        c.out = out;
        c.seed = seed++;
        check_case(blas.h, s, c);
      }
  // The promotion: a long K in f32 out, block and tensor scales.
  for (Fp8Scaling kind : {Fp8Scaling::kTensor, Fp8Scaling::kBlock}) {
    Case c{256, 256, 16384, kind};
    c.out = DType::kFP32;
    c.seed = seed++;
    check_case(blas.h, s, c);
  }
  // e5m2 operands; reduce-add into zeros; leading dimensions with padding columns (poison kept).
  Case e5{300, 264, 528, Fp8Scaling::kBlock, Fp8Type::kE5M2};
  e5.seed = seed++;
  check_case(blas.h, s, e5);
  Case add{260, 136, 400, Fp8Scaling::kRowCol};
  add.opt.store = GemmStore::kReduceAdd;
  add.out = DType::kFP32;
  add.seed = seed++;
  check_case(blas.h, s, add);
  // Few persistent blocks, so that every block takes many tiles (the accumulator, the pipeline's position
  // and the epilogue's buffers carry across tiles): the quick shapes alone give each block one tile.
  for (int blocks : {1, 3}) {
    Case few{517, 200, 1008, Fp8Scaling::kBlock};
    few.opt.max_blocks = blocks;
    few.seed = seed++;
    check_case(blas.h, s, few);
    Case wide{1000, 1000, 1040, Fp8Scaling::kTensor};
    wide.opt.max_blocks = blocks;
    wide.out = DType::kFP32;
    wide.seed = seed++;
    check_case(blas.h, s, wide);
  }
  Case ld{190, 200, 272, Fp8Scaling::kBlock};
  ld.opt.lda = 288;
  ld.opt.ldb = 304;
  ld.opt.ldc = 216;
  ld.seed = seed++;
  check_case(blas.h, s, ld);
}

WEFT_GPU_TEST_ONE_GPU(gemm_fp8_rejects_unsupported) {
  Rank& rank = ctx.comm().local(0);
  WEFT_CUDA_CHECK(cudaSetDevice(rank.device()));
  DeviceBuffer a(1 << 16), b(1 << 16), c(1 << 18), sc(1 << 12);
  const Fp8Scales scales{Fp8Scaling::kTensor, sc.as<float>(), sc.as<float>()};
  auto call = [&](int64_t m, int64_t n, int64_t k, Fp8Scales sx, DType out, GemmOptions o = {}) {
    return error_of([&] { gemm_fp8(a.p, b.p, c.p, m, n, k, Fp8Type::kE4M3, sx, out, rank.stream(), o); });
  };
  std::string e = call(64, 64, 24, scales, DType::kBF16);
  WEFT_EXPECT(e.find("multiple of 16") != std::string::npos, "K = 24: got '" << e << "'");
  e = call(64, 60, 64, scales, DType::kBF16);
  WEFT_EXPECT(e.find("ldc") != std::string::npos, "N = 60 bf16: got '" << e << "'");
  e = call(64, 64, 64, Fp8Scales{Fp8Scaling::kBlock, nullptr, sc.as<float>()}, DType::kBF16);
  WEFT_EXPECT(e.find("scales.a") != std::string::npos, "null scales: got '" << e << "'");
  e = call(64, 64, 64, scales, DType::kFP16);
  WEFT_EXPECT(e.find("bf16 or fp32") != std::string::npos, "fp16 out: got '" << e << "'");
  GemmOptions wide;
  wide.tile_n = 256;
  e = call(64, 64, 64, scales, DType::kBF16, wide);
  WEFT_EXPECT(e.find("tile_n") != std::string::npos, "tile_n: got '" << e << "'");
  e = call(0, 64, 64, scales, DType::kBF16);
  WEFT_EXPECT(e.find("at least 1") != std::string::npos, "M = 0: got '" << e << "'");
  GemmOptions counted;  // grouped_gemm's (bf16) alone
  counted.group_rows = sc.as<int32_t>();
  e = call(64, 64, 64, scales, DType::kBF16, counted);
  WEFT_EXPECT(e.find("group_rows") != std::string::npos, "group_rows: got '" << e << "'");
  e = call(64, 64, 64, Fp8Scales{Fp8Scaling::kBlock, sc.as<float>(), sc.as<float>(), 63}, DType::kBF16);
  WEFT_EXPECT(e.find("a_m_stride") != std::string::npos, "a_m_stride 63 < M: got '" << e << "'");
  e = call(64, 64, 64, Fp8Scales{Fp8Scaling::kTensor, sc.as<float>(), sc.as<float>(), 64}, DType::kBF16);
  WEFT_EXPECT(e.find("a_m_stride") != std::string::npos, "a_m_stride with tensor scales: got '" << e << "'");
  const Plan p = gemm_fp8_plan(4096, 4096, 4096, Fp8Type::kE4M3, scales, DType::kBF16);
  WEFT_EXPECT(p.tiles.m == 128 && p.tiles.n == 128 && p.tiles.k == 128 && p.blocks > 0,
              "plan: " << describe(p));
}

// M-major block scales of A (Fp8Scales::a_m_stride: torch's layout for 1 x 128 blockwise scales) give the
// row-major layout's result bit for bit; the rows between M and the stride hold NaN, never to be read. Each
// shape twice: a stride of whole 16 bytes (the scales staged by the loader's TMA) and one float more (read
// by the consumers), each checked against the plan's path; row-major scales are never staged (checked the
// same way).
WEFT_GPU_TEST_ONE_GPU(gemm_fp8_m_major_block_scales) {
  Rank& rank = ctx.comm().local(0);
  WEFT_CUDA_CHECK(cudaSetDevice(rank.device()));
  const cudaStream_t s = rank.stream();
  struct Shape {
    int64_t m, n, k;
  };
  std::vector<Shape> shapes = {
      {1, 16, 16}, {129, 264, 1008}, {300, 136, 4096}, {517, 200, 400}, {257, 392, 1296}};
  if (!ctx.quick) shapes.push_back({2048, 2048, 7168});
  uint64_t seed = 500;
  for (const Shape& sh : shapes)
    for (const bool staged : {true, false}) {
      const int64_t g = (sh.k + kFp8ScaleBlock - 1) / kFp8ScaleBlock,
                    ld = (sh.m + 3) / 4 * 4 + (staged ? 4 : 5);
      const Case c{sh.m, sh.n, sh.k, Fp8Scaling::kBlock};
      const auto [na, nb] = scale_counts(c);
      DeviceBuffer a(sh.m * sh.k), b(sh.n * sh.k), sa(na * 4), sa_m(ld * g * 4), sb(nb * 4),
          row_major(sh.m * sh.n * 2), m_major(sh.m * sh.n * 2);
      fill_fp8<false><<<264, 256, 0, s>>>(a.as<uint8_t>(), sh.m * sh.k, seed++);
      fill_fp8<false><<<264, 256, 0, s>>>(b.as<uint8_t>(), sh.n * sh.k, seed++);
      fill_scales<<<64, 256, 0, s>>>(sa.as<float>(), na, seed++);
      fill_scales<<<64, 256, 0, s>>>(sb.as<float>(), nb, seed++);
      WEFT_CUDA_CHECK(cudaGetLastError());
      std::vector<float> rows(na), cols(ld * g, std::nanf(""));
      WEFT_CUDA_CHECK(cudaMemcpyAsync(rows.data(), sa.p, na * 4, cudaMemcpyDeviceToHost, s));
      WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
      for (int64_t i = 0; i < sh.m; ++i)
        for (int64_t j = 0; j < g; ++j) cols[j * ld + i] = rows[i * g + j];
      WEFT_CUDA_CHECK(cudaMemcpyAsync(sa_m.p, cols.data(), cols.size() * 4, cudaMemcpyHostToDevice, s));
      WEFT_CUDA_CHECK(cudaMemsetAsync(row_major.p, 0xff, row_major.bytes, s));
      WEFT_CUDA_CHECK(cudaMemsetAsync(m_major.p, 0xff, m_major.bytes, s));
      gemm_fp8(a.p, b.p, row_major.p, sh.m, sh.n, sh.k, Fp8Type::kE4M3,
               Fp8Scales{Fp8Scaling::kBlock, sa.as<float>(), sb.as<float>()}, DType::kBF16, s);
      const Fp8Scales m_scales{Fp8Scaling::kBlock, sa_m.as<float>(), sb.as<float>(), ld};
      gemm_fp8(a.p, b.p, m_major.p, sh.m, sh.n, sh.k, Fp8Type::kE4M3, m_scales, DType::kBF16, s);
      const std::string path = gemm_fp8_plan(sh.m, sh.n, sh.k, Fp8Type::kE4M3, m_scales, DType::kBF16).path;
      const std::string row_path =
          gemm_fp8_plan(sh.m, sh.n, sh.k, Fp8Type::kE4M3,
                        Fp8Scales{Fp8Scaling::kBlock, sa.as<float>(), sb.as<float>()}, DType::kBF16)
              .path;
      WEFT_CUDA_CHECK(cudaGetLastError());
      std::vector<uint16_t> r(sh.m * sh.n), m(sh.m * sh.n);
      WEFT_CUDA_CHECK(cudaMemcpyAsync(r.data(), row_major.p, row_major.bytes, cudaMemcpyDeviceToHost, s));
      WEFT_CUDA_CHECK(cudaMemcpyAsync(m.data(), m_major.p, m_major.bytes, cudaMemcpyDeviceToHost, s));
      WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
      int64_t nonfinite = 0, differ = 0;
      for (size_t i = 0; i < r.size(); ++i) {
        nonfinite += (r[i] & 0x7f80) == 0x7f80;  // bf16 exponent all ones: inf or NaN (the poison)
        differ += r[i] != m[i];
      }
      const std::string what = std::to_string(sh.m) + "x" + std::to_string(sh.n) + "x" + std::to_string(sh.k);
      WEFT_EXPECT((path.find("staged") != std::string::npos) == staged,
                  what << ", stride " << ld << ": plan path '" << path << "'");
      WEFT_EXPECT(row_path.find("staged") == std::string::npos,
                  what << ", row-major scales: plan path '" << row_path << "'");
      WEFT_EXPECT(nonfinite == 0, what << ": " << nonfinite << " row-major outputs are not finite");
      WEFT_EXPECT(differ == 0,
                  what << ": " << differ << " outputs of the M-major scales differ from the row-major ones");
      std::printf("    %-16s M-major scales (stride %lld, %s): %lld of %zu outputs differ\n", what.c_str(),
                  static_cast<long long>(ld), staged ? "staged" : "read by the consumers",
                  static_cast<long long>(differ), r.size());
    }
}

namespace {

__global__ void fill_bf16_unit(__nv_bfloat16* p, uint64_t count, uint64_t seed) {
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < count;
       i += uint64_t(gridDim.x) * blockDim.x)  // a spread of magnitudes: 2^-6 .. 2^2
    p[i] = __float2bfloat16(unit(seed, i) * exp2f(-2.f + 4.f * unit(seed + 77, i)));
}

float bf16_value(uint16_t h) {
  const uint32_t w = uint32_t(h) << 16;
  float v;
  std::memcpy(&v, &w, 4);
  return v;
}

// Host decode of e4m3 (no infinities; 0x7f / 0xff NaN).
float e4m3_value(uint8_t b) {
  const int sign = b >> 7, exp = (b >> 3) & 15, man = b & 7;
  if (exp == 15 && man == 7) return NAN;
  const float v = exp == 0 ? std::ldexp(float(man), -9) : std::ldexp(1.f + man / 8.f, exp - 7);
  return sign ? -v : v;
}

// The scale a block of values gets: amax / 448 (the floor as the device's).
float expected_scale(float amax) {
  return std::max(amax, 1e-12f) / 448.f;
}

// in [rows, cols] bf16 (host copy) quantized on the GPU for `operand` and `kind`: the scales against the
// host's amax, every element within FP8's rounding of its input. Returns the device out / scales.
void check_quantized(const std::vector<uint16_t>& in, int64_t rows, int64_t cols, Fp8Scaling kind,
                     Fp8Operand operand, const std::vector<uint8_t>& q, const std::vector<float>& scales) {
  const int64_t groups = (cols + 127) / 128;
  auto scale_index = [&](int64_t r, int64_t c) -> int64_t {
    if (kind == Fp8Scaling::kTensor) return 0;
    if (kind == Fp8Scaling::kRowCol) return r;
    return operand == Fp8Operand::kA ? r * groups + c / 128 : (r / 128) * groups + c / 128;
  };
  std::vector<float> amax(scales.size(), 0.f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      float& a = amax[scale_index(r, c)];
      a = std::max(a, std::fabs(bf16_value(in[r * cols + c])));
    }
  int64_t bad_scales = 0, bad_values = 0;
  for (size_t i = 0; i < scales.size(); ++i) bad_scales += scales[i] != expected_scale(amax[i]);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const float x = bf16_value(in[r * cols + c]), s = scales[scale_index(r, c)];
      const float d = e4m3_value(q[r * cols + c]) * s;
      bad_values += !(std::fabs(d - x) <= std::fabs(x) * 0.0626f + s * std::ldexp(1.f, -10) + 1e-30f);
    }
  WEFT_EXPECT(bad_scales == 0, str(kind) << (operand == Fp8Operand::kA ? " A" : " B") << ": " << bad_scales
                                         << " of " << scales.size() << " scales differ from amax / 448");
  WEFT_EXPECT(bad_values == 0, str(kind) << (operand == Fp8Operand::kA ? " A" : " B") << ": " << bad_values
                                         << " elements off by more than e4m3's rounding");
}

}  // namespace

// Block scales read back from a layout with gaps (poisoned with NaN before the quantization), row i's scale
// of group j at hs[i * row_step + j * group_step]: how many differ bit for bit from the row-major want_s
// [m, g], and how many gap floats were written.
struct StridedScaleDiff {
  int64_t scales = 0, gaps = 0;
};
static StridedScaleDiff compare_strided_scales(const std::vector<float>& hs, const std::vector<float>& want_s,
                                               int64_t m, int64_t g, int64_t row_step, int64_t group_step) {
  StridedScaleDiff d;
  std::vector<char> used(hs.size(), 0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < g; ++j) {
      const int64_t at = i * row_step + j * group_step;
      used[at] = 1;
      d.scales += std::memcmp(&hs[at], &want_s[i * g + j], 4) != 0;
    }
  for (size_t x = 0; x < hs.size(); ++x) d.gaps += !used[x] && !std::isnan(hs[x]);  // never written
  return d;
}

// A's block scales quantized M-major (a stride of M + 3 rows, the gaps poisoned with NaN): the row-major
// quantization's values and scales bit for bit, and gemm_fp8 on them its product bit for bit (`want`).
static void check_m_major_quantize(const DeviceBuffer& a, int64_t m, int64_t k, const std::vector<uint8_t>& want_q,
                                   const std::vector<float>& want_s, const DeviceBuffer& qb, const DeviceBuffer& sb,
                                   const std::vector<float>& want, cudaStream_t s) {
  const int64_t g = (k + 127) / 128, ld = m + 3, n = int64_t(want.size()) / m;
  DeviceBuffer q(m * k), sm(g * ld * 4), out(m * n * 4);
  WEFT_CUDA_CHECK(cudaMemsetAsync(sm.p, 0xff, sm.bytes, s));  // NaN
  WEFT_CUDA_CHECK(cudaMemsetAsync(out.p, 0xff, out.bytes, s));
  quantize_fp8(a.p, DType::kBF16, q.p, Fp8Type::kE4M3, sm.as<float>(), m, k, Fp8Scaling::kBlock, Fp8Operand::kA,
               s, 0, 0, ld);
  Fp8Scales scales{Fp8Scaling::kBlock, sm.as<float>(), sb.as<float>()};
  scales.a_m_stride = ld;
  gemm_fp8(q.p, qb.p, out.p, m, n, k, Fp8Type::kE4M3, scales, DType::kFP32, s);
  std::vector<uint8_t> hq(m * k);
  std::vector<float> hs(g * ld), ho(m * n);
  WEFT_CUDA_CHECK(cudaMemcpyAsync(hq.data(), q.p, q.bytes, cudaMemcpyDeviceToHost, s));
  WEFT_CUDA_CHECK(cudaMemcpyAsync(hs.data(), sm.p, sm.bytes, cudaMemcpyDeviceToHost, s));
  WEFT_CUDA_CHECK(cudaMemcpyAsync(ho.data(), out.p, out.bytes, cudaMemcpyDeviceToHost, s));
  WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
  const StridedScaleDiff d = compare_strided_scales(hs, want_s, m, g, 1, ld);
  const int64_t bad_s = d.scales, bad_gap = d.gaps;
  int64_t bad_out = 0;
  for (int64_t i = 0; i < m * n; ++i) bad_out += std::memcmp(&ho[i], &want[i], 4) != 0 || !std::isfinite(ho[i]);
  std::printf("    block scales of A M-major (stride M + 3): %lld scales, %lld gap floats, %lld outputs differ\n",
              (long long)bad_s, (long long)bad_gap, (long long)bad_out);
  WEFT_EXPECT(hq == want_q, "M-major quantization: the values differ from the row-major one's");
  WEFT_EXPECT(bad_s == 0, bad_s << " M-major scales differ from the row-major ones");
  WEFT_EXPECT(bad_gap == 0, bad_gap << " floats between M and the stride were written");
  WEFT_EXPECT(bad_out == 0, bad_out << " outputs of gemm_fp8 on M-major scales differ from the row-major ones'");
}

// A's block scales quantized into rows of a stride (the groups + 3 floats a row, the gaps poisoned with NaN,
// as moe_dispatch_fp8 puts them behind each row's values): the row-major quantization's values and scales bit
// for bit, the gaps untouched.
static void check_row_stride_quantize(const DeviceBuffer& a, int64_t m, int64_t k,
                                      const std::vector<uint8_t>& want_q, const std::vector<float>& want_s,
                                      cudaStream_t s) {
  const int64_t g = (k + 127) / 128, ld = g + 3;
  DeviceBuffer q(m * k), sr(m * ld * 4);
  WEFT_CUDA_CHECK(cudaMemsetAsync(sr.p, 0xff, sr.bytes, s));  // NaN
  quantize_fp8(a.p, DType::kBF16, q.p, Fp8Type::kE4M3, sr.as<float>(), m, k, Fp8Scaling::kBlock,
               Fp8Operand::kA, s, 0, 0, 0, ld);
  std::vector<uint8_t> hq(m * k);
  std::vector<float> hs(m * ld);
  WEFT_CUDA_CHECK(cudaMemcpyAsync(hq.data(), q.p, q.bytes, cudaMemcpyDeviceToHost, s));
  WEFT_CUDA_CHECK(cudaMemcpyAsync(hs.data(), sr.p, sr.bytes, cudaMemcpyDeviceToHost, s));
  WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
  const StridedScaleDiff d = compare_strided_scales(hs, want_s, m, g, ld, 1);
  const int64_t bad_s = d.scales, bad_gap = d.gaps;
  std::printf("    block scales of A in rows of a stride (groups + 3): %lld scales, %lld gap floats differ\n",
              (long long)bad_s, (long long)bad_gap);
  WEFT_EXPECT(hq == want_q, "row-stride quantization: the values differ from the row-major one's");
  WEFT_EXPECT(bad_s == 0, bad_s << " row-stride scales differ from the row-major ones");
  WEFT_EXPECT(bad_gap == 0, bad_gap << " floats between a row's groups and the stride were written");
}

// bf16 operands quantized by weft::quantize_fp8 for each scale kind and operand (scales and values checked
// on the host), then gemm_fp8 on them against cuBLAS's fp32-accumulated bf16 GEMM of the originals: the
// quantization's error only (e4m3: ~4% per element, ~5% in the Frobenius norm of C).
WEFT_GPU_TEST_ONE_GPU(quantize_fp8_then_gemm_fp8_matches_bf16) {
  Rank& rank = ctx.comm().local(0);
  WEFT_CUDA_CHECK(cudaSetDevice(rank.device()));
  const cudaStream_t s = rank.stream();
  Blas blas(s);
  const int64_t m = 300, n = 260, k = 1040;
  DeviceBuffer a(m * k * 2), b(n * k * 2), qa(m * k), qb(n * k), ref(m * n * 4), out(m * n * 4);
  fill_bf16_unit<<<264, 256, 0, s>>>(a.as<__nv_bfloat16>(), m * k, 11);
  fill_bf16_unit<<<264, 256, 0, s>>>(b.as<__nv_bfloat16>(), n * k, 12);
  WEFT_CUDA_CHECK(cudaGetLastError());
  const float one = 1.f, zero = 0.f;
  CUBLAS_OK(cublasGemmEx(blas.h, CUBLAS_OP_T, CUBLAS_OP_N, int(n), int(m), int(k), &one, b.p, CUDA_R_16BF,
                         int(k), a.p, CUDA_R_16BF, int(k), &zero, ref.p, CUDA_R_32F, int(n),
                         CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  std::vector<uint16_t> ha(m * k), hb(n * k);
  std::vector<float> hr(m * n), ho(m * n);
  WEFT_CUDA_CHECK(cudaMemcpyAsync(ha.data(), a.p, a.bytes, cudaMemcpyDeviceToHost, s));
  WEFT_CUDA_CHECK(cudaMemcpyAsync(hb.data(), b.p, b.bytes, cudaMemcpyDeviceToHost, s));
  WEFT_CUDA_CHECK(cudaMemcpyAsync(hr.data(), ref.p, ref.bytes, cudaMemcpyDeviceToHost, s));
  const int64_t g = (k + 127) / 128;
  for (Fp8Scaling kind : {Fp8Scaling::kTensor, Fp8Scaling::kRowCol, Fp8Scaling::kBlock}) {
    const int64_t na = kind == Fp8Scaling::kTensor ? 1 : kind == Fp8Scaling::kRowCol ? m : m * g;
    const int64_t nb = kind == Fp8Scaling::kTensor   ? 1
                       : kind == Fp8Scaling::kRowCol ? n
                                                     : ((n + 127) / 128) * g;
    DeviceBuffer sa(na * 4), sb(nb * 4);
    quantize_fp8(a.p, DType::kBF16, qa.p, Fp8Type::kE4M3, sa.as<float>(), m, k, kind, Fp8Operand::kA, s);
    quantize_fp8(b.p, DType::kBF16, qb.p, Fp8Type::kE4M3, sb.as<float>(), n, k, kind, Fp8Operand::kB, s);
    WEFT_CUDA_CHECK(cudaMemsetAsync(out.p, 0xff, out.bytes, s));
    gemm_fp8(qa.p, qb.p, out.p, m, n, k, Fp8Type::kE4M3, Fp8Scales{kind, sa.as<float>(), sb.as<float>()},
             DType::kFP32, s);
    std::vector<uint8_t> hqa(m * k), hqb(n * k);
    std::vector<float> hsa(na), hsb(nb);
    WEFT_CUDA_CHECK(cudaMemcpyAsync(hqa.data(), qa.p, qa.bytes, cudaMemcpyDeviceToHost, s));
    WEFT_CUDA_CHECK(cudaMemcpyAsync(hqb.data(), qb.p, qb.bytes, cudaMemcpyDeviceToHost, s));
    WEFT_CUDA_CHECK(cudaMemcpyAsync(hsa.data(), sa.p, sa.bytes, cudaMemcpyDeviceToHost, s));
    WEFT_CUDA_CHECK(cudaMemcpyAsync(hsb.data(), sb.p, sb.bytes, cudaMemcpyDeviceToHost, s));
    WEFT_CUDA_CHECK(cudaMemcpyAsync(ho.data(), out.p, out.bytes, cudaMemcpyDeviceToHost, s));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
    check_quantized(ha, m, k, kind, Fp8Operand::kA, hqa, hsa);
    check_quantized(hb, n, k, kind, Fp8Operand::kB, hqb, hsb);
    double e2 = 0, r2 = 0;
    int64_t nonfinite = 0;
    for (int64_t i = 0; i < m * n; ++i) {
      if (!std::isfinite(ho[i])) {
        ++nonfinite;
        continue;
      }
      e2 += double(ho[i] - hr[i]) * (ho[i] - hr[i]);
      r2 += double(hr[i]) * hr[i];
    }
    const double rel = std::sqrt(e2 / r2);
    std::printf("    quantized %-8s -> gemm_fp8 vs bf16 GEMM: rel err %.3f\n", str(kind), rel);
    WEFT_EXPECT(nonfinite == 0, str(kind) << ": " << nonfinite << " outputs not finite");
    WEFT_EXPECT(rel <= 0.08, str(kind) << ": relative Frobenius error " << rel << " > 0.08");
    if (kind == Fp8Scaling::kBlock) {
      check_m_major_quantize(a, m, k, hqa, hsa, qb, sb, ho, s);
      check_row_stride_quantize(a, m, k, hqa, hsa, s);
    }
  }
}

namespace {

double activated(Activation act, double x, double up) {
  switch (act) {
    case Activation::kSwiGLU:
      return x / (1 + std::exp(-x)) * up;
    case Activation::kSiLU:
      return x / (1 + std::exp(-x));
    case Activation::kGELU:
      return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0)));
    case Activation::kReLU:
      return std::max(x, 0.0);
    default:
      return x;
  }
}

// One activate_quantize_fp8 call's output against the host: every written row's scales (amax / 448 of the
// fp64 activation, to fp32's rounding of the device's fp32 one) and values (within e4m3's rounding), every
// other row's left as poisoned. Returns the rows written.
int64_t check_activated(const std::vector<uint16_t>& in, int64_t rows, int64_t cols, Activation act,
                        const std::vector<uint8_t>& q, const std::vector<float>& scales, int64_t m_stride,
                        const std::function<bool(int64_t)>& written) {
  const int64_t groups = (cols + 127) / 128, in_cols = act == Activation::kSwiGLU ? 2 * cols : cols;
  int64_t bad_scales = 0, bad_values = 0, touched = 0, live = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const bool w = written(r);
    live += w;
    for (int64_t g = 0; g < groups; ++g) {
      const float s = scales[m_stride ? g * m_stride + r : r * groups + g];
      double amax = 0;
      std::vector<double> y;
      for (int64_t c = g * 128; c < std::min(cols, g * 128 + 128); ++c) {
        y.push_back(activated(act, bf16_value(in[r * in_cols + c]),
                              act == Activation::kSwiGLU ? bf16_value(in[r * in_cols + cols + c]) : 1.0));
        amax = std::max(amax, std::fabs(y.back()));
      }
      if (!w) {
        touched += !std::isnan(s);
        for (int64_t c = g * 128; c < std::min(cols, g * 128 + 128); ++c) touched += q[r * cols + c] != 0x7f;
        continue;
      }
      const double want = std::max(amax, 1e-12) / 448;
      bad_scales += !(std::fabs(s - want) <= want * 1e-5);
      for (size_t i = 0; i < y.size(); ++i) {
        const double d = e4m3_value(q[r * cols + g * 128 + int64_t(i)]) * double(s);
        bad_values += !(std::fabs(d - y[i]) <= std::fabs(y[i]) * 0.0626 + s * std::ldexp(1.0, -10) + 1e-30);
      }
    }
  }
  WEFT_EXPECT(bad_scales == 0, bad_scales << " scales differ from amax / 448 of the activation");
  WEFT_EXPECT(bad_values == 0, bad_values << " values off by more than e4m3's rounding of the activation");
  WEFT_EXPECT(touched == 0, touched << " values or scales of rows not to be written were written");
  return live;
}

}  // namespace

// activate_quantize_fp8 against the host for each activation: 320 x 260 (a partial 128-column group), scales
// row-major and M-major (stride rows + 3), every row and only a low-latency dispatch's counted rows (groups
// ending at 128, 128, 300, counting 5, 0 and 100 rows; rows 300-319 past the last end). Without an
// activation: quantize_fp8's bits. Outputs poisoned (e4m3 NaN, NaN scales) before each call.
WEFT_GPU_TEST_ONE_GPU(activate_quantize_fp8_matches_host) {
  Rank& rank = ctx.comm().local(0);
  WEFT_CUDA_CHECK(cudaSetDevice(rank.device()));
  const cudaStream_t s = rank.stream();
  const int64_t rows = 320, cols = 260, groups = 3, ld = rows + 3;
  const std::vector<int32_t> ends = {128, 128, 300}, counts = {5, 0, 100};
  DeviceBuffer in(rows * 2 * cols * 2), q(rows * cols), sc(groups * ld * 4), ge(12), gr(12), q0(rows * cols),
      s0(rows * groups * 4);
  fill_bf16_unit<<<264, 256, 0, s>>>(in.as<__nv_bfloat16>(), rows * 2 * cols, 41);
  WEFT_CUDA_CHECK(cudaGetLastError());
  WEFT_CUDA_CHECK(cudaMemcpyAsync(ge.p, ends.data(), 12, cudaMemcpyHostToDevice, s));
  WEFT_CUDA_CHECK(cudaMemcpyAsync(gr.p, counts.data(), 12, cudaMemcpyHostToDevice, s));
  std::vector<uint16_t> hin(rows * 2 * cols);
  WEFT_CUDA_CHECK(cudaMemcpyAsync(hin.data(), in.p, in.bytes, cudaMemcpyDeviceToHost, s));
  const Fp8QuantizeRows counted{ge.as<int32_t>(), gr.as<int32_t>(), 3};
  auto is_counted = [&](int64_t r) {
    for (int e = 0; e < 3; ++e)
      if (r < ends[e]) return r - (e ? ends[e - 1] : 0) < counts[e];
    return false;
  };
  for (Activation act :
       {Activation::kNone, Activation::kSwiGLU, Activation::kSiLU, Activation::kGELU, Activation::kReLU})
    for (const int64_t m_stride : {int64_t(0), ld})
      for (const bool only_counted : {false, true}) {
        WEFT_CUDA_CHECK(cudaMemsetAsync(q.p, 0x7f, q.bytes, s));
        WEFT_CUDA_CHECK(cudaMemsetAsync(sc.p, 0xff, sc.bytes, s));
        activate_quantize_fp8(in.p, DType::kBF16, act, q.p, Fp8Type::kE4M3, sc.as<float>(), rows, cols, s, 0,
                              0, m_stride, only_counted ? counted : Fp8QuantizeRows{});
        std::vector<uint8_t> hq(q.bytes);
        std::vector<float> hs(sc.bytes / 4);
        WEFT_CUDA_CHECK(cudaMemcpyAsync(hq.data(), q.p, q.bytes, cudaMemcpyDeviceToHost, s));
        WEFT_CUDA_CHECK(cudaMemcpyAsync(hs.data(), sc.p, sc.bytes, cudaMemcpyDeviceToHost, s));
        WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
        const int64_t live = check_activated(hin, rows, cols, act, hq, hs, m_stride,
                                             [&](int64_t r) { return !only_counted || is_counted(r); });
        std::printf("    activation %d, scales %s, %s: %lld rows written\n", int(act),
                    m_stride ? "M-major" : "row-major", only_counted ? "counted rows" : "every row",
                    (long long)live);
        if (act != Activation::kNone || m_stride || only_counted) continue;
        // No activation: quantize_fp8's bits.
        quantize_fp8(in.p, DType::kBF16, q0.p, Fp8Type::kE4M3, s0.as<float>(), rows, cols, Fp8Scaling::kBlock,
                     Fp8Operand::kA, s);
        std::vector<uint8_t> hq0(q0.bytes);
        std::vector<float> hs0(s0.bytes / 4);
        WEFT_CUDA_CHECK(cudaMemcpyAsync(hq0.data(), q0.p, q0.bytes, cudaMemcpyDeviceToHost, s));
        WEFT_CUDA_CHECK(cudaMemcpyAsync(hs0.data(), s0.p, s0.bytes, cudaMemcpyDeviceToHost, s));
        WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
        WEFT_EXPECT(hq0 == hq && std::memcmp(hs0.data(), hs.data(), hs0.size() * 4) == 0,
                    "no activation: the values or scales differ from quantize_fp8's");
      }
  WEFT_EXPECT_ERROR(activate_quantize_fp8(in.p, DType::kBF16, Activation::kSwiGLU, q.p, Fp8Type::kE4M3,
                                          sc.as<float>(), rows, 258, s),
                    "multiples of 4");
  WEFT_EXPECT_ERROR(activate_quantize_fp8(in.p, DType::kBF16, Activation::kSwiGLU, q.p, Fp8Type::kE4M3,
                                          sc.as<float>(), rows, cols, s, cols),
                    "ld_in must be at least 520");
  WEFT_EXPECT_ERROR(
      activate_quantize_fp8(in.p, DType::kBF16, Activation::kNone, q.p, Fp8Type::kE4M3, sc.as<float>(), rows,
                            cols, s, 0, 0, 0, Fp8QuantizeRows{nullptr, gr.as<int32_t>(), 3}),
      "needs which.group_end");
}

// The grouped FP8 GEMM against gemm_fp8 on each group's rows (the same tiles, k-blocks and scales: the same
// bits): groups of 128, 0 and 256 rows in a capacity of 512 (the rows past the last end left as they were),
// a K tail (K = 400), N 256 and 192 (a column tile past N reads the next expert's rows, which the store
// clips), bf16 and f32 out, A's scales row-major and M-major (staged; a stride past the rows, the gap NaN);
// its refusals and its plan.
static void grouped_fp8_case(Rank& rank, int64_t n) {
  const cudaStream_t s = rank.stream();
  const int groups = 3;
  const int64_t k = 400, rows = 512, kb = (k + 127) / 128, nb = (n + 127) / 128;
  const std::vector<int32_t> ends = {128, 128, 384};
  DeviceBuffer a(rows * k), b(groups * n * k), sa(rows * kb * 4), sb(groups * nb * kb * 4), ge(groups * 4),
      c(rows * n * 4), ref(rows * n * 4);
  fill_fp8<false><<<264, 256, 0, s>>>(a.as<uint8_t>(), rows * k, 21);
  fill_fp8<false><<<264, 256, 0, s>>>(b.as<uint8_t>(), groups * n * k, 22);
  fill_scales<<<64, 256, 0, s>>>(sa.as<float>(), rows * kb, 23);
  fill_scales<<<64, 256, 0, s>>>(sb.as<float>(), groups * nb * kb, 24);
  WEFT_CUDA_CHECK(cudaGetLastError());
  WEFT_CUDA_CHECK(cudaMemcpyAsync(ge.p, ends.data(), groups * 4, cudaMemcpyHostToDevice, s));
  // The same scales M-major, rows + 4 floats between k-blocks (staged) and rows + 3 (TMA cannot copy them:
  // read by the consumers), the gaps NaN.
  std::vector<float> hs(rows * kb);
  WEFT_CUDA_CHECK(cudaMemcpyAsync(hs.data(), sa.p, sa.bytes, cudaMemcpyDeviceToHost, s));
  WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
  DeviceBuffer sam4(kb * (rows + 4) * 4), sam3(kb * (rows + 3) * 4);
  std::vector<Fp8Scales> layouts = {Fp8Scales{Fp8Scaling::kBlock, sa.as<float>(), sb.as<float>()}};
  for (DeviceBuffer* buf : {&sam4, &sam3}) {
    const int64_t ld = buf == &sam4 ? rows + 4 : rows + 3;
    std::vector<float> hm(kb * ld, std::nanf(""));
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < kb; ++j) hm[j * ld + i] = hs[i * kb + j];
    WEFT_CUDA_CHECK(cudaMemcpyAsync(buf->p, hm.data(), buf->bytes, cudaMemcpyHostToDevice, s));
    Fp8Scales m_major{Fp8Scaling::kBlock, buf->as<float>(), sb.as<float>()};
    m_major.a_m_stride = ld;
    const Plan plan = grouped_gemm_fp8_plan(groups, rows, n, k, Fp8Type::kE4M3, m_major, DType::kBF16);
    WEFT_EXPECT((plan.path.find("staged") != std::string::npos) == (ld % 4 == 0),
                "M-major scales, stride " << ld << ": plan " << describe(plan));
    layouts.push_back(m_major);
  }
  for (const Fp8Scales& scales : layouts)
    for (DType out : {DType::kBF16, DType::kFP32}) {
      const int64_t es = out == DType::kFP32 ? 4 : 2;
      const std::string layout =
          scales.a_m_stride ? "M-major, stride " + std::to_string(scales.a_m_stride) : "row-major";
      WEFT_CUDA_CHECK(cudaMemsetAsync(c.p, 0xff, c.bytes, s));
      WEFT_CUDA_CHECK(cudaMemsetAsync(ref.p, 0xff, ref.bytes, s));
      grouped_gemm_fp8(a.p, b.p, c.p, ge.as<int32_t>(), groups, rows, n, k, Fp8Type::kE4M3, scales, out, s);
      for (int g = 0; g < groups; ++g) {
        const int64_t begin = g ? ends[g - 1] : 0, m = ends[g] - begin;
        if (m == 0) continue;
        gemm_fp8(a.as<uint8_t>() + begin * k, b.as<uint8_t>() + g * n * k, ref.as<char>() + begin * n * es, m,
                 n, k, Fp8Type::kE4M3,
                 Fp8Scales{Fp8Scaling::kBlock, sa.as<float>() + begin * kb, sb.as<float>() + g * nb * kb},
                 out, s);
      }
      std::vector<uint8_t> hc(rows * n * es), hr(rows * n * es);
      WEFT_CUDA_CHECK(cudaMemcpyAsync(hc.data(), c.p, hc.size(), cudaMemcpyDeviceToHost, s));
      WEFT_CUDA_CHECK(cudaMemcpyAsync(hr.data(), ref.p, hr.size(), cudaMemcpyDeviceToHost, s));
      WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
      const size_t used = size_t(ends.back()) * n * es;
      WEFT_EXPECT(std::memcmp(hc.data(), hr.data(), used) == 0,
                  (out == DType::kFP32 ? "f32" : "bf16")
                      << ", A's scales " << layout << ": the grouped GEMM's rows differ from gemm_fp8's");
      bool untouched = true;
      for (size_t i = used; i < hc.size(); ++i) untouched &= hc[i] == 0xff;
      WEFT_EXPECT(untouched, "A's scales " << layout << ": rows past the last group's end were written");
    }
}

WEFT_GPU_TEST_ONE_GPU(grouped_gemm_fp8_matches_gemm_fp8_per_group) {
  Rank& rank = ctx.comm().local(0);
  WEFT_CUDA_CHECK(cudaSetDevice(rank.device()));
  for (int64_t n : {int64_t(256), int64_t(192)}) grouped_fp8_case(rank, n);
  const cudaStream_t s = rank.stream();
  const int groups = 3;
  const int64_t n = 256, k = 400, rows = 512, nb = n / 128;
  DeviceBuffer a(rows * k), b(groups * n * k), sa(rows * 4 * 4), sb(groups * nb * 4 * 4), ge(groups * 4),
      c(rows * n * 4);
  std::string e = error_of([&] {
    grouped_gemm_fp8(a.p, b.p, c.p, ge.as<int32_t>(), groups, 500, n, k, Fp8Type::kE4M3,
                     Fp8Scales{Fp8Scaling::kBlock, sa.as<float>(), sb.as<float>()}, DType::kBF16, s);
  });
  WEFT_EXPECT(e.find("multiple of 128") != std::string::npos, "rows = 500: got '" << e << "'");
  e = error_of([&] {
    grouped_gemm_fp8(a.p, b.p, c.p, nullptr, groups, rows, n, k, Fp8Type::kE4M3,
                     Fp8Scales{Fp8Scaling::kBlock, sa.as<float>(), sb.as<float>()}, DType::kBF16, s);
  });
  WEFT_EXPECT(e.find("group_end") != std::string::npos, "null group_end: got '" << e << "'");
  GemmOptions counted;  // the grouped FP8 GEMM's alone
  counted.group_rows = ge.as<int32_t>();
  e = error_of([&] {
    gemm_fp8(a.p, b.p, c.p, 128, n, k, Fp8Type::kE4M3,
             Fp8Scales{Fp8Scaling::kBlock, sa.as<float>(), sb.as<float>()}, DType::kBF16, s, counted);
  });
  WEFT_EXPECT(e.find("options.group_rows") != std::string::npos, "group_rows on gemm_fp8: got '" << e << "'");
  const Plan p =
      grouped_gemm_fp8_plan(groups, rows, n, k, Fp8Type::kE4M3, Fp8Scales{Fp8Scaling::kBlock}, DType::kBF16);
  WEFT_EXPECT(p.op == "grouped_gemm_fp8" && p.tiles.count == (rows / 128) * nb && p.blocks > 0,
              "plan: " << describe(p));
}

// options.group_rows (a low-latency dispatch's fixed groups, partly filled): groups of 256 rows each in a
// capacity of 1024, counting 0, 1, 130 and 256 rows. Every tile holding counted rows is computed whole (the
// bits of the same call without group_rows), every other tile left as it was.
WEFT_GPU_TEST_ONE_GPU(grouped_gemm_fp8_group_rows) {
  Rank& rank = ctx.comm().local(0);
  WEFT_CUDA_CHECK(cudaSetDevice(rank.device()));
  const cudaStream_t s = rank.stream();
  const int groups = 4;
  const int64_t n = 256, k = 400, span = 256, rows = groups * span, kb = (k + 127) / 128, nb = n / 128;
  const std::vector<int32_t> ends = {256, 512, 768, 1024}, counts = {0, 1, 130, 256};
  DeviceBuffer a(rows * k), b(groups * n * k), sa(rows * kb * 4), sb(groups * nb * kb * 4), ge(groups * 4),
      gr(groups * 4), c(rows * n * 2), ref(rows * n * 2);
  fill_fp8<false><<<264, 256, 0, s>>>(a.as<uint8_t>(), rows * k, 31);
  fill_fp8<false><<<264, 256, 0, s>>>(b.as<uint8_t>(), groups * n * k, 32);
  fill_scales<<<64, 256, 0, s>>>(sa.as<float>(), rows * kb, 33);
  fill_scales<<<64, 256, 0, s>>>(sb.as<float>(), groups * nb * kb, 34);
  WEFT_CUDA_CHECK(cudaGetLastError());
  WEFT_CUDA_CHECK(cudaMemcpyAsync(ge.p, ends.data(), groups * 4, cudaMemcpyHostToDevice, s));
  WEFT_CUDA_CHECK(cudaMemcpyAsync(gr.p, counts.data(), groups * 4, cudaMemcpyHostToDevice, s));
  WEFT_CUDA_CHECK(cudaMemsetAsync(c.p, 0xff, c.bytes, s));
  const Fp8Scales scales{Fp8Scaling::kBlock, sa.as<float>(), sb.as<float>()};
  grouped_gemm_fp8(a.p, b.p, ref.p, ge.as<int32_t>(), groups, rows, n, k, Fp8Type::kE4M3, scales,
                   DType::kBF16, s);
  GemmOptions o;
  o.group_rows = gr.as<int32_t>();
  grouped_gemm_fp8(a.p, b.p, c.p, ge.as<int32_t>(), groups, rows, n, k, Fp8Type::kE4M3, scales, DType::kBF16,
                   s, o);
  std::vector<uint8_t> hc(c.bytes), hr(ref.bytes);
  WEFT_CUDA_CHECK(cudaMemcpyAsync(hc.data(), c.p, hc.size(), cudaMemcpyDeviceToHost, s));
  WEFT_CUDA_CHECK(cudaMemcpyAsync(hr.data(), ref.p, hr.size(), cudaMemcpyDeviceToHost, s));
  WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
  const size_t tile_bytes = 128 * n * 2;
  int64_t bad_live = 0, bad_dead = 0;
  for (int e = 0; e < groups; ++e)
    for (int64_t t = 0; t < span / 128; ++t) {
      const size_t at = size_t(e * span + t * 128) * n * 2;
      if (t * 128 < counts[e]) {
        bad_live += std::memcmp(hc.data() + at, hr.data() + at, tile_bytes) != 0;
      } else {
        bool poisoned = true;
        for (size_t i = 0; i < tile_bytes; ++i) poisoned &= hc[at + i] == 0xff;
        bad_dead += !poisoned;
      }
    }
  WEFT_EXPECT(bad_live == 0,
              bad_live << " tiles holding counted rows differ from the call without group_rows");
  WEFT_EXPECT(bad_dead == 0, bad_dead << " tiles past the counts were written");
}
