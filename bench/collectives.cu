// weft-bench allreduce / allgather / reducescatter / alltoall / broadcast / scatter / gather / reduce /
// alltoallv: weft against NCCL (C API) in the same run,
// nccl-tests columns. Both sides are timed as CUDA graphs of many back-to-back calls on every GPU at once;
// a rank's time is the median over graph launches, the row's time the slowest rank's. Small messages
// rotate through several buffer sets so L2 does not serve the data. weft uses symmetric-heap buffers
// (zero-copy), NCCL plain cudaMalloc buffers (as nccl-tests does). #wrong counts elements where weft's
// result differs from NCCL's on the same random input (beyond bf16 rounding for reductions).
#include <nccl.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>

#include "bench.hpp"
#include "weft/ops/collectives.hpp"

namespace weft::bench {
namespace {

enum class Coll { kAllReduce, kAllGather, kReduceScatter, kAllToAll, kBroadcast, kScatter, kGather, kReduce };
// The rooted collectives' root in these runs.
constexpr int kRoot = 0;
bool rooted_at_receiver(Coll c) {  // only the root has a defined output
  return c == Coll::kGather || c == Coll::kReduce;
}
const char* coll_name(Coll c) {
  switch (c) {
    case Coll::kAllReduce:
      return "all-reduce";
    case Coll::kAllGather:
      return "all-gather";
    case Coll::kReduceScatter:
      return "reduce-scatter";
    case Coll::kAllToAll:
      return "all-to-all";
    case Coll::kBroadcast:
      return "broadcast";
    case Coll::kScatter:
      return "scatter";
    case Coll::kGather:
      return "gather";
    case Coll::kReduce:
      return "reduce";
  }
  return "?";
}

// nccl-tests conventions: `size` is the larger of the per-rank buffers (all-gather: the output, reduce-
// scatter: the input); busbw = algbw * factor.
struct Geometry {
  uint64_t in_bytes, out_bytes, count;  // count: elements of the size column
  double bus_factor;
};
Geometry geometry(Coll c, uint64_t size, int W, uint64_t es) {
  switch (c) {
    case Coll::kAllReduce:
      return {size, size, size / es, 2.0 * (W - 1) / W};
    case Coll::kAllGather:
      return {size / W, size, size / es, double(W - 1) / W};
    case Coll::kReduceScatter:
      return {size, size / W, size / es, double(W - 1) / W};
    case Coll::kAllToAll:
      return {size, size, size / es, double(W - 1) / W};
    case Coll::kBroadcast:
    case Coll::kReduce:
      return {size, size, size / es, 1.0};
    case Coll::kScatter:
      return {size, size / W, size / es, double(W - 1) / W};
    case Coll::kGather:
      return {size / W, size, size / es, double(W - 1) / W};
  }
  return {};
}

struct Side {  // one implementation's buffers on every GPU, `sets` rotating copies
  std::vector<std::vector<char*>> in, out;  // [set][rank]
  std::vector<SymmetricBuffer> sym;
};

// Tuning the automatic choices: weft-bench --ar-algo forces an all-reduce algorithm, --flow the
// reduce-scatter / two-shot flow (CollectiveOptions).
CollectiveOptions forced_options(const Context& ctx) {
  CollectiveOptions x;
  if (ctx.ar_algo == "oneshot") x.algo = AllReduceAlgo::kOneShot;
  if (ctx.ar_algo == "twoshot") x.algo = AllReduceAlgo::kTwoShot;
  if (ctx.flow == "pull") x.flow = ReduceFlow::kPull;
  if (ctx.flow == "steps") x.flow = ReduceFlow::kSteps;
  if (ctx.flow == "push") x.flow = ReduceFlow::kPush;
  return x;
}

void enqueue_weft(Communicator& comm, Coll c, int i, const void* in, void* out, const Geometry& g,
                  cudaStream_t s, const CollectiveOptions& forced) {
  Rank& r = comm.local(i);
  const int W = comm.world();
  switch (c) {
    case Coll::kAllReduce:
      return all_reduce(comm, r, in, out, g.count, DType::kBF16, ReduceOp::kSum, s, forced);
    case Coll::kAllGather:
      return all_gather(comm, r, in, out, Shape2D{g.in_bytes / 2, 1}, 0, DType::kBF16, s);
    case Coll::kReduceScatter:
      return reduce_scatter(comm, r, in, out, Shape2D{g.out_bytes / 2, 1}, 0, DType::kBF16, ReduceOp::kSum, s,
                            forced);
    case Coll::kAllToAll:
      return all_to_all(comm, r, in, out, g.count / W, DType::kBF16, s);
    case Coll::kBroadcast:
      return broadcast(comm, r, in, out, g.count, DType::kBF16, kRoot, s);
    case Coll::kScatter:
      return scatter(comm, r, in, out, g.out_bytes / 2, DType::kBF16, kRoot, s);
    case Coll::kGather:
      return gather(comm, r, in, out, g.in_bytes / 2, DType::kBF16, kRoot, s);
    case Coll::kReduce:
      return reduce(comm, r, in, out, g.count, DType::kBF16, ReduceOp::kSum, kRoot, s);
  }
}

void enqueue_nccl(ncclComm_t nc, Coll c, const void* in, void* out, const Geometry& g, int W,
                  cudaStream_t s) {
  switch (c) {
    case Coll::kAllReduce:
      WEFT_NCCL_CHECK(ncclAllReduce(in, out, g.count, ncclBfloat16, ncclSum, nc, s));
      return;
    case Coll::kAllGather:
      WEFT_NCCL_CHECK(ncclAllGather(in, out, g.in_bytes / 2, ncclBfloat16, nc, s));
      return;
    case Coll::kReduceScatter:
      WEFT_NCCL_CHECK(ncclReduceScatter(in, out, g.out_bytes / 2, ncclBfloat16, ncclSum, nc, s));
      return;
    case Coll::kAllToAll: {
      const size_t n = g.count / W;
      WEFT_NCCL_CHECK(ncclGroupStart());
      for (int p = 0; p < W; ++p) {
        WEFT_NCCL_CHECK(ncclSend(static_cast<const char*>(in) + p * n * 2, n, ncclBfloat16, p, nc, s));
        WEFT_NCCL_CHECK(ncclRecv(static_cast<char*>(out) + p * n * 2, n, ncclBfloat16, p, nc, s));
      }
      WEFT_NCCL_CHECK(ncclGroupEnd());
      return;
    }
    case Coll::kBroadcast:
      WEFT_NCCL_CHECK(ncclBroadcast(in, out, g.count, ncclBfloat16, kRoot, nc, s));
      return;
    case Coll::kReduce:
      WEFT_NCCL_CHECK(ncclReduce(in, out, g.count, ncclBfloat16, ncclSum, kRoot, nc, s));
      return;
    case Coll::kScatter:
    case Coll::kGather: {  // send / recv in a group, as nccl-tests does
      int me = 0;
      WEFT_NCCL_CHECK(ncclCommUserRank(nc, &me));
      const bool scatter = c == Coll::kScatter;
      const size_t n = (scatter ? g.out_bytes : g.in_bytes) / 2;
      const char* src = static_cast<const char*>(in);
      char* dst = static_cast<char*>(out);
      WEFT_NCCL_CHECK(ncclGroupStart());
      if (me == kRoot)
        for (int p = 0; p < W; ++p) {
          if (scatter)
            WEFT_NCCL_CHECK(ncclSend(src + p * n * 2, n, ncclBfloat16, p, nc, s));
          else
            WEFT_NCCL_CHECK(ncclRecv(dst + p * n * 2, n, ncclBfloat16, p, nc, s));
        }
      if (scatter)
        WEFT_NCCL_CHECK(ncclRecv(dst, n, ncclBfloat16, kRoot, nc, s));
      else
        WEFT_NCCL_CHECK(ncclSend(src, n, ncclBfloat16, kRoot, nc, s));
      WEFT_NCCL_CHECK(ncclGroupEnd());
      return;
    }
  }
}

float bf16_to_float(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

void run_collective(Context& ctx, Coll which) {
  WEFT_CHECK(ctx.team_size() >= 2, std::string(coll_name(which)) + " needs at least 2 ranks");
  BenchTeam team(ctx);
  const bool nccl_on = team.has_nccl();  // virtual ranks: weft alone
  Communicator* comm = team.comm.get();
  const int W = team.world(), L = team.local();
  const CollectiveOptions forced = forced_options(ctx);
  std::vector<ncclComm_t>& nccl = team.nccl;
  std::vector<cudaStream_t>& streams = team.streams;
  auto team_max = [&](double x) { return team.team_max(x); };
  double link = 0;  // one process per GPU or virtual ranks: not measured
  if (!ctx.env && nccl_on) {
    ctx.progress("%s: measuring the link (all-to-all puts, 256 MiB per peer)", coll_name(which));
    link = measure_all_to_all_egress(*comm, 256ull << 20);
  }

  std::vector<uint64_t> sizes = {8 << 10, 32 << 10, 128 << 10, 512 << 10, 1 << 20,
                                 4 << 20, 16 << 20, 64 << 20,  256 << 20, 1ull << 30};
  if (ctx.quick) sizes = {8 << 10, 1 << 20, 64 << 20, 256 << 20};
  // Tuning runs: --min-bytes / --max-bytes keep a range of sizes.
  sizes.erase(std::remove_if(sizes.begin(), sizes.end(),
                             [&](uint64_t b) {
                               return (ctx.min_bytes && b < ctx.min_bytes) ||
                                      (ctx.max_bytes && b > ctx.max_bytes);
                             }),
              sizes.end());
  Table t(fmt("%s, bf16, %s: weft vs NCCL %d.%d.%d", coll_name(which), ctx.team_label().c_str(), NCCL_MAJOR,
              NCCL_MINOR, NCCL_PATCH),
          {"size", "count", "type", "NCCL time us", "NCCL busbw", "weft time us", "weft algbw", "weft busbw",
           "#wrong", "speedup", "% link"},
          "Times: CUDA graphs of many calls, slowest rank's median. busbw in GB/s; " +
              (link > 0 ? fmt("%% link = weft busbw over the per-GPU all-to-all egress measured just before "
                              "(%.0f GB/s).",
                              link)
                        : std::string("% link: not measured with one process per GPU or virtual ranks.")) +
              (nccl_on ? "" : " No NCCL on virtual ranks: its columns are empty, #wrong counts NaN only."));
  for (uint64_t size : sizes) {
    const Geometry g = geometry(which, size, W, 2);
    if (g.count % W != 0 && (which == Coll::kAllToAll || which == Coll::kScatter || which == Coll::kGather))
      continue;
    ctx.progress("%s: %s", coll_name(which), human_bytes(size).c_str());
    const int sets = size <= (16u << 20) ? 4 : 1;  // rotate small buffers past the 50-60 MB L2
    Side ws, ns;
    for (int k = 0; k < sets; ++k) {
      SymmetricBuffer a = comm->alloc(g.in_bytes), b = comm->alloc(g.out_bytes);
      ws.sym.push_back(a);
      ws.sym.push_back(b);
      ws.in.push_back(a.local);
      ws.out.push_back(b.local);
      std::vector<char*> ni(L), no(L);
      for (int i = 0; i < L; ++i) {
        WEFT_CUDA_CHECK(cudaSetDevice(comm->local(i).device()));
        WEFT_CUDA_CHECK(cudaMalloc(&ni[i], g.in_bytes));
        WEFT_CUDA_CHECK(cudaMalloc(&no[i], g.out_bytes));
      }
      ns.in.push_back(ni);
      ns.out.push_back(no);
    }
    // Same random input on both sides; one call each; compare.
    for (int i = 0; i < L; ++i) {
      std::vector<uint16_t> host(g.in_bytes / 2);
      std::mt19937 rng(1234 + comm->local(i).rank());
      std::uniform_real_distribution<float> u(-1.f, 1.f);
      for (auto& h : host) {
        float f = u(rng);
        uint32_t x;
        std::memcpy(&x, &f, 4);
        h = static_cast<uint16_t>((x + 0x8000u) >> 16);
      }
      WEFT_CUDA_CHECK(cudaSetDevice(comm->local(i).device()));
      for (int k = 0; k < sets; ++k) {
        WEFT_CUDA_CHECK(cudaMemcpy(ws.in[k][i], host.data(), g.in_bytes, cudaMemcpyHostToDevice));
        WEFT_CUDA_CHECK(cudaMemcpy(ns.in[k][i], host.data(), g.in_bytes, cudaMemcpyHostToDevice));
        WEFT_CUDA_CHECK(cudaMemset(ws.out[k][i], 0xff, g.out_bytes));
      }
    }
    auto nccl_all = [&](int k) {
      if (!nccl_on) return;
      WEFT_NCCL_CHECK(ncclGroupStart());
      for (int i = 0; i < L; ++i) {
        WEFT_CUDA_CHECK(cudaSetDevice(comm->local(i).device()));
        enqueue_nccl(nccl[i], which, ns.in[k % sets][i], ns.out[k % sets][i], g, W, streams[i]);
      }
      WEFT_NCCL_CHECK(ncclGroupEnd());
    };
    for (int i = 0; i < L; ++i)
      enqueue_weft(*comm, which, i, ws.in[0][i], ws.out[0][i], g, streams[i], forced);
    nccl_all(0);
    uint64_t wrong = 0;
    for (int i = 0; i < L; ++i) {
      if (rooted_at_receiver(which) && comm->local(i).rank() != kRoot) continue;
      WEFT_CUDA_CHECK(cudaSetDevice(comm->local(i).device()));
      WEFT_CUDA_CHECK(cudaStreamSynchronize(streams[i]));
      std::vector<uint16_t> a(g.out_bytes / 2), b(g.out_bytes / 2);
      WEFT_CUDA_CHECK(cudaMemcpy(a.data(), ws.out[0][i], g.out_bytes, cudaMemcpyDeviceToHost));
      WEFT_CUDA_CHECK(cudaMemcpy(b.data(), ns.out[0][i], g.out_bytes, cudaMemcpyDeviceToHost));
      const bool reduction =
          which == Coll::kAllReduce || which == Coll::kReduceScatter || which == Coll::kReduce;
      for (size_t k = 0; k < a.size(); ++k) {
        const float x = bf16_to_float(a[k]), y = bf16_to_float(b[k]);
        if (std::isnan(x) ||
            (nccl_on && (reduction ? std::fabs(x - y) > 2e-2f * std::max(1.f, std::fabs(y)) : a[k] != b[k])))
          ++wrong;
      }
    }
    comm->check_device_errors();
    wrong = static_cast<uint64_t>(team_max(double(wrong)));  // any rank's mismatches show

    const int iters = size <= (1u << 20) ? 200 : size <= (64u << 20) ? 20 : 4;
    const int reps = ctx.quick ? 3 : 7;
    const double t_nccl_local = nccl_on ? time_graphs(*comm, streams, iters, reps, nccl_all) : 0.0;
    const double t_weft_local = time_graphs(*comm, streams, iters, reps, [&](int k) {
      for (int i = 0; i < L; ++i)
        enqueue_weft(*comm, which, i, ws.in[k % sets][i], ws.out[k % sets][i], g, streams[i], forced);
    });
    const double t_nccl = team_max(t_nccl_local), t_weft = team_max(t_weft_local);
    const double alg_w = size / (t_weft * 1e3), bus_w = alg_w * g.bus_factor;
    const double bus_n = size / (t_nccl * 1e3) * g.bus_factor;
    auto nccl_cell = [&](const std::string& s) { return nccl_on ? s : std::string("-"); };
    t.add({human_bytes(size), std::to_string(g.count), "bf16", nccl_cell(fmt("%.1f", t_nccl)),
           nccl_cell(fmt("%.1f", bus_n)), fmt("%.1f", t_weft), fmt("%.1f", alg_w), fmt("%.1f", bus_w),
           std::to_string(wrong), nccl_cell(fmt("%.2fx", t_nccl / t_weft)),
           link > 0 ? fmt("%.0f%%", 100.0 * bus_w / link) : std::string("-")});
    for (auto& b : ws.sym) comm->free(b);
    for (int k = 0; k < sets; ++k)
      for (int i = 0; i < L; ++i) {
        WEFT_CUDA_CHECK(cudaSetDevice(comm->local(i).device()));
        WEFT_CUDA_CHECK(cudaFree(ns.in[k][i]));
        WEFT_CUDA_CHECK(cudaFree(ns.out[k][i]));
      }
  }
  ctx.add(std::move(t));
}

// all_to_all_v: MoE-style routing, `tokens` rows of 4096 bf16 per rank split among the ranks by a fixed
// random draw (some parts empty). weft reads the counts on the GPU; NCCL's grouped send / recv is given them
// on the host (its best case: a real MoE layer first copies them to the host, a synchronisation weft avoids).
void run_all_to_all_v(Context& ctx) {
  WEFT_CHECK(ctx.team_size() >= 2, "alltoallv needs at least 2 ranks");
  BenchTeam team(ctx);
  const bool nccl_on = team.has_nccl();
  Communicator* comm = team.comm.get();
  const int W = team.world(), L = team.local();
  constexpr int64_t kHidden = 4096;
  std::vector<int64_t> token_counts = {128, 1024, 4096, 16384};
  if (ctx.quick) token_counts = {128, 4096};
  Table t(
      fmt("all_to_all_v, bf16 rows of %lld, %s: weft (counts on the GPU) vs NCCL %d.%d.%d send / recv "
          "(counts "
          "on the host)",
          (long long)kHidden, ctx.team_label().c_str(), NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH),
      {"tokens / rank", "MiB / rank", "NCCL time us", "weft time us", "#wrong", "speedup"},
      "Times: CUDA graphs of many calls, slowest rank's median. Counts: a fixed random split of each rank's "
      "tokens, one part in five empty.");
  for (int64_t tokens : token_counts) {
    std::mt19937_64 rng(77 + tokens);
    std::vector<std::vector<int64_t>> counts(W, std::vector<int64_t>(W, 0));
    for (int s = 0; s < W; ++s)
      for (int64_t k = 0; k < tokens; ++k) ++counts[s][rng() % W];
    int64_t cap = 0;
    for (int q = 0; q < W; ++q) {
      int64_t col = 0;
      for (int s = 0; s < W; ++s) col += counts[s][q];
      cap = std::max(cap, col);
    }
    const uint64_t row = kHidden * 2, in_bytes = tokens * row, out_bytes = cap * row;
    SymmetricBuffer win = comm->alloc(in_bytes), wout = comm->alloc(std::max<uint64_t>(out_bytes, 256));
    std::vector<char*> nin(L), nout(L);
    std::vector<int64_t*> dev_counts(L);
    for (int i = 0; i < L; ++i) {
      const int r = comm->local(i).rank();
      WEFT_CUDA_CHECK(cudaSetDevice(comm->local(i).device()));
      WEFT_CUDA_CHECK(cudaMalloc(&nin[i], in_bytes));
      WEFT_CUDA_CHECK(cudaMalloc(&nout[i], std::max<uint64_t>(out_bytes, 256)));
      WEFT_CUDA_CHECK(cudaMalloc(&dev_counts[i], 2 * W * 8));
      WEFT_CUDA_CHECK(cudaMemcpy(dev_counts[i], counts[r].data(), W * 8, cudaMemcpyHostToDevice));
      std::vector<uint16_t> host(in_bytes / 2);
      for (size_t k = 0; k < host.size(); ++k) host[k] = static_cast<uint16_t>(0x3f80 + (k + r * 131) % 97);
      WEFT_CUDA_CHECK(cudaMemcpy(win.local[i], host.data(), in_bytes, cudaMemcpyHostToDevice));
      WEFT_CUDA_CHECK(cudaMemcpy(nin[i], host.data(), in_bytes, cudaMemcpyHostToDevice));
    }
    auto weft_all = [&](int) {
      for (int i = 0; i < L; ++i)
        all_to_all_v(*comm, comm->local(i), win.local[i], dev_counts[i], tokens, wout.local[i],
                     dev_counts[i] + W, cap, kHidden, DType::kBF16, team.streams[i]);
    };
    auto nccl_all = [&](int) {
      if (!nccl_on) return;
      WEFT_NCCL_CHECK(ncclGroupStart());
      for (int i = 0; i < L; ++i) {
        const int r = comm->local(i).rank();
        WEFT_CUDA_CHECK(cudaSetDevice(comm->local(i).device()));
        int64_t src = 0, dst = 0;
        for (int q = 0; q < W; ++q) {
          WEFT_NCCL_CHECK(ncclSend(nin[i] + src * row, counts[r][q] * kHidden, ncclBfloat16, q, team.nccl[i],
                                   team.streams[i]));
          WEFT_NCCL_CHECK(ncclRecv(nout[i] + dst * row, counts[q][r] * kHidden, ncclBfloat16, q, team.nccl[i],
                                   team.streams[i]));
          src += counts[r][q];
          dst += counts[q][r];
        }
      }
      WEFT_NCCL_CHECK(ncclGroupEnd());
    };
    weft_all(0);
    nccl_all(0);
    uint64_t wrong = 0;
    for (int i = 0; i < L; ++i) {
      const int r = comm->local(i).rank();
      int64_t got = 0;
      for (int s = 0; s < W; ++s) got += counts[s][r];
      WEFT_CUDA_CHECK(cudaSetDevice(comm->local(i).device()));
      WEFT_CUDA_CHECK(cudaStreamSynchronize(team.streams[i]));
      std::vector<uint16_t> a(got * kHidden), b(got * kHidden);
      WEFT_CUDA_CHECK(cudaMemcpy(a.data(), wout.local[i], got * row, cudaMemcpyDeviceToHost));
      WEFT_CUDA_CHECK(cudaMemcpy(b.data(), nout[i], got * row, cudaMemcpyDeviceToHost));
      for (size_t k = 0; k < a.size(); ++k) wrong += nccl_on && a[k] != b[k];
    }
    comm->check_device_errors();
    wrong = static_cast<uint64_t>(team.team_max(double(wrong)));
    const int iters = tokens <= 1024 ? 100 : 20, reps = ctx.quick ? 3 : 7;
    const double tn = nccl_on ? team.team_max(time_graphs(*comm, team.streams, iters, reps, nccl_all)) : 0.0;
    const double tw = team.team_max(time_graphs(*comm, team.streams, iters, reps, weft_all));
    t.add({std::to_string(tokens), fmt("%.1f", in_bytes / 1048576.0), nccl_on ? fmt("%.1f", tn) : "-",
           fmt("%.1f", tw), std::to_string(wrong), nccl_on ? fmt("%.2fx", tn / tw) : "-"});
    comm->free(win);
    comm->free(wout);
    for (int i = 0; i < L; ++i) {
      WEFT_CUDA_CHECK(cudaSetDevice(comm->local(i).device()));
      WEFT_CUDA_CHECK(cudaFree(nin[i]));
      WEFT_CUDA_CHECK(cudaFree(nout[i]));
      WEFT_CUDA_CHECK(cudaFree(dev_counts[i]));
    }
  }
  ctx.add(std::move(t));
}

ModeRegistrar r1(
    "allreduce", "bf16 all-reduce vs NCCL, 8 KiB..1 GiB",
    [](Context& c) { run_collective(c, Coll::kAllReduce); }, 2, true);
ModeRegistrar r2(
    "allgather", "bf16 all-gather vs NCCL", [](Context& c) { run_collective(c, Coll::kAllGather); }, 2, true);
ModeRegistrar r3(
    "reducescatter", "bf16 reduce-scatter vs NCCL",
    [](Context& c) { run_collective(c, Coll::kReduceScatter); }, 2, true);
ModeRegistrar r4(
    "alltoall", "bf16 all-to-all vs NCCL", [](Context& c) { run_collective(c, Coll::kAllToAll); }, 2, true);
ModeRegistrar r5(
    "broadcast", "bf16 broadcast from rank 0 vs NCCL",
    [](Context& c) { run_collective(c, Coll::kBroadcast); }, 2, true);
ModeRegistrar r6(
    "scatter", "bf16 scatter from rank 0 vs NCCL send / recv",
    [](Context& c) { run_collective(c, Coll::kScatter); }, 2, true);
ModeRegistrar r7(
    "gather", "bf16 gather to rank 0 vs NCCL send / recv",
    [](Context& c) { run_collective(c, Coll::kGather); }, 2, true);
ModeRegistrar r9(
    "alltoallv", "bf16 all-to-all with variable splits (MoE routing) vs NCCL send / recv",
    [](Context& c) { run_all_to_all_v(c); }, 2, true);
ModeRegistrar r8(
    "reduce", "bf16 sum to rank 0 vs NCCL", [](Context& c) { run_collective(c, Coll::kReduce); }, 2, true);

}  // namespace
}  // namespace weft::bench
