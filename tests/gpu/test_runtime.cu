// GPU tests of the runtime and the synchronization primitives: symmetric heap, signal/wait, barriers,
// the timeout and abort paths, and teardown hygiene. Each test runs on every rank of the team, in
// single-process mode (one process, all GPUs) or one process per rank.
#include <dirent.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <thread>

#include "harness.hpp"
#include "weft/comm/barrier.cuh"
#include "weft/comm/signal.cuh"

using namespace weft;
using weft::test::TestContext;

namespace {

template <class F>
void for_each_local(Communicator& c, F&& f) {
  for (int i = 0; i < c.num_local(); ++i) {
    Rank& r = c.local(i);
    WEFT_CUDA_CHECK(cudaSetDevice(r.device()));
    f(r, i);
  }
}

// Zeroes a symmetric buffer on every rank and makes sure every rank finished before anyone writes into it.
void zero_buffer(Communicator& c, const SymmetricBuffer& b) {
  for_each_local(
      c, [&](Rank& r, int i) { WEFT_CUDA_CHECK(cudaMemsetAsync(b.local[i], 0, b.bytes, r.stream())); });
  c.synchronize();
  c.host_barrier();
}

uint64_t read_u64(const Rank& r, const void* p) {
  uint64_t v = 0;
  WEFT_CUDA_CHECK(cudaSetDevice(r.device()));
  WEFT_CUDA_CHECK(cudaMemcpy(&v, p, sizeof(v), cudaMemcpyDeviceToHost));
  return v;
}

// Synchronizes and returns the error message, or "" if there was none.
std::string sync_error(Communicator& c) {
  try {
    c.synchronize();
  } catch (const Error& e) {
    return e.what();
  }
  return {};
}

int count_open_fds() {
  int n = 0;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (readdir(d)) ++n;
    closedir(d);
  }
  return n;
}

__device__ __forceinline__ int value_of(int round, int src, int i) {
  return round * 7919 + src * 131 + i;
}

enum class Meet { kBlockBarrier, kGridBarrier, kHoistedSignals };

// A one-block meeting built from hoisted-release signals: fence as soon as the data is written, then a
// relaxed signal. Checks that fence_release + signal_set<Order::kRelaxed> publishes the data.
__device__ bool hoisted_meet(const TeamView& team, uint64_t* inbox, uint64_t round) {
  __syncthreads();
  for (int p = threadIdx.x; p < team.world; p += blockDim.x) {
    if (p == team.rank) continue;
    fence_release();
    signal_set<Order::kRelaxed>(team, inbox + team.rank, p, round);
  }
  bool ok = true;
  for (int p = threadIdx.x; p < team.world; p += blockDim.x)
    if (p != team.rank) ok &= wait_ge(team, inbox + p, round);
  return __syncthreads_and(ok) != 0;
}

// Every round: each rank writes its slot of `box` on every peer with plain stores, the team meets, and
// each rank checks every slot it received. A second meeting keeps the next round's writes out until all
// checks are done. Mismatches are counted in `bad`.
template <Meet kMeet>
__global__ void exchange_kernel(TeamView team, int* box, int ints_per_slot, int rounds,
                                unsigned long long* bad, int slot, uint64_t* inbox = nullptr) {
  auto meet = [&](uint64_t n) {
    if constexpr (kMeet == Meet::kGridBarrier)
      return barrier_grid(team, slot);
    else if constexpr (kMeet == Meet::kBlockBarrier)
      return barrier_block(team, slot);
    else
      return hoisted_meet(team, inbox, n);
  };
  const int nthreads = blockDim.x * gridDim.x;
  const int tid = threadIdx.x + blockIdx.x * blockDim.x;
  for (int round = 1; round <= rounds; ++round) {
    for (int p = 0; p < team.world; ++p) {
      int* dst = team.peer_ptr(box, p) + team.rank * ints_per_slot;
      for (int i = tid; i < ints_per_slot; i += nthreads) dst[i] = value_of(round, team.rank, i);
    }
    if (!meet(2 * round - 1)) return;
    for (int src = 0; src < team.world; ++src)
      for (int i = tid; i < ints_per_slot; i += nthreads)
        if (box[src * ints_per_slot + i] != value_of(round, src, i)) atomicAdd(bad, 1ull);
    if (!meet(2 * round)) return;
  }
}

