// GPU tests of the fused tensor-parallel ops (all_gather_matmul, matmul_reduce_scatter, matmul_all_reduce)
// against an fp64 host reference built from the same bf16 inputs on every process. Outputs are poisoned (NaN)
// before each call. Both paths run: the fused kernel (forced, also below the size where kAuto would pick it)
// and the sequential fallback. Shapes include partial tiles in M, N and K and shards that straddle tiles.
#include <cuda_bf16.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

#include "harness.hpp"
#include "weft/ops/fused.hpp"

using namespace weft;
using weft::test::TestContext;

namespace {

struct Mat {  // bf16 values in [-1, 1] and their doubles
  std::vector<__nv_bfloat16> h;
  std::vector<double> d;
};
Mat make(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  Mat m;
  m.h.resize(n);
  m.d.resize(n);
  for (size_t i = 0; i < n; ++i) {
    m.h[i] = __float2bfloat16_rn(u(rng));
    m.d[i] = __bfloat162float(m.h[i]);
  }
  return m;
}

// ref[i][j] += sum_k a[i][k] * b(k, j) for rows [r0, r1) of a [*, K]; b is [N,K] (nk) or [K,N].
void gemm_ref(std::vector<double>& ref, const Mat& a, const Mat& b, int64_t r0, int64_t r1, int64_t n,
              int64_t k, bool nk) {
  for (int64_t i = r0; i < r1; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (int64_t q = 0; q < k; ++q) s += a.d[i * k + q] * b.d[nk ? j * k + q : q * n + j];
      ref[(i - r0) * n + j] += s;
    }
}

struct Buf {  // per local rank: symmetric or cudaMalloc
  Communicator& c;
  bool sym;
  SymmetricBuffer s;
  std::vector<char*> p;
  Buf(Communicator& comm, uint64_t bytes, bool symmetric) : c(comm), sym(symmetric) {
    if (sym) {
      s = c.alloc(bytes);
      p = s.local;
      return;
    }
    for (int i = 0; i < c.num_local(); ++i) {
      char* x = nullptr;
      WEFT_CUDA_CHECK(cudaSetDevice(c.local(i).device()));
      WEFT_CUDA_CHECK(cudaMalloc(&x, bytes));
      p.push_back(x);
    }
  }
  ~Buf() {
    if (sym) {
      c.free(s);
      return;
    }
    for (int i = 0; i < c.num_local(); ++i) {
      cudaSetDevice(c.local(i).device());
      cudaFree(p[i]);
    }
  }
};

void put(Communicator& c, int i, void* dst, const void* src, size_t bytes) {
  WEFT_CUDA_CHECK(cudaSetDevice(c.local(i).device()));
  WEFT_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}
void poison(Communicator& c, int i, void* dst, size_t bytes) {
  WEFT_CUDA_CHECK(cudaSetDevice(c.local(i).device()));
  WEFT_CUDA_CHECK(cudaMemset(dst, 0xff, bytes));
}
std::vector<__nv_bfloat16> get(Communicator& c, int i, const void* src, size_t count) {
  std::vector<__nv_bfloat16> v(count);
  WEFT_CUDA_CHECK(cudaSetDevice(c.local(i).device()));
  WEFT_CUDA_CHECK(cudaMemcpy(v.data(), src, count * 2, cudaMemcpyDeviceToHost));
  return v;
}
std::string compare(const std::vector<__nv_bfloat16>& got, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double g = __bfloat162float(got[i]);
    if (std::isnan(g)) return "NaN at element " + std::to_string(i) + " (not written?)";
    num += (g - ref[i]) * (g - ref[i]);
    den += ref[i] * ref[i];
  }
  const double err = std::sqrt(num / std::max(den, 1e-30));
  return err > 1e-2 ? "relative error " + std::to_string(err) : std::string();
}

struct Shape {
  int64_t shard, n, k;  // M = W * shard
};
// M / W: one tile, partial tiles (200, 520: not multiples of 64), tiles straddling shards (192), tiny.
const Shape kShapes[] = {{128, 256, 256}, {200, 264, 136}, {192, 264, 136}, {520, 384, 192}, {64, 8, 8}};
const FusedOptions::Mode kModes[] = {FusedOptions::Mode::kFused, FusedOptions::Mode::kSequential};
const char* mode_name(FusedOptions::Mode m) {
  return m == FusedOptions::Mode::kFused ? "fused" : "sequential";
}

enum class Op { kAG, kRS, kAR };

