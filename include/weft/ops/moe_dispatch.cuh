// The MoE dispatch inside the first expert GEMM (host side: weft::moe_dispatch_grouped_gemm, src/ops/moe.cu):
// the grouped GEMM of weft/ops/gemm.cuh whose loader waits, per 128-row tile of this rank's expert rows,
// until every row of the tile has landed, while the idle warps of every block's loader warpgroup move the
// rows.
//
// The rows' places are the dispatch's layout (src/ops/moe_layout.hpp: groups by local expert, within a group
// by source rank, then token order), computed before the kernel. Each source walks its slots by destination
// in turn (slot i of destination d, then of d + 1, ...: every destination is written at once) and, per
// destination, by (expert, token): the destinations' groups fill in order, as the GEMM's tiles are walked.
//   pusher warps    per slot of the walk that is its token's first on that destination (its smallest row
//                   there): the token's row into that row, the token's other rows there into the row's
//                   record, each row's source slot (for a scattering epilogue), then a release store of each
//                   row's state (1: a first row, expand it; 2: a row its first row's expansion fills).
//   expander warps  this rank's rows in order, 32 at a time (a lane's wait per row): each first row of the
//                   batch is copied to the other rows of its record; then one release add per row into the
//                   row's tile count.
//   loader          claims the next tile in the GEMM's order (lcsc::ClaimedTiles: with a fixed share per
//                   block, blocks whose tiles waited fell behind the rest for good, and the tiles in flight
//                   then spanned more experts' weights than L2 holds), waits until the tile counts 128 rows
//                   (padding rows are counted before the kernel), then makes the rows visible to its TMA
//                   loads (the async-proxy fence).
// Each token crosses a link once per destination, as in weft::moe_dispatch. Row states and tile counts are
// zeroed before the call's first meeting, so no peer writes them before they are.
#pragma once
#include <climits>

#include "weft/comm/copy_rows.cuh"
#include "weft/comm/signal.cuh"
#include "weft/ops/gemm.cuh"

