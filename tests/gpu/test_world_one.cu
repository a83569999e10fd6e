// Every op on a team of one rank (one GPU; torchrun --nproc_per_node=1 when debugging a tensor-parallel
// model): the collectives return their input (all-reduce of one rank, gather of one shard, ...), in place
// and out of place, at odd element counts; the fused ops return the plain product on every path. Outputs are
// poisoned (NaN) before each call. Single-process: a one-rank team on the first GPU; multi-process: only
// when the launcher started one rank.
#include <cuda_bf16.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "harness.hpp"
#include "weft/ops/fused.hpp"

using namespace weft;
using weft::test::DeviceBuffer;
using weft::test::TestContext;

namespace {

std::vector<uint16_t> random_bf16(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<uint16_t> v(n);
  for (auto& x : v) {
    const __nv_bfloat16 b = __float2bfloat16_rn(u(rng));
    std::memcpy(&x, &b, 2);
  }
  return v;
}
double to_double(uint16_t x) {
  __nv_bfloat16 b;
  std::memcpy(&b, &x, 2);
  return __bfloat162float(b);
}

std::unique_ptr<Communicator> one_rank_team(TestContext& ctx) {
  if (ctx.multi_process) {
    if (ctx.world != 1) WEFT_SKIP("multi-process with more than one rank (the team-of-one test needs 1)");
    return ctx.make_comm();
  }
  Options o = ctx.options;
  o.devices = {ctx.options.devices.empty() ? 0 : ctx.options.devices[0]};
  o.ranks_per_gpu = 1;
  return Communicator::create_single_process(o);
}

}  // namespace

WEFT_GPU_TEST_ONE_GPU(collectives_on_a_team_of_one) {
  auto comm = one_rank_team(ctx);
  Rank& r = comm->local(0);
  WEFT_CUDA_CHECK(cudaSetDevice(r.device()));
  for (size_t count : {size_t(1), size_t(1001), size_t(1 << 20) + 3}) {
    const auto host = random_bf16(count, count);
    const size_t bytes = count * 2;
    DeviceBuffer in(bytes), out(bytes);
    SymmetricBuffer sym = comm->alloc(bytes);
    auto check = [&](const void* got_dev, const char* what) {
      std::vector<uint16_t> got(count);
      WEFT_CUDA_CHECK(cudaStreamSynchronize(r.stream()));
      WEFT_CUDA_CHECK(cudaMemcpy(got.data(), got_dev, bytes, cudaMemcpyDeviceToHost));
      WEFT_EXPECT(std::memcmp(got.data(), host.data(), bytes) == 0,
                  what << " at one rank, " << count << " elements: output is not the input");
    };
    auto reset = [&] {  // the input in `in`, both outputs poisoned
      WEFT_CUDA_CHECK(cudaMemcpy(in.p, host.data(), bytes, cudaMemcpyHostToDevice));
      WEFT_CUDA_CHECK(cudaMemset(out.p, 0xff, bytes));
      WEFT_CUDA_CHECK(cudaMemset(sym.local[0], 0xff, bytes));
      WEFT_CUDA_CHECK(cudaDeviceSynchronize());  // the memsets ran on the legacy stream, the op will not
    };
    const Shape2D flat{count, 1}, wide{1, count};
    for (void* dst : {out.p, static_cast<void*>(sym.local[0])}) {
      reset();
      all_reduce(*comm, r, in.p, dst, count, DType::kBF16, ReduceOp::kSum);
      check(dst, "all_reduce");
      reset();
      all_gather(*comm, r, in.p, dst, count % 2 ? flat : wide, count % 2 ? 0 : 1, DType::kBF16);
      check(dst, "all_gather");
      reset();
      reduce_scatter(*comm, r, in.p, dst, count % 2 ? wide : flat, count % 2 ? 1 : 0, DType::kBF16,
                     ReduceOp::kMax);
      check(dst, "reduce_scatter");
      reset();
      all_to_all(*comm, r, in.p, dst, count, DType::kBF16);
      check(dst, "all_to_all");
    }
    reset();  // in place
    all_reduce(*comm, r, in.p, in.p, count, DType::kBF16, ReduceOp::kSum);
    check(in.p, "all_reduce in place");
    reset();
    all_to_all(*comm, r, in.p, in.p, count, DType::kBF16);
    check(in.p, "all_to_all in place");
    comm->free(sym);
  }
}

