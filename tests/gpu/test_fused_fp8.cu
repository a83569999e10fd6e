// GPU tests of the FP8 tensor-parallel ops (weft::all_gather_scaled_matmul, scaled_matmul_reduce_scatter,
// scaled_matmul_all_reduce): random FP8 operands (e4m3, e5m2) and fp32 scales per tensor, per row and per
// 1 x 128 / 128 x 128 block, against an fp64 host reference of the decoded, scaled operands; outputs poisoned
// first; the fused kernel and the sequential path, shards straddling tiles and K past whole 128-blocks, an
// all-reduce with M not divisible by W; the plan agrees with the call; what each refuses.
// Pass: relative Frobenius error <= 1e-2 (bf16 out), no NaN.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "harness.hpp"
#include "weft/ops/fused.hpp"

using namespace weft;
using weft::test::poison;
using weft::test::RankBuffers;
using weft::test::TestContext;
using weft::test::upload;

namespace {

using Mode = FusedOptions::Mode;

uint8_t encode(float v, Fp8Type t) {
  return t == Fp8Type::kE5M2 ? __nv_fp8_e5m2(v).__x : __nv_fp8_e4m3(v).__x;
}
double decode(uint8_t x, Fp8Type t) {
  if (t == Fp8Type::kE5M2) {
    __nv_fp8_e5m2 v;
    v.__x = x;
    return float(v);
  }
  __nv_fp8_e4m3 v;
  v.__x = x;
  return float(v);
}

struct Case {
  int64_t shard, n, k;  // M = W * shard
  Fp8Scaling scaling;
  Fp8Type type = Fp8Type::kE4M3;
};

// A's rows and B's rows as FP8 bytes and their decoded, scaled doubles.
struct Operand {
  std::vector<uint8_t> bytes;
  std::vector<float> scales;
  std::vector<double> value;  // decode(bytes) x scale
};
// rows x k FP8 values in [-4, 4] (e4m3) or [-32, 32] (e5m2) and positive scales in [2^-4, 2^-2): one
// (kTensor), per row (kRowCol A and B), per row and 128 of K (kBlock A) or per 128 x 128 block (kBlock B).
Operand make(int64_t rows, int64_t k, const Case& c, bool is_b, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  const int64_t groups = (k + kFp8ScaleBlock - 1) / kFp8ScaleBlock;
  const bool block = c.scaling == Fp8Scaling::kBlock, tensor = c.scaling == Fp8Scaling::kTensor;
  const int64_t count = tensor   ? 1
                        : !block ? rows
                        : is_b   ? (rows + kFp8ScaleBlock - 1) / kFp8ScaleBlock * groups
                                 : rows * groups;
  Operand o;
  o.scales.resize(count);
  for (float& s : o.scales) s = std::exp2(-3.f + u(rng));
  o.bytes.resize(rows * k);
  o.value.resize(rows * k);
  const float range = c.type == Fp8Type::kE5M2 ? 32.f : 4.f;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t q = 0; q < k; ++q) {
      const int64_t i = r * k + q;
      o.bytes[i] = encode(u(rng) * range, c.type);
      const float s = tensor   ? o.scales[0]
                      : !block ? o.scales[r]
                      : is_b   ? o.scales[(r / kFp8ScaleBlock) * groups + q / kFp8ScaleBlock]
                               : o.scales[r * groups + q / kFp8ScaleBlock];
      o.value[i] = decode(o.bytes[i], c.type) * s;
    }
  return o;
}

std::string compare(const std::vector<__nv_bfloat16>& got, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double g = __bfloat162float(got[i]);
    if (!std::isfinite(g)) return "non-finite value at element " + std::to_string(i) + " (not written?)";
    num += (g - ref[i]) * (g - ref[i]);
    den += ref[i] * ref[i];
  }
  const double err = std::sqrt(num / std::max(den, 1e-30));
  return err > 1e-2 ? "relative error " + std::to_string(err) : std::string();
}

