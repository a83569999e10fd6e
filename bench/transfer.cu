// weft-bench transfer: peer bandwidth of the three ways onto NVLink (the ParallelKittens paper's Table 1,
// measured on this machine): the copy engine, the bulk-copy engine (TMA) and 16-byte register loads and
// stores, as puts (local -> peer) and gets (peer -> local), for one pair and for all-to-all traffic.
#include <functional>
#include <memory>

#include "bench.hpp"
#include "weft/device/bulk_copy.cuh"
#include "weft/device/vec.cuh"

namespace weft::bench {
namespace {

constexpr int kMaxSegments = 32;
struct Segment {
  const char* src;
  char* dst;
  uint64_t bytes;
};
struct Segments {
  Segment s[kMaxSegments];
  int n;
};

// Blocks are dealt round-robin to segments; block b works on segment b % n as its (b / n)-th worker.
struct SegmentShare {
  Segment seg;
  uint32_t worker, workers;
  __device__ SegmentShare(const Segments& segs) {
    const uint32_t k = blockIdx.x % segs.n;
    seg = segs.s[k];
    worker = blockIdx.x / segs.n;
    workers = (gridDim.x - k + segs.n - 1) / segs.n;
  }
};

constexpr int kVecUnroll = 4;
__global__ void __launch_bounds__(1024) vec16_copy_kernel(Segments segs) {
  const SegmentShare my(segs);
  const uint4* src = reinterpret_cast<const uint4*>(my.seg.src);
  uint4* dst = reinterpret_cast<uint4*>(my.seg.dst);
  const uint64_t n = my.seg.bytes / 16, stride = uint64_t(my.workers) * blockDim.x;
  uint64_t i = uint64_t(my.worker) * blockDim.x + threadIdx.x;
  for (; i + (kVecUnroll - 1) * stride < n; i += kVecUnroll * stride) {
    uint4 v[kVecUnroll];
#pragma unroll
    for (int u = 0; u < kVecUnroll; ++u) v[u] = ld16(src + i + u * stride);
#pragma unroll
    for (int u = 0; u < kVecUnroll; ++u) st16(dst + i + u * stride, v[u]);
  }
  for (; i < n; i += stride) st16(dst + i, ld16(src + i));
}

// One thread per block drives the copy engine through a ring of shared-memory stages:
// load chunk k (global -> shared, mbarrier), store it (shared -> global, bulk group), and refill a stage
// as soon as the store that used it has finished reading it.
constexpr int kBulkStages = 4;
__global__ void bulk_copy_kernel(Segments segs, uint32_t chunk) {
  extern __shared__ __align__(128) char stage_mem[];
  __shared__ uint64_t full[kBulkStages];
  if (threadIdx.x != 0) return;
  const SegmentShare my(segs);
  const uint64_t total = (my.seg.bytes + chunk - 1) / chunk;
  const int64_t n = my.worker < total ? (total - my.worker + my.workers - 1) / my.workers : 0;
  auto offset = [&](int64_t k) { return (my.worker + uint64_t(k) * my.workers) * chunk; };
  auto size = [&](int64_t k) {
    return static_cast<uint32_t>(uint64_t(chunk) < my.seg.bytes - offset(k) ? uint64_t(chunk)
                                                                            : my.seg.bytes - offset(k));
  };
  auto load = [&](int64_t k) {
    const int s = k % kBulkStages;
    mbarrier_arrive_expect_tx(&full[s], size(k));
    bulk_load(stage_mem + s * chunk, my.seg.src + offset(k), size(k), &full[s]);
  };
  for (int s = 0; s < kBulkStages; ++s) mbarrier_init(&full[s], 1);
  fence_barrier_init();
  for (int64_t k = 0; k < n && k < kBulkStages; ++k) load(k);
  for (int64_t k = 0; k < n; ++k) {
    mbarrier_wait(&full[k % kBulkStages], (k / kBulkStages) & 1);
    bulk_store(my.seg.dst + offset(k), stage_mem + (k % kBulkStages) * chunk, size(k));
    bulk_commit();
    if (k >= 1 && k - 1 + kBulkStages < n) {
      bulk_wait_read<1>();  // the store of chunk k-1 no longer reads its stage
      load(k - 1 + kBulkStages);
    }
  }
  bulk_wait<0>();
}

enum class Mech { kCopyEngine, kTmaPut, kTmaGet, kStorePut, kLoadGet };
struct MechInfo {
  Mech m;
  const char* name;
  bool get;  // the receiver's kernel pulls
};
constexpr MechInfo kMechs[] = {{Mech::kCopyEngine, "copy engine", false},
                               {Mech::kTmaPut, "TMA put", false},
                               {Mech::kTmaGet, "TMA get", true},
                               {Mech::kStorePut, "16B st put", false},
                               {Mech::kLoadGet, "16B ld get", true}};

uint32_t bulk_chunk(uint64_t bytes, int blocks) {
  uint64_t c = bytes / blocks;
  c = std::max<uint64_t>(1024, std::min<uint64_t>(32768, c));
  return static_cast<uint32_t>(c & ~uint64_t(15));
}

// Issues one transfer of every segment with mechanism m on `stream` (copy engine: one stream per segment,
// forked from and joined to `stream`).
struct Launcher {
  std::vector<cudaStream_t> side;
  std::vector<cudaEvent_t> fork, join;
  explicit Launcher(int n) : side(n), fork(n), join(n) {
    for (int i = 0; i < n; ++i) {
      WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&side[i], cudaStreamNonBlocking));
      WEFT_CUDA_CHECK(cudaEventCreateWithFlags(&fork[i], cudaEventDisableTiming));
      WEFT_CUDA_CHECK(cudaEventCreateWithFlags(&join[i], cudaEventDisableTiming));
    }
  }
  ~Launcher() {
    for (size_t i = 0; i < side.size(); ++i) {
      cudaStreamDestroy(side[i]);
      cudaEventDestroy(fork[i]);
      cudaEventDestroy(join[i]);
    }
  }
  void run(Mech m, const Segments& segs, int sms, cudaStream_t stream) {
    if (m == Mech::kCopyEngine) {
      for (int i = 0; i < segs.n; ++i) {
        WEFT_CUDA_CHECK(cudaEventRecord(fork[i], stream));
        WEFT_CUDA_CHECK(cudaStreamWaitEvent(side[i], fork[i]));
        WEFT_CUDA_CHECK(cudaMemcpyAsync(segs.s[i].dst, segs.s[i].src, segs.s[i].bytes,
                                        cudaMemcpyDeviceToDevice, side[i]));
        WEFT_CUDA_CHECK(cudaEventRecord(join[i], side[i]));
        WEFT_CUDA_CHECK(cudaStreamWaitEvent(stream, join[i]));
      }
    } else if (m == Mech::kTmaPut || m == Mech::kTmaGet) {
      const uint32_t chunk = bulk_chunk(segs.s[0].bytes, std::max(1, sms / segs.n));
      bulk_copy_kernel<<<sms, 32, kBulkStages * chunk, stream>>>(segs, chunk);
    } else {
      vec16_copy_kernel<<<sms, 1024, 0, stream>>>(segs);
    }
    WEFT_CUDA_CHECK(cudaGetLastError());
  }
};

