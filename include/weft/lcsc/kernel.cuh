// The LCSC (load, compute, store, communicate) persistent kernel (its host launcher: lcsc/launch.cuh).
//
// One block per SM (or per SM of a cluster). Blocks [0, compute_blocks) compute, the rest of the grid (a
// run-time count, possibly zero) runs the op's communicator instead. A compute block has one loader
// warpgroup and Op::kConsumerWarpgroups consumer warpgroups:
//   loader     thread 0 walks the tile sequence: Op::wait_inputs (optional hook), then Op::load, which fills
//              pipeline stages with TMA. The loader warpgroup gives registers back (setmaxnreg.dec).
//   consumers  every consumer warpgroup walks the same sequence: Op::compute (mainloop into registers), then
//              Op::store (the storer: registers -> shared -> TMA to local or peer memory), finally
//              Op::finish. Consumers take the loader's registers (setmaxnreg.inc).
// While the consumers store tile i, the loader already fills the free stages with tile i + 1.
//
// An op is a struct of roles and types:
//   kConsumerWarpgroups, kClusterSize, kLoaderRegs, kConsumerRegs
//   Scheduler (the op's work items and their order, below), Params (with `Scheduler::Params sched`; passed
//   as __grid_constant__), Smem (with `Pipeline::Storage pipe`), Pipeline, Accum, StoreState
//   static load(p, smem, pipe, PipeState&, const Work&)                 loader thread
//   static compute(p, smem, pipe, PipeState&, const Work&, wg, Accum&)  consumer warpgroup wg (or with the
//                                                          StoreState& last, for an op whose compute acts
//                                                          on what its stores left, e.g. counts them)
//   static store(p, smem, const Work&, wg, const Accum&, StoreState&)   consumer warpgroup wg
// and optionally:
//   static init(p, smem)                                   thread 0, before the block syncs (own barriers)
//   static wait_inputs(p, const Work&)                     loader thread, before an item's loads: the hook
//                                                          for "inputs of this item have arrived" (a wait
//                                                          on a flag set by a peer or a communicator block).
//                                                          No function call here or in load / helper_warp
//                                                          (wait_ge_inlined, not wait_ge): a call after
//                                                          setmaxnreg.dec makes ptxas ignore every setmaxnreg
//                                                          of the kernel (ptxas info C7507), and the
//                                                          consumers then spill on the launch's registers
//   static finish(p, smem, wg, StoreState&)                consumer warpgroup after its last item
//   static finish(p, smem, wg, StoreState&, Accum&)        the same, for an op whose compute() leaves part
//                                                          of an item to the next call (its last one's here)
//   static helper_warp(p, smem, index, count)              warps 1-3 of a compute block's loader warpgroup
//                                                          (idle otherwise; index of count such warps in
//                                                          the grid), with the loader's registers: side work
//                                                          beside the compute, e.g. pushing data to peers
// and, for ops with communicator blocks (index = blockIdx.x - compute_blocks, count of them), a task loop
// run by every thread of such a block, each hook optional:
//   static bool comm_begin(p, smem, index)                 first (e.g. meet the peers' counterpart blocks);
//                                                          false skips the tasks
//   CommTasks(p, index, count); bool next(Task&)           the tasks of this block (lcsc::StridedTasks deals
//                                                          [0, n) round-robin)
//   static comm_task(p, smem, const Task&)                 one task (e.g. push a chunk, then signal it)
//   static comm_end(p, smem, index)                        last (e.g. count the block as a finisher)
// Work is Scheduler::Work. A scheduler hands each compute block (cluster) its work items in turn:
//   using Params; using Work;                              its launch arguments; one work item
//   static int compute_blocks(const Params&)               blocks below it compute, the rest communicate
//   Scheduler(const Params&, int cluster_index, int cluster_rank)    on the device, per block
//   bool next(Work&)                                       the block's next item; false when done
//   kMaxClusterSize (optional)                             the largest cluster its items can be split over
//   Storage, static prepare(const Params&, Storage&) (optional, together): the scheduler's shared memory,
//                                                          Op::Smem::sched. Every thread of a compute block
//                                                          runs prepare (e.g. a table that every role reads)
//                                                          before the block syncs; each role's scheduler is
//                                                          then Scheduler(params, storage, cluster_index,
//                                                          cluster_rank)
// The loader and every consumer warpgroup walk the same sequence. GemmTileScheduler (lcsc/scheduler.cuh)
// serves GEMM-shaped ops: output tiles in grouped, rotated, optionally owner-interleaved order;
// GroupedTileScheduler (lcsc/grouped_scheduler.cuh) a grouped GEMM's, the live tiles of counted groups only.
#pragma once
#include <cuda_runtime.h>

