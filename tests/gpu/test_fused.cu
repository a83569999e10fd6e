// GPU tests of the fused tensor-parallel ops (all_gather_matmul, matmul_reduce_scatter, matmul_all_reduce)
// against an fp64 host reference built from the same bf16 inputs on every process. Outputs are poisoned (NaN)
// before each call. Both paths run: the fused kernel (forced, also below the size where kAuto would pick it)
// and the sequential fallback. Shapes include partial tiles in M, N and K and shards that straddle tiles.
#include <cuda_bf16.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
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
  weft::test::parallel_for(size_t(r1 - r0) * n / 64 + 1, [&](size_t p0, size_t p1) {
    for (int64_t e = int64_t(p0) * 64; e < std::min(int64_t(p1) * 64, (r1 - r0) * n); ++e) {
      const int64_t i = r0 + e / n, j = e % n;
      double s = 0;
      for (int64_t q = 0; q < k; ++q) s += a.d[i * k + q] * b.d[nk ? j * k + q : q * n + j];
      ref[e] += s;
    }
  });
}

using weft::test::poison;
using weft::test::RankBuffers;
using weft::test::upload;

std::vector<__nv_bfloat16> get(Communicator& c, int i, const void* src, size_t count) {
  std::vector<__nv_bfloat16> v(count);
  weft::test::download(c, i, v.data(), src, count * 2);
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
// M / W: one tile, partial tiles (200, 520: not multiples of 64), tiles straddling shards (192), tiny, and
// three tile rows per shard, partial tiles at N = 120. all_gather_matmul's fused kernel and the RS / AR
// summed in the epilogue take 128 x 256 tiles, or 128 x 128 (options.tile_n): the cases alternate.
const Shape kShapes[] = {{128, 256, 256}, {200, 264, 136}, {192, 264, 136}, {520, 384, 192},
                         {64, 8, 8},      {384, 264, 136}, {200, 120, 136}};
using Mode = FusedOptions::Mode;
const Mode kModes[] = {Mode::kFused, Mode::kPipelined, Mode::kSequential};
const char* mode_name(Mode m) {
  return m == Mode::kFused       ? "fused"
         : m == Mode::kPipelined ? "pipelined"
         : m == Mode::kAuto      ? "auto"
                                 : "sequential";
}
FusedPath path_of(Mode m) {
  return m == Mode::kFused       ? FusedPath::kFused
         : m == Mode::kPipelined ? FusedPath::kPipelined
                                 : FusedPath::kSequential;
}

enum class Op { kAG, kRS, kAR };

// One CUDA graph per local rank of what issue(i) enqueues on rank i's stream.
template <class Issue>
std::vector<cudaGraphExec_t> capture_per_rank(Communicator& c, Issue&& issue) {
  std::vector<cudaGraphExec_t> exec(c.num_local());
  for (int i = 0; i < c.num_local(); ++i) {
    WEFT_CUDA_CHECK(cudaSetDevice(c.local(i).device()));
    cudaGraph_t g;
    WEFT_CUDA_CHECK(cudaStreamBeginCapture(c.local(i).stream(), cudaStreamCaptureModeThreadLocal));
    issue(i);
    WEFT_CUDA_CHECK(cudaStreamEndCapture(c.local(i).stream(), &g));
    WEFT_CUDA_CHECK(cudaGraphInstantiate(&exec[i], g, 0));
    WEFT_CUDA_CHECK(cudaGraphDestroy(g));
  }
  return exec;
}

// RS / AR: how the fused kernel sums the partials (ignored on the other paths and by AG). A case names it
// with the output tile's width: the summed-in-epilogue way and kAuto take both.
struct Summing {
  FusedOptions::Partials partials = FusedOptions::Partials::kStaged;
  int tile_n = 0;  // FusedOptions::tile_n: 0 (auto, 256) or 128
};
using Partials = FusedOptions::Partials;

void run_case(TestContext& ctx, Op op, Shape s, BLayout layout, Mode mode, bool sym, uint64_t seed,
              Summing summing = {}) {
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
  RankBuffers A(c, (op == Op::kAG ? s.shard : m) * k * 2, sym), B(c, n * k * 2, false),
      out(c, out_rows * n * 2, sym), gathered(c, m * k * 2, sym);
  FusedOptions o;
  o.mode = mode;
  o.comm_blocks = int(seed % 3) * 4;                               // 0 (auto), 4, 8
  if (o.comm_blocks >= c.local(0).sm_budget()) o.comm_blocks = 0;  // a small --sm-budget: auto (at least 2)
  o.pipeline_pieces = int(seed / 3 % 4);                           // 0 (auto), 1, 2, 3
  // AG's fused kernel: 128 x 128 or auto (256), both outs each; RS / AR: the case's.
  o.tile_n = op == Op::kAG ? (seed / 2 % 2 ? 128 : 0) : summing.tile_n;
  // AG: the gathered A taken in every other case (without it the fused kernel skips the shard's copy into
  // this rank's own rows where no tile straddles two shards).
  const bool take_gathered = op == Op::kAG && seed % 2 == 0;
  // AG: the copy engine's gather in every other case (it runs where M / W is a multiple of 128, one rank a
  // GPU; elsewhere the communicator blocks).
  if (op == Op::kAG && seed / 4 % 2 == 0) o.gather = FusedOptions::Gather::kCopyEngine;
  if (op != Op::kAG) o.partials = summing.partials;
  // The staged way with the storers' wide ring (FusedOptions::store_ring 5) in every other such case.
  if (op != Op::kAG && o.partials == Partials::kStaged && seed / 6 % 2) o.store_ring = 5;
  const char* partials = op == Op::kAG                                ? ""
                         : o.partials == Partials::kAddedAtOwner      ? " added at owner"
                         : o.partials == Partials::kStagedProgressive ? " staged, progressive"
                         : o.partials == Partials::kSummedInEpilogue  ? " summed in epilogue"
                         : o.partials == Partials::kAuto              ? " auto partials"
                                                                      : " staged";
  const char* ring = o.store_ring == 5 ? ", wide ring" : "";
  if (std::getenv("WEFT_TEST_VERBOSE"))
    std::fprintf(stderr, "  case op %d M=%lld N=%lld K=%lld %s %s %s comm_blocks %d pieces %d%s%s%s%s\n",
                 int(op), (long long)m, (long long)n, (long long)k, nk ? "NK" : "KN", mode_name(mode),
                 sym ? "sym" : "device", o.comm_blocks, o.pipeline_pieces, partials, ring,
                 take_gathered ? " gathered" : "",
                 o.gather == FusedOptions::Gather::kCopyEngine ? " copy engine" : "");
  for (int i = 0; i < c.num_local(); ++i) {
    const int r = c.local(i).rank();
    const __nv_bfloat16* a_src = op == Op::kAG ? a[0].h.data() + r * s.shard * k : a[r].h.data();
    upload(c, i, A.ptr[i], a_src, (op == Op::kAG ? s.shard : m) * k * 2);
    upload(c, i, B.ptr[i], b[r].h.data(), n * k * 2);
    poison(c, i, out.ptr[i], out_rows * n * 2);
    poison(c, i, gathered.ptr[i], m * k * 2);
  }
  c.host_barrier();
  // The fused RS / AR kernels need M / W to be a multiple of 64; forced, other shapes must be refused
  // with that reason (before anything is launched) and kAuto must fall back.
  if (op != Op::kAG && s.shard % 64 != 0 && mode == Mode::kFused) {
    for (int i = 0; i < c.num_local(); ++i) {
      std::string msg;
      try {
        if (op == Op::kRS)
          matmul_reduce_scatter(c, c.local(i), A.ptr[i], B.ptr[i], out.ptr[i], m, n, k, layout, nullptr, o);
        else
          matmul_all_reduce(c, c.local(i), A.ptr[i], B.ptr[i], out.ptr[i], m, n, k, layout, nullptr, o);
      } catch (const Error& e) {
        msg = e.what();
      }
      WEFT_EXPECT(msg.find("not a multiple of 64") != std::string::npos, "forced fused: got '" << msg << "'");
    }
    o.mode = mode = Mode::kAuto;  // which must not pick the fused kernel here
    o.min_fused_m = 0;
  }
  for (int i = 0; i < c.num_local(); ++i) {
    Rank& r = c.local(i);
    // The plan first (it grows nothing), then the call, which must take the planned path and grow no
    // workspace past what the plan named.
    const Plan plan =
        op == Op::kAG
            ? all_gather_matmul_plan(c, r, A.ptr[i], B.ptr[i], out.ptr[i],
                                     take_gathered ? gathered.ptr[i] : nullptr, m, n, k, layout, nullptr, o)
        : op == Op::kRS
            ? matmul_reduce_scatter_plan(c, r, A.ptr[i], B.ptr[i], out.ptr[i], m, n, k, layout, nullptr, o)
            : matmul_all_reduce_plan(c, r, A.ptr[i], B.ptr[i], out.ptr[i], m, n, k, layout, nullptr, o);
    const weft::test::WorkspaceSizes before = weft::test::workspace_sizes(c, plan);
    FusedPath path;
    if (op == Op::kAG)
      path = all_gather_matmul(c, r, A.ptr[i], B.ptr[i], out.ptr[i],
                               take_gathered ? gathered.ptr[i] : nullptr, m, n, k, layout, nullptr, o);
    else if (op == Op::kRS)
      path = matmul_reduce_scatter(c, r, A.ptr[i], B.ptr[i], out.ptr[i], m, n, k, layout, nullptr, o);
    else
      path = matmul_all_reduce(c, r, A.ptr[i], B.ptr[i], out.ptr[i], m, n, k, layout, nullptr, o);
    WEFT_EXPECT(plan.path.rfind(fused_path_name(path), 0) == 0,
                "the plan says '" << describe(plan) << "', the call ran " << fused_path_name(path));
    WEFT_EXPECT(path != FusedPath::kFused || plan.why_not.empty(),
                "the fused kernel ran although the plan says: " << plan.why_not);
    WEFT_EXPECT(path != FusedPath::kFused || plan.blocks > plan.comm_blocks,
                "fused plan without compute blocks: " << describe(plan));
    const std::string kept = weft::test::check_call_kept_plan(c, plan, before);
    WEFT_EXPECT(kept.empty(), kept);
    if (mode == Mode::kAuto)
      WEFT_EXPECT(path != FusedPath::kFused, "kAuto ran the fused kernel where it cannot run");
    else
      WEFT_EXPECT(path == path_of(mode), "path " << fused_path_name(path) << " for mode " << mode_name(mode));
  }
  c.synchronize();
  std::vector<double> sum;  // RS / AR: the sum over ranks of A_q . B_q, all M rows, made once
  if (op != Op::kAG) {
    sum.assign(size_t(m * n), 0.0);
    for (int q = 0; q < W; ++q) gemm_ref(sum, a[q], b[q], 0, m, n, k, nk);
  }
  for (int i = 0; i < c.num_local(); ++i) {
    const int r = c.local(i).rank();
    std::vector<double> ref(size_t(out_rows * n), 0.0);
    if (op == Op::kAG) {
      gemm_ref(ref, a[0], b[r], 0, m, n, k, nk);
      if (take_gathered) {
        const auto g = get(c, i, gathered.ptr[i], m * k);
        WEFT_EXPECT(std::memcmp(g.data(), a[0].h.data(), m * k * 2) == 0, "gathered A differs, rank " << r);
      }
    } else {
      const int64_t first = op == Op::kRS ? r * s.shard * n : 0;
      std::copy(sum.begin() + first, sum.begin() + first + out_rows * n, ref.begin());
    }
    const std::string err = compare(get(c, i, out.ptr[i], out_rows * n), ref);
    WEFT_EXPECT(err.empty(), (op == Op::kAG   ? "all_gather_matmul"
                              : op == Op::kRS ? "matmul_reduce_scatter"
                                              : "matmul_all_reduce")
                                 << " M=" << m << " N=" << n << " K=" << k << (nk ? " [N,K] B" : " [K,N] B")
                                 << " " << mode_name(mode) << partials << ring
                                 << (sym ? " symmetric" : " device") << " rank " << r << ": " << err);
  }
  c.host_barrier();
}

// The RS / AR cases' ways of summing, by shape and layout (both outs take each): on the shards of whole
// 128-row tiles (shapes 0 and 5, the only ones where the summed-in-epilogue kernel runs; --quick keeps the
// first layout of shape 0 and the second of shape 5) the summed way on narrow and wide tiles and kAuto, on
// the others the staged and counted ways (and kAuto's fallback).
Summing summing_of(size_t shape, int layout) {
  if (shape == 0)
    return layout == 0 ? Summing{Partials::kSummedInEpilogue, 128} : Summing{Partials::kAuto, 0};
  if (shape == 5)
    return layout == 0 ? Summing{Partials::kAuto, 128} : Summing{Partials::kSummedInEpilogue, 0};
  const Partials ways[] = {Partials::kStaged, Partials::kAddedAtOwner, Partials::kStagedProgressive,
                           Partials::kAuto};
  return {ways[(2 * shape + layout) % 4], 0};
}

void run_all(TestContext& ctx, Op op) {
  uint64_t seed = 1 + 100 * int(op);
  for (size_t si = 0; si < std::size(kShapes); ++si)
    for (BLayout layout : {BLayout::kNK, BLayout::kKN})
      for (Mode mode : kModes)
        for (bool sym : {true, false}) {
          const Shape& s = kShapes[si];
          if (ctx.quick && (layout == BLayout::kKN) != (s.n % 256 != 0)) continue;
          run_case(ctx, op, s, layout, mode, sym, seed++, summing_of(si, layout == BLayout::kKN));
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
// A negative pipeline_pieces is refused with its name, before anything runs.
WEFT_GPU_TEST(fused_ops_reject_negative_pieces) {
  Communicator& c = ctx.comm();
  const int64_t m = 64 * c.world(), n = 64, k = 64;
  RankBuffers a(c, m * k * 2, false), b(c, n * k * 2, false), out(c, m * n * 2, false);
  FusedOptions o;
  o.pipeline_pieces = -1;
  for (int i = 0; i < c.num_local(); ++i) {
    std::string msg;
    try {
      matmul_all_reduce(c, c.local(i), a.ptr[i], b.ptr[i], out.ptr[i], m, n, k, BLayout::kNK, nullptr, o);
    } catch (const Error& e) {
      msg = e.what();
    }
    WEFT_EXPECT(msg.find("pipeline_pieces") != std::string::npos, "got '" << msg << "'");
  }
}

// Repeated calls: the per-call epochs and barriers must carry over without resets (and mixed with the
// collectives, which share barrier slots with the fused kernels); the pipelines' flags must come back to 0.
WEFT_GPU_TEST(fused_ops_back_to_back) {
  for (int rep = 0; rep < (ctx.quick ? 3 : 10); ++rep) {
    const Mode mode = rep % 3 == 2 ? Mode::kFused : Mode::kPipelined;
    run_case(ctx, Op::kAG, kShapes[1], BLayout::kNK, mode, rep % 2 == 0, 500 + rep);
    run_case(ctx, Op::kRS, kShapes[rep % 4 < 2 ? 2 : 5], BLayout::kKN,
             rep % 2 ? Mode::kFused : Mode::kPipelined, true, 600 + rep);
    run_case(ctx, Op::kAR, kShapes[0], BLayout::kNK, mode, false, 700 + rep);
    // AG's fused kernel on whole 128-row shards: the copy engine's gather and the communicator blocks' in
    // turn (their flags and handshakes carry over between calls).
    run_case(ctx, Op::kAG, kShapes[0], BLayout::kNK, Mode::kFused, rep % 2 == 0, 1100 + 4 * rep);
    // The ways of summing in turn, call after call: the counted calls' counts carry over between calls and
    // between the ways. Shards of whole 128-row tiles (shape 5), where the summed-in-epilogue way runs on
    // both tile widths; --quick's three reps take it at rep 0 (RS, wide; AR, kAuto: wide) and rep 1 (AR,
    // narrow), kAuto's RS at rep 1.
    const Partials ways[] = {Partials::kSummedInEpilogue, Partials::kAuto, Partials::kStaged,
                             Partials::kAddedAtOwner, Partials::kStagedProgressive};
    run_case(ctx, Op::kAR, kShapes[5], BLayout::kNK, Mode::kFused, true, 802 + 4 * rep,
             Summing{ways[(6 - rep % 5) % 5], rep % 2 ? 128 : 0});
    run_case(ctx, Op::kRS, kShapes[2], BLayout::kNK, Mode::kFused, rep % 2 == 0, 902 + 4 * rep,
             Summing{ways[2 + rep % 3]});
    run_case(ctx, Op::kRS, kShapes[5], BLayout::kNK, Mode::kFused, rep % 2 == 1, 1028 + 4 * rep,
             Summing{ways[rep % 5], rep % 4 < 2 ? 0 : 128});
  }
}

// A rank that stalls mid-stream (it made one call, then never makes the next) makes every other rank's call
// fail within the team's timeout, naming the wait, on each path: the fused kernel, the copy-engine pipeline
// (its stream waits are timed kernels) and the sequential path. On virtual ranks a rank that died looks the
// same; between processes the abort flag also ends the waits (rank_death_fails_peers_fast).
WEFT_GPU_TEST(fused_ops_fail_fast_when_a_rank_stalls) {
  for (Op op : {Op::kAG, Op::kRS, Op::kAR})
    for (Mode mode : kModes)
      for (FusedOptions::Partials partials :  // RS / AR fused: also with the partials counted at the owner
           {FusedOptions::Partials::kStaged, FusedOptions::Partials::kAddedAtOwner,
            FusedOptions::Partials::kStagedProgressive, FusedOptions::Partials::kSummedInEpilogue}) {
        const bool counted = partials != FusedOptions::Partials::kStaged;
        if (counted && (op == Op::kAG || mode != Mode::kFused)) continue;
        auto cp = ctx.make_comm(std::chrono::milliseconds(500));
        Communicator& c = *cp;
        const int W = c.world(), stalled = W - 1;
        const int64_t shard = 128, m = W * shard, n = 256, k = 256;
        const int64_t out_rows = op == Op::kRS ? shard : m;
        RankBuffers A(c, (op == Op::kAG ? shard : m) * k * 2, true), B(c, n * k * 2, false),
            out(c, out_rows * n * 2, true);
        FusedOptions o;
        o.mode = mode;
        o.partials = partials;
        auto call_all = [&](bool skip_stalled) {
          for (int i = 0; i < c.num_local(); ++i) {
            Rank& r = c.local(i);
            if (skip_stalled && r.rank() == stalled) continue;
            if (op == Op::kAG)
              all_gather_matmul(c, r, A.ptr[i], B.ptr[i], out.ptr[i], nullptr, m, n, k, BLayout::kNK, nullptr,
                                o);
            else if (op == Op::kRS)
              matmul_reduce_scatter(c, r, A.ptr[i], B.ptr[i], out.ptr[i], m, n, k, BLayout::kNK, nullptr, o);
            else
              matmul_all_reduce(c, r, A.ptr[i], B.ptr[i], out.ptr[i], m, n, k, BLayout::kNK, nullptr, o);
          }
        };
        for (int i = 0; i < c.num_local(); ++i) {
          poison(c, i, A.ptr[i], (op == Op::kAG ? shard : m) * k * 2);  // values do not matter here
          poison(c, i, B.ptr[i], n * k * 2);
        }
        call_all(false);
        c.synchronize();
        c.host_barrier();
        const auto t0 = std::chrono::steady_clock::now();
        call_all(true);
        std::string msg;
        try {
          c.synchronize();
        } catch (const Error& e) {
          msg = e.what();
        }
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        const bool waits = !(ctx.multi_process && c.local(0).rank() == stalled);  // the stalled rank itself
        const std::string what =
            std::string(op == Op::kAG   ? "all_gather_matmul"
                        : op == Op::kRS ? "matmul_reduce_scatter"
                                        : "matmul_all_reduce") +
            " " + mode_name(mode) +
            (partials == FusedOptions::Partials::kAddedAtOwner        ? " (added at owner)"
             : partials == FusedOptions::Partials::kStagedProgressive ? " (staged, progressive)"
             : partials == FusedOptions::Partials::kSummedInEpilogue  ? " (summed in epilogue)"
                                                                      : "");
        if (waits) {
          WEFT_EXPECT(msg.find("timed out") != std::string::npos || msg.find("gave up") != std::string::npos,
                      what << ": the others should fail with a diagnostic, got '" << msg << "'");
          WEFT_EXPECT(msg.find("waiting for") != std::string::npos, what << ": " << msg);
          WEFT_EXPECT(s < 8.0, what << ": took " << s << " s to fail for a 0.5 s timeout");
          std::printf("  %s: failed after %.2f s: %s\n", what.c_str(), s, msg.c_str());
        }
        c.host_barrier();
      }
}

// RS / AR at a size where blocks take several tiles, of every owner, with a partial last tile column: the
// fused kernel and the pipeline (in 3 pieces per step) against the sequential path (cuBLAS + weft's
// collective) on the same inputs, and repeated: each result must be the same bits every time (a fixed
// summation order; a difference between runs is a race).
WEFT_GPU_TEST(fused_rs_ar_large_match_sequential) {
  Communicator& c = ctx.comm();
  const int W = c.world();
  const int64_t shard = 1024, m = W * shard, n = 1288, k = 512;
  for (Op op : {Op::kRS, Op::kAR}) {
    const int64_t out_rows = op == Op::kRS ? shard : m;
    // Two input sets: a second one's calls fill the staging slots with other partials before each checked
    // call, so a read of a slot before this call's store landed shows.
    RankBuffers a(c, m * k * 2, false), b(c, n * k * 2, false), a2(c, m * k * 2, false),
        b2(c, n * k * 2, false), out(c, out_rows * n * 2, op == Op::kAR), ref(c, out_rows * n * 2, false),
        ref2(c, out_rows * n * 2, false), scratch(c, out_rows * n * 2, op == Op::kAR),
        outs0(c, out_rows * n * 2, op == Op::kAR), outs1(c, out_rows * n * 2, op == Op::kAR),
        outs2(c, out_rows * n * 2, op == Op::kAR);
    for (int i = 0; i < c.num_local(); ++i) {
      const int r = c.local(i).rank();
      upload(c, i, a.ptr[i], make(size_t(m * k), 77 + r).h.data(), m * k * 2);
      upload(c, i, b.ptr[i], make(size_t(n * k), 88 + r).h.data(), n * k * 2);
      upload(c, i, a2.ptr[i], make(size_t(m * k), 177 + r).h.data(), m * k * 2);
      upload(c, i, b2.ptr[i], make(size_t(n * k), 188 + r).h.data(), n * k * 2);
    }
    c.host_barrier();
    using Partials = FusedOptions::Partials;
    // Enqueues the op on every local rank (inputs `second`: a2, b2), no synchronisation.
    auto enqueue = [&](RankBuffers& dst, Mode mode, Partials partials, bool second) {
      FusedOptions o;
      o.mode = mode;
      o.pipeline_pieces = 3;
      o.partials = partials;
      for (int i = 0; i < c.num_local(); ++i) {
        Rank& r = c.local(i);
        const void *ai = second ? a2.ptr[i] : a.ptr[i], *bi = second ? b2.ptr[i] : b.ptr[i];
        if (op == Op::kRS)
          matmul_reduce_scatter(c, r, ai, bi, dst.ptr[i], m, n, k, BLayout::kNK, nullptr, o);
        else
          matmul_all_reduce(c, r, ai, bi, dst.ptr[i], m, n, k, BLayout::kNK, nullptr, o);
      }
    };
    auto run = [&](RankBuffers& dst, Mode mode, Partials partials) {
      for (int i = 0; i < c.num_local(); ++i) poison(c, i, dst.ptr[i], out_rows * n * 2);
      c.host_barrier();
      enqueue(scratch, Mode::kFused, Partials::kStaged, true);  // other partials in the slots first
      enqueue(dst, mode, partials, false);
      c.synchronize();
    };
    auto expect_equal = [&](RankBuffers& got, RankBuffers& want, const char* what) {
      for (int i = 0; i < c.num_local(); ++i) {
        const auto w = get(c, i, want.ptr[i], out_rows * n);
        const std::string err =
            compare(get(c, i, got.ptr[i], out_rows * n), std::vector<double>(w.begin(), w.end()));
        WEFT_EXPECT(err.empty(), (op == Op::kRS ? "matmul_reduce_scatter" : "matmul_all_reduce")
                                     << " " << what << " rank " << c.local(i).rank() << ": " << err);
      }
    };
    run(ref, Mode::kSequential, Partials::kStaged);
    for (int i = 0; i < c.num_local(); ++i) poison(c, i, ref2.ptr[i], out_rows * n * 2);
    c.host_barrier();
    enqueue(ref2, Mode::kSequential, Partials::kStaged, true);
    c.synchronize();
    // Counted calls back to back with no synchronisation between them, inputs alternating: each result its
    // own (a fast rank's next call must not disturb a slow rank's slots or counts).
    for (Partials counted :
         {Partials::kStagedProgressive, Partials::kAddedAtOwner, Partials::kSummedInEpilogue}) {
      for (RankBuffers* o : {&outs0, &outs1, &outs2})
        for (int i = 0; i < c.num_local(); ++i) poison(c, i, o->ptr[i], out_rows * n * 2);
      c.host_barrier();
      enqueue(outs0, Mode::kFused, counted, false);
      enqueue(outs1, Mode::kFused, counted, true);
      enqueue(outs2, Mode::kFused, counted, false);
      c.synchronize();
      const char* name = counted == Partials::kAddedAtOwner       ? "added at owner, back to back"
                         : counted == Partials::kSummedInEpilogue ? "summed in epilogue, back to back"
                                                                  : "staged progressive, back to back";
      expect_equal(outs0, ref, name);
      expect_equal(outs1, ref2, name);
      expect_equal(outs2, ref, name);
      c.host_barrier();
    }
    // The partials added at the owner: against the sequential result (the adds' order varies between runs,
    // so no bitwise comparison of repetitions).
    for (int rep = 0; rep < 2; ++rep) {
      run(out, Mode::kFused, Partials::kAddedAtOwner);
      for (int i = 0; i < c.num_local(); ++i) {
        const auto want = get(c, i, ref.ptr[i], out_rows * n);
        const std::string err =
            compare(get(c, i, out.ptr[i], out_rows * n), std::vector<double>(want.begin(), want.end()));
        WEFT_EXPECT(err.empty(), (op == Op::kRS ? "matmul_reduce_scatter" : "matmul_all_reduce")
                                     << " fused, added at owner, M=" << m << " rep " << rep << " rank "
                                     << c.local(i).rank() << ": " << err);
      }
      c.host_barrier();
    }
    // Fused (staged; staged, progressive; summed in the epilogue) and pipelined: against the sequential
    // result, and the same bits in every repetition (a fixed order of the partials); the progressive sum the
    // same bits as the staged one (one order of the W slots; the epilogue's sum adds this rank's partial
    // unrounded, so not those bits).
    struct Variant {
      Mode mode;
      Partials partials;
      const char* name;
    };
    std::vector<std::vector<__nv_bfloat16>> staged_bits(c.num_local());
    for (const Variant v :
         {Variant{Mode::kFused, Partials::kStaged, "fused"},
          Variant{Mode::kFused, Partials::kStagedProgressive, "fused (staged, progressive)"},
          Variant{Mode::kFused, Partials::kSummedInEpilogue, "fused (summed in epilogue)"},
          Variant{Mode::kPipelined, Partials::kStaged, "pipelined"}}) {
      const Mode mode = v.mode;
      std::vector<std::vector<__nv_bfloat16>> first(c.num_local());
      for (int rep = 0; rep < 3; ++rep) {
        run(out, mode, v.partials);
        for (int i = 0; i < c.num_local(); ++i) {
          const int r = c.local(i).rank();
          const auto got = get(c, i, out.ptr[i], out_rows * n);
          const auto want = get(c, i, ref.ptr[i], out_rows * n);
          const std::vector<double> want_d(want.begin(), want.end());
          const std::string err = compare(got, want_d);
          WEFT_EXPECT(err.empty(), (op == Op::kRS ? "matmul_reduce_scatter" : "matmul_all_reduce")
                                       << " " << v.name << " M=" << m << " rep " << rep << " rank " << r
                                       << ": " << err);
          if (rep == 0)
            first[i] = got;
          else
            WEFT_EXPECT(std::memcmp(got.data(), first[i].data(), got.size() * 2) == 0,
                        (op == Op::kRS ? "matmul_reduce_scatter" : "matmul_all_reduce")
                            << " " << v.name << " rank " << r << ": rep " << rep
                            << " differs from rep 0 (a race?)");
          if (rep == 0 && v.partials == Partials::kStaged && mode == Mode::kFused) staged_bits[i] = got;
          if (rep == 0 && v.partials == Partials::kStagedProgressive)
            WEFT_EXPECT(std::memcmp(got.data(), staged_bits[i].data(), got.size() * 2) == 0,
                        (op == Op::kRS ? "matmul_reduce_scatter" : "matmul_all_reduce")
                            << " rank " << r << ": the progressive sum differs from the staged one");
        }
        c.host_barrier();
      }
    }
  }
}

// The three ops, pipelined, captured once per rank into a CUDA graph and replayed on fresh inputs: the
// pipelines' stream writes and waits replay with the same values, so their flags must return to 0 per call.
// all_gather_matmul's fused kernel fed by the copy engine (Gather::kCopyEngine, on the first 512 rows of each
// shard: whole 128-row tiles) shares the pipeline's flags and is captured beside them.
WEFT_GPU_TEST(fused_ops_pipelined_in_cuda_graphs) {
  Communicator& c = ctx.comm();
  const int W = c.world();
  const Shape s = kShapes[3];
  const int64_t m = W * s.shard, n = s.n, k = s.k;
  FusedOptions o;
  o.mode = Mode::kPipelined;
  RankBuffers a_ag(c, s.shard * k * 2, false), a(c, m * k * 2, false), b(c, n * k * 2, false),
      out_ag(c, m * n * 2, false), out_rs(c, s.shard * n * 2, false), out_ar(c, m * n * 2, true);
  const int64_t ce_shard = 512, ce_m = W * ce_shard;
  RankBuffers out_ce(c, ce_m * n * 2, false);
  FusedOptions ce;
  ce.mode = Mode::kFused;
  ce.gather = FusedOptions::Gather::kCopyEngine;
  auto issue = [&](int i) {
    Rank& r = c.local(i);
    all_gather_matmul(c, r, a_ag.ptr[i], b.ptr[i], out_ag.ptr[i], nullptr, m, n, k, BLayout::kNK, r.stream(),
                      o);
    all_gather_matmul(c, r, a_ag.ptr[i], b.ptr[i], out_ce.ptr[i], nullptr, ce_m, n, k, BLayout::kNK,
                      r.stream(), ce);
    matmul_reduce_scatter(c, r, a.ptr[i], b.ptr[i], out_rs.ptr[i], m, n, k, BLayout::kNK, r.stream(), o);
    matmul_all_reduce(c, r, a.ptr[i], b.ptr[i], out_ar.ptr[i], m, n, k, BLayout::kNK, r.stream(), o);
  };
  for (int i = 0; i < c.num_local(); ++i) issue(i);  // workspace, copy streams, cuBLAS handles
  c.synchronize();
  if (c.ranks_per_gpu() > 1) {  // virtual ranks: refused under capture, before anything is captured
    Rank& r = c.local(0);
    WEFT_CUDA_CHECK(cudaSetDevice(r.device()));
    WEFT_CUDA_CHECK(cudaStreamBeginCapture(r.stream(), cudaStreamCaptureModeThreadLocal));
    std::string msg;
    try {
      all_gather_matmul(c, r, a_ag.ptr[0], b.ptr[0], out_ag.ptr[0], nullptr, m, n, k, BLayout::kNK,
                        r.stream(), o);
    } catch (const Error& e) {
      msg = e.what();
    }
    cudaGraph_t g = nullptr;
    WEFT_CUDA_CHECK(cudaStreamEndCapture(r.stream(), &g));
    if (g) WEFT_CUDA_CHECK(cudaGraphDestroy(g));
    WEFT_EXPECT(msg.find("not captured into CUDA graphs on virtual ranks") != std::string::npos,
                "got '" << msg << "'");
    // What kAuto captures there instead (the fused kernel or the sequential path) replays right; warmed up
    // first so that its workspace is grown before the capture.
    o.mode = Mode::kAuto;
    for (int i = 0; i < c.num_local(); ++i) issue(i);
    c.synchronize();
  }
  std::vector<cudaGraphExec_t> exec = capture_per_rank(c, issue);
  for (int replay = 0; replay < 3; ++replay) {
    const uint64_t seed = 900 + 10 * replay;
    const Mat full_a = make(size_t(m * k), seed);  // AG: the gathered A; RS / AR: every rank's A
    std::vector<Mat> bs(W);
    for (int r = 0; r < W; ++r) bs[r] = make(size_t(n * k), seed + 1 + r);
    for (int i = 0; i < c.num_local(); ++i) {
      const int r = c.local(i).rank();
      upload(c, i, a_ag.ptr[i], full_a.h.data() + r * s.shard * k, s.shard * k * 2);
      upload(c, i, a.ptr[i], full_a.h.data(), m * k * 2);
      upload(c, i, b.ptr[i], bs[r].h.data(), n * k * 2);
      for (auto [p, bytes] : {std::pair{out_ag.ptr[i], m * n * 2},
                              {out_rs.ptr[i], s.shard * n * 2},
                              {out_ar.ptr[i], m * n * 2},
                              {out_ce.ptr[i], ce_m * n * 2}})
        poison(c, i, p, bytes);
    }
    c.host_barrier();
    for (int i = 0; i < c.num_local(); ++i) {
      WEFT_CUDA_CHECK(cudaSetDevice(c.local(i).device()));
      WEFT_CUDA_CHECK(cudaGraphLaunch(exec[i], c.local(i).stream()));
    }
    c.synchronize();
    Mat ce_a = make(size_t(ce_m * k), 0);  // the copy engine's gathered A: each shard's first 512 rows
    for (int q = 0; q < W; ++q) {
      std::copy_n(full_a.h.begin() + q * s.shard * k, ce_shard * k, ce_a.h.begin() + q * ce_shard * k);
      std::copy_n(full_a.d.begin() + q * s.shard * k, ce_shard * k, ce_a.d.begin() + q * ce_shard * k);
    }
    std::vector<double> sum(size_t(m * n), 0.0);  // sum over ranks of A . B_r
    for (int q = 0; q < W; ++q) gemm_ref(sum, full_a, bs[q], 0, m, n, k, true);
    for (int i = 0; i < c.num_local(); ++i) {
      const int r = c.local(i).rank();
      std::vector<double> ag(size_t(m * n), 0.0);
      gemm_ref(ag, full_a, bs[r], 0, m, n, k, true);
      const std::vector<double> rs(sum.begin() + r * s.shard * n, sum.begin() + (r + 1) * s.shard * n);
      std::string err = compare(get(c, i, out_ag.ptr[i], m * n), ag);
      WEFT_EXPECT(err.empty(), "replay " << replay << " all_gather_matmul rank " << r << ": " << err);
      err = compare(get(c, i, out_rs.ptr[i], s.shard * n), rs);
      WEFT_EXPECT(err.empty(), "replay " << replay << " matmul_reduce_scatter rank " << r << ": " << err);
      err = compare(get(c, i, out_ar.ptr[i], m * n), sum);
      WEFT_EXPECT(err.empty(), "replay " << replay << " matmul_all_reduce rank " << r << ": " << err);
      std::vector<double> ce_ref(size_t(ce_m * n), 0.0);
      gemm_ref(ce_ref, ce_a, bs[r], 0, ce_m, n, k, true);
      err = compare(get(c, i, out_ce.ptr[i], ce_m * n), ce_ref);
      WEFT_EXPECT(err.empty(), "replay " << replay << " all_gather_matmul, copy engine, rank " << r << ": " << err);
    }
    c.host_barrier();
  }
  for (auto& e : exec) cudaGraphExecDestroy(e);
}

// GEMM + all-reduce inputs: each rank's A [M,K] and B ([N,K] if nk, else [K,N]) drawn from seeds seed_a +
// rank and seed_b + rank and uploaded, its out poisoned, the ranks met; returns the fp64 sum of the W
// products.
static std::vector<double> all_reduce_inputs(Communicator& c, RankBuffers& A, RankBuffers& B,
                                             RankBuffers& out, int64_t m, int64_t n, int64_t k, bool nk,
                                             uint64_t seed_a, uint64_t seed_b) {
  const int W = c.world();
  std::vector<Mat> a(W), b(W);
  std::vector<double> sum(size_t(m * n), 0.0);
  for (int r = 0; r < W; ++r) {
    a[r] = make(size_t(m * k), seed_a + r);
    b[r] = make(size_t(n * k), seed_b + r);
    gemm_ref(sum, a[r], b[r], 0, m, n, k, nk);
  }
  for (int i = 0; i < c.num_local(); ++i) {
    const int r = c.local(i).rank();
    upload(c, i, A.ptr[i], a[r].h.data(), m * k * 2);
    upload(c, i, B.ptr[i], b[r].h.data(), n * k * 2);
    poison(c, i, out.ptr[i], m * n * 2);
  }
  c.host_barrier();
  return sum;
}

// matmul_all_reduce (B [N,K], options o) captured per rank into a CUDA graph after a warm-up call, then
// replayed three times on new inputs (seeds from `seed`), each against the fp64 reference, outputs poisoned.
static void check_all_reduce_replays(Communicator& c, int64_t m, int64_t n, int64_t k, const FusedOptions& o,
                                     uint64_t seed, const char* what) {
  RankBuffers A(c, m * k * 2, false), B(c, n * k * 2, false), out(c, m * n * 2, false);
  auto issue = [&](int i) {
    Rank& r = c.local(i);
    matmul_all_reduce(c, r, A.ptr[i], B.ptr[i], out.ptr[i], m, n, k, BLayout::kNK, r.stream(), o);
  };
  for (int i = 0; i < c.num_local(); ++i) issue(i);  // workspace, handles
  c.synchronize();
  std::vector<cudaGraphExec_t> exec = capture_per_rank(c, issue);
  for (int replay = 0; replay < 3; ++replay) {
    const std::vector<double> sum =
        all_reduce_inputs(c, A, B, out, m, n, k, true, seed + 10 * replay, seed + 1000 + 10 * replay);
    for (int i = 0; i < c.num_local(); ++i) {
      WEFT_CUDA_CHECK(cudaSetDevice(c.local(i).device()));
      WEFT_CUDA_CHECK(cudaGraphLaunch(exec[i], c.local(i).stream()));
    }
    c.synchronize();
    for (int i = 0; i < c.num_local(); ++i) {
      const std::string err = compare(get(c, i, out.ptr[i], m * n), sum);
      WEFT_EXPECT(err.empty(),
                  what << ", replay " << replay << ", rank " << c.local(i).rank() << ": " << err);
    }
    c.host_barrier();
  }
  for (auto& e : exec) cudaGraphExecDestroy(e);
}

// matmul_all_reduce takes any M (decode batches: 1, 3, 7, 129, 1000 rows, at any world size): kAuto and the
// sequential path against the fp64 reference, outputs poisoned first; the fused kernel and the pipeline,
// which split M over the ranks, are refused by name when M is not divisible by the world size; and the call
// captured per rank into a CUDA graph replays right on fresh inputs.
WEFT_GPU_TEST(matmul_all_reduce_any_m) {
  Communicator& c = ctx.comm();
  const int W = c.world();
  const int64_t n = 264, k = 136;
  for (int64_t m : {1, 3, 7, 129, 1000}) {
    std::vector<Mat> a(W), b(W);
    for (int r = 0; r < W; ++r) {
      a[r] = make(size_t(m * k), 4000 + 10 * m + r);
      b[r] = make(size_t(n * k), 5000 + 10 * m + r);
    }
    std::vector<double> sum(size_t(m * n), 0.0);
    for (int q = 0; q < W; ++q) gemm_ref(sum, a[q], b[q], 0, m, n, k, true);
    for (bool sym : {true, false}) {
      RankBuffers A(c, m * k * 2, false), B(c, n * k * 2, false), out(c, m * n * 2, sym);
      for (int i = 0; i < c.num_local(); ++i) {
        const int r = c.local(i).rank();
        upload(c, i, A.ptr[i], a[r].h.data(), m * k * 2);
        upload(c, i, B.ptr[i], b[r].h.data(), n * k * 2);
      }
      for (Mode mode : {Mode::kAuto, Mode::kSequential, Mode::kFused, Mode::kPipelined}) {
        FusedOptions o;
        o.mode = mode;
        o.min_fused_m = 0;  // kAuto weighs every path, as it would for a large M
        const bool refused = m % W != 0 && (mode == Mode::kFused || mode == Mode::kPipelined);
        if (!refused && mode != Mode::kAuto && mode != Mode::kSequential) continue;  // covered above
        for (int i = 0; i < c.num_local(); ++i) poison(c, i, out.ptr[i], m * n * 2);
        c.host_barrier();
        for (int i = 0; i < c.num_local(); ++i) {
          std::string msg;
          try {
            matmul_all_reduce(c, c.local(i), A.ptr[i], B.ptr[i], out.ptr[i], m, n, k, BLayout::kNK, nullptr,
                              o);
          } catch (const Error& e) {
            msg = e.what();
          }
          if (refused)
            WEFT_EXPECT(msg.find("not divisible by the world size") != std::string::npos,
                        "M=" << m << " forced " << mode_name(mode) << ": got '" << msg << "'");
          else
            WEFT_EXPECT(msg.empty(), "M=" << m << " " << mode_name(mode) << ": " << msg);
        }
        if (refused) continue;
        c.synchronize();
        for (int i = 0; i < c.num_local(); ++i) {
          const std::string err = compare(get(c, i, out.ptr[i], m * n), sum);
          WEFT_EXPECT(err.empty(), "matmul_all_reduce M=" << m << " W=" << W << " " << mode_name(mode)
                                                          << (sym ? " symmetric" : " device") << " rank "
                                                          << c.local(i).rank() << ": " << err);
        }
        c.host_barrier();
      }
    }
  }
  // Graph replay at M = 7 (kAuto).
  check_all_reduce_replays(c, 7, n, k, FusedOptions{}, 6000, "matmul_all_reduce M=7");
}

// Partials::kSplitK (matmul_all_reduce at decode sizes, ops::SplitKAllReduceOp) against the fp64 reference:
// M of one row, a few, a 16-row band, past one 128-row tile and two whole tiles; N with a partial column tile
// and several tiles a rank; K with a partial k-block and many (so several slices); both B layouts, symmetric
// and device outs, outputs poisoned first; three rounds of new inputs each; three calls with nothing between
// them on each rank's stream, M and the tile width changing in the middle (the slots and result areas serve
// the next call without a meeting); both tile widths (FusedOptions::tile_n 128, 256); the plan names the
// kernel; a call captured per rank into a CUDA graph replays right on new inputs; reduce-scatter refuses it.
WEFT_GPU_TEST(matmul_all_reduce_split_k) {
  Communicator& c = ctx.comm();
  const int W = c.world();
  struct Case {
    int64_t m, n, k;
    BLayout layout;
    bool sym;
  };
  std::vector<Case> cases = {{1, 264, 136, BLayout::kNK, false},
                             {7, 1024, 2048, BLayout::kKN, true},
                             {16, 1024, 2048, BLayout::kNK, true},
                             {129, 264, 1000, BLayout::kKN, false},
                             {256, 512, 520, BLayout::kNK, false}};
  if (!ctx.quick) cases.push_back({64, 8192, 2048, BLayout::kNK, true});
  FusedOptions o;
  o.partials = Partials::kSplitK;
  FusedOptions wide = o;
  wide.tile_n = 256;  // 128 x 256 items
  for (const Case& cs : cases)
    for (const FusedOptions& ot : {o, wide}) {
      const int64_t m = cs.m, n = cs.n, k = cs.k;
      const bool nk = cs.layout == BLayout::kNK;
      RankBuffers A(c, m * k * 2, false), B(c, n * k * 2, false), out(c, m * n * 2, cs.sym);
      for (int round = 0; round < 3; ++round) {
        const std::vector<double> sum = all_reduce_inputs(
            c, A, B, out, m, n, k, nk, 8000 + 100 * round + 10 * m, 9000 + 100 * round + 10 * m);
        for (int i = 0; i < c.num_local(); ++i) {
          Rank& r = c.local(i);
          const Plan plan =
              matmul_all_reduce_plan(c, r, A.ptr[i], B.ptr[i], out.ptr[i], m, n, k, cs.layout, nullptr, ot);
          WEFT_EXPECT(plan.path.find("split-K") != std::string::npos, "plan: " << describe(plan));
          const FusedPath path =
              matmul_all_reduce(c, r, A.ptr[i], B.ptr[i], out.ptr[i], m, n, k, cs.layout, nullptr, ot);
          WEFT_EXPECT(path == FusedPath::kFused, "path " << fused_path_name(path));
        }
        c.synchronize();
        for (int i = 0; i < c.num_local(); ++i) {
          const std::string err = compare(get(c, i, out.ptr[i], m * n), sum);
          WEFT_EXPECT(err.empty(), "split-K matmul_all_reduce M="
                                       << m << " N=" << n << " K=" << k << " tile_n " << ot.tile_n
                                       << (nk ? " [N,K] B" : " [K,N] B") << " W=" << W
                                       << (cs.sym ? " symmetric" : " device") << " round " << round
                                       << " rank " << c.local(i).rank() << ": " << err);
        }
        c.host_barrier();
      }
    }
  // Back to back, nothing between the calls on each rank's stream (the slots, flags and result areas serve
  // the next call without a meeting), and the shape changing in the middle (M 16, 7, 16 and 128 x 128, 128 x
  // 256, 128 x 128 items: other bands, other slot indices); each call on its own inputs and out.
  {
    const int64_t n = 1024, k = 2048, rows = 16;
    const int64_t ms[3] = {16, 7, 16};
    std::vector<std::unique_ptr<RankBuffers>> As, outs;  // (not movable)
    std::vector<std::vector<double>> sums(3, std::vector<double>(size_t(rows * n), 0.0));
    RankBuffers B(c, n * k * 2, false);
    std::vector<Mat> b(W);
    for (int r = 0; r < W; ++r) b[r] = make(size_t(n * k), 9700 + r);
    for (int j = 0; j < 3; ++j) {
      As.push_back(std::make_unique<RankBuffers>(c, rows * k * 2, false));
      outs.push_back(std::make_unique<RankBuffers>(c, rows * n * 2, j == 1));
      for (int r = 0; r < W; ++r) {
        const Mat a = make(size_t(rows * k), 9800 + 10 * j + r);
        gemm_ref(sums[j], a, b[r], 0, rows, n, k, true);
        for (int i = 0; i < c.num_local(); ++i)
          if (c.local(i).rank() == r) upload(c, i, As[j]->ptr[i], a.h.data(), rows * k * 2);
      }
    }
    for (int i = 0; i < c.num_local(); ++i) {
      upload(c, i, B.ptr[i], b[c.local(i).rank()].h.data(), n * k * 2);
      for (int j = 0; j < 3; ++j) poison(c, i, outs[j]->ptr[i], rows * n * 2);
    }
    c.host_barrier();
    for (int j = 0; j < 3; ++j)
      for (int i = 0; i < c.num_local(); ++i)
        matmul_all_reduce(c, c.local(i), As[j]->ptr[i], B.ptr[i], outs[j]->ptr[i], ms[j], n, k, BLayout::kNK,
                          nullptr, j == 1 ? wide : o);
    c.synchronize();
    for (int j = 0; j < 3; ++j)
      for (int i = 0; i < c.num_local(); ++i) {
        const std::vector<double> want(sums[j].begin(), sums[j].begin() + ms[j] * n);
        const std::string err = compare(get(c, i, outs[j]->ptr[i], ms[j] * n), want);
        WEFT_EXPECT(err.empty(), "split-K back to back, call " << j << " (M=" << ms[j] << ") rank "
                                                               << c.local(i).rank() << ": " << err);
      }
    c.host_barrier();
  }
  check_all_reduce_replays(c, 5, 264, 392, o, 8500, "split-K");
  check_all_reduce_replays(c, 5, 264, 392, wide, 8600, "split-K, 128 x 256 items");
  const int64_t n = 264, k = 392;
  RankBuffers A_rs(c, W * k * 2, false), B(c, n * k * 2, false), out_rs(c, n * 2, false);  // W rows, a rank
  for (int i = 0; i < c.num_local(); ++i) {
    std::string msg;
    try {
      matmul_reduce_scatter(c, c.local(i), A_rs.ptr[i], B.ptr[i], out_rs.ptr[i], W, n, k, BLayout::kNK,
                            nullptr, o);
    } catch (const Error& e) {
      msg = e.what();
    }
    WEFT_EXPECT(msg.find("kSplitK") != std::string::npos, "reduce-scatter with kSplitK: got '" << msg << "'");
  }
}

// A timeline (weft/timeline.hpp) attached to every rank records the fused kernels' phases: each rank's
// all_gather_matmul (forced fused) marks block spans, loader waits, mainloops, stores and communicator tasks,
// every span's end after its begin, and the call's result is still right; after timeline_take nothing is
// recorded any more, and a second take is refused.
WEFT_GPU_TEST(timeline_records_fused_phases) {
  Communicator& c = ctx.comm();
  const int W = c.world();
  const Shape s = kShapes[0];
  const int64_t m = W * s.shard, n = s.n, k = s.k;
  RankBuffers A(c, s.shard * k * 2, true), B(c, n * k * 2, false), out(c, m * n * 2, true);
  const Mat a = make(size_t(m * k), 31);
  std::vector<Mat> b(W);
  for (int r = 0; r < W; ++r) b[r] = make(size_t(n * k), 32 + r);
  for (int i = 0; i < c.num_local(); ++i) {
    const int r = c.local(i).rank();
    upload(c, i, A.ptr[i], a.h.data() + r * s.shard * k, s.shard * k * 2);
    upload(c, i, B.ptr[i], b[r].h.data(), n * k * 2);
    poison(c, i, out.ptr[i], m * n * 2);
  }
  c.host_barrier();
  FusedOptions o;
  o.mode = Mode::kFused;
  for (int i = 0; i < c.num_local(); ++i) c.timeline_start(c.local(i), 1 << 16);
  for (int i = 0; i < c.num_local(); ++i)
    all_gather_matmul(c, c.local(i), A.ptr[i], B.ptr[i], out.ptr[i], nullptr, m, n, k, BLayout::kNK, nullptr,
                      o);
  c.synchronize();
  for (int i = 0; i < c.num_local(); ++i) {
    const int r = c.local(i).rank();
    const TimelineRecord rec = c.timeline_take(c.local(i));
    WEFT_EXPECT(rec.rank == r && rec.dropped == 0,
                "rank " << r << ": record of rank " << rec.rank << ", " << rec.dropped << " dropped");
    int begins[int(TimelinePhase::kCount)] = {}, ends[int(TimelinePhase::kCount)] = {};
    for (size_t e = 0; e < rec.events.size(); ++e) {
      const int phase = rec.events[e].edge & ~kTimelineEnd;
      WEFT_EXPECT(phase < int(TimelinePhase::kCount), "rank " << r << ": phase " << phase);
      if (phase >= int(TimelinePhase::kCount)) break;
      (rec.events[e].edge & kTimelineEnd ? ends : begins)[phase]++;
      WEFT_EXPECT(e == 0 || rec.events[e].t_ns >= rec.events[e - 1].t_ns,
                  "rank " << r << ": events not by time");
    }
    for (TimelinePhase p : {TimelinePhase::kBlock, TimelinePhase::kWaitInputs, TimelinePhase::kMainloop,
                            TimelinePhase::kStore, TimelinePhase::kCommBegin, TimelinePhase::kCommTask})
      WEFT_EXPECT(begins[int(p)] > 0 && begins[int(p)] == ends[int(p)],
                  "rank " << r << ": " << timeline_phase_name(p) << " began " << begins[int(p)]
                          << " times, ended " << ends[int(p)]);
    std::vector<double> ref(size_t(m * n), 0.0);
    gemm_ref(ref, a, b[r], 0, m, n, k, true);
    const std::string err = compare(get(c, i, out.ptr[i], m * n), ref);
    WEFT_EXPECT(err.empty(), "all_gather_matmul with a timeline, rank " << r << ": " << err);
    std::string msg;
    try {
      c.timeline_take(c.local(i));
    } catch (const Error& e) {
      msg = e.what();
    }
    WEFT_EXPECT(msg.find("not recording") != std::string::npos, "second take: '" << msg << "'");
  }
  c.host_barrier();
}