struct Setup {
  Communicator& comm;
  SymmetricBuffer src, dst;  // dst holds one slot of max_bytes per source rank
  uint64_t max_bytes;
  int sms;
  std::vector<std::unique_ptr<Launcher>> launchers;
};

// Times `iters` transfers on every sending rank; returns the max over ranks of the per-rank median (us).
// A team barrier before each transfer lines the ranks up, so all-to-all traffic really overlaps.
float time_transfer(Setup& st, Mech m, bool all_to_all, uint64_t bytes, int sms, int iters) {
  Communicator& c = st.comm;
  const int W = c.world();
  const bool get = m == Mech::kTmaGet || m == Mech::kLoadGet;
  const int warmup = 2;
  std::vector<std::vector<cudaEvent_t>> ev(W, std::vector<cudaEvent_t>(2 * (warmup + iters)));
  std::vector<bool> active(W, false);
  for (int i = 0; i < W; ++i) {
    WEFT_CUDA_CHECK(cudaSetDevice(c.local(i).device()));
    for (auto& e : ev[i]) WEFT_CUDA_CHECK(cudaEventCreate(&e));
  }
  for (int it = 0; it < warmup + iters; ++it) {
    c.device_barrier();
    for (int i = 0; i < W; ++i) {
      Rank& r = c.local(i);
      WEFT_CUDA_CHECK(cudaSetDevice(r.device()));
      Segments segs{};
      // One pair: data flows rank 0 -> rank 1 (rank 0 puts, or rank 1 gets). All-to-all: every rank to every
      // other.
      for (int p = 0; p < W; ++p) {
        if (p == r.rank()) continue;
        const int from = get ? p : r.rank(), to = get ? r.rank() : p;
        if (!all_to_all && !(from == 0 && to == 1)) continue;
        segs.s[segs.n++] = Segment{r.at<const char>(st.src, from),
                                   r.at<char>(st.dst, to, uint64_t(from) * st.max_bytes), bytes};
      }
      if (segs.n == 0) continue;
      active[i] = true;
      WEFT_CUDA_CHECK(cudaEventRecord(ev[i][2 * it], r.stream()));
      st.launchers[i]->run(m, segs, sms, r.stream());
      WEFT_CUDA_CHECK(cudaEventRecord(ev[i][2 * it + 1], r.stream()));
    }
  }
  c.synchronize();
  float worst = 0;
  for (int i = 0; i < W; ++i) {
    if (active[i]) {
      std::vector<float> ms;
      for (int it = warmup; it < warmup + iters; ++it) {
        float t = 0;
        WEFT_CUDA_CHECK(cudaEventElapsedTime(&t, ev[i][2 * it], ev[i][2 * it + 1]));
        ms.push_back(t);
      }
      worst = std::max(worst, median(ms));
    }
    for (auto& e : ev[i]) cudaEventDestroy(e);
  }
  return worst * 1000.0f;
}

