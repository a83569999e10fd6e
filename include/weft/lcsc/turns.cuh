// Turns at the tensor cores for the consumer warpgroups of an LCSC block ("ping-pong"): warpgroup c issues
// its MMAs only in its turn and hands the turn to warpgroup c + 1 (round robin) once they are issued, so the
// warpgroups' MMA batches run one after another while the others do their non-MMA work (softmax, epilogue)
// meanwhile, instead of all competing for the tensor cores at once and then all idling them together.
//
// One named barrier per warpgroup, each over 2 warpgroups: warpgroup c's 128 threads sync on its own barrier
// (begin), which completes when the previous warpgroup's 128 threads have arrived there (its end). Every
// warpgroup must take the same number of turns, in the same order of items; the last warpgroup opens the
// first turn once (start), before anything else.
#pragma once
#include "weft/tile/warp_roles.cuh"

namespace weft::lcsc {

template <int kWarpgroups, int kFirstBarrierId>
struct Turns {
  static_assert(kWarpgroups >= 1 && kFirstBarrierId >= 1 && kFirstBarrierId + kWarpgroups <= 16,
                "named barriers 1..15");
  static constexpr int kBarrierThreads = 2 * tile::kWarpgroupThreads;

  // Once per kernel, before warpgroup 0's first begin().
  __device__ static void start(int wg) {
    if constexpr (kWarpgroups > 1)
      if (wg == kWarpgroups - 1) tile::named_barrier_arrive(kFirstBarrierId, kBarrierThreads);
  }
  // Waits for warpgroup wg's turn. bar.sync is warp-aligned: the warp meets first (a preceding wait's loop
  // may have let lanes leave at different times).
  __device__ static void begin(int wg) {
    __syncwarp();
    if constexpr (kWarpgroups > 1) tile::named_barrier_sync(kFirstBarrierId + wg, kBarrierThreads);
  }
  // Hands the turn on, once the warpgroup's MMAs of this turn are issued.
  __device__ static void end(int wg) {
    if constexpr (kWarpgroups > 1)
      tile::named_barrier_arrive(kFirstBarrierId + (wg + 1) % kWarpgroups, kBarrierThreads);
  }
};

}  // namespace weft::lcsc
