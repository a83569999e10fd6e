// The load -> compute pipeline of the LCSC template: a ring of kStages shared-memory stages, each guarded by
// two mbarriers.
//   full[s]   the loader arrives once with the stage's transaction bytes (arrive_expect_tx); the TMA loads
//             complete the phase. Consumers wait on it.
//   empty[s]  every consumer warpgroup of every CTA in the cluster arrives once when it no longer reads the
//             stage (kWarpArrivals: every consumer warp, where threads read the stage themselves, not only
//             through wgmma). The loader waits on it before refilling the stage.
// With a cluster, a stage is filled partly by peer CTAs (TMA multicast of a shared operand), so a stage is
// free only when the consumers of every CTA that receives the multicast are done with it: each consumer
// warpgroup releases the stage in every CTA of the cluster.
//
// Loader and consumers walk the same sequence of (tile, k-block) steps, each with its own PipeState; the
// phase bit flips every time the ring wraps. Barriers are never reset.
#pragma once
#include <cstdint>

#include "weft/device/bulk_copy.cuh"
#include "weft/tile/cluster.cuh"
#include "weft/tile/warp_roles.cuh"

namespace weft::lcsc {

struct PipeState {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance(int stages) {
    if (++stage == stages) {
      stage = 0;
      phase ^= 1u;
    }
  }
};

// kWarpArrivals: each consumer warp releases a stage on its own (its lanes' shared-memory reads of the stage
// done), where a warpgroup's release by its thread 0 would speak for warps still reading it: with stage data
// read by ordinary loads (not only by the warpgroup's wgmma, complete for all its warps at once), a warp
// may lag its warpgroup's first.
template <int kStages_, int kConsumerWarpgroups, int kClusterSize, bool kWarpArrivals = false>
class Pipeline {
  static_assert(!kWarpArrivals || kClusterSize == 1, "per-warp releases: no cluster");

 public:
  static constexpr int kStages = kStages_;
  struct Storage {
    uint64_t full[kStages];
    uint64_t empty[kStages];
  };

  __device__ explicit Pipeline(Storage& s) : s_(s) {}

  // One thread, before the block (cluster) syncs; follow with fence_barrier_init().
  __device__ void init() {
    for (int i = 0; i < kStages; ++i) {
      mbarrier_init(&s_.full[i], 1);
      mbarrier_init(&s_.empty[i],
                    kConsumerWarpgroups * kClusterSize * (kWarpArrivals ? tile::kWarpgroupThreads / 32 : 1));
    }
  }

  // ---- loader (one thread) ----
  // Waits until the stage is free, then announces `bytes` of loads into it (this CTA's share of the
  // transactions: every byte that lands in this CTA's stage, whoever issued the load). Returns the barrier
  // the loads complete on.
  __device__ __forceinline__ uint64_t* producer_acquire(const PipeState& st, uint32_t bytes) {
    // A fresh barrier counts as having completed the phase before phase 0, so the first pass does not wait.
    tile::mbarrier_wait_bounded(&s_.empty[st.stage], st.phase ^ 1u);
    mbarrier_arrive_expect_tx(&s_.full[st.stage], bytes);
    return &s_.full[st.stage];
  }

  // ---- consumers (whole warpgroups) ----
  // Returns with the warp converged (lanes may leave the wait's loop at different times), ready for
  // warp-aligned instructions such as wgmma.
  __device__ __forceinline__ void consumer_wait(const PipeState& st) {
    tile::mbarrier_wait_bounded(&s_.full[st.stage], st.phase);
    __syncwarp();
  }
  // Called by every thread of the warpgroup after its reads of the stage completed (wgmma::wait).
  __device__ __forceinline__ void consumer_release(const PipeState& st) {
    const int t = tile::thread_in_warpgroup();
    if constexpr (kWarpArrivals) {
      // Every lane's reads of the stage issued; the arrive (a release) orders them before the loader's
      // acquire and so before the TMA it then issues into the stage, as a warpgroup's arrive does for its
      // wgmma's reads. No proxy fence: it is a MEMBAR.ALL.CTA, which waits for the thread's loads still in
      // flight (the FP8 GEMM's staged path at 0.84 of its per-tensor speed with it, 0.92 without;
      // bench/RESULTS.md 2026-11-29).
      __syncwarp();
      if (t % 32 == 0) tile::mbarrier_arrive(&s_.empty[st.stage]);
    } else if constexpr (kClusterSize == 1) {
      if (t == 0) tile::mbarrier_arrive(&s_.empty[st.stage]);
    } else {
      if (t < kClusterSize) tile::mbarrier_arrive_cluster(&s_.empty[st.stage], static_cast<uint32_t>(t));
    }
  }

 private:
  Storage& s_;
};

}  // namespace weft::lcsc
