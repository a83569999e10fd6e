// weft-bench flash_decode: weft::flash_decode (q_len 1, bf16, D 128) on a team of one (GPU 0; a team row's
// local part also on each of the team's GPUs alone) and over all the team's GPUs (each sequence's cache split
// evenly), against the floor: the KV bytes a rank reads over the GPU's copy rate (cudaMemcpy device to device
// of 1 GiB, read + write traffic, measured in the same run). CUDA graphs of many calls, the cache rotating
// through copies past L2, the slowest rank's median; team rows also with the output on rank 0 alone
// (DecodeOptions::out_rank). The torch baselines (SDPA; local decode + NCCL all-gather + merge) are
// python/benchmarks/decode.py's.
#include <cuda_runtime.h>

#include <algorithm>
#include <filesystem>
#include <memory>
#include <vector>

#include "bench.hpp"
#include "weft/ops/flash_decode.hpp"

namespace weft::bench {
namespace {

struct DecodeCase {
  int64_t batch, seq, heads, kv_heads;
};

// Bytes moved per second by a device-to-device copy on GPU `device` (read + write).
double copy_rate(int device, cudaStream_t s) {
  WEFT_CUDA_CHECK(cudaSetDevice(device));
  constexpr size_t kBytes = size_t(1) << 30;
  DeviceBuffer a(kBytes), b(kBytes);
  const float ms = median_call_ms(
      [&] { WEFT_CUDA_CHECK(cudaMemcpyAsync(b.p, a.p, kBytes, cudaMemcpyDeviceToDevice, s)); }, 10, s);
  return 2.0 * double(kBytes) / (double(ms) * 1e-3);
}

struct DecodeRow {
  double us;
  std::vector<std::string> cells;
};

// One row: every local rank's part of the cache (seq / W tokens of each sequence), timed in graphs. With
// --timeline and `timelines`, one call's in-kernel timeline (TimelinePhase::kDecode's steps) into it.
DecodeRow run_case(Context& ctx, Communicator& comm, const std::vector<cudaStream_t>& streams,
                   const DecodeCase& c, double rate, BenchTeam* team, std::vector<Table>* timelines) {
  const int W = comm.world(), L = comm.num_local();
  const int64_t local = (c.seq + W - 1) / W, D = 128;
  const DecodeShape shape{c.batch, 1, c.heads, c.kv_heads, D, local};
  struct Buffers {
    std::unique_ptr<DeviceBuffer> q, out, meta;
    std::vector<std::unique_ptr<DeviceBuffer>> k, v;  // rotating copies of the cache
  };
  // The cache (K and V) rotates through copies (rotating_sets), call k reading copy k % sets.
  const size_t kv = size_t(c.batch) * local * c.kv_heads * D;
  const int sets = rotating_sets(4 * kv, comm.local(0).device());
  std::vector<Buffers> rs(L);
  for (int i = 0; i < L; ++i) {
    Rank& r = comm.local(i);
    WEFT_CUDA_CHECK(cudaSetDevice(r.device()));
    rs[i].q = std::make_unique<DeviceBuffer>(c.batch * c.heads * D * 2);
    rs[i].out = std::make_unique<DeviceBuffer>(c.batch * c.heads * D * 2);
    rs[i].meta = std::make_unique<DeviceBuffer>(3 * c.batch * 4);
    fill_uniform_bf16(rs[i].q->p, c.batch * c.heads * D, 1, streams[i]);
    for (int s = 0; s < sets; ++s) {
      rs[i].k.push_back(std::make_unique<DeviceBuffer>(kv * 2));
      rs[i].v.push_back(std::make_unique<DeviceBuffer>(kv * 2));
      fill_uniform_bf16(rs[i].k[s]->p, kv, 2 + r.rank() + 100 * s, streams[i]);
      fill_uniform_bf16(rs[i].v[s]->p, kv, 3 + r.rank() + 100 * s, streams[i]);
    }
    std::vector<int32_t> meta(3 * c.batch);
    for (int64_t b = 0; b < c.batch; ++b) {
      const int64_t first = std::min(c.seq, r.rank() * local);
      meta[b] = int32_t(std::min(c.seq, first + local) - first);
      meta[c.batch + b] = int32_t(first);
      meta[2 * c.batch + b] = int32_t(c.seq);
    }
    WEFT_CUDA_CHECK(
        cudaMemcpyAsync(rs[i].meta->p, meta.data(), meta.size() * 4, cudaMemcpyHostToDevice, streams[i]));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(streams[i]));
  }
  DecodeOptions o;
  auto call = [&](int k) {
    for (int i = 0; i < L; ++i) {
      WEFT_CUDA_CHECK(cudaSetDevice(comm.local(i).device()));
      DecodeCache cache;
      cache.k = rs[i].k[k % sets]->p;
      cache.v = rs[i].v[k % sets]->p;
      const auto* meta = static_cast<const int32_t*>(rs[i].meta->p);
      cache.seqlens = meta;
      cache.offsets = meta + c.batch;
      cache.seq_total = meta + 2 * c.batch;
      flash_decode(comm, comm.local(i), rs[i].q->p, cache, rs[i].out->p, nullptr, shape, DType::kBF16,
                   streams[i], o);
    }
  };
  call(0);  // the inbox grows before any capture
  comm.synchronize();
  const auto timed = [&] {
    const double us_rank = time_graphs(comm, streams, 20, ctx.quick ? 3 : 7, call);
    return team ? team->team_max(us_rank) : us_rank;
  };
  const double us = timed();
  // One call, and three in one graph: the ranks start apart in the first (one host thread launches them in
  // turn) and re-align through its merges, so the later calls show the steady state the timed graphs of 20
  // measure. Teams of one too (the local part against which a team's overhead is read).
  for (int calls : {1, 3})
    if (timelines && !ctx.timeline_dir.empty())
      timelines->push_back(record_timeline(
          comm, streams,
          [&] {
            for (int k = 0; k < calls; ++k) call(k);
          },
          fmt("flash_decode on %d GPU%s, batch=%lld tokens=%lld (this rank's %lld) heads=%lld/%lld, "
              "%d call%s in one graph",
              W, W > 1 ? "s" : "", (long long)c.batch, (long long)c.seq, (long long)local, (long long)c.heads,
              (long long)c.kv_heads, calls, calls > 1 ? "s" : ""),
          ctx.timeline_dir + fmt("/flash_decode_w%d_%lld_%lld_%lld_x%d.csv", W, (long long)c.batch,
                                 (long long)c.seq, (long long)c.heads, calls)));
  std::string one_rank_us;
  if (W > 1) {
    o.out_rank = 0;
    one_rank_us = fmt("%.1f", timed());
  }
  const double bytes = double(c.batch) * local * c.kv_heads * D * 2 * 2;  // K and V this rank reads
  const double floor_us = bytes / rate * 1e6;
  return {us,
          {std::to_string(W), std::to_string(c.batch), std::to_string(c.seq),
           fmt("%lld/%lld", (long long)c.heads, (long long)c.kv_heads), fmt("%.1f", us), one_rank_us,
           fmt("%.1f", floor_us), fmt("%.0f", bytes / (us * 1e-6) / 1e9),
           fmt("%.0f%%", 100.0 * floor_us / us), "", "", "", ""}};
}

void run_flash_decode(Context& ctx) {
  BenchTeam team(ctx);
  Communicator& comm = *team.comm;
  const double rate = copy_rate(comm.local(0).device(), team.streams[0]);
  std::vector<DecodeCase> cases = {{1, 8192, 64, 8},  {1, 131072, 64, 8}, {16, 8192, 64, 8},
                                   {64, 8192, 32, 8}, {8, 32768, 32, 8},  {1, 1 << 20, 64, 8}};
  if (ctx.quick) cases = {{1, 32768, 64, 8}, {16, 8192, 64, 8}, {8, 32768, 32, 8}};
  if (ctx.decode_grid) {  // issue 55's local target: batch 1-64 x 8k-128k tokens, GQA 64/8 and 32/8
    cases.clear();
    for (int64_t heads : {64, 32})
      for (int64_t batch : {1, 4, 16, 64})
        for (int64_t seq : {8192, 32768, 131072}) cases.push_back({batch, seq, heads, 8});
  }
  Table t(
      fmt("flash_decode, bf16, D 128, q_len 1, on %s and on one GPU", ctx.team_label().c_str()),
      {"GPUs", "batch", "tokens", "heads", "weft us", "out on rank 0 us", "floor us", "KV GB/s per GPU",
       "floor / weft", "local part on one GPU us", "team - local us", "local part, slowest GPU us",
       "team - slowest local us"},
      fmt("floor = the KV bytes a GPU reads / the device-to-device copy's traffic rate measured in the same "
          "run (%.0f GB/s); the team splits each sequence's cache evenly. Graphs of 20 calls, the slowest "
          "rank's median. local part = the same call on one GPU (the team's first) over one rank's share of "
          "the tokens (issue 55's team target: team <= local + 10 us); slowest GPU: the local part timed "
          "on each of the team's GPUs alone, in turn, the largest (the team's calls wait for their slowest "
          "rank).",
          rate / 1e9));
  // A team of one on each local GPU: the local part alone on every GPU of the team.
  std::vector<std::unique_ptr<Communicator>> singles;
  for (int i = 0; i < comm.num_local(); ++i) {
    Options one;
    one.devices = {comm.local(i).device()};
    singles.push_back(Communicator::create_single_process(one));
  }
  Communicator& single = *singles[0];
  const std::vector<cudaStream_t> one_stream = {team.streams[0]};
  std::vector<Table> timelines;
  if (!ctx.timeline_dir.empty()) std::filesystem::create_directories(ctx.timeline_dir);
  for (const DecodeCase& c : cases) {
    ctx.progress("flash_decode: batch %lld tokens %lld, one GPU", (long long)c.batch, (long long)c.seq);
    t.add(run_case(ctx, single, one_stream, c, rate, nullptr, &timelines).cells);
    const int W = comm.world();
    if (W > 1 && !ctx.decode_grid) {
      ctx.progress("flash_decode: batch %lld tokens %lld, %d GPUs", (long long)c.batch, (long long)c.seq, W);
      DecodeRow row = run_case(ctx, comm, team.streams, c, rate, &team, &timelines);
      DecodeCase part = c;
      part.seq = (c.seq + W - 1) / W;
      const double local_us = run_case(ctx, single, one_stream, part, rate, nullptr, &timelines).us;
      double slowest_us = local_us;
      for (size_t i = 1; i < singles.size(); ++i)
        slowest_us = std::max(slowest_us,
                              run_case(ctx, *singles[i], {team.streams[i]}, part, rate, nullptr, nullptr).us);
      row.cells[9] = fmt("%.1f", local_us);
      row.cells[10] = fmt("%.1f", row.us - local_us);
      row.cells[11] = fmt("%.1f", slowest_us);
      row.cells[12] = fmt("%.1f", row.us - slowest_us);
      t.add(row.cells);
    }
  }
  ctx.add(std::move(t));
  for (Table& tl : timelines) ctx.add(std::move(tl));
}

ModeRegistrar reg("flash_decode",
                  "distributed flash-decode: one GPU and the team, against the KV read floor (bf16, D 128)",
                  &run_flash_decode, 1, false, /*by_default=*/true);

}  // namespace
}  // namespace weft::bench