// The operands on every local rank: a_of(r) gives rank r's a bytes and a scales (a_bytes, sa_bytes of them),
// b[r] its b; out poisoned.
struct Operands {
  RankBuffers a, sa, b, sb, out;
  template <class AOf>
  Operands(Communicator& c, int64_t a_bytes, int64_t sa_bytes, const std::vector<Operand>& bs,
           int64_t out_bytes, AOf a_of)
      : a(c, a_bytes, false),
        sa(c, sa_bytes, false),
        b(c, bs[0].bytes.size(), false),
        sb(c, bs[0].scales.size() * 4, false),
        out(c, out_bytes, false) {
    for (int i = 0; i < c.num_local(); ++i) {
      const int r = c.local(i).rank();
      const auto [a_host, sa_host] = a_of(r);
      upload(c, i, a.ptr[i], a_host, a_bytes);
      upload(c, i, sa.ptr[i], sa_host, sa_bytes);
      upload(c, i, b.ptr[i], bs[r].bytes.data(), bs[r].bytes.size());
      upload(c, i, sb.ptr[i], bs[r].scales.data(), bs[r].scales.size() * 4);
      poison(c, i, out.ptr[i], out_bytes);
    }
    c.host_barrier();
  }
  const float* scale_a(int i) const { return reinterpret_cast<const float*>(sa.ptr[i]); }
  const float* scale_b(int i) const { return reinterpret_cast<const float*>(sb.ptr[i]); }
};

// The call on every local rank after its plan: call(i, plan_only) returns the plan (plan_only) or runs the
// call and returns its path; the path must be the planned one (and `want`, unless kAuto), the workspace no
// larger.
template <class Call>
void run_planned(Communicator& c, const std::string& what, Mode mode, Call&& call) {
  for (int i = 0; i < c.num_local(); ++i) {
    const Plan plan = std::get<Plan>(call(i, true));
    const weft::test::WorkspaceSizes before = weft::test::workspace_sizes(c, plan);
    const FusedPath path = std::get<FusedPath>(call(i, false));
    WEFT_EXPECT(plan.path.rfind(fused_path_name(path), 0) == 0,
                what << ": the plan says '" << describe(plan) << "', the call ran " << fused_path_name(path));
    if (mode != Mode::kAuto)
      WEFT_EXPECT(path == (mode == Mode::kFused ? FusedPath::kFused : FusedPath::kSequential),
                  what << ": ran " << fused_path_name(path));
    const std::string kept = weft::test::check_call_kept_plan(c, plan, before);
    WEFT_EXPECT(kept.empty(), what << ": " << kept);
  }
  c.synchronize();
}

// Every local rank's out ([rows, n] bf16) against ref_of(r, ref) (which fills ref, [rows, n]).
template <class RefOf>
void check_out(Communicator& c, const RankBuffers& out, int64_t rows, int64_t n, const std::string& what,
               RefOf ref_of) {
  for (int i = 0; i < c.num_local(); ++i) {
    const int r = c.local(i).rank();
    std::vector<double> ref(size_t(rows * n), 0.0);
    ref_of(r, ref);
    std::vector<__nv_bfloat16> got(size_t(rows * n));
    weft::test::download(c, i, got.data(), out.ptr[i], rows * n * 2);
    const std::string err = compare(got, ref);
    WEFT_EXPECT(err.empty(), what << " rank " << r << ": " << err);
  }
  c.host_barrier();
}

// out[row][j]: the sum over q of as[q][row] . bs[q][j] (their values), rows [0, rows).
void product(std::vector<double>& out, const std::vector<const Operand*>& as,
             const std::vector<const Operand*>& bs, int64_t rows, int64_t n, int64_t k) {
  weft::test::parallel_for(
      size_t(rows),
      [&](size_t i0, size_t i1) {
        for (size_t row = i0; row < i1; ++row)
          for (int64_t j = 0; j < n; ++j) {
            double s = 0;
            for (size_t q = 0; q < as.size(); ++q)
              for (int64_t t = 0; t < k; ++t) s += as[q]->value[row * k + t] * bs[q]->value[j * k + t];
            out[row * n + j] = s;
          }
      },
      8);
}

void run_case(TestContext& ctx, const Case& cs, Mode mode, uint64_t seed) {
  Communicator& c = ctx.comm();
  const int W = c.world();
  const int64_t m = W * cs.shard, n = cs.n, k = cs.k;
  const Operand a = make(m, k, cs, false, seed * 131);
  std::vector<Operand> b(W);
  for (int r = 0; r < W; ++r) b[r] = make(n, k, cs, true, seed * 137 + 1000 + r);
  const int64_t a_cols = a.scales.size() / m;  // scales a row of A
  const Operands x(c, cs.shard * k, cs.shard * a_cols * 4, b, m * n * 2, [&](int r) {
    return std::pair{a.bytes.data() + r * cs.shard * k, a.scales.data() + r * cs.shard * a_cols};
  });
  FusedOptions o;
  o.mode = mode;
  o.comm_blocks = int(seed % 2) * 4;  // 0 (auto) or 4
  if (o.comm_blocks >= c.local(0).sm_budget()) o.comm_blocks = 0;
  const std::string what =
      "all_gather_scaled_matmul M=" + std::to_string(m) + " N=" + std::to_string(n) +
      " K=" + std::to_string(k) + (cs.scaling == Fp8Scaling::kBlock ? " block" : " row") +
      (cs.type == Fp8Type::kE5M2 ? " e5m2 " : " e4m3 ") + (mode == Mode::kFused ? "fused" : "sequential");
  run_planned(c, what, mode, [&](int i, bool plan_only) -> std::variant<Plan, FusedPath> {
    Rank& r = c.local(i);
    if (plan_only)
      return all_gather_scaled_matmul_plan(c, r, x.a.ptr[i], x.scale_a(i), x.b.ptr[i], x.scale_b(i),
                                           x.out.ptr[i], m, n, k, cs.type, cs.scaling, nullptr, o);
    return all_gather_scaled_matmul(c, r, x.a.ptr[i], x.scale_a(i), x.b.ptr[i], x.scale_b(i), x.out.ptr[i], m,
                                    n, k, cs.type, cs.scaling, nullptr, o);
  });
  check_out(c, x.out, m, n, what,
            [&](int r, std::vector<double>& ref) { product(ref, {&a}, {&b[r]}, m, n, k); });
}