#include <concepts>
#include <cstdint>

#include "weft/device/timeline.cuh"
#include "weft/lcsc/pipeline.cuh"
#include "weft/lcsc/scheduler.cuh"
#include "weft/tile/cluster.cuh"
#include "weft/tile/warp_roles.cuh"

namespace weft::lcsc {

template <class Op>
inline constexpr int kThreads = (1 + Op::kConsumerWarpgroups) * tile::kWarpgroupThreads;

// Helper warps (an op's helper_warp hook): warps 1-3 of each compute block's loader warpgroup; helper warp h
// of a block is its warp h + 1.
inline constexpr int kHelperWarps = tile::kWarpgroupThreads / 32 - 1;

// Claimed tiles: an op whose Smem holds a TileQueue named tile_queue (and whose scheduler params name a
// claims counter) has its loader thread claim each next unit from the counter and hand it to the consumer
// warpgroups through the queue, in place of every block walking its own fixed share.
struct TileQueue {
  static constexpr int kDepth = 4;
  int unit[kDepth];                      // a claimed position of the unit sequence, -1: none left
  uint64_t full[kDepth], empty[kDepth];  // loader -> consumers, consumers -> loader
  __device__ void init(int consumer_threads) {
    for (int i = 0; i < kDepth; ++i) {
      mbarrier_init(&full[i], 1);
      mbarrier_init(&empty[i], consumer_threads);
    }
  }
};

template <class Scheduler>
class ClaimedTiles {
 public:
  using Work = typename Scheduler::Work;
  __device__ ClaimedTiles(Scheduler& s, TileQueue& q, int* claims, bool loader)
      : s_(s), q_(q), claims_(claims), loader_(loader) {}
  // Scheduler::at(u, t) returns whether unit u has an item (false: skipped, by every role alike).
  __device__ bool next(Work& t) {
    for (;;) {
      const int i = taken_ % TileQueue::kDepth;
      const uint32_t parity = (taken_ / TileQueue::kDepth) & 1u;
      ++taken_;
      int u;
      if (loader_) {
        tile::mbarrier_wait_bounded(&q_.empty[i], parity ^ 1u);  // the entry's previous unit has been read
        u = atomicAdd(claims_, 1);
        if (u >= s_.units()) u = -1;
        q_.unit[i] = u;
        tile::mbarrier_arrive(&q_.full[i]);  // orders the store before the consumers' reads (release, CTA)
      } else {
        tile::mbarrier_wait_bounded(&q_.full[i], parity);
        u = q_.unit[i];
        tile::mbarrier_arrive(&q_.empty[i]);
      }
      if (u < 0) return false;
      if (s_.at(u, t)) return true;
    }
  }