// One block per peer; the lower rank of each pair serves, the higher answers.
__global__ void pingpong_all_pairs_kernel(TeamView team, uint64_t* inbox, int rounds,
                                          unsigned long long* bad) {
  const int p = blockIdx.x;
  if (p == team.rank || threadIdx.x != 0) return;
  for (int i = 1; i <= rounds; ++i) {
    // Each side checks the exact value before answering: the next one cannot have been sent yet.
    auto check = [&] {
      if (*reinterpret_cast<volatile uint64_t*>(inbox + p) != static_cast<uint64_t>(i)) atomicAdd(bad, 1ull);
    };
    if (team.rank < p) {
      signal_set(team, inbox + team.rank, p, i);
      if (!wait_ge(team, inbox + p, i)) return;
      check();
    } else {
      if (!wait_ge(team, inbox + p, i)) return;
      check();
      signal_set(team, inbox + team.rank, p, i);
    }
  }
}

__global__ void signal_add_kernel(TeamView team, uint64_t* counter, int reps) {
  for (int k = 0; k < reps; ++k)
    for (int p = 0; p < team.world; ++p)
      if (p != team.rank) signal_add(team, counter, p, 1);
}

__global__ void wait_kernel(TeamView team, const uint64_t* flag, uint64_t want) {
  (void)wait_ge(team, flag, want);  // the test reads the failure from the host
}

__global__ void many_barriers_kernel(TeamView team, int n, int slot) {
  for (int i = 0; i < n; ++i)
    if (!barrier_block(team, slot)) return;
}

}  // namespace

WEFT_GPU_TEST(team_layout) {
  Communicator& c = ctx.comm();
  WEFT_EXPECT(c.world() == ctx.world, c.world());
  for_each_local(c, [&](Rank& r, int) {
    const TeamView& v = r.view();
    WEFT_EXPECT(v.world == c.world(), v.world);
    WEFT_EXPECT(v.local_base == r.heap_of(r.rank()), "local base is this rank's heap");
    // The device-side peer table must match the host's view of every peer's heap.
    std::vector<uint64_t> table(c.world());
    WEFT_CUDA_CHECK(cudaMemcpy(table.data(), v.pad() + SignalPadLayout::kPeerTableOffset,
                               sizeof(uint64_t) * c.world(), cudaMemcpyDeviceToHost));
    for (int p = 0; p < c.world(); ++p)
      WEFT_EXPECT(table[p] == reinterpret_cast<uint64_t>(r.heap_of(p)), "peer table entry " << p);
    WEFT_EXPECT(r.sm_budget() == c.local(0).sm_budget() && r.sm_budget() >= 1 &&
                    r.sm_budget() * c.ranks_per_gpu() <= r.device_sms(),
                "rank " << r.rank() << ": SM budget " << r.sm_budget() << " of " << r.device_sms() << " SMs, "
                        << c.ranks_per_gpu() << " ranks per GPU");
  });
  // Virtual ranks map every heap at addresses of their own (the mapping path of separate processes); one
  // rank per GPU in one process shares its owner's address.
  for (int i = 0; i < c.num_local(); ++i)
    for (int j = 0; j < i; ++j)
      for (int p = 0; p < c.world(); ++p) {
        const bool same = c.local(i).heap_of(p) == c.local(j).heap_of(p);
        WEFT_EXPECT(same == (c.ranks_per_gpu() == 1),
                    "rank " << c.local(i).rank() << " and rank " << c.local(j).rank() << " see rank " << p
                            << "'s heap at " << (same ? "one" : "two") << " address(es)");
      }
}