int iters_for(uint64_t bytes, bool quick) {
  const uint64_t budget = quick ? (1ull << 30) : (8ull << 30);
  return static_cast<int>(std::clamp<uint64_t>(budget / bytes, quick ? 3 : 10, quick ? 20 : 200));
}

void run_transfer(Context& ctx) {
  Options o;
  for (int d = 0; d < ctx.gpus; ++d) o.devices.push_back(d);
  WEFT_CHECK(ctx.gpus >= 2, "transfer needs at least 2 GPUs");
  WEFT_CHECK(!ctx.env,
             "transfer runs single-process (it drives every GPU itself); start it without a launcher");
  auto comm = Communicator::create_single_process(o);
  const int W = comm->world();
  const uint64_t max_bytes = 1ull << 30;
  cudaDeviceProp prop{};
  WEFT_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  Setup st{*comm,     comm->alloc(max_bytes),   comm->alloc(max_bytes * W),
           max_bytes, prop.multiProcessorCount, {}};
  for (int i = 0; i < W; ++i) {
    WEFT_CUDA_CHECK(cudaSetDevice(comm->local(i).device()));
    WEFT_CUDA_CHECK(cudaFuncSetAttribute(bulk_copy_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         kBulkStages * 32768));
    WEFT_CUDA_CHECK(cudaMemset(st.src.local[i], 0x5a, max_bytes));
    st.launchers.push_back(std::make_unique<Launcher>(kMaxSegments));
  }
  comm->synchronize();

  std::vector<uint64_t> sizes;
  for (uint64_t b = 4096; b <= max_bytes; b *= 4) sizes.push_back(b);
  if (ctx.quick) sizes = {64 << 10, 16 << 20, 1ull << 30};
  auto gbps = [](uint64_t bytes, float us) { return fmt("%.1f", bytes / (us * 1e3)); };

  // 1. One pair, size sweep, all SMs.
  {
    std::vector<std::string> cols = {"size"};
    for (auto& m : kMechs) cols.push_back(std::string(m.name) + " GB/s");
    Table t("transfer: one pair (GPU0 -> GPU1), bandwidth vs message size, all " + std::to_string(st.sms) +
                " SMs",
            cols,
            "Unidirectional; median of many transfers. Copy engine: cudaMemcpyAsync between symmetric-heap "
            "buffers.");
    for (uint64_t b : sizes) {
      ctx.progress("transfer: one pair, %s", human_bytes(b).c_str());
      std::vector<std::string> row = {human_bytes(b)};
      for (auto& m : kMechs)
        row.push_back(gbps(b, time_transfer(st, m.m, false, b, st.sms, iters_for(b, ctx.quick))));
      t.add(row);
    }
    ctx.add(std::move(t));
  }
  // 2. One pair, SM sweep at a large size.
  {
    const uint64_t b = ctx.quick ? (256ull << 20) : (1ull << 30);
    std::vector<int> sm_counts = {1, 2, 4, 8, 16, 24, 32, 48, 64, 96, st.sms};
    if (ctx.quick) sm_counts = {1, 8, 16, 32, st.sms};
    std::vector<std::string> cols = {"SMs"};
    for (auto& m : kMechs)
      if (m.m != Mech::kCopyEngine) cols.push_back(std::string(m.name) + " GB/s");
    Table t("transfer: one pair, bandwidth vs SMs used, " + human_bytes(b), cols);
    for (int sms : sm_counts) {
      if (sms > st.sms) continue;
      ctx.progress("transfer: one pair, %d SMs", sms);
      std::vector<std::string> row = {std::to_string(sms)};
      for (auto& m : kMechs)
        if (m.m != Mech::kCopyEngine)
          row.push_back(gbps(b, time_transfer(st, m.m, false, b, sms, ctx.quick ? 3 : 5)));
      t.add(row);
    }
    ctx.add(std::move(t));
  }
  // 3. All-to-all traffic: every GPU sends `size` to every other GPU at once.
  {
    std::vector<std::string> cols = {"size per peer"};
    for (auto& m : kMechs) cols.push_back(std::string(m.name) + " GB/s");
    Table t("transfer: all-to-all among " + std::to_string(W) + " GPUs, per-GPU egress bandwidth", cols,
            "Each GPU moves (W-1) x size per transfer, to (put) or from (get) every peer at once; the "
            "slowest GPU counts.");
    for (uint64_t b : sizes) {
      if (b > (256ull << 20) && W > 2 && !ctx.quick)
        continue;  // (W-1) x 1 GiB per GPU adds little over 256 MiB
      ctx.progress("transfer: all-to-all, %s per peer", human_bytes(b).c_str());
      std::vector<std::string> row = {human_bytes(b)};
      for (auto& m : kMechs)
        row.push_back(
            gbps(b * (W - 1), time_transfer(st, m.m, true, b, st.sms, iters_for(b * (W - 1), ctx.quick))));
      t.add(row);
    }
    ctx.add(std::move(t));
  }
  comm->free(st.src);
  comm->free(st.dst);
}

}  // namespace

double measure_all_to_all_egress(Communicator& comm, uint64_t bytes_per_peer) {
  const int W = comm.world();
  cudaDeviceProp prop{};
  WEFT_CUDA_CHECK(cudaGetDeviceProperties(&prop, comm.local(0).device()));
  Setup st{comm,           comm.alloc(bytes_per_peer), comm.alloc(bytes_per_peer * W),
           bytes_per_peer, prop.multiProcessorCount,   {}};
  for (int i = 0; i < W; ++i) st.launchers.push_back(std::make_unique<Launcher>(kMaxSegments));
  const float us = time_transfer(st, Mech::kStorePut, true, bytes_per_peer, st.sms, 5);
  comm.free(st.src);
  comm.free(st.dst);
  return double(bytes_per_peer) * (W - 1) / (us * 1e3);
}

namespace {
ModeRegistrar reg("transfer", "peer bandwidth: copy engine, TMA, 16-byte ld/st; one pair and all-to-all",
                  &run_transfer);

}  // namespace
}  // namespace weft::bench
