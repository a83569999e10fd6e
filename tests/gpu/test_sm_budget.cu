// GPU tests of the SM budget and of the guards that virtual ranks need: a budget the GPU cannot hold for
// every rank on it is refused when the team is made; a kernel needing more resident blocks than the budget is
// refused before launch (forced), and kAuto takes a path that fits; a team with a budget of a few SMs
// computes right (tests/gpu/run.sh also runs the collective and fused suites under --sm-budget 4); a rank
// handed a pointer into another rank's heap is told so (with virtual ranks the device check cannot see it).
#include <cuda_bf16.h>

#include <string>
#include <vector>

#include "harness.hpp"
#include "weft/ops/collectives.hpp"
#include "weft/ops/fused.hpp"

using namespace weft;
using weft::test::RankBuffers;
using weft::test::TestContext;

namespace {

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return {};
}

std::vector<__nv_bfloat16> filled(size_t n, float v) {
  return std::vector<__nv_bfloat16>(n, __float2bfloat16_rn(v));
}

// Counts elements of a bf16 buffer on local rank i that differ from `want` (exact: small integers).
size_t mismatches(Communicator& c, int i, const void* p, size_t n, float want) {
  std::vector<__nv_bfloat16> h(n);
  weft::test::download(c, i, h.data(), p, n * 2);
  size_t bad = 0;
  for (auto x : h) bad += __bfloat162float(x) != want;
  return bad;
}

// A [m, k] filled with rank + 1 and B [n, k] of ones on every local rank: products are exact small integers.
void upload_rank_and_ones(Communicator& c, RankBuffers& a, RankBuffers& b, int64_t m, int64_t n, int64_t k) {
  for (int i = 0; i < c.num_local(); ++i) {
    weft::test::upload(c, i, a.ptr[i], filled(size_t(m * k), float(c.local(i).rank() + 1)).data(), m * k * 2);
    weft::test::upload(c, i, b.ptr[i], filled(size_t(n * k), 1.f).data(), n * k * 2);
  }
}

// A team of this run's mode whose ranks may each keep `sms` SMs busy.
std::unique_ptr<Communicator> team_with_budget(TestContext& ctx, int sms) {
  Options o = ctx.options;
  o.sm_budget = sms;
  return ctx.make_comm_with(o);
}

}  // namespace

WEFT_GPU_TEST(sm_budget_above_the_gpu_share_is_refused) {
  const Rank& r = ctx.comm().local(0);
  const int share = r.device_sms() / ctx.comm().ranks_per_gpu();
  Options o = ctx.options;
  o.sm_budget = share + 1;
  const std::string msg = error_of([&] { ctx.make_comm_with(o); });
  WEFT_EXPECT(msg.find("SM budget of " + std::to_string(share + 1)) != std::string::npos &&
                  msg.find("at most " + std::to_string(share)) != std::string::npos,
              "got '" << msg << "'");
}

// A team with a budget of 4 SMs per rank: what needs more is refused with the budget named, kAuto fits,
// and the results are right.
WEFT_GPU_TEST(small_sm_budget_refuses_big_grids_and_computes_right) {
  auto comm = team_with_budget(ctx, 4);
  Communicator& c = *comm;
  const int W = c.world();
  for (int i = 0; i < c.num_local(); ++i) WEFT_EXPECT(c.local(i).sm_budget() == 4, c.local(i).sm_budget());

  // All-reduce of 256 KiB: a one-shot needs 32-64 resident blocks.
  const size_t count = 128 << 10;
  RankBuffers in(c, count * 2, true), out(c, count * 2, false);
  for (int i = 0; i < c.num_local(); ++i) {
    weft::test::upload(c, i, in.ptr[i], filled(count, float(c.local(i).rank() + 1)).data(), count * 2);
    weft::test::poison(c, i, out.ptr[i], count * 2);
  }
  c.host_barrier();
  for (int i = 0; i < c.num_local(); ++i) {
    const std::string msg = error_of([&] {
      all_reduce(c, c.local(i), in.ptr[i], out.ptr[i], count, DType::kBF16, ReduceOp::kSum, nullptr,
                 AllReduceAlgo::kOneShot);
    });
    WEFT_EXPECT(msg.find("SM budget of 4") != std::string::npos, "forced one-shot: got '" << msg << "'");
  }
  for (int i = 0; i < c.num_local(); ++i)
    all_reduce(c, c.local(i), in.ptr[i], out.ptr[i], count, DType::kBF16, ReduceOp::kSum);
  c.synchronize();
  for (int i = 0; i < c.num_local(); ++i)
    WEFT_EXPECT(mismatches(c, i, out.ptr[i], count, float(W * (W + 1) / 2)) == 0, "all_reduce, rank " << i);
  c.host_barrier();

  // Fused ops: A and B of ones (K = 64), so every output is an exact small integer.
  const int64_t shard = 128, m = W * shard, n = 256, k = 64;
  RankBuffers a(c, m * k * 2, true), b(c, n * k * 2, false), y(c, m * n * 2, false);
  upload_rank_and_ones(c, a, b, m, n, k);
  c.host_barrier();
  FusedOptions fo;
  fo.mode = FusedOptions::Mode::kFused;
  fo.comm_blocks = 4;  // nothing left for the GEMM
  for (int i = 0; i < c.num_local(); ++i) {
    const std::string msg = error_of([&] {
      all_gather_matmul(c, c.local(i), a.ptr[i], b.ptr[i], y.ptr[i], nullptr, m, n, k, BLayout::kNK, nullptr,
                        fo);
    });
    WEFT_EXPECT(msg.find("SM budget of 4") != std::string::npos, "all_gather_matmul: got '" << msg << "'");
  }
  fo.comm_blocks = 0;  // auto: 2 of the 4
  for (int op = 0; op < 2; ++op) {
    for (int i = 0; i < c.num_local(); ++i) weft::test::poison(c, i, y.ptr[i], m * n * 2);
    c.host_barrier();
    for (int i = 0; i < c.num_local(); ++i) {
      const FusedPath path = op == 0 ? all_gather_matmul(c, c.local(i), a.ptr[i], b.ptr[i], y.ptr[i], nullptr,
                                                         m, n, k, BLayout::kNK, nullptr, fo)
                                     : matmul_reduce_scatter(c, c.local(i), a.ptr[i], b.ptr[i], y.ptr[i], m,
                                                             n, k, BLayout::kNK, nullptr, fo);
      WEFT_EXPECT(path == FusedPath::kFused, fused_path_name(path));
    }
    c.synchronize();
    for (int i = 0; i < c.num_local(); ++i) {
      if (op == 0) {  // row block q holds rank q's shard, all (q + 1): out = (q + 1) * K
        std::vector<__nv_bfloat16> h(size_t(m * n));
        weft::test::download(c, i, h.data(), y.ptr[i], m * n * 2);
        size_t bad = 0;
        for (int64_t row = 0; row < m; ++row)
          for (int64_t j = 0; j < n; ++j)
            bad += __bfloat162float(h[row * n + j]) != float((row / shard + 1) * k);
        WEFT_EXPECT(bad == 0, "all_gather_matmul rank " << c.local(i).rank() << ": " << bad << " wrong");
      } else {  // sum over ranks q of (q + 1) * K
        WEFT_EXPECT(mismatches(c, i, y.ptr[i], size_t(shard * n), float(k * W * (W + 1) / 2)) == 0,
                    "matmul_reduce_scatter rank " << c.local(i).rank());
      }
    }
    c.host_barrier();
  }
}