WEFT_GPU_TEST(symmetric_alloc_same_offsets_and_reuse) {
  Communicator& c = ctx.comm();
  const uint64_t g = c.heap_granularity();
  SymmetricBuffer a = c.alloc(1000), b = c.alloc(3 * g + 1), d = c.alloc(g);
  WEFT_EXPECT(a.bytes == g && b.bytes == 4 * g && d.bytes == g, "sizes round up to the granularity " << g);
  // Earlier tests of the same process may leave holes in the heap (ops keep their workspaces), so the
  // placement is checked relative to them: disjoint blocks, and b's hole found again by the next block of
  // its size (b went to the lowest hole that fit it; a and d only shrank holes). The allocator's placement
  // on an empty heap is tested on the host (tests/host/test_heap_allocator.cpp).
  auto disjoint = [](const SymmetricBuffer& x, const SymmetricBuffer& y) {
    return x.offset + x.bytes <= y.offset || y.offset + y.bytes <= x.offset;
  };
  WEFT_EXPECT(disjoint(a, b) && disjoint(a, d) && disjoint(b, d), "live blocks overlap");
  for_each_local(
      c, [&](Rank& r, int i) { WEFT_EXPECT(b.local[i] == r.heap_of(r.rank()) + b.offset, "local ptr"); });
  const uint64_t b_off = b.offset;
  c.free(b);
  SymmetricBuffer e = c.alloc(4 * g);
  WEFT_EXPECT(e.offset == b_off, "a freed hole is reused first");
  c.free(a);
  c.free(d);
  c.free(e);
}

// Runs exchange_kernel<kMeet> on every rank: box = [world slots of `ints`][mismatch counter][inbox].
template <Meet kMeet>
void check_exchange(TestContext& ctx, int ints, int rounds, int blocks, int threads, int slot) {
  Communicator& c = ctx.comm();
  const uint64_t data_bytes = sizeof(int) * ints * c.world();
  SymmetricBuffer box = c.alloc(data_bytes + 64 + sizeof(uint64_t) * kMaxWorld);
  zero_buffer(c, box);
  for_each_local(c, [&](Rank& r, int i) {
    auto* bad = reinterpret_cast<unsigned long long*>(box.local[i] + data_bytes);
    auto* inbox = reinterpret_cast<uint64_t*>(box.local[i] + data_bytes + 64);
    exchange_kernel<kMeet><<<blocks, threads, 0, r.stream()>>>(r.view(), reinterpret_cast<int*>(box.local[i]),
                                                               ints, rounds, bad, slot, inbox);
    WEFT_CUDA_CHECK(cudaGetLastError());
  });
  c.synchronize();
  for_each_local(c, [&](Rank& r, int i) {
    const uint64_t bad = read_u64(r, box.local[i] + data_bytes);
    WEFT_EXPECT(bad == 0,
                "rank " << r.rank() << ": " << bad << " stale elements after " << rounds << " rounds");
  });
  c.free(box);
}

WEFT_GPU_TEST(peer_writes_visible_after_block_barrier) {
  check_exchange<Meet::kBlockBarrier>(ctx, 64 * 1024, ctx.quick ? 20 : 500, 1, 512, 0);
}

WEFT_GPU_TEST(peer_writes_visible_after_grid_barrier) {
  // Every block of the grid meets: all must be resident, within the SM budget.
  const int blocks = std::min(16, ctx.comm().local(0).sm_budget());
  check_exchange<Meet::kGridBarrier>(ctx, 256 * 1024, ctx.quick ? 10 : 300, blocks, 256, 1);
}

WEFT_GPU_TEST(peer_writes_visible_after_hoisted_release_signals) {
  check_exchange<Meet::kHoistedSignals>(ctx, 64 * 1024, ctx.quick ? 20 : 500, 1, 512, 0);
}

WEFT_GPU_TEST(barrier_stress_in_kernel_and_across_launches) {
  Communicator& c = ctx.comm();
  const int in_kernel = ctx.quick ? 100 : 20000, launches = ctx.quick ? 20 : 2000;
  // A slot of the test's own (the slots are granted in the order their owners declare them, which the link
  // order decides), counted from where earlier runs of the test on this team left it.
  const int slot = c.resources(ResourceRequest{"tests: barrier stress", 0, 1}).slots[0];
  std::vector<uint64_t> before(c.num_local());
  for_each_local(c, [&](Rank& r, int i) { before[i] = read_u64(r, r.view().barrier_epoch(slot)); });
  for_each_local(c, [&](Rank& r, int) {
    many_barriers_kernel<<<1, 32, 0, r.stream()>>>(r.view(), in_kernel, slot);
    WEFT_CUDA_CHECK(cudaGetLastError());
  });
  for (int i = 0; i < launches; ++i) c.device_barrier();
  c.synchronize();
  // Every rank completed the same number of barriers on the slot.
  for_each_local(c, [&](Rank& r, int i) {
    const uint64_t after = read_u64(r, r.view().barrier_epoch(slot));
    WEFT_EXPECT(after == before[i] + static_cast<uint64_t>(in_kernel),
                "slot " << slot << " epoch " << after << ", expected " << before[i] << " + " << in_kernel);
  });
}

