// Team barriers usable inside any kernel, epoch-based: each slot keeps a monotonic epoch, so there is no
// reset kernel and no state to clean up between launches.
//
//   barrier_block(team, slot)  every thread of ONE block per rank calls it; returns when every rank's block
//                              has arrived. Thread p < world announces to peer p and waits for peer p, so a
//                              team of W ranks costs one round of W-1 parallel stores and polls.
//   barrier_arrive / barrier_wait   barrier_block in two halves, for pipelined kernels (below).
//   barrier_grid(team, slot)   every thread of EVERY block calls it: the blocks of this kernel meet first,
//                              the last one to arrive runs the cross-rank barrier, then releases the rest.
//                              All blocks must be co-resident (a persistent grid of at most one wave).
// A slot must not be used by two barriers at once (two blocks, or two concurrent kernels) on one rank.
// Both return false if a wait failed (timeout/abort, recorded for the host), and then every thread of the
// caller sees false.
#pragma once
#include "weft/comm/signal.cuh"

namespace weft {

// Split form of barrier_block, for pipelines: barrier_arrive announces that this block's earlier writes
// (to any rank) are done and returns the epoch it announced; barrier_wait(epoch) returns once every rank's
// block announced at least that epoch. A block may arrive several times before it waits (each arrival is
// its own epoch); every rank's block must make the same sequence of arrivals on the slot.
__device__ __forceinline__ uint64_t barrier_arrive(const TeamView& team, int slot = 0) {
  uint64_t* epoch_p = team.barrier_epoch(slot);
  __syncthreads();  // the block's earlier writes happen-before the release stores below
  const uint64_t epoch = *reinterpret_cast<volatile uint64_t*>(epoch_p) + 1;
  __syncthreads();  // everyone read the old epoch before thread 0 advances it
  if (threadIdx.x == 0) *epoch_p = epoch;
  const int nthreads = blockDim.x * blockDim.y * blockDim.z;
  for (int p = detail::linear_thread(); p < team.world; p += nthreads)
    if (p != team.rank) signal_set(team, team.barrier_inbox(slot, team.rank), p, epoch);
  return epoch;
}

[[nodiscard]] __device__ __forceinline__ bool barrier_wait(const TeamView& team, int slot, uint64_t epoch) {
  bool ok = true;
  const int nthreads = blockDim.x * blockDim.y * blockDim.z;
  for (int p = detail::linear_thread(); p < team.world; p += nthreads)
    if (p != team.rank) ok &= wait_ge(team, team.barrier_inbox(slot, p), epoch);
  return __syncthreads_and(ok) != 0;
}

[[nodiscard]] __device__ __forceinline__ bool barrier_block(const TeamView& team, int slot = 0) {
  return barrier_wait(team, slot, barrier_arrive(team, slot));
}

[[nodiscard]] __device__ __forceinline__ bool barrier_grid(const TeamView& team, int slot = 0) {
  __shared__ int ok_shared;
  const uint64_t nblocks = uint64_t(gridDim.x) * gridDim.y * gridDim.z;
  __syncthreads();
  if (detail::linear_thread() == 0) {
    uint64_t* gen_p = team.grid_generation(slot);
    const uint64_t gen = ptx::ld_acquire_gpu(gen_p);
    // acq_rel: publishes this block's writes to the last arriver and, for it, acquires everyone's.
    const uint64_t arrived = ptx::atom_add_acq_rel_gpu(team.grid_arrive(slot), 1) + 1;
    bool ok = true;
    if (arrived == nblocks) {
      *team.grid_arrive(slot) = 0;  // nobody touches it again until we bump the generation
      uint64_t* epoch_p = team.barrier_epoch(slot);
      const uint64_t epoch = *epoch_p + 1;
      *epoch_p = epoch;
      for (int p = 0; p < team.world; ++p)
        if (p != team.rank) signal_set(team, team.barrier_inbox(slot, team.rank), p, epoch);
      for (int p = 0; p < team.world; ++p)
        if (p != team.rank) ok &= wait_ge(team, team.barrier_inbox(slot, p), epoch);
      ptx::st_release_gpu(gen_p, gen + 1);
    } else {
      ok = wait_ge_local(team, gen_p, gen + 1);
    }
    ok_shared = ok;
  }
  __syncthreads();
  return ok_shared != 0;
}

}  // namespace weft