namespace weft::ops {

enum MoeRowState : uint64_t {
  kMoeRowPending = 0,  // not landed yet
  kMoeRowFirst = 1,    // a token's first row on this rank: landed; its expansion fills the record's rows
  kMoeRowCopy = 2,     // a row the expansion of its token's first row fills
  kMoeRowPadding = 3,  // a group's padding (zeros, counted in its tile before the kernel)
};

struct MoeDispatchRows {
  TeamView team;
  const uint4* tokens;     // this rank's [tokens][row_vecs]
  const int32_t* experts;  // [tokens][top_k] global expert ids, -1 dropped
  const int32_t* row_of;   // [tokens][top_k] each slot's row on its expert's rank
  const int32_t* walk;     // this rank's slots by (expert, token); destination d's: [walk_begin[d], [d + 1])
  const int32_t* walk_begin;  // [world + 1]
  const int32_t* group_end;   // this rank's groups' padded ends
  uint4* rows;                // symmetric [capacity][row_vecs]: the expert rows (the GEMM's A)
  int32_t* row_source;        // symmetric [capacity]: source * max_tokens * top_k + slot
  uint64_t* row_state;        // symmetric [capacity]: MoeRowState
  int32_t* record;      // symmetric [capacity][top_k]: for a first row, the token's other rows (-1 none)
  uint64_t* tile_rows;  // [capacity / 128]: rows of the tile in place
  int* tile_claims;     // the GEMM's tiles claimed so far (lcsc::ClaimedTiles), zeroed before the kernel
  int per_rank, top_k, row_vecs, groups;
  int64_t max_tokens;
};

// The GEMM's pipeline stages under the dispatch: fewer than the plain grouped GEMM's (4 / 6), the shared
// memory they leave the helper warps' staging for the bulk-copy engine (three warps of 40 registers moving
// rows with their own loads and stores keep ~6 KiB in flight per SM; through the copy engine, 42 KiB).
template <int kTileN>
inline constexpr int kMoeDispatchStages = kTileN == 256 ? 3 : 4;
using MoeDispatchStaging = BulkStaging<7168>;
using MoeRowCopier = BulkRowCopier<MoeDispatchStaging>;

// Pusher warp `index` of `count`. Its copies complete, and their rows' states are released, kPushBatch
// pushes at a time (each lane holds its rows of the batch).
inline constexpr int kPushBatch = 4;
__device__ inline void moe_push_rows(const MoeDispatchRows& p, MoeRowCopier& copier, int index, int count) {
  const TeamView& t = p.team;
  const int lane = threadIdx.x % 32, W = t.world, k = p.top_k;
  const int64_t row_bytes = int64_t(p.row_vecs) * 16;
  int pending = 0, rows[kPushBatch],
      states[kPushBatch];  // per push: this lane's row (-1 none), (d << 2) | state
  const auto release = [&] {
    copier.complete();
    __syncwarp();  // lane 0's completed copies and the lanes' stores, then each lane's releases cover them
#pragma unroll
    for (int j = 0; j < kPushBatch; ++j)
      if (j < pending && rows[j] >= 0)
        ptx::st_release_sys(t.peer_ptr(p.row_state, states[j] >> 2) + rows[j], uint64_t(states[j] & 3));
    pending = 0;
  };
  int longest = 0;
  for (int d = 0; d < W; ++d) longest = max(longest, __ldg(p.walk_begin + d + 1) - __ldg(p.walk_begin + d));
  for (int64_t u = index; u < int64_t(W) * longest; u += count) {
    const int d = static_cast<int>((u % W + t.rank) % W);
    const int i = static_cast<int>(u / W), b = __ldg(p.walk_begin + d);
    if (i >= __ldg(p.walk_begin + d + 1) - b) continue;
    const int slot = __ldg(p.walk + b + i);
    const int64_t token = slot / k;
    const int e = lane < k ? __ldg(p.experts + token * k + lane) : -1;
    const bool here = e >= 0 && e / p.per_rank == d;
    const int row = here ? __ldg(p.row_of + token * k + lane) : INT_MAX;
    int first = row;
#pragma unroll
    for (int off = 16; off > 0; off /= 2) first = min(first, __shfl_xor_sync(0xffffffffu, first, off));
    if (__ldg(p.row_of + slot) != first) continue;  // the token's first slot here carries it
    if (lane < k) {
      t.peer_ptr(p.record, d)[int64_t(first) * k + lane] = here && row != first ? row : -1;
      if (here)
        t.peer_ptr(p.row_source, d)[row] = static_cast<int32_t>(t.rank * p.max_tokens * k + token * k + lane);
    }
    uint4* to = t.peer_ptr(p.rows, d) + int64_t(first) * p.row_vecs;
    copier.broadcast(p.tokens + token * p.row_vecs, row_bytes, 1, [&](int) { return to; });
#pragma unroll
    for (int j = kPushBatch - 1; j > 0; --j) {  // shifts (static indices keep the batch in registers)
      rows[j] = rows[j - 1];
      states[j] = states[j - 1];
    }
    rows[0] = here ? row : -1;
    states[0] = (d << 2) | int(row == first ? kMoeRowFirst : kMoeRowCopy);
    if (++pending == kPushBatch) release();
  }
  release();
}

// Expander warp `index` of `count`: rows in batches of 32, a lane's wait per row (one acquire instruction
// for the warp's 32 rows). Each first row of the batch counts in its tile at once (it has landed); then it
// is copied to its record's rows (each chunk loaded once, stored to all), and once the batch's copies are
// complete they count in their tiles.
__device__ inline void moe_expand_rows(const MoeDispatchRows& p, MoeRowCopier& copier, int index, int count) {
  const int lane = threadIdx.x % 32, k = p.top_k;
  const int64_t row_bytes = int64_t(p.row_vecs) * 16;
  const int end = __ldg(p.group_end + p.groups - 1);
  for (int r0 = 32 * index; r0 < end; r0 += 32 * count) {
    const int r = r0 + lane;
    // A failed wait is recorded (synchronize() reports it); the warp stops, and the loaders' waits fail.
    const bool ok = r >= end || wait_ge(p.team, p.row_state + r, kMoeRowFirst);
    if (!__all_sync(0xffffffffu, ok)) return;
    const bool first = r < end && ptx::ld_relaxed_sys(p.row_state + r) == kMoeRowFirst;
    if (first) ptx::red_release_gpu_add(p.tile_rows + r / 128, 1);
    __syncwarp();  // orders each lane's acquire before lane 0's reads of the batch's rows and records
    if (lane == 0) acquire_for_tma();  // and before its copy-engine loads of the rows
    const unsigned firsts = __ballot_sync(0xffffffffu, first);
    for (unsigned rows = firsts; rows != 0; rows &= rows - 1) {
      const int from = r0 + __ffs(rows) - 1;
      const int32_t* record = p.record + int64_t(from) * k;
      copier.broadcast(p.rows + int64_t(from) * p.row_vecs, row_bytes, k, [&](int j) {
        const int to = record[j];
        return to >= 0 ? p.rows + int64_t(to) * p.row_vecs : nullptr;
      });
    }
    copier.complete();
    __syncwarp();  // lane 0's completed copies, then each lane's release covers them
    for (unsigned rows = firsts; rows != 0; rows &= rows - 1) {
      const int from = r0 + __ffs(rows) - 1;
      const int target = lane < k ? p.record[int64_t(from) * k + lane] : -1;
      if (target >= 0) ptx::red_release_gpu_add(p.tile_rows + target / 128, 1);
    }
  }
}

// Base: GroupedGemmOp or GroupedGemmSwigluOp (weft/ops/gemm.cuh) with kMoeDispatchStages stages, without
// counted groups (kCountedGroups false: group_rows is refused with a dispatch).
template <class Base>
struct GroupedGemmDispatchOp : Base {
  using Base::kBM;
  static_assert(Base::kBM == 128, "tile counts are per 128 rows");
  struct Params : Base::Params {
    MoeDispatchRows dispatch;
  };
  struct Smem : Base::Smem {
    MoeDispatchStaging staging[lcsc::kHelperWarps];  // one per helper warp
    lcsc::TileQueue tile_queue;  // tiles are claimed in order: a block whose tile waited stays with the rest
  };
  __device__ static void wait_inputs(const Params& p, const lcsc::GroupTile& t) {
    if (Base::skipped(p, t)) return;
    // A failed wait is recorded; the loads still go out, so the consumers drain and the kernel ends.
    (void)wait_ge_local(p.dispatch.team, p.dispatch.tile_rows + t.m, kBM);
    acquire_for_tma();  // the rows' stores before this thread's TMA loads
  }
  // Warps 1-3 of each block's loader warpgroup: two push, one expands.
  __device__ static void helper_warp(const Params& p, Smem& s, int index, int count) {
    static_assert(lcsc::kHelperWarps == 3, "two pushers and one expander per block");
    const int blocks = count / 3, role = index % 3, block = index / 3;
    MoeRowCopier copier(s.staging[role]);
    if (role < 2)
      moe_push_rows(p.dispatch, copier, 2 * block + role, 2 * blocks);
    else
      moe_expand_rows(p.dispatch, copier, block, blocks);
  }
};

}  // namespace weft::ops
