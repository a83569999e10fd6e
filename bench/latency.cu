// weft-bench latency: the cost of cross-GPU synchronization. Signal round trip between two GPUs (weft's
// signal/wait beside two naive orderings for comparison) and the in-kernel team barrier for 2..N GPUs.
// Times come from %globaltimer inside one long kernel, so launch overhead is not in them.
#include <memory>

#include "bench.hpp"
#include "weft/comm/barrier.cuh"

namespace weft::bench {
namespace {

// Ways to signal and to wait, measured against each other (weft's choice is the library's signal_set /
// wait_ge). Only sys-scope release/acquire pairs are correct between GPUs under the PTX memory model; the
// gpu-scope and relaxed rows are there to show what the ordering costs.
constexpr const char* kSignalKinds[] = {"st.release.sys",
                                        "fence.acq_rel.sys + st.relaxed.sys",
                                        "fence.sc.sys + st.relaxed.sys",
                                        "red.release.sys.add",
                                        "atom.release.sys.exch",
                                        "fence.acq_rel.gpu + st.relaxed.sys (gpu scope)",
                                        "st.relaxed.sys (no order)"};
constexpr const char* kWaitKinds[] = {"ld.acquire.sys poll", "relaxed poll + fence.acq_rel.sys",
                                      "relaxed poll + ld.acquire.sys", "relaxed poll + fence.acq_rel.gpu",
                                      "relaxed poll (no order)"};
constexpr int kWeftKind = -1;         // signal_set / wait_ge
constexpr int kWeftHoistedKind = -2;  // fence_release early, signal_set<Order::kRelaxed> / wait_ge

__device__ __forceinline__ void send_kind(int kind, const TeamView& team, uint64_t* inbox, int peer,
                                          uint64_t v) {
  uint64_t* remote = team.peer_ptr(inbox, peer);
  switch (kind) {
    case kWeftKind:
      signal_set(team, inbox, peer, v);
      break;
    case kWeftHoistedKind:
      signal_set<Order::kRelaxed>(team, inbox, peer, v);
      fence_release();  // publishes what the next signal covers; overlaps the wait for the peer
      break;
    case 0:
      ptx::st_release_sys(remote, v);
      break;
    case 1:
      ptx::fence_acq_rel_sys();
      ptx::st_relaxed_sys(remote, v);
      break;
    case 2:
      ptx::fence_sc_sys();
      ptx::st_relaxed_sys(remote, v);
      break;
    case 3:
      ptx::red_release_sys_add(remote, 1);
      break;  // values rise by one per round
    case 4:
      ptx::atom_exch_release_sys(remote, v);
      break;
    case 5:
      ptx::fence_acq_rel_gpu();
      ptx::st_relaxed_sys(remote, v);
      break;
    default:
      ptx::st_relaxed_sys(remote, v);
      break;
  }
}

// Bounded spins: a broken variant must not hang the benchmark.
__device__ __forceinline__ bool await_kind(int kind, const TeamView& team, uint64_t* inbox, uint64_t v) {
  if (kind < 0) return wait_ge(team, inbox, v);
  for (long spin = 0; spin < (1l << 30); ++spin) {
    if (kind == 0) {
      if (ptx::ld_acquire_sys(inbox) >= v) return true;
      continue;
    }
    if (ptx::ld_relaxed_sys(inbox) < v) continue;
    if (kind == 1) ptx::fence_acq_rel_sys();
    if (kind == 2) ptx::ld_acquire_sys(inbox);
    if (kind == 3) ptx::fence_acq_rel_gpu();
    return true;
  }
  return false;
}

// Rank `initiator` sends round i, the other echoes it; `rounds` round trips after a handshake barrier.
__global__ void pingpong_kernel(TeamView team, uint64_t* inbox, int peer, bool initiator, int rounds,
                                uint64_t base, int signal_kind, int wait_kind, unsigned long long* elapsed_ns,
                                unsigned long long* failures) {
  if (!barrier_block(team, 3)) return;
  if (signal_kind == kWeftHoistedKind) fence_release();
  const uint64_t t0 = ptx::globaltimer_ns();
  for (int i = 1; i <= rounds; ++i) {
    const uint64_t v = base + i;
    if (initiator) send_kind(signal_kind, team, inbox, peer, v);
    if (!await_kind(wait_kind, team, inbox, v)) {
      atomicAdd(failures, 1ull);
      return;
    }
    if (!initiator) send_kind(signal_kind, team, inbox, peer, v);
  }
  *elapsed_ns = ptx::globaltimer_ns() - t0;
}

template <bool kGrid>
__global__ void barrier_loop_kernel(TeamView team, int warmup, int rounds, unsigned long long* elapsed_ns) {
  auto bar = [&] { return kGrid ? barrier_grid(team, 4) : barrier_block(team, 4); };
  for (int i = 0; i < warmup; ++i)
    if (!bar()) return;
  const uint64_t t0 = ptx::globaltimer_ns();
  for (int i = 0; i < rounds; ++i)
    if (!bar()) return;
  if (threadIdx.x == 0 && blockIdx.x == 0) *elapsed_ns = ptx::globaltimer_ns() - t0;
}

std::unique_ptr<Communicator> team_of(std::vector<int> devices) {
  Options o;
  o.devices = std::move(devices);
  return Communicator::create_single_process(o);
}

// Round trip on a two-rank team, in microseconds: the best of 3 runs of `rounds` round trips.
struct PingPong {
  std::unique_ptr<Communicator> c;
  SymmetricBuffer buf;
  uint64_t sent = 0;  // flags only grow: each run continues where the last stopped
  PingPong(int a, int b) : c(team_of({a, b})), buf(c->alloc(64)) {
    for (int i = 0; i < 2; ++i) {
      WEFT_CUDA_CHECK(cudaSetDevice(c->local(i).device()));
      WEFT_CUDA_CHECK(cudaMemset(buf.local[i], 0, 64));
    }
    c->synchronize();
  }
  double round_trip_us(int signal_kind, int wait_kind, int rounds) {
    double best = 1e30;
    for (int rep = 0; rep < 3; ++rep) {
      for (int i = 0; i < 2; ++i) {
        Rank& r = c->local(i);
        WEFT_CUDA_CHECK(cudaSetDevice(r.device()));
        auto* p = reinterpret_cast<uint64_t*>(buf.local[i]);
        pingpong_kernel<<<1, 1, 0, r.stream()>>>(r.view(), p, 1 - i, i == 0, rounds, sent, signal_kind,
                                                 wait_kind, reinterpret_cast<unsigned long long*>(p + 2),
                                                 reinterpret_cast<unsigned long long*>(p + 3));
        WEFT_CUDA_CHECK(cudaGetLastError());
      }
      c->synchronize();
      sent += rounds;
      uint64_t v[4];
      WEFT_CUDA_CHECK(cudaSetDevice(c->local(0).device()));
      WEFT_CUDA_CHECK(cudaMemcpy(v, buf.local[0], sizeof(v), cudaMemcpyDeviceToHost));
      WEFT_CHECK(v[3] == 0, "ping-pong variant lost a signal");
      best = std::min(best, v[2] / 1e3 / rounds);
    }
    return best;
  }
};

// Per-barrier time: the slowest rank's loop time over the number of barriers.
template <bool kGrid>
double barrier_us(int world, int blocks, int rounds) {
  std::vector<int> devs;
  for (int d = 0; d < world; ++d) devs.push_back(d);
  auto c = team_of(devs);
  SymmetricBuffer buf = c->alloc(64);
  for (int i = 0; i < world; ++i) {
    Rank& r = c->local(i);
    WEFT_CUDA_CHECK(cudaSetDevice(r.device()));
    barrier_loop_kernel<kGrid><<<blocks, 128, 0, r.stream()>>>(
        r.view(), 200, rounds, reinterpret_cast<unsigned long long*>(buf.local[i]));
    WEFT_CUDA_CHECK(cudaGetLastError());
  }
  c->synchronize();
  double worst = 0;
  for (int i = 0; i < world; ++i) {
    uint64_t ns = 0;
    WEFT_CUDA_CHECK(cudaSetDevice(c->local(i).device()));
    WEFT_CUDA_CHECK(cudaMemcpy(&ns, buf.local[i], sizeof(ns), cudaMemcpyDeviceToHost));
    worst = std::max(worst, ns / 1e3 / rounds);
  }
  c->free(buf);
  return worst;
}

void run_latency(Context& ctx) {
  WEFT_CHECK(ctx.gpus >= 2, "latency needs at least 2 GPUs");
  WEFT_CHECK(!ctx.env,
             "latency runs single-process (it drives every GPU itself); start it without a launcher");
  const int rounds = ctx.quick ? 2000 : 20000;
  {
    Table t(
        "latency: signal round trip between two GPUs (us)",
        {"pair", "release fused: signal_set / wait_ge",
         "release hoisted: fence_release .. signal_set<kRelaxed> / wait_ge"},
        "Both orderings publish the sender's earlier writes (sys-scope release, acquire polling). Fused: the "
        "release is part of the signal. Hoisted: the fence is issued right after the data, overlapping the "
        "wait for the peer. Best of 3 runs of " +
            std::to_string(rounds) + " round trips inside one kernel.");
    for (int b = 1; b < ctx.gpus; ++b) {
      ctx.progress("latency: round trip GPU0 <-> GPU%d", b);
      PingPong pp(0, b);
      t.add({fmt("0 <-> %d", b), fmt("%.2f", pp.round_trip_us(kWeftKind, kWeftKind, rounds)),
             fmt("%.2f", pp.round_trip_us(kWeftHoistedKind, kWeftHoistedKind, rounds))});
    }
    ctx.add(std::move(t));
  }
  {
    std::vector<std::string> cols = {"signal \\ wait"};
    for (auto* w : kWaitKinds) cols.push_back(w);
    Table t("latency: round trip GPU0 <-> GPU1 by memory ordering (us)", cols,
            "What each ordering costs. Correct between GPUs: sys-scope release with sys-scope acquire.");
    PingPong pp(0, 1);
    const int n = ctx.quick ? 1000 : 5000;
    for (int s = 0; s < int(std::size(kSignalKinds)); ++s) {
      ctx.progress("latency: ordering matrix, signal %s", kSignalKinds[s]);
      std::vector<std::string> row = {kSignalKinds[s]};
      for (int w = 0; w < int(std::size(kWaitKinds)); ++w)
        row.push_back(fmt("%.2f", pp.round_trip_us(s, w, n)));
      t.add(row);
    }
    ctx.add(std::move(t));
  }
  {
    cudaDeviceProp prop{};
    WEFT_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    const int sms = prop.multiProcessorCount;
    Table t("latency: in-kernel team barrier (us per barrier)",
            {"GPUs", "barrier_block (1 block)", "barrier_grid (8 blocks)", "barrier_grid (32 blocks)",
             fmt("barrier_grid (%d blocks)", sms)},
            "Slowest rank's time per barrier over " + std::to_string(rounds / 4) + " back-to-back barriers.");
    for (int w = 2; w <= ctx.gpus; ++w) {
      ctx.progress("latency: barrier, %d GPUs", w);
      t.add({std::to_string(w), fmt("%.2f", barrier_us<false>(w, 1, rounds / 4)),
             fmt("%.2f", barrier_us<true>(w, 8, rounds / 4)),
             fmt("%.2f", barrier_us<true>(w, 32, rounds / 4)),
             fmt("%.2f", barrier_us<true>(w, sms, rounds / 4))});
    }
    ctx.add(std::move(t));
  }
}

ModeRegistrar reg("latency", "signal round trip and in-kernel barrier latency, 2..N GPUs", &run_latency);

}  // namespace
}  // namespace weft::bench