 private:
  Scheduler& s_;
  TileQueue& q_;
  int* claims_;
  bool loader_;
  int taken_ = 0;
};

// An op whose tile_queue may be absent (a variant that does not claim) declares it NoTileQueue.
struct NoTileQueue {};
template <class Op>
inline constexpr bool kClaimsTiles = requires(typename Op::Smem& s) {
  { s.tile_queue } -> std::same_as<TileQueue&>;
};

// A scheduler with shared storage (Op::Smem::sched): built with it, after its prepare().
template <class Op>
inline constexpr bool kSchedulerStorage = requires(typename Op::Smem& s) {
  s.sched;
};

template <class Op>
__device__ __forceinline__ typename Op::Scheduler make_scheduler(const typename Op::Params& p,
                                                                 typename Op::Smem& smem, int cluster_index,
                                                                 int cluster_rank) {
  if constexpr (kSchedulerStorage<Op>)
    return typename Op::Scheduler(p.sched, smem.sched, cluster_index, cluster_rank);
  else
    return typename Op::Scheduler(p.sched, cluster_index, cluster_rank);
}

// The counter an op's blocks claim units from: its Params::claims where it has one (an op whose scheduler
// params are shared with kernels that do not claim, which then carry no counter), else its scheduler's.
template <class Op>
__device__ __forceinline__ int* claims_counter(const typename Op::Params& p) {
  if constexpr (requires { p.claims; })
    return p.claims;
  else
    return p.sched.claims;
}

// A role's tile sequence: the scheduler itself, or its units as claimed.
template <class Op, class Scheduler>
__device__ decltype(auto) role_tiles(Scheduler& sched, typename Op::Smem& smem, const typename Op::Params& p,
                                     bool loader) {
  if constexpr (kClaimsTiles<Op>) {
    static_assert(Op::kClusterSize == 1, "claimed tiles: one CTA per unit");
    return ClaimedTiles<Scheduler>(sched, smem.tile_queue, claims_counter<Op>(p), loader);
  } else {
    return (sched);  // the scheduler itself, not a copy
  }
}

// Timelines (weft/timeline.hpp): ops whose scheduler params carry a `timeline` buffer get their blocks'
// phases recorded there when it is set: each block's span (thread 0), the loader's waits for a work item's
// inputs, each consumer warpgroup's mainloop and store per item (its first thread), a communicator block's
// opening and tasks. The buffer is read from the (constant) parameters at each mark rather than held in a
// register through the loops, which would cost the consumers registers they do not have.
template <class Op>
__device__ __forceinline__ void mark(const typename Op::Params& p, bool recorder, TimelinePhase phase,
                                     bool end, uint32_t arg = 0) {
  if constexpr (requires { p.sched.timeline; })
    if (recorder && p.sched.timeline != nullptr) timeline_mark(p.sched.timeline, phase, end, arg);
}
template <class Work>
__device__ __forceinline__ uint32_t timeline_arg(const Work& w) {
  if constexpr (requires {
                  w.m;
                  w.n;
                })
    return uint32_t(w.m) << 16 | (uint32_t(w.n) & 0xffffu);
  else if constexpr (requires {
                       w.head;
                       w.q_block;
                     })  // attention: (head, block of the sequence)
    return uint32_t(w.head) << 16 | (uint32_t(w.q_block) & 0xffffu);
  else
    return 0;
}

// Dynamic shared memory: the op's Smem, at the 1024-byte alignment of the kernel's declaration (the swizzle
// atom).
template <class Op>
inline constexpr size_t kSmemBytes = sizeof(typename Op::Smem);
inline constexpr size_t kMaxSmemBytes = 227 * 1024;  // Hopper's per-block opt-in limit

template <class Op>
__global__ void __launch_bounds__(kThreads<Op>, 1)
    persistent_kernel(const __grid_constant__ typename Op::Params p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(Op::kLoaderRegs + Op::kConsumerWarpgroups * Op::kConsumerRegs <=
                    (65536 / kThreads<Op> / 8 * 8) * (1 + Op::kConsumerWarpgroups),
                "setmaxnreg: the warpgroups together need more registers than the block is given");
  extern __shared__ __align__(1024) uint8_t lcsc_smem[];
  using Smem = typename Op::Smem;
  // The array itself: every address derived from `smem` is then a shared one at a fixed offset (32-bit
  // shared addresses, the offsets folded into the instructions). The 1024-byte alignment the swizzled tiles
  // need is the declaration's, which the compiler and the driver both honour; an align-up through an integer
  // made each use re-derive the generic address (the shared window's base, the CTA's id in the cluster) and
  // convert it back, in every consumer loop.
  Smem& smem = *reinterpret_cast<Smem*>(lcsc_smem);
  using Scheduler = typename Op::Scheduler;
  using Work = typename Scheduler::Work;
  if constexpr (requires { Scheduler::kMaxClusterSize; })
    static_assert(Op::kClusterSize <= Scheduler::kMaxClusterSize,
                  "the op's clusters are too large for its scheduler");
  const int compute_blocks = Scheduler::compute_blocks(p.sched);

  if (static_cast<int>(blockIdx.x) >= compute_blocks) {
    mark<Op>(p, threadIdx.x == 0, TimelinePhase::kBlock, false, 1);
    const int index = static_cast<int>(blockIdx.x) - compute_blocks;
    bool go = true;
    if constexpr (requires { Op::comm_begin(p, smem, index); }) {
      mark<Op>(p, threadIdx.x == 0, TimelinePhase::kCommBegin, false);
      go = Op::comm_begin(p, smem, index);
      mark<Op>(p, threadIdx.x == 0, TimelinePhase::kCommBegin, true);
    }
    if constexpr (requires { typename Op::CommTasks; }) {
      if (go) {
        typename Op::CommTasks tasks(p, index, static_cast<int>(gridDim.x) - compute_blocks);
        typename Op::CommTasks::Task t;
        while (tasks.next(t)) {
          mark<Op>(p, threadIdx.x == 0, TimelinePhase::kCommTask, false, uint32_t(t));
          Op::comm_task(p, smem, t);
          mark<Op>(p, threadIdx.x == 0, TimelinePhase::kCommTask, true, uint32_t(t));
        }
      }
    }
    if constexpr (requires { Op::comm_end(p, smem, index); }) Op::comm_end(p, smem, index);
    mark<Op>(p, threadIdx.x == 0, TimelinePhase::kBlock, true, 1);
    return;
  }

  typename Op::Pipeline pipe(smem.pipe);
  if (threadIdx.x == 0) {
    pipe.init();
    if constexpr (kClaimsTiles<Op>) smem.tile_queue.init(Op::kConsumerWarpgroups * tile::kWarpgroupThreads);
    if constexpr (requires { Op::init(p, smem); }) Op::init(p, smem);
    fence_barrier_init();
  }
  if constexpr (kSchedulerStorage<Op>) Scheduler::prepare(p.sched, smem.sched);  // every thread of the block
  if constexpr (Op::kClusterSize > 1)
    tile::cluster_sync();
  else
    __syncthreads();

  const int rank = Op::kClusterSize > 1 ? static_cast<int>(tile::cluster_ctarank()) : 0;
  Scheduler sched = make_scheduler<Op>(p, smem, static_cast<int>(blockIdx.x) / Op::kClusterSize, rank);
  const int wg = tile::warpgroup_index();
  if (wg == 0) {
    tile::setmaxnreg_dec<Op::kLoaderRegs>();
    if (threadIdx.x == 0) {
      mark<Op>(p, true, TimelinePhase::kBlock, false, 0);
      PipeState st;
      Work t;
      auto&& tiles = role_tiles<Op>(sched, smem, p, true);
      while (tiles.next(t)) {
        if constexpr (requires { Op::wait_inputs(p, t); }) {
          mark<Op>(p, true, TimelinePhase::kWaitInputs, false, timeline_arg(t));
          Op::wait_inputs(p, t);
          mark<Op>(p, true, TimelinePhase::kWaitInputs, true, timeline_arg(t));
        }
        Op::load(p, smem, pipe, st, t);
      }
      mark<Op>(p, true, TimelinePhase::kBlock, true, 0);
    } else if constexpr (requires { Op::helper_warp(p, smem, 0, 0); }) {
      if (threadIdx.x >= 32)
        Op::helper_warp(p, smem,
                        static_cast<int>(blockIdx.x) * kHelperWarps + static_cast<int>(threadIdx.x) / 32 - 1,
                        compute_blocks * kHelperWarps);
    }
  } else {
    tile::setmaxnreg_inc<Op::kConsumerRegs>();
    const int c = wg - 1;
    typename Op::Accum acc{};
    typename Op::StoreState es{};
    PipeState st;
    Work t;
    auto&& tiles = role_tiles<Op>(sched, smem, p, false);
    while (tiles.next(t)) {
      // wgmma is warp-aligned: the whole warp must issue it together. Independent thread scheduling does
      // not promise that lanes split by a branch of the previous item's store (or a timeline mark) have met
      // again, so meet here.
      mark<Op>(p, tile::thread_in_warpgroup() == 0, TimelinePhase::kMainloop, false, timeline_arg(t));
      __syncwarp();
      if constexpr (requires { Op::compute(p, smem, pipe, st, t, c, acc, es); })
        Op::compute(p, smem, pipe, st, t, c, acc, es);
      else
        Op::compute(p, smem, pipe, st, t, c, acc);
      mark<Op>(p, tile::thread_in_warpgroup() == 0, TimelinePhase::kMainloop, true, timeline_arg(t));
      mark<Op>(p, tile::thread_in_warpgroup() == 0, TimelinePhase::kStore, false, timeline_arg(t));
      __syncwarp();
      Op::store(p, smem, t, c, acc, es);
      mark<Op>(p, tile::thread_in_warpgroup() == 0, TimelinePhase::kStore, true, timeline_arg(t));
    }
    if constexpr (requires { Op::finish(p, smem, c, es, acc); })
      Op::finish(p, smem, c, es, acc);
    else if constexpr (requires { Op::finish(p, smem, c, es); })
      Op::finish(p, smem, c, es);
  }
  // No CTA of a cluster may leave while a peer can still multicast into it or arrive on its barriers.
  if constexpr (Op::kClusterSize > 1) {
    __syncwarp();
    tile::cluster_sync();
  }
#else
  __trap();  // built for sm_90a only (wgmma, setmaxnreg); the host launcher refuses other GPUs
#endif
}

}  // namespace weft::lcsc