WEFT_GPU_TEST(signal_pingpong_all_pairs) {
  Communicator& c = ctx.comm();
  const int rounds = ctx.quick ? 50 : 5000;
  SymmetricBuffer box = c.alloc(sizeof(uint64_t) * (kMaxWorld + 1));
  zero_buffer(c, box);
  for_each_local(c, [&](Rank& r, int i) {
    auto* inbox = reinterpret_cast<uint64_t*>(box.local[i]);
    pingpong_all_pairs_kernel<<<c.world(), 32, 0, r.stream()>>>(
        r.view(), inbox, rounds, reinterpret_cast<unsigned long long*>(inbox + kMaxWorld));
    WEFT_CUDA_CHECK(cudaGetLastError());
  });
  c.synchronize();
  for_each_local(c, [&](Rank& r, int i) {
    auto* inbox = reinterpret_cast<uint64_t*>(box.local[i]);
    WEFT_EXPECT(read_u64(r, inbox + kMaxWorld) == 0, "out-of-order values seen");
    for (int p = 0; p < c.world(); ++p)
      if (p != r.rank())
        WEFT_EXPECT(read_u64(r, inbox + p) == static_cast<uint64_t>(rounds), "from rank " << p);
  });
  c.free(box);
}

WEFT_GPU_TEST(signal_add_from_every_thread) {
  Communicator& c = ctx.comm();
  const int blocks = 8, threads = 256, reps = ctx.quick ? 2 : 64;
  SymmetricBuffer box = c.alloc(sizeof(uint64_t));
  zero_buffer(c, box);
  for_each_local(c, [&](Rank& r, int i) {
    signal_add_kernel<<<blocks, threads, 0, r.stream()>>>(r.view(), reinterpret_cast<uint64_t*>(box.local[i]),
                                                          reps);
    WEFT_CUDA_CHECK(cudaGetLastError());
  });
  c.synchronize();
  c.device_barrier();  // every rank's adds have landed once everyone passed this
  c.synchronize();
  const uint64_t want = uint64_t(c.world() - 1) * blocks * threads * reps;
  for_each_local(c, [&](Rank& r, int i) {
    const uint64_t got = read_u64(r, box.local[i]);
    WEFT_EXPECT(got == want, "rank " << r.rank() << " counted " << got << ", expected " << want);
  });
  c.free(box);
}

WEFT_GPU_TEST(wait_timeout_reports_who_and_what) {
  auto c = ctx.make_comm(std::chrono::milliseconds(300));
  const Flags flags = c->resources(ResourceRequest{"test: a wait nobody answers", 8}).flags;
  const auto t0 = std::chrono::steady_clock::now();
  for_each_local(*c, [&](Rank& r, int) {
    if (r.rank() != 0) return;  // nobody ever signals flag 7 of rank 0
    wait_kernel<<<1, 1, 0, r.stream()>>>(r.view(), r.view().flag(flags, 7), 42);
    WEFT_CUDA_CHECK(cudaGetLastError());
  });
  const std::string msg = sync_error(*c);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (ctx.process_rank == 0) {
    WEFT_EXPECT(!msg.empty(), "the wait should have timed out");
    WEFT_EXPECT(msg.find("rank 0") != std::string::npos, msg);
    WEFT_EXPECT(msg.find("timed out") != std::string::npos, msg);
    WEFT_EXPECT(msg.find("flag 7 of 'test: a wait nobody answers'") != std::string::npos, msg);
    WEFT_EXPECT(msg.find("reach 42") != std::string::npos, msg);
    WEFT_EXPECT(s < 5.0, "took " << s << " s for a 0.3 s timeout");
  } else {
    WEFT_EXPECT(msg.empty(), msg);
  }
  c->host_barrier();
}