WEFT_GPU_TEST_ONE_GPU(fused_ops_on_a_team_of_one) {
  auto comm = one_rank_team(ctx);
  Rank& r = comm->local(0);
  WEFT_CUDA_CHECK(cudaSetDevice(r.device()));
  const int64_t m = 192, n = 136, k = 72;  // partial tiles in every dimension (M a multiple of 64: kFused)
  const auto a = random_bf16(m * k, 1), b = random_bf16(n * k, 2);
  std::vector<double> want(m * n, 0.0);  // a . b^T, b an [N, K] weight
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j)
      for (int64_t q = 0; q < k; ++q) want[i * n + j] += to_double(a[i * k + q]) * to_double(b[j * k + q]);
  DeviceBuffer da(m * k * 2), db(n * k * 2), dout(m * n * 2), dgathered(m * k * 2);
  WEFT_CUDA_CHECK(cudaMemcpy(da.p, a.data(), m * k * 2, cudaMemcpyHostToDevice));
  WEFT_CUDA_CHECK(cudaMemcpy(db.p, b.data(), n * k * 2, cudaMemcpyHostToDevice));
  using Mode = FusedOptions::Mode;
  for (Mode mode : {Mode::kAuto, Mode::kFused, Mode::kPipelined, Mode::kSequential})
    for (int op = 0; op < 3; ++op) {
      FusedOptions o;
      o.mode = mode;
      o.min_fused_m = 1;
      WEFT_CUDA_CHECK(cudaMemset(dout.p, 0xff, m * n * 2));
      WEFT_CUDA_CHECK(cudaMemset(dgathered.p, 0xff, m * k * 2));
      WEFT_CUDA_CHECK(cudaDeviceSynchronize());
      const char* name = op == 0   ? "all_gather_matmul"
                         : op == 1 ? "matmul_reduce_scatter"
                                   : "matmul_all_reduce";
      FusedPath path;
      if (op == 0)
        path =
            all_gather_matmul(*comm, r, da.p, db.p, dout.p, dgathered.p, m, n, k, BLayout::kNK, nullptr, o);
      else if (op == 1)
        path = matmul_reduce_scatter(*comm, r, da.p, db.p, dout.p, m, n, k, BLayout::kNK, nullptr, o);
      else
        path = matmul_all_reduce(*comm, r, da.p, db.p, dout.p, m, n, k, BLayout::kNK, nullptr, o);
      WEFT_CUDA_CHECK(cudaStreamSynchronize(r.stream()));
      std::vector<uint16_t> got(m * n);
      WEFT_CUDA_CHECK(cudaMemcpy(got.data(), dout.p, m * n * 2, cudaMemcpyDeviceToHost));
      double num = 0, den = 0;
      bool finite = true;
      for (int64_t i = 0; i < m * n; ++i) {
        const double g = to_double(got[i]);
        finite = finite && std::isfinite(g);
        num += (g - want[i]) * (g - want[i]);
        den += want[i] * want[i];
      }
      const double rel = std::sqrt(num / den);
      WEFT_EXPECT(finite && rel <= 1e-2, name << " (mode " << int(mode) << ", path " << fused_path_name(path)
                                              << ") at one rank: relative error " << rel
                                              << (finite ? "" : ", non-finite values"));
      if (op == 0) {
        std::vector<uint16_t> g(m * k);
        WEFT_CUDA_CHECK(cudaMemcpy(g.data(), dgathered.p, m * k * 2, cudaMemcpyDeviceToHost));
        WEFT_EXPECT(std::memcmp(g.data(), a.data(), m * k * 2) == 0,
                    name << " (mode " << int(mode) << "): gathered_a is not A");
      }
    }
}
