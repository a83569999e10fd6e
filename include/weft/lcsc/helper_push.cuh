// What an LCSC kernel needs for its helper warps (the idle warps of each compute block's loader warpgroup,
// lcsc::helper_warp) to push rows into peers while its consumers compute: a staging buffer per helper warp
// for the bulk-copy engine, added to the op's shared memory, and the call's synchronization with the
// receivers (per-call epochs, arrival flags, the finishers that end a call). Ring and Ulysses attention push
// their K / V and Q rows this way.
#pragma once
#include "weft/comm/call_epoch.cuh"
#include "weft/comm/copy_rows.cuh"
#include "weft/lcsc/kernel.cuh"
#include "weft/team_view.hpp"

namespace weft::lcsc {

// An op's shared memory with each helper warp's staging for the bulk-copy engine.
using HelperStaging = BulkStaging<4096>;
template <class OpSmem>
struct WithHelperStaging : OpSmem {
  HelperStaging staging[kHelperWarps];
};
// A helper warp's copier, over its block's staging (warp w of the loader warpgroup takes staging[w - 1]).
template <class Smem>
__device__ BulkRowCopier<HelperStaging> helper_copier(Smem& s) {
  return BulkRowCopier<HelperStaging>(s.staging[threadIdx.x / 32 - 1]);
}

// A pushing call's synchronization: its number (flags only grow, by a constant per call), the arrival
// flags its receivers wait on, and the finishers (consumer warpgroups and helper warps of every block) that
// end it.
struct PushSync {
  TeamView team;
  Flags state;    // [0] calls completed, [1] finishers of this call
  Flags arrived;  // the op's arrival flags (ring: slot s, chunk j at s * chunks + j)
  int done_target;
  __device__ CallEpoch calls() const { return CallEpoch{team.flag(state, 0)}; }
  __device__ uint64_t epoch() const { return calls().epoch(); }
  __device__ void done() const { calls().finished(uint64_t(done_target)); }
};

}  // namespace weft::lcsc