WEFT_GPU_TEST(alloc_errors_are_clear) {
  Communicator& c = ctx.comm();
  std::string msg;
  try {
    c.alloc(0);
  } catch (const Error& e) {
    msg = e.what();
  }
  WEFT_EXPECT(msg.find("0 bytes") != std::string::npos, msg);
  msg.clear();
  try {
    c.alloc(c.heap_capacity() + 1);
  } catch (const Error& e) {
    msg = e.what();
  }
  WEFT_EXPECT(msg.find("exceeds the heap capacity") != std::string::npos, msg);
  if (!ctx.multi_process) {
    msg.clear();
    try {
      Options o;
      o.devices = {0, 0};
      Communicator::create_single_process(o);
    } catch (const Error& e) {
      msg = e.what();
    }
    WEFT_EXPECT(msg.find("listed twice") != std::string::npos, msg);
  }
  // The communicator is still usable after rejected calls.
  SymmetricBuffer b = c.alloc(1);
  c.free(b);
}

WEFT_GPU_TEST(create_destroy_cycles_leak_nothing) {
  ctx.shared.reset();  // measure with no other team alive
  const int cycles = ctx.quick ? 3 : 100;
  std::vector<int> devices = ctx.options.devices;
  if (ctx.multi_process) {
    int n = 0;
    WEFT_CUDA_CHECK(cudaGetDeviceCount(&n));
    devices = {ctx.options.env->local_rank % n};
  }
  auto free_mem = [&] {
    std::vector<size_t> f;
    for (int d : devices) {
      size_t fr = 0, tot = 0;
      WEFT_CUDA_CHECK(cudaSetDevice(d));
      WEFT_CUDA_CHECK(cudaMemGetInfo(&fr, &tot));
      f.push_back(fr);
    }
    return f;
  };
  // Measure inside a probe team: its rendezvous guarantees every peer has destroyed its previous team
  // (and so unmapped our memory, which its mappings would otherwise keep alive).
  auto probe = [&](int* fds, std::vector<size_t>* mem) {
    auto c = ctx.make_comm();
    c->host_barrier();
    *fds = count_open_fds();
    *mem = free_mem();
  };
  int fds0 = 0, fds1 = 0;
  std::vector<size_t> mem0, mem1;
  probe(&fds0, &mem0);  // also warms up modules and contexts
  probe(&fds0, &mem0);
  for (int i = 0; i < cycles; ++i) {
    auto c = ctx.make_comm();
    SymmetricBuffer a = c->alloc(8 << 20), b = c->alloc(1 << 20);
    c->device_barrier();
    c->synchronize();
    c->free(a);
    WEFT_EXPECT(c->live_mappings() > 0, "b and the signal pad are still mapped");
    (void)b;  // freed by the destructor
  }
  probe(&fds1, &mem1);
  WEFT_EXPECT(fds1 == fds0,
              "open file descriptors " << fds0 << " -> " << fds1 << " after " << cycles << " cycles");
  for (size_t i = 0; i < mem0.size(); ++i) {
    const long long diff = static_cast<long long>(mem0[i]) - static_cast<long long>(mem1[i]);
    WEFT_EXPECT(diff < (32ll << 20),
                "GPU memory lost after " << cycles << " cycles: " << (diff >> 20) << " MiB");
  }
}

WEFT_GPU_TEST(rank_death_fails_peers_fast) {
  if (!ctx.multi_process) WEFT_SKIP("needs one process per rank");
  if (!std::getenv("WEFT_TEST_RANK_DEATH")) WEFT_SKIP("set WEFT_TEST_RANK_DEATH=1 (tests/gpu/run.sh does)");
  ctx.shared.reset();
  auto c = ctx.make_comm(std::chrono::milliseconds(120000));  // only the abort path can end the wait quickly
  if (ctx.process_rank == ctx.world - 1) {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    std::printf("[rank %d] exiting abruptly on purpose\n", ctx.process_rank);
    std::fflush(stdout);
    ::_exit(0);
  }
  Rank& r = c->local(0);
  const Flags flags = c->resources(ResourceRequest{"test: rank death", 4}).flags;
  wait_kernel<<<1, 1, 0, r.stream()>>>(r.view(), r.view().flag(flags, 3), 1);
  WEFT_CUDA_CHECK(cudaGetLastError());
  const auto t0 = std::chrono::steady_clock::now();
  const std::string msg = sync_error(*c);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("[rank %d] saw after %.2f s: %s\n", ctx.process_rank, s, msg.c_str());
  WEFT_EXPECT(!msg.empty(), "the wait should have been aborted");
  WEFT_EXPECT(msg.find("exited") != std::string::npos || msg.find("lost") != std::string::npos, msg);
  WEFT_EXPECT(s < 5.0, "took " << s << " s");
  c.reset();
}