void run_case(TestContext& ctx, Op op, Shape s, BLayout layout, FusedOptions::Mode mode, bool sym,
              uint64_t seed) {
  Communicator& c = ctx.comm();
  const int W = c.world();
  const int64_t m = W * s.shard, n = s.n, k = s.k;
  const bool nk = layout == BLayout::kNK;
  std::vector<Mat> a(W), b(W);  // AG: a[0] is the full A; RS/AR: rank r's A and B
  for (int r = 0; r < W; ++r) {
    if (op != Op::kAG || r == 0) a[r] = make(size_t(m * k), seed * 131 + r);
    b[r] = make(size_t(n * k), seed * 137 + 1000 + r);
  }
  const int64_t out_rows = op == Op::kRS ? s.shard : m;
  Buf A(c, (op == Op::kAG ? s.shard : m) * k * 2, sym), B(c, n * k * 2, false), out(c, out_rows * n * 2, sym),
      gathered(c, m * k * 2, sym);
  FusedOptions o;
  o.mode = mode;
  o.comm_blocks = int(seed % 3) * 4;  // 0 (auto), 4, 8
  if (std::getenv("WEFT_TEST_VERBOSE"))
    std::fprintf(stderr, "  case op %d M=%lld N=%lld K=%lld %s %s %s comm_blocks %d\n", int(op), (long long)m,
                 (long long)n, (long long)k, nk ? "NK" : "KN", mode_name(mode), sym ? "sym" : "device",
                 o.comm_blocks);
  for (int i = 0; i < c.num_local(); ++i) {
    const int r = c.local(i).rank();
    const __nv_bfloat16* a_src = op == Op::kAG ? a[0].h.data() + r * s.shard * k : a[r].h.data();
    put(c, i, A.p[i], a_src, (op == Op::kAG ? s.shard : m) * k * 2);
    put(c, i, B.p[i], b[r].h.data(), n * k * 2);
    poison(c, i, out.p[i], out_rows * n * 2);
    poison(c, i, gathered.p[i], m * k * 2);
  }
  c.host_barrier();
  // The fused RS / AR kernels need M / W to be a multiple of 64; forced, other shapes must be refused
  // with that reason (before anything is launched) and kAuto must fall back.
  if (op != Op::kAG && s.shard % 64 != 0 && mode == FusedOptions::Mode::kFused) {
    for (int i = 0; i < c.num_local(); ++i) {
      std::string msg;
      try {
        if (op == Op::kRS)
          matmul_reduce_scatter(c, c.local(i), A.p[i], B.p[i], out.p[i], m, n, k, layout, nullptr, o);
        else
          matmul_all_reduce(c, c.local(i), A.p[i], B.p[i], out.p[i], m, n, k, layout, nullptr, o);
      } catch (const Error& e) {
        msg = e.what();
      }
      WEFT_EXPECT(msg.find("not a multiple of 64") != std::string::npos, "forced fused: got '" << msg << "'");
    }
    o.mode = FusedOptions::Mode::kAuto;
    o.min_fused_m = 0;
    mode = FusedOptions::Mode::kSequential;  // what kAuto must pick here
  }
  for (int i = 0; i < c.num_local(); ++i) {
    Rank& r = c.local(i);
    FusedPath path;
    if (op == Op::kAG)
      path = all_gather_matmul(c, r, A.p[i], B.p[i], out.p[i], gathered.p[i], m, n, k, layout, nullptr, o);
    else if (op == Op::kRS)
      path = matmul_reduce_scatter(c, r, A.p[i], B.p[i], out.p[i], m, n, k, layout, nullptr, o);
    else
      path = matmul_all_reduce(c, r, A.p[i], B.p[i], out.p[i], m, n, k, layout, nullptr, o);
    WEFT_EXPECT((path == FusedPath::kFused) == (mode == FusedOptions::Mode::kFused),
                "path " << fused_path_name(path));
  }
  c.synchronize();
  for (int i = 0; i < c.num_local(); ++i) {
    const int r = c.local(i).rank();
    std::vector<double> ref(size_t(out_rows * n), 0.0);
    if (op == Op::kAG) {
      gemm_ref(ref, a[0], b[r], 0, m, n, k, nk);
      const auto g = get(c, i, gathered.p[i], m * k);
      WEFT_EXPECT(std::memcmp(g.data(), a[0].h.data(), m * k * 2) == 0, "gathered A differs, rank " << r);
    } else {
      for (int q = 0; q < W; ++q)
        gemm_ref(ref, a[q], b[q], op == Op::kRS ? r * s.shard : 0, op == Op::kRS ? (r + 1) * s.shard : m, n,
                 k, nk);
    }
    const std::string err = compare(get(c, i, out.p[i], out_rows * n), ref);
    WEFT_EXPECT(err.empty(), (op == Op::kAG   ? "all_gather_matmul"
                              : op == Op::kRS ? "matmul_reduce_scatter"
                                              : "matmul_all_reduce")
                                 << " M=" << m << " N=" << n << " K=" << k << (nk ? " [N,K] B" : " [K,N] B")
                                 << " " << mode_name(mode) << (sym ? " symmetric" : " device") << " rank "
                                 << r << ": " << err);
  }
  c.host_barrier();
}

void run_all(TestContext& ctx, Op op) {
  uint64_t seed = 1 + 100 * int(op);
  for (const Shape& s : kShapes)
    for (BLayout layout : {BLayout::kNK, BLayout::kKN})
      for (FusedOptions::Mode mode : kModes)
        for (bool sym : {true, false}) {
          if (ctx.quick && (layout == BLayout::kKN) != (s.n % 256 != 0)) continue;
          run_case(ctx, op, s, layout, mode, sym, seed++);
        }
}

}  // namespace

WEFT_GPU_TEST(all_gather_matmul_matches_fp64_reference) {
  run_all(ctx, Op::kAG);
}
WEFT_GPU_TEST(matmul_reduce_scatter_matches_fp64_reference) {
  run_all(ctx, Op::kRS);
}
WEFT_GPU_TEST(matmul_all_reduce_matches_fp64_reference) {
  run_all(ctx, Op::kAR);
}
// Repeated calls: the per-call epochs and barriers must carry over without resets (and mixed with the
// collectives, which share barrier slots with the fused kernels).
WEFT_GPU_TEST(fused_ops_back_to_back) {
  for (int rep = 0; rep < (ctx.quick ? 3 : 10); ++rep) {
    run_case(ctx, Op::kAG, kShapes[1], BLayout::kNK, FusedOptions::Mode::kFused, rep % 2 == 0, 500 + rep);
    run_case(ctx, Op::kRS, kShapes[2], BLayout::kKN, FusedOptions::Mode::kFused, true, 600 + rep);
    run_case(ctx, Op::kAR, kShapes[0], BLayout::kNK, FusedOptions::Mode::kFused, false, 700 + rep);
  }
}