// scaled_matmul_reduce_scatter (all_reduce false) / scaled_matmul_all_reduce: rank r's a_r [M, K] and b_r
// [N, K] with scales of their own; the sum over r of the scaled products, this rank's rows or all.
void run_reduce_case(TestContext& ctx, const Case& cs, int64_t m, bool all_reduce, Mode mode, uint64_t seed) {
  Communicator& c = ctx.comm();
  const int W = c.world();
  const int64_t n = cs.n, k = cs.k, rows = all_reduce ? m : m / W;
  std::vector<Operand> a(W), b(W);
  for (int r = 0; r < W; ++r) {
    a[r] = make(m, k, cs, false, seed * 131 + r);
    b[r] = make(n, k, cs, true, seed * 137 + 1000 + r);
  }
  const Operands x(c, m * k, a[0].scales.size() * 4, b, rows * n * 2, [&](int r) {
    return std::pair{a[r].bytes.data(), a[r].scales.data()};
  });
  FusedOptions o;
  o.mode = mode;
  const char* scaling = cs.scaling == Fp8Scaling::kBlock    ? " block"
                        : cs.scaling == Fp8Scaling::kRowCol ? " row"
                                                            : " tensor";
  const std::string what =
      std::string(all_reduce ? "scaled_matmul_all_reduce" : "scaled_matmul_reduce_scatter") +
      " M=" + std::to_string(m) + " N=" + std::to_string(n) + " K=" + std::to_string(k) + scaling +
      (mode == Mode::kFused  ? " fused"
       : mode == Mode::kAuto ? " auto"
                             : " sequential");
  run_planned(c, what, mode, [&](int i, bool plan_only) -> std::variant<Plan, FusedPath> {
    Rank& r = c.local(i);
    if (plan_only)
      return scaled_matmul_reduce_plan(c, r, x.a.ptr[i], x.scale_a(i), x.b.ptr[i], x.scale_b(i), x.out.ptr[i],
                                       m, n, k, cs.type, cs.scaling, all_reduce, nullptr, o);
    const auto op = all_reduce ? &scaled_matmul_all_reduce : &scaled_matmul_reduce_scatter;
    return op(c, r, x.a.ptr[i], x.scale_a(i), x.b.ptr[i], x.scale_b(i), x.out.ptr[i], m, n, k, cs.type,
              cs.scaling, nullptr, o);
  });
  std::vector<const Operand*> as, bs;
  for (int q = 0; q < W; ++q) {
    as.push_back(&a[q]);
    bs.push_back(&b[q]);
  }
  std::vector<double> sum(size_t(m * n));  // every rank's rows, made once
  product(sum, as, bs, m, n, k);
  check_out(c, x.out, rows, n, what, [&](int r, std::vector<double>& ref) {
    const int64_t first = all_reduce ? 0 : r * rows * n;
    std::copy(sum.begin() + first, sum.begin() + first + rows * n, ref.begin());
  });
}

// What a call refuses, with its reason, before it launches anything.
void expect_refusal(TestContext& ctx, Fp8Scaling scaling, int64_t k, Mode mode, const std::string& reason) {
  Communicator& c = ctx.comm();
  const int W = c.world();
  const int64_t shard = 128, m = W * shard, n = 128, kk = std::max<int64_t>(k, 16);
  RankBuffers A(c, shard * kk, false), S(c, m * kk * 4, false), B(c, n * kk, false), out(c, m * n * 2, false);
  FusedOptions o;
  o.mode = mode;
  for (int i = 0; i < c.num_local(); ++i) {
    std::string msg;
    try {
      const auto* s = reinterpret_cast<const float*>(S.ptr[i]);
      all_gather_scaled_matmul(c, c.local(i), A.ptr[i], s, B.ptr[i], s, out.ptr[i], m, n, k, Fp8Type::kE4M3,
                               scaling, nullptr, o);
    } catch (const Error& e) {
      msg = e.what();
    }
    WEFT_EXPECT(msg.find(reason) != std::string::npos, "expected '" << reason << "', got '" << msg << "'");
  }
}

}  // namespace