// A budget of one SM cannot hold the fused RS kernel (a communicator block and a GEMM block): forced, it is
// refused; kAuto, whose rule picks it at 2 ranks for this shape, falls back to the sequential path, right.
WEFT_GPU_TEST(kauto_falls_back_when_the_budget_cannot_hold_the_fused_kernel) {
  auto comm = team_with_budget(ctx, 1);
  Communicator& c = *comm;
  const int W = c.world();
  const int64_t shard = 128, m = W * shard, n = 256, k = 64;
  RankBuffers a(c, m * k * 2, false), b(c, n * k * 2, false), y(c, shard * n * 2, false);
  upload_rank_and_ones(c, a, b, m, n, k);
  for (int i = 0; i < c.num_local(); ++i) weft::test::poison(c, i, y.ptr[i], shard * n * 2);
  c.host_barrier();
  FusedOptions fo;
  fo.mode = FusedOptions::Mode::kFused;
  for (int i = 0; i < c.num_local(); ++i) {
    const std::string msg = error_of([&] {
      matmul_reduce_scatter(c, c.local(i), a.ptr[i], b.ptr[i], y.ptr[i], m, n, k, BLayout::kNK, nullptr, fo);
    });
    WEFT_EXPECT(msg.find("SM budget of 1") != std::string::npos, "forced fused: got '" << msg << "'");
  }
  fo.mode = FusedOptions::Mode::kAuto;
  fo.min_fused_m = 0;
  for (int i = 0; i < c.num_local(); ++i) {
    const FusedPath path = matmul_reduce_scatter(c, c.local(i), a.ptr[i], b.ptr[i], y.ptr[i], m, n, k,
                                                 BLayout::kNK, nullptr, fo);
    WEFT_EXPECT(path == FusedPath::kSequential, fused_path_name(path));
  }
  c.synchronize();
  for (int i = 0; i < c.num_local(); ++i)
    WEFT_EXPECT(mismatches(c, i, y.ptr[i], size_t(shard * n), float(k * W * (W + 1) / 2)) == 0,
                "matmul_reduce_scatter rank " << c.local(i).rank());
}

// Rank i handed a pointer into another rank's heap (a peer's buffer, or its own view of a peer) hears so.
WEFT_GPU_TEST(pointer_into_another_ranks_heap_is_refused) {
  Communicator& c = ctx.comm();
  SymmetricBuffer buf = c.alloc(1 << 20);
  for (int i = 0; i < c.num_local(); ++i) {
    Rank& r = c.local(i);
    const int peer = (r.rank() + 1) % c.world();
    char* theirs = r.at(buf, peer);  // this rank's view of the peer's copy
    const std::string msg =
        error_of([&] { all_reduce(c, r, theirs, buf.local[i], 1024, DType::kFP32, ReduceOp::kSum); });
    WEFT_EXPECT(
        msg.find("points into rank " + std::to_string(peer) + "'s symmetric heap") != std::string::npos,
        "got '" << msg << "'");
  }
  c.free(buf);
}
