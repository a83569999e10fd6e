// weft-bench latency: the cost of cross-GPU synchronization. Signal round trip between two GPUs (weft's
// signal/wait beside two naive orderings for comparison) and the in-kernel team barrier for 2..N GPUs.
// Times come from %globaltimer inside one long kernel, so launch overhead is not in them.
#include <memory>

#include "bench.hpp"
#include "weft/comm/barrier.cuh"

namespace weft::bench {
namespace {

enum class Ordering { kWeft, kAcquirePoll, kRelaxed };

// Rank `initiator` sends value i, the other echoes it; rounds round trips after a handshake barrier.
template <Ordering O>
__global__ void pingpong_kernel(TeamView team, uint64_t* inbox, int peer, bool initiator, int rounds, uint64_t base,
                                unsigned long long* elapsed_ns, unsigned long long* failures) {
  if (!barrier_block(team, 3)) return;
  uint64_t* remote = team.peer_ptr(inbox, peer);
  auto send = [&](uint64_t v) {
    if constexpr (O == Ordering::kRelaxed) ptx::st_relaxed_sys(remote, v);
    else ptx::st_release_sys(remote, v);
  };
  auto await = [&](uint64_t v) -> bool {
    if constexpr (O == Ordering::kWeft) {
      return wait_ge(team, inbox, v);
    } else {
      // Bounded spins: a broken variant must not hang the benchmark.
      for (long spin = 0; spin < (1l << 31); ++spin) {
        const uint64_t x = O == Ordering::kAcquirePoll ? ptx::ld_acquire_sys(inbox) : ptx::ld_relaxed_sys(inbox);
        if (x >= v) return true;
      }
      return false;
    }
  };
  const uint64_t t0 = ptx::globaltimer_ns();
  for (int i = 1; i <= rounds; ++i) {
    const uint64_t v = base + i;
    if (initiator) send(v);
    if (!await(v)) {
      atomicAdd(failures, 1ull);
      return;
    }
    if (!initiator) send(v);
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

// Round trip between devices a and b, in microseconds per round trip.
template <Ordering O>
double round_trip_us(int a, int b, int rounds) {
  auto c = team_of({a, b});
  SymmetricBuffer buf = c->alloc(64);
  for (int i = 0; i < 2; ++i) {
    WEFT_CUDA_CHECK(cudaSetDevice(c->local(i).device()));
    WEFT_CUDA_CHECK(cudaMemset(buf.local[i], 0, 64));
  }
  c->synchronize();
  double best = 1e30;
  for (int rep = 0; rep < 3; ++rep) {
    for (int i = 0; i < 2; ++i) {
      Rank& r = c->local(i);
      WEFT_CUDA_CHECK(cudaSetDevice(r.device()));
      auto* p = reinterpret_cast<uint64_t*>(buf.local[i]);
      pingpong_kernel<O><<<1, 1, 0, r.stream()>>>(r.view(), p, 1 - i, i == 0, rounds, uint64_t(rep) * rounds,
                                                  reinterpret_cast<unsigned long long*>(p + 2),
                                                  reinterpret_cast<unsigned long long*>(p + 3));
      WEFT_CUDA_CHECK(cudaGetLastError());
    }
    c->synchronize();
    uint64_t v[4];
    WEFT_CUDA_CHECK(cudaSetDevice(c->local(0).device()));
    WEFT_CUDA_CHECK(cudaMemcpy(v, buf.local[0], sizeof(v), cudaMemcpyDeviceToHost));
    WEFT_CHECK(v[3] == 0, "ping-pong variant lost a signal");
    best = std::min(best, v[2] / 1e3 / rounds);
  }
  c->free(buf);
  return best;
}

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
    barrier_loop_kernel<kGrid><<<blocks, 128, 0, r.stream()>>>(r.view(), 200, rounds,
                                                               reinterpret_cast<unsigned long long*>(buf.local[i]));
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
  const int rounds = ctx.quick ? 2000 : 20000;
  {
    Table t("latency: signal round trip between two GPUs (us)",
            {"pair", "weft signal/wait", "release store + acquire poll", "relaxed store + relaxed poll"},
            "weft: st.release.sys, relaxed polling then one fence.acq_rel.sys. The relaxed variant orders nothing "
            "(a lower bound, not usable for data). Best of 3 runs of " + std::to_string(rounds) + " round trips.");
    for (int b = 1; b < ctx.gpus; ++b) {
      ctx.progress("latency: round trip GPU0 <-> GPU%d", b);
      t.add({fmt("0 <-> %d", b), fmt("%.2f", round_trip_us<Ordering::kWeft>(0, b, rounds)),
             fmt("%.2f", round_trip_us<Ordering::kAcquirePoll>(0, b, rounds)),
             fmt("%.2f", round_trip_us<Ordering::kRelaxed>(0, b, rounds))});
    }
    ctx.add(std::move(t));
  }
  {
    cudaDeviceProp prop{};
    WEFT_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    Table t("latency: in-kernel team barrier (us per barrier)",
            {"GPUs", "barrier_block (1 block)", fmt("barrier_grid (%d blocks)", prop.multiProcessorCount)},
            "Slowest rank's time per barrier over " + std::to_string(rounds / 4) + " back-to-back barriers.");
    for (int w = 2; w <= ctx.gpus; ++w) {
      ctx.progress("latency: barrier, %d GPUs", w);
      t.add({std::to_string(w), fmt("%.2f", barrier_us<false>(w, 1, rounds / 4)),
             fmt("%.2f", barrier_us<true>(w, prop.multiProcessorCount, rounds / 4))});
    }
    ctx.add(std::move(t));
  }
}

ModeRegistrar reg("latency", "signal round trip and in-kernel barrier latency, 2..N GPUs", &run_latency);

}  // namespace
}  // namespace weft::bench