WEFT_GPU_TEST(all_gather_scaled_matmul_matches_fp64_reference) {
  // Shards of one tile, of partial tiles straddling two (200), K past whole 128-blocks (272, 528).
  const Case cases[] = {{128, 256, 256, Fp8Scaling::kRowCol},
                        {200, 264, 272, Fp8Scaling::kBlock},
                        {200, 136, 528, Fp8Scaling::kRowCol, Fp8Type::kE5M2},
                        {384, 264, 144, Fp8Scaling::kBlock}};
  uint64_t seed = 1;
  for (const Case& cs : cases)
    for (Mode mode : {Mode::kFused, Mode::kSequential}) {
      if (ctx.quick && seed % 2 == 0 && cs.shard != 200) {
        ++seed;
        continue;
      }
      run_case(ctx, cs, mode, seed++);
    }
}

WEFT_GPU_TEST(all_gather_scaled_matmul_refusals) {
  expect_refusal(ctx, Fp8Scaling::kTensor, 256, Mode::kAuto, "per-tensor scales are refused");
  expect_refusal(ctx, Fp8Scaling::kRowCol, 24, Mode::kAuto, "must be a multiple of 16");
  expect_refusal(ctx, Fp8Scaling::kRowCol, 256, Mode::kPipelined, "has no copy-engine pipeline");
}

WEFT_GPU_TEST(scaled_matmul_reduce_matches_fp64_reference) {
  const int W = ctx.comm().world();
  // M / W of whole 64-row halves (the fused kernel), partial tiles in N and K; every scaling; then an
  // all-reduce with M not divisible by W (the sequential path, under kAuto).
  const Case cases[] = {{0, 256, 256, Fp8Scaling::kTensor},
                        {0, 264, 272, Fp8Scaling::kBlock},
                        {0, 136, 528, Fp8Scaling::kRowCol, Fp8Type::kE5M2}};
  uint64_t seed = 50;
  for (const Case& cs : cases)
    for (bool all_reduce : {false, true}) {
      const int64_t m = W * (seed % 2 ? 128 : 192);
      run_reduce_case(ctx, cs, m, all_reduce, Mode::kFused, seed++);
      if (!ctx.quick) run_reduce_case(ctx, cs, m, all_reduce, Mode::kSequential, seed++);
    }
  run_reduce_case(ctx, {0, 136, 144, Fp8Scaling::kRowCol}, 3 * W + 1, true, Mode::kAuto, seed++);
  // Past the all-reduce's 4 MiB (its push flow takes the shared workspace): the product must not sit there.
  run_reduce_case(ctx, {0, 2048, 128, Fp8Scaling::kRowCol}, 1025, true, Mode::kAuto, seed++);
}

WEFT_GPU_TEST(scaled_matmul_reduce_refusals) {
  Communicator& c = ctx.comm();
  const int W = c.world();
  const int64_t m = 64 * W, n = 128, k = 128;
  RankBuffers A(c, m * k, false), S(c, m * 8, false), B(c, n * k, false), out(c, m * n * 2, false);
  const auto expect = [&](int64_t kk, FusedOptions o, int64_t mm, const std::string& reason) {
    for (int i = 0; i < c.num_local(); ++i) {
      std::string msg;
      try {
        const auto* s = reinterpret_cast<const float*>(S.ptr[i]);
        scaled_matmul_reduce_scatter(c, c.local(i), A.ptr[i], s, B.ptr[i], s, out.ptr[i], mm, n, kk,
                                     Fp8Type::kE4M3, Fp8Scaling::kTensor, nullptr, o);
      } catch (const Error& e) {
        msg = e.what();
      }
      WEFT_EXPECT(msg.find(reason) != std::string::npos, "expected '" << reason << "', got '" << msg << "'");
    }
  };
  FusedOptions o;
  expect(120, o, m, "must be a multiple of 16");
  expect(k, o, m + 1, "must be divisible by the world size");
  o.partials = FusedOptions::Partials::kAddedAtOwner;
  expect(k, o, m, "kStaged only");
  o.partials = FusedOptions::Partials::kStaged;
  o.mode = Mode::kPipelined;
  expect(k, o, m, "has no copy-engine pipeline");
}
