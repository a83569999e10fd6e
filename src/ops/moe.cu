// weft::moe_dispatch (weft/ops/moe.hpp): the layout of src/ops/moe_layout.hpp computed on the device, and
// the token rows pushed once per destination rank, then copied into the row groups of their other experts
// there.
//
// The op's symmetric workspace area ("moe dispatch"), on every rank: counts [W sources][E + 1] (each
// source's rows per global expert, then its token count; then this rank's group ends), records [W
// sources][max_tokens][top_k] (per source token: the row each slot fills on this rank, or -1), rows
// [capacity][hidden], each row's source slot, landed counts [W sources][chunks of kLandedChunk tokens].
// Steps, one stream: count this rank's slots per expert; exchange the counts (meet, push to every rank,
// meet); positions (every rank derives every group's offset from the same counts, so a source knows its rows'
// places on every destination); zero the landed counts; push and expand in one kernel (meet; each token's row
// to the first of its rows on each destination, a record per (token, destination) and a count per chunk of
// tokens there; on each rank, each landed token's row to its other rows, chunk by chunk as they complete;
// meet).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <string>

#include "../runtime/kernels.hpp"
#include "grouped_gemm_scatter.hpp"
#include "op_args.hpp"
#include "weft/comm/barrier.cuh"
#include "weft/comm/call_epoch.cuh"
#include "weft/comm/copy_rows.cuh"
#include "weft/device/timeline.cuh"
#include "weft/ops/moe.hpp"
#include "weft/ops/moe_dispatch.cuh"
#include "weft/runtime/error.hpp"
#include "weft/runtime/kernel_preload.hpp"

namespace weft {
namespace {

using ops::round256;
const char* const kArea = "moe dispatch";
const char* const kCombineArea = "moe combine";
const char* const kCombineLowLatencyArea = "moe combine: the low-latency dispatch's rows";
const char* const kCombineGradArea = "moe combine backward";
const char* const kStagingArea = "moe combine staging";
const char* const kWalkArea = "moe dispatch walk";
// The low-latency dispatch (MoeShape::low_latency): its workspace area (rows, their fixed group ends, the
// counts a call leaves, the records; LowLatencyParts) and its signal-pad flags: [0, 2) its call epoch
// (CallEpoch), then zeroed[p] (rank p's counters are zero again through call zeroed[p]: p writes it here) and
// done[s] (rank s has placed its rows of call done[s] here: s writes it), kMaxWorld each.
const char* const kLowLatencyArea = "moe dispatch, low latency";
// Its counters and grid counter live in an area of their own, of one fixed layout, so that a call of another
// shape never finds them inside bytes that rows of an earlier call wrote (areas are zeroed when made only).
const char* const kLowLatencyStateArea = "moe dispatch, low latency: counters";
constexpr int kLowLatencyMaxExperts = 8192;  // local experts a low-latency dispatch counts rows for
const char* const kLowLatencyFlags = "moe dispatch, low latency: call, zeroed, done";
const ResourceDeclaration kLowLatencyResources{{kLowLatencyFlags, 2 + 2 * kMaxWorld}};
constexpr int kMaxTopK = 16;  // MoeShape::top_k's limit

struct Dims {
  int world, rank, experts, per_rank, top_k, align;
  int64_t tokens, max_tokens, hidden;
  bool zero_padding;  // MoeShape::zero_padding
};

// Slots per expert, and the expert ids kept for combine; a dropped slot's row_of is -1 (place_slots writes
// the others).
__global__ void count_slots(const int32_t* experts, int64_t slots, int num_experts, int32_t* counts,
                            int32_t* row_of, int32_t* kept, TimelineBuffer* tl) {
  const TimelineSpan span(threadIdx.x == 0 ? tl : nullptr, TimelinePhase::kMoe,
                          uint32_t(MoeStep::kCountSlots));
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < slots;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int e = experts[i];
    if (e >= num_experts) __trap();  // an expert id past the count: stop rather than scatter anywhere
    kept[i] = e;
    if (e >= 0)
      atomicAdd(counts + e, 1);
    else
      row_of[i] = -1;
  }
}

// One block: every rank gets this rank's counts and token count in its row `rank` of the counts table.
__global__ void exchange_counts(TeamView team, BarrierSlots slots, const int32_t* mine, int32_t tokens,
                                int32_t* table, int experts) {
  const TimelineSpan span(threadIdx.x == 0 ? team.timeline : nullptr, TimelinePhase::kMoe,
                          uint32_t(MoeStep::kExchangeCounts));
  if (!barrier_block(team, slots[0])) return;
  for (int p = 0; p < team.world; ++p) {
    int32_t* row = team.peer_ptr(table, p) + int64_t(team.rank) * (experts + 1);
    for (int i = threadIdx.x; i <= experts; i += blockDim.x) row[i] = i < experts ? mine[i] : tokens;
  }
  (void)barrier_block(team, slots[0]);
}

__device__ __forceinline__ int64_t padded(int64_t n, int align) {
  return (n + align - 1) / align * align;
}

// What the dispatch inside the first GEMM (weft/ops/moe_dispatch.cuh) adds to the layout; null pointers in
// the plain dispatch.
struct WalkLayout {
  int32_t *walk, *walk_begin;  // this rank's slots by (expert, token); destination d's from walk_begin[d]
  uint64_t *row_state, *tile_rows;
};

// Block-wide: this rank's slots of expert e, in token order, at rows base, base + 1, ... (row_of), and with a
// walk, their slot indices at walk[walk_at ...]. Each thread takes kSlotsPerThread consecutive slots a round
// and a block-wide scan of the per-thread counts places them (one scan per blockDim x kSlotsPerThread slots:
// a scan per blockDim slots kept E blocks busy for 40-90 us at 32-64k slots).
__device__ void place_own_slots(const int32_t* experts, int64_t slots, int e, int64_t base, int64_t walk_at,
                                int32_t* row_of, int32_t* walk) {
  constexpr int kSlotsPerThread = 8;
  __shared__ int warp_sums[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = int(blockDim.x / 32);
  int64_t placed = 0;  // this block's rows so far
  for (int64_t at = 0; at < slots; at += int64_t(blockDim.x) * kSlotsPerThread) {
    const int64_t first = at + int64_t(threadIdx.x) * kSlotsPerThread;
    unsigned mine = 0;
#pragma unroll
    for (int j = 0; j < kSlotsPerThread; ++j)
      if (first + j < slots && experts[first + j] == e) mine |= 1u << j;
    const int count = __popc(mine);
    int inclusive = count;
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
      const int up = __shfl_up_sync(0xffffffffu, inclusive, o);
      if (lane >= o) inclusive += up;
    }
    if (lane == 31) warp_sums[warp] = inclusive;
    __syncthreads();
    int before = inclusive - count, all = 0;
    for (int w = 0; w < warps; ++w) {
      before += w < warp ? warp_sums[w] : 0;
      all += warp_sums[w];
    }
    for (int64_t q = placed + before; mine != 0; mine &= mine - 1, ++q) {
      const int64_t i = first + __ffs(mine) - 1;
      row_of[i] = static_cast<int32_t>(base + q);
      if (walk != nullptr) walk[walk_at + q] = static_cast<int32_t>(i);
    }
    placed += all;
    __syncthreads();  // warp_sums reused
  }
}

// Block e (a global expert): its group's place on its rank from the counts table, this rank's rows in it
// by token order (a block-wide scan over the slots), and, on the expert's own rank, the group's end and its
// padding rows' sources (none). With a walk: this rank's slots of expert e at their place in it, and the
// padding rows marked and counted in their tiles. The padding rows are zeroed later (zero_padding_share).
__global__ void __launch_bounds__(256)
    place_slots(const int32_t* table, const int32_t* experts, Dims d, int32_t* row_of, int32_t* group_end,
                int32_t* row_source, WalkLayout walk, TimelineBuffer* tl) {
  const TimelineSpan span(threadIdx.x == 0 ? tl : nullptr, TimelinePhase::kMoe,
                          uint32_t(MoeStep::kPlaceSlots));
  __shared__ int64_t base_s, pad_begin_s, pad_end_s, walk_s;
  __shared__ int64_t warp_partials[2][8];
  const int e = blockIdx.x, owner = e / d.per_rank, local = e % d.per_rank;
  const int stride = d.experts + 1;
  auto total = [&](int g) {
    int64_t n = 0;
    for (int s = 0; s < d.world; ++s) n += table[int64_t(s) * stride + g];
    return n;
  };
  // The group's offset (the padded groups of its rank's experts before it) and, with a walk, this rank's
  // slots of the experts before e: sums over up to E entries of the counts table, taken by the whole block
  // (one thread's dependent loads took tens of microseconds at E = 256).
  {
    int64_t offset_part = 0, before_part = 0;
    for (int g = owner * d.per_rank + int(threadIdx.x); g < e; g += blockDim.x)
      offset_part += padded(total(g), d.align);
    if (walk.walk != nullptr)
      for (int g = int(threadIdx.x); g < e; g += blockDim.x)
        before_part += table[int64_t(d.rank) * stride + g];
#pragma unroll
    for (int o = 16; o > 0; o /= 2) {
      offset_part += __shfl_xor_sync(0xffffffffu, offset_part, o);
      before_part += __shfl_xor_sync(0xffffffffu, before_part, o);
    }
    if (threadIdx.x % 32 == 0) {
      warp_partials[0][threadIdx.x / 32] = offset_part;
      warp_partials[1][threadIdx.x / 32] = before_part;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    int64_t offset = 0, before = 0;
    for (int w = 0; w < int(blockDim.x / 32); ++w) {
      offset += warp_partials[0][w];
      before += warp_partials[1][w];
    }
    const int64_t n = total(e);
    pad_begin_s = pad_end_s = walk_s = 0;
    if (owner == d.rank) {
      group_end[local] = static_cast<int32_t>(offset + padded(n, d.align));
      pad_begin_s = offset + n;
      pad_end_s = offset + padded(n, d.align);
    }
    for (int s = 0; s < d.rank; ++s) offset += table[int64_t(s) * stride + e];
    base_s = offset;
    if (walk.walk != nullptr) {
      walk_s = before;
      if (local == 0) walk.walk_begin[owner] = static_cast<int32_t>(before);
      if (e == d.experts - 1)
        walk.walk_begin[d.world] = static_cast<int32_t>(before + table[int64_t(d.rank) * stride + e]);
      for (int64_t t = pad_begin_s / 128; t * 128 < pad_end_s; ++t)
        atomicAdd(reinterpret_cast<unsigned long long*>(walk.tile_rows + t),
                  static_cast<unsigned long long>(min(pad_end_s, (t + 1) * 128) - max(pad_begin_s, t * 128)));
    }
  }
  __syncthreads();
  for (int64_t r = pad_begin_s + threadIdx.x; r < pad_end_s; r += blockDim.x) {
    row_source[r] = -1;
    if (walk.row_state != nullptr) walk.row_state[r] = ops::kMoeRowPadding;
  }
  place_own_slots(experts, d.tokens * d.top_k, e, base_s, walk_s, row_of, walk.walk);
}

// The padding rows of this rank's groups zeroed (the expert GEMMs run over whole groups: a padding row must
// be finite where a gradient meets it; no push writes there): thread `worker` of `workers` takes every
// workers-th 16 bytes of each group's padding. Run by the whole grid, not one block per expert (a group's up
// to align - 1 rows of hidden took tens of microseconds that way).
__device__ void zero_padding_share(const int32_t* table, const int32_t* group_end, const Dims& d, uint4* rows,
                                   int64_t worker, int64_t workers) {
  const int64_t row_vecs = d.hidden * 2 / 16;
  for (int local = 0; local < d.per_rank; ++local) {
    int64_t n = 0;
    for (int s = 0; s < d.world; ++s) n += table[int64_t(s) * (d.experts + 1) + d.rank * d.per_rank + local];
    const int64_t end = group_end[local], begin = end - (padded(n, d.align) - n);
    for (int64_t i = begin * row_vecs + worker; i < end * row_vecs; i += workers)
      rows[i] = make_uint4(0, 0, 0, 0);
  }
}

// zero_padding_share over a grid of its own, before the dispatch inside the first GEMM (whose tiles may read
// padding rows as soon as they start).
__global__ void zero_padding_rows(const int32_t* table, const int32_t* group_end, Dims d, uint4* rows,
                                  TimelineBuffer* tl) {
  const TimelineSpan span(threadIdx.x == 0 ? tl : nullptr, TimelinePhase::kMoe,
                          uint32_t(MoeStep::kZeroPadding));
  zero_padding_share(table, group_end, d, rows, int64_t(blockIdx.x) * blockDim.x + threadIdx.x,
                     int64_t(gridDim.x) * blockDim.x);
}

// Dispatch's push and expand, one kernel. Pusher warps (the first kPushWarps of each block), one per (token,
// destination): a record of the rows the token fills there and, when it fills any, the row itself into the
// first of them; then one release add into the counter of the token's chunk (kLandedChunk tokens of this
// source) there, whether or not it sent a row (every chunk's count reaches its token count). Expander warps:
// first their share of this rank's padding rows zeroed (Dims::zero_padding), then one per (source, token) of
// this rank: once the token's chunk has all landed, the row from the first of its rows to the others, and
// each row's source slot (source rank, token, j) for a scattering epilogue. Both walk the tokens in order, so
// the copies on this GPU run under the pushes over the links.
constexpr int kDispatchWarps = 16, kPushWarps = 8;
constexpr int64_t kLandedChunk = 32;

// Landed counters per source (at least one, so the area is never empty).
__host__ __device__ constexpr int64_t landed_chunks(int64_t max_tokens) {
  return max_tokens > 0 ? (max_tokens + kLandedChunk - 1) / kLandedChunk : 1;
}

__global__ void __launch_bounds__(kDispatchWarps * 32)
    dispatch_tokens(TeamView team, BarrierSlots slots, const uint4* tokens, const int32_t* experts,
                    const int32_t* row_of, const int32_t* table, const int32_t* group_end, Dims d,
                    int32_t* records, uint4* rows, int32_t* row_source, uint64_t* landed) {
  const TimelineSpan span(threadIdx.x == 0 ? team.timeline : nullptr, TimelinePhase::kMoe,
                          uint32_t(MoeStep::kDispatchTokens));
  if (!barrier_block(team, slots[blockIdx.x])) return;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int row_vecs = static_cast<int>(d.hidden * 2 / 16);
  const int64_t chunks = landed_chunks(d.max_tokens);
  if (warp < kPushWarps) {
    const int64_t warps = int64_t(gridDim.x) * kPushWarps, units = d.tokens * d.world;
    for (int64_t u = int64_t(blockIdx.x) * kPushWarps + warp; u < units; u += warps) {
      const int64_t t = u / d.world;
      const int dest = static_cast<int>((u % d.world + team.rank) % d.world);  // rank-staggered
      // Lane j < top_k takes slot j (one round of loads for the warp, not top_k in turn); the token's row
      // goes to the first of its rows on `dest`.
      bool here = false;
      int row = -1;
      if (lane < d.top_k) {
        const int e = experts[t * d.top_k + lane];
        here = e >= 0 && e / d.per_rank == dest;
        if (here) row = row_of[t * d.top_k + lane];
        team.peer_ptr(records, dest)[(int64_t(team.rank) * d.max_tokens + t) * d.top_k + lane] = row;
      }
      const unsigned with_row = __ballot_sync(0xffffffffu, here);
      const int first = with_row ? __shfl_sync(0xffffffffu, row, __ffs(with_row) - 1) : -1;
      if (first >= 0) {
        const int tt = static_cast<int>(t), n = static_cast<int>(d.tokens);
        prefetch_rows_l2(tokens, tt, tt + 1, n, row_vecs, lane);
        warp_copy_rows(tokens, team.peer_ptr(rows, dest) + int64_t(first) * row_vecs, tt, tt + 1, n, row_vecs,
                       lane);
      }
      __syncwarp();  // the warp's stores, then one release covers them
      if (lane == 0) signal_add(team, landed + int64_t(team.rank) * chunks + t / kLandedChunk, dest, 1);
    }
  } else {
    const int per_block = kDispatchWarps - kPushWarps;
    const int64_t warps = int64_t(gridDim.x) * per_block, units = int64_t(d.world) * d.max_tokens;
    const int64_t expander = int64_t(blockIdx.x) * per_block + warp - kPushWarps;
    // First this rank's padding rows, while the first pushes are on their way (HBM writes under link time).
    if (d.zero_padding) zero_padding_share(table, group_end, d, rows, expander * 32 + lane, warps * 32);
    bool ok = true;
    for (int64_t u = expander; u < units && ok; u += warps) {
      const int s = static_cast<int>(u % d.world);
      const int64_t t = u / d.world, n = table[int64_t(s) * (d.experts + 1) + d.experts];
      if (t >= n) continue;  // past source s's tokens
      const int64_t c = t / kLandedChunk;
      // A failed wait is recorded (synchronize() reports it); the warp stops expanding.
      ok = wait_ge(team, landed + s * chunks + c,
                   static_cast<uint64_t>(min(kLandedChunk, n - c * kLandedChunk)));
      const int32_t* rec = records + (int64_t(s) * d.max_tokens + t) * d.top_k;
      int first = -1;
      for (int j = 0; j < d.top_k && ok; ++j) {
        const int r = rec[j];
        if (r < 0) continue;
        if (lane == 0) row_source[r] = static_cast<int32_t>(s * d.max_tokens * d.top_k + t * d.top_k + j);
        if (first < 0) {
          first = r;
          prefetch_rows_l2(rows, first, first + 1, first + 1, row_vecs, lane);
          continue;
        }
        warp_copy_rows(rows, rows + int64_t(r) * row_vecs, first, first + 1, first + 1, row_vecs, lane);
      }
    }
  }
  (void)barrier_block(team, slots[blockIdx.x]);
}

// The low-latency dispatch's area's parts (symmetric): the rows, the groups' ends, the counts a call leaves,
// the records. Then the state area's: the grid counters, the groups' counters, the word (the
// same places whatever the shape).
struct LowLatencyParts {
  uint4* rows;                      // [per_rank x group, hidden]
  int32_t *group_end, *group_rows;  // [per_rank]
  // [W sources][max_tokens][top_k]: slot j's row here, tagged with the call (record_tag).
  uint64_t* records;
  uint32_t* blocks_done;  // this rank's grid counters: [0] rows placed, [1] rows expanded
  int32_t* counters;      // [per_rank]: rows taken in each group this call
  uint64_t* words;        // this rank's: [0] every rank done (the grid's release)
};

struct LowLatency : LowLatencyParts {
  TeamView team;
  Flags flags;             // kLowLatencyFlags: epoch state [0, 2), zeroed [2, 2 + kMaxWorld), done after
  const uint4* tokens;     // [tokens, hidden]
  const int32_t* experts;  // [tokens, top_k]
  int32_t *row_of, *kept;  // [tokens, top_k]
  Dims d;
  int64_t group;  // rows a group holds
};

// A record of call `epoch`: its row (or -1) beside a tag that is never 0 (what the area holds when made), so
// a record of an earlier call, or none, never passes for this call's.
__device__ __forceinline__ uint32_t record_tag(uint64_t epoch) {
  return static_cast<uint32_t>(epoch % 0xffffffffull) + 1;
}
__device__ __forceinline__ uint64_t record_of(uint64_t epoch, int row) {
  return (uint64_t(record_tag(epoch)) << 32) | static_cast<uint32_t>(row);
}
// The row a record of call `epoch` names, or -1 (another call's record, or a slot without a row here).
__device__ __forceinline__ int record_row(uint64_t record, uint64_t epoch) {
  return uint32_t(record >> 32) == record_tag(epoch) ? static_cast<int32_t>(uint32_t(record)) : -1;
}

// Whether this block is the grid's last to get here; every block calls it once (after a __syncthreads), when
// its threads' writes are done. Each counts itself on `counter` (this rank's, zero between calls); the last
// resets it. Release: every block's writes come before its count, so what the last block signals after this
// publishes the whole grid's.
__device__ __forceinline__ bool grid_last_block(uint32_t* counter) {
  __shared__ bool last;
  if (threadIdx.x == 0) {
    fence_release();
    last = atomicAdd(counter, 1u) + 1 == gridDim.x;
    if (last) {
      *counter = 0;     // for the next use (stream-ordered after this kernel)
      fence_release();  // the other blocks' fenced work, seen through the count, before the signals
    }
  }
  __syncthreads();
  return last;
}

// Every block of the grid, once its writes are done (after a __syncthreads), tells every rank
// (flag_of(this rank) = value there) and waits until every rank has told it the same. The grid's last block
// to arrive signals, waits on the W flags and releases the other blocks through `go`, a word of this rank
// they poll at GPU scope: one block polls the peers' lines, not the whole grid (each poll of a flag line by
// ~100 blocks at once slows it ~100x, docs/DESIGN.md). A failed wait is recorded and reported to the peers;
// the blocks go on (the host's synchronize() raises it) rather than wait out a timeout each.
template <class FlagOf>
__device__ __forceinline__ void publish_and_wait(const TeamView& team, uint32_t* counter, uint64_t* go,
                                                 FlagOf flag_of, uint64_t value) {
  if (grid_last_block(counter)) {
    if (static_cast<int>(threadIdx.x) < team.world)
      signal_set(team, flag_of(team.rank), static_cast<int>(threadIdx.x), value);
    bool ok = true;
    for (int s = threadIdx.x; s < team.world; s += blockDim.x) ok &= wait_ge(team, flag_of(s), value);
    if (!__syncthreads_and(ok) && threadIdx.x == 0) detail::report_failure_to_peers(team);
    if (threadIdx.x == 0) ptx::st_release_gpu(go, value);
  } else if (threadIdx.x == 0) {
    (void)wait_ge_local(team, go, value);
  }
  __syncthreads();
}

// Blocks of 256 threads an SM holds of the low-latency dispatch (its launch bounds' minimum): every block
// waits for peers, so the grid (at most this many an SM of the rank's budget) must be
// resident at once.
constexpr int kLowLatencyBlocksPerSm = 2;

// A low-latency kernel's timeline marks (MoeStep::kLowLatency*), by the thread given the buffer (thread 0).
struct LowLatencyMarks {
  TimelineBuffer* timeline;
  __device__ void operator()(MoeStep step, bool end) const {
    timeline_mark(timeline, TimelinePhase::kMoe, end, uint32_t(step));
  }
};

__device__ __forceinline__ uint64_t* ll_zeroed(const LowLatency& a, int p) {
  return a.team.flag(a.flags, 2 + p);
}
__device__ __forceinline__ uint64_t* ll_done(const LowLatency& a, int s) {
  return a.team.flag(a.flags, 2 + kMaxWorld + s);
}

// Once every rank's rows and records of call `epoch` are here (low_latency_rows): each other
// source's token from its first row here to its others, a warp per (source, token).
__device__ void expand_landed_rows(const LowLatency& a, uint64_t epoch) {
  const TeamView& team = a.team;
  const int lane = threadIdx.x % 32, warps = blockDim.x / 32, W = team.world, top_k = a.d.top_k;
  const int row_vecs = static_cast<int>(a.d.hidden * 2 / 16);
  const int64_t capacity = a.d.per_rank * a.group;
  for (int64_t u = int64_t(blockIdx.x) * warps + threadIdx.x / 32; u < int64_t(W) * a.d.max_tokens;
       u += int64_t(gridDim.x) * warps) {
    const int s = static_cast<int>(u % W);
    const int64_t t = u / W;
    if (s == team.rank) continue;
    int row =
        lane < top_k ? record_row(a.records[(int64_t(s) * a.d.max_tokens + t) * top_k + lane], epoch) : -1;
    if (row >= capacity) row = -1;  // (never: a record of this call names a row of the groups)
    const unsigned with_row = __ballot_sync(0xffffffffu, row >= 0);
    if (__popc(with_row) < 2) continue;
    const int first = __shfl_sync(0xffffffffu, row, __ffs(with_row) - 1);
    for (unsigned m = with_row & (with_row - 1); m != 0; m &= m - 1) {
      const int r = __shfl_sync(0xffffffffu, row, __ffs(m) - 1);
      warp_copy_rows(a.rows, a.rows + int64_t(r) * row_vecs, first, first + 1, first + 1, row_vecs, lane);
    }
  }
}

// The low-latency dispatch, one kernel (MoeShape::low_latency; weft/ops/moe.hpp, docs/DESIGN.md): one warp
// per (token, destination rank), rank-staggered. Lane j < top_k holds slot j; the lanes whose experts live on
// the destination take their rows there, each by one system-scope atomic add on its group's counter at that
// rank (after the rank's counters are known to be zero again: zeroed[dest] through the previous call); the
// warp stores the token's row into the first of them and every lane a record of its slot's row (tagged with
// the call) into the destination's records; on this rank itself the row goes straight into all of its rows.
// row_of[slot] is the row at the expert's rank (the combine pulls it from there). The grid's last block
// tells every rank (done). Then every block waits for every rank's done and copies each landed token from
// its first row to its others (the records of this call); the grid's last block to finish copies the
// counters into group_rows, zeroes them and tells every rank (zeroed): their next call's pushes come after
// every copy here. Bytes over the links: a token once per rank holding any of its experts, not once per
// expert. The grid must be resident at once (every block waits): at most two blocks an SM of the rank's SM
// budget, which the launch bounds guarantee room for (kLowLatencyBlocksPerSm).
__global__ void __launch_bounds__(256, kLowLatencyBlocksPerSm) low_latency_rows(LowLatency a) {
  const LowLatencyMarks mark{threadIdx.x == 0 ? a.team.timeline : nullptr};
  mark(MoeStep::kLowLatencySlots, false);
  const TeamView& team = a.team;
  const CallEpoch calls{team.flag(a.flags, 0)};
  const uint64_t epoch = calls.epoch();
  const int lane = threadIdx.x % 32, warps = blockDim.x / 32, W = team.world;
  const int row_vecs = static_cast<int>(a.d.hidden * 2 / 16);
  const int n = static_cast<int>(a.d.tokens), top_k = a.d.top_k;
  // A failed wait (recorded; synchronize() reports it) leaves the warp's remaining slots dropped (row_of -1,
  // so a combine queued behind reads nothing of them); the block tells every rank.
  bool ok = true;
  for (int64_t u = int64_t(blockIdx.x) * warps + threadIdx.x / 32; u < a.d.tokens * W;
       u += int64_t(gridDim.x) * warps) {
    const int t = static_cast<int>(u / W), dest = static_cast<int>((u % W + team.rank) % W);
    const int64_t i = int64_t(t) * top_k + lane;  // lane's slot
    const int e = lane < top_k ? a.experts[i] : -1;
    if (e >= a.d.experts) __trap();  // an expert id past the count: stop rather than scatter anywhere
    const bool here = e >= 0 && e / a.d.per_rank == dest;
    if (lane < top_k && e < 0 && dest == team.rank) a.kept[i] = a.row_of[i] = -1;  // a dropped slot
    if (__ballot_sync(0xffffffffu, here) == 0) continue;
    // The destination zeroed its counters, and finished its copies, at the end of its previous call.
    if (lane == 0 && ok) ok = wait_ge(team, ll_zeroed(a, dest), epoch - 1);
    ok = __shfl_sync(0xffffffffu, ok, 0);
    __syncwarp();  // lane 0's acquire, then every lane's atomics and stores at the destination
    int row = -1;
    if (here && ok) {
      const int local = e % a.d.per_rank;
      const int pos = atomicAdd_system(team.peer_ptr(a.counters + local, dest), 1);
      if (pos < 0 || pos >= a.group) __trap();  // more rows than the group holds: an expert named twice
      row = static_cast<int>(local * a.group + pos);
    }
    if (here) {
      a.kept[i] = row >= 0 ? e : -1;
      a.row_of[i] = row;
    }
    const unsigned with_row = __ballot_sync(0xffffffffu, row >= 0);
    if (with_row == 0) continue;
    uint4* rows = team.peer_ptr(a.rows, dest);
    if (dest == team.rank) {  // every row here now
      for (unsigned m = with_row; m != 0; m &= m - 1) {
        const int r = __shfl_sync(0xffffffffu, row, __ffs(m) - 1);
        warp_copy_rows(a.tokens, rows + int64_t(r) * row_vecs, t, t + 1, n, row_vecs, lane);
      }
    } else {
      const int first = __shfl_sync(0xffffffffu, row, __ffs(with_row) - 1);
      warp_copy_rows(a.tokens, rows + int64_t(first) * row_vecs, t, t + 1, n, row_vecs, lane);
    }
    if (lane < top_k)
      team.peer_ptr(a.records, dest)[(int64_t(team.rank) * a.d.max_tokens + t) * top_k + lane] =
          record_of(epoch, row);
  }
  if (!__syncthreads_and(ok) && threadIdx.x == 0) detail::report_failure_to_peers(team);
  mark(MoeStep::kLowLatencySlots, true);
  mark(MoeStep::kLowLatencyWaitRanks, false);
  publish_and_wait(
      team, a.blocks_done, a.words, [&](int s) { return ll_done(a, s); }, epoch);
  mark(MoeStep::kLowLatencyWaitRanks, true);
  expand_landed_rows(a, epoch);
  __syncthreads();
  if (grid_last_block(a.blocks_done + 1)) {
    for (int e = threadIdx.x; e < a.d.per_rank; e += blockDim.x) {
      a.group_rows[e] = a.counters[e];
      a.counters[e] = 0;
      a.group_end[e] = static_cast<int32_t>((e + 1) * a.group);
    }
    __syncthreads();
    if (static_cast<int>(threadIdx.x) < W)
      signal_set(team, ll_zeroed(a, team.rank), static_cast<int>(threadIdx.x), epoch);
  }
  if (threadIdx.x == 0) (void)calls.finished(gridDim.x);
}

// Combine: one warp per (token, 256-column chunk), 8 elements per lane, the slots summed in ascending order.
// Decode-sized batches have few tokens and each token's rows sit on other GPUs: so that many remote loads
// are in flight, a warp takes a chunk rather than a whole token, its lanes first read the token's slots
// (expert, row, weight) side by side, and all top_k rows' loads are issued before the sum.
template <class T>
__global__ void combine_tokens(TeamView team, BarrierSlots slots, const T* expert_out, const int32_t* experts,
                               const int32_t* row_of, const float* weights, Dims d, T* out, bool meet) {
  const TimelineSpan span(threadIdx.x == 0 ? team.timeline : nullptr, TimelinePhase::kMoe,
                          uint32_t(MoeStep::kCombineTokens));
  if (meet) {  // the meeting marked apart (MoeStep::kCombineMeet): a late peer's launch shows there
    bool met;
    {
      const TimelineSpan meeting(threadIdx.x == 0 ? team.timeline : nullptr, TimelinePhase::kMoe,
                                 uint32_t(MoeStep::kCombineMeet));
      met = barrier_block(team, slots[blockIdx.x]);
    }
    if (!met) return;
  }
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * blockDim.x / 32, chunks = (d.hidden + 255) / 256;
  for (int64_t u = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; u < d.tokens * chunks; u += warps) {
    const int64_t t = u / chunks, c = (u % chunks) * 256 + lane * 8;
    // Lane j < top_k holds slot j: its rank's row (null for a dropped slot) and weight.
    const T* src = nullptr;
    float w = 0.f;
    if (lane < d.top_k) {
      const int e = experts[t * d.top_k + lane];
      if (e >= 0) {
        src = team.peer_ptr(expert_out, e / d.per_rank) + int64_t(row_of[t * d.top_k + lane]) * d.hidden;
        w = weights[t * d.top_k + lane];
      }
    }
    uint4 v[kMaxTopK];
#pragma unroll
    for (int j = 0; j < kMaxTopK; ++j) {
      const T* row =
          reinterpret_cast<const T*>(__shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(src), j));
      v[j] = j < d.top_k && row != nullptr && c < d.hidden ? *reinterpret_cast<const uint4*>(row + c)
                                                           : make_uint4(0, 0, 0, 0);
    }
    float acc[8] = {};
#pragma unroll
    for (int j = 0; j < kMaxTopK; ++j) {
      const float wj = __shfl_sync(0xffffffffu, w, j);
      const bool live = __shfl_sync(0xffffffffu, src != nullptr, j);
      if (j >= d.top_k || !live) continue;
      const T* x = reinterpret_cast<const T*>(&v[j]);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = fmaf(wj, static_cast<float>(x[i]), acc[i]);
    }
    if (c < d.hidden) {
      uint4 r;
      T* h = reinterpret_cast<T*>(&r);
#pragma unroll
      for (int i = 0; i < 8; ++i) h[i] = static_cast<T>(acc[i]);
      *reinterpret_cast<uint4*>(out + t * d.hidden + c) = r;
    }
  }
  // No meeting at the end: a peer writes its expert outputs again only after its next dispatch, which ends
  // after this rank's next dispatch has begun (the dispatch of record: its meetings; the low-latency one: its
  // end wait for every rank's done), and this rank begins that only after this kernel; or, in a backward,
  // after the first meeting of its next moe_combine_backward (which copies them there itself) or after the
  // last meeting of one (a dispatch's backward, a combine, copying its rows' gradient there). Two combines
  // on the area with neither between them would race.
}

// The combine's backward, one warp per token, slot by slot: where the slot has an expert, d_weights =
// <dout[t], the expert's output row> (fp32, summed over the warp) and the expert's gradient row = weights *
// dout[t], stored into that rank's gradient buffer at the slot's row (every slot has a row of its own); a
// dropped slot's d_weights is 0.
template <class T>
__global__ void combine_backward_tokens(TeamView team, const T* expert_out, T* d_expert_out,
                                        const int32_t* experts, const int32_t* row_of, const float* weights,
                                        const T* dout, Dims d, float* d_weights) {
  const TimelineSpan span(threadIdx.x == 0 ? team.timeline : nullptr, TimelinePhase::kMoe,
                          uint32_t(MoeStep::kCombineBackward));
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * blockDim.x / 32;
  for (int64_t t = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; t < d.tokens; t += warps)
    for (int j = 0; j < d.top_k; ++j) {
      const int64_t slot = t * d.top_k + j;
      const int e = experts[slot];
      float dot = 0.f;
      if (e >= 0) {
        const float w = weights[slot];
        const int owner = e / d.per_rank;
        const int64_t row = int64_t(row_of[slot]) * d.hidden;
        const T* out_row = team.peer_ptr(expert_out, owner) + row;
        T* grad_row = team.peer_ptr(d_expert_out, owner) + row;
        for (int64_t c = lane * 8; c < d.hidden; c += 256) {
          const uint4 gu = *reinterpret_cast<const uint4*>(dout + t * d.hidden + c);
          const uint4 ou = *reinterpret_cast<const uint4*>(out_row + c);
          const T* g = reinterpret_cast<const T*>(&gu);
          const T* o = reinterpret_cast<const T*>(&ou);
          uint4 r;
          T* h = reinterpret_cast<T*>(&r);
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const float gi = static_cast<float>(g[i]);
            dot = fmaf(gi, static_cast<float>(o[i]), dot);
            h[i] = static_cast<T>(w * gi);
          }
          *reinterpret_cast<uint4*>(grad_row + c) = r;
        }
      }
#pragma unroll
      for (int off = 16; off > 0; off /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, off);
      if (lane == 0) d_weights[slot] = dot;
    }
}

// A low-latency handle's expert outputs from the caller's buffer into the combine area: of each group
// (blockIdx.y; `group` rows apart) only the rows it received (group_rows, read here), 16 bytes a thread.
__global__ void copy_received_rows(const uint4* from, uint4* to, const int32_t* group_rows, int64_t group,
                                   int64_t row_vecs) {
  const int64_t base = int64_t(blockIdx.y) * group * row_vecs, n = int64_t(group_rows[blockIdx.y]) * row_vecs;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    to[base + i] = from[base + i];
}

// The fused combine's sum, on this rank: out[t] = sum over j of weights[t, j] * staging[t * top_k + j] (the
// experts' outputs for this rank's slots, pushed here by the scattering GEMM), in fp32 in ascending j as
// combine_tokens sums. One warp per token, 8 elements per lane at a time.
__global__ void sum_staged_slots(const __nv_bfloat16* staging, const int32_t* experts, const float* weights,
                                 Dims d, __nv_bfloat16* out, TimelineBuffer* tl) {
  const TimelineSpan span(threadIdx.x == 0 ? tl : nullptr, TimelinePhase::kMoe,
                          uint32_t(MoeStep::kSumStagedSlots));
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * blockDim.x / 32;
  for (int64_t t = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; t < d.tokens; t += warps)
    for (int64_t c = lane * 8; c < d.hidden; c += 256) {
      float acc[8] = {};
      for (int j = 0; j < d.top_k; ++j) {
        if (experts[t * d.top_k + j] < 0) continue;
        const float w = weights[t * d.top_k + j];
        const uint4 u = *reinterpret_cast<const uint4*>(staging + (t * d.top_k + j) * d.hidden + c);
        const __nv_bfloat16* v = reinterpret_cast<const __nv_bfloat16*>(&u);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] = fmaf(w, __bfloat162float(v[i]), acc[i]);
      }
      uint4 r;
      __nv_bfloat16* h = reinterpret_cast<__nv_bfloat16*>(&r);
#pragma unroll
      for (int i = 0; i < 8; ++i) h[i] = __float2bfloat16(acc[i]);
      *reinterpret_cast<uint4*>(out + t * d.hidden + c) = r;
    }
}

struct Sizes {
  Dims d;
  int64_t capacity;
  size_t table_bytes, record_bytes, row_bytes, source_bytes, landed_bytes, counts_bytes, row_of_bytes;
  Sizes(int world, int rank, const MoeShape& s)
      : d{world,    rank,          s.num_experts, world > 0 ? s.num_experts / world : 0,
          s.top_k,  s.align,       s.tokens,      s.max_tokens,
          s.hidden, s.zero_padding} {
    capacity = moe_capacity(world, s);
    // the table, then this rank's group ends
    table_bytes = round256((size_t(world) * (s.num_experts + 1) + d.per_rank) * 4);
    record_bytes = round256(size_t(world) * s.max_tokens * s.top_k * 4);
    row_bytes = round256(size_t(capacity) * s.hidden * 2);
    source_bytes = round256(size_t(capacity) * 4);
    landed_bytes = round256(size_t(world) * landed_chunks(s.max_tokens) * 8);
    counts_bytes = round256(size_t(s.num_experts) * 4);
    row_of_bytes = round256(size_t(std::max<int64_t>(s.max_tokens, 1)) * s.top_k * 4);
  }
};

void check(const MoeShape& s, int world, const std::string& where) {
  WEFT_CHECK(s.num_experts > 0 && s.num_experts % world == 0,
             where + "num_experts (" + std::to_string(s.num_experts) +
                 ") must be a positive multiple of the world size (" + std::to_string(world) + ")");
  WEFT_CHECK(s.top_k >= 1 && s.top_k <= kMaxTopK,
             where + "top_k must be 1.." + std::to_string(kMaxTopK) + ", got " + std::to_string(s.top_k));
  WEFT_CHECK(
      s.hidden > 0 && s.hidden % 8 == 0,
      where + "hidden must be a positive multiple of 8 (16-byte rows), got " + std::to_string(s.hidden));
  WEFT_CHECK(s.max_tokens >= 0 && s.tokens >= 0 && s.tokens <= s.max_tokens,
             where + "tokens (" + std::to_string(s.tokens) + ") must be 0..max_tokens (" +
                 std::to_string(s.max_tokens) + ")");
  WEFT_CHECK(s.align >= 1, where + "align must be at least 1");
  WEFT_CHECK(moe_capacity(world, s) < (int64_t(1) << 31), where + "the expert buffer's rows exceed int32");
}

// The low-latency dispatch's group: every source's max_tokens, rounded up to the grouped GEMM's 128-row
// tiles.
int64_t low_latency_group(int world, const MoeShape& s) {
  return (int64_t(world) * s.max_tokens + 127) / 128 * 128;
}

}  // namespace

int64_t moe_capacity(int world, const MoeShape& s) {
  const int per = world > 0 ? s.num_experts / world : 0;
  if (s.low_latency) return int64_t(per) * low_latency_group(world, s);
  const int64_t worst = int64_t(world) * s.max_tokens * s.top_k + int64_t(per) * (s.align - 1);
  return (worst + s.align - 1) / s.align * s.align;
}

namespace {
// The caller's workspace: the per-expert counts, each (token, k)'s row, and which of them were kept.
struct WorkspaceParts {
  int32_t *counts, *row_of, *kept;
};
WorkspaceParts carve_workspace(ops::WorkspaceLayout& w, const Sizes& z) {
  WorkspaceParts p;
  p.counts = w.take<int32_t>(z.counts_bytes);
  p.row_of = w.take<int32_t>(z.row_of_bytes);
  p.kept = w.take<int32_t>(z.row_of_bytes);
  return p;
}
}  // namespace

size_t moe_dispatch_workspace_bytes(int world, const MoeShape& shape) {
  ops::WorkspaceLayout w;
  carve_workspace(w, Sizes(world, 0, shape));
  return w.bytes();
}

namespace {

// A dispatch's buffers on this rank: the area's parts (symmetric), the caller's workspace's, and with a walk
// (the dispatch inside the first GEMM) the walk area's.
struct DispatchBuffers {
  Sizes z;
  int32_t *table, *records, *row_source, *counts, *row_of, *kept, *group_end, *record;
  uint4* rows;
  uint64_t* landed;
  WalkLayout walk{};
};

// The symmetric area: the table (then this rank's group ends), the records, the rows, their sources, the
// landed counts.
void carve_area(ops::WorkspaceLayout& a, const Sizes& z, DispatchBuffers& b) {
  b.table = a.take<int32_t>(z.table_bytes);
  b.records = a.take<int32_t>(z.record_bytes);
  b.rows = a.take<uint4>(z.row_bytes);
  b.row_source = a.take<int32_t>(z.source_bytes);
  b.landed = a.take<uint64_t>(z.landed_bytes);
}
// The walk area: [capacity] row states, [capacity][top_k] records, [capacity / 128 + 2] tile counts then the
// GEMM's tile claims, [max_tokens * top_k] walk, [world + 1] walk begins.
void carve_walk(ops::WorkspaceLayout& w, const Sizes& z, DispatchBuffers& b) {
  b.walk.row_state = w.take<uint64_t>(size_t(z.capacity) * 8);
  b.record = w.take<int32_t>(size_t(z.capacity) * z.d.top_k * 4);
  b.walk.tile_rows = w.take<uint64_t>(size_t(z.capacity / 128 + 2) * 8);
  b.walk.walk = w.take<int32_t>(z.row_of_bytes);
  b.walk.walk_begin = w.take<int32_t>(size_t(z.d.world + 1) * 4);
}

// The caller's workspace of a dispatch: at least `need` bytes (as `sizer`, the public size function, says),
// 256-byte aligned.
void check_workspace(const ops::OpCall& call, const void* workspace, size_t workspace_bytes, size_t need,
                     const char* sizer) {
  ops::check_workspace(workspace, workspace_bytes, need, std::string(sizer) + "()", call.where);
}

// A dispatch's arguments (either form): the shape, the dtype, the workspace and the pointers' alignment.
void check_dispatch_args(const ops::OpCall& call, const void* tokens, const int32_t* experts,
                         const MoeShape& shape, const void* workspace, size_t workspace_bytes, DType dtype) {
  const Rank& rank = call.rank;
  const std::string& where = call.where;
  check(shape, rank.world(), where);
  WEFT_CHECK(dtype == DType::kBF16 || dtype == DType::kFP16, where + "tokens must be bf16 or fp16");
  check_workspace(call, workspace, workspace_bytes, moe_dispatch_workspace_bytes(rank.world(), shape),
                  "moe_dispatch_workspace_bytes");
  if (shape.tokens > 0) {
    ops::check_pointer_alignment(tokens, "tokens", 16, where);
    ops::check_pointer_alignment(experts, "experts", 4, where);
  }
}

// Checks the arguments and carves the buffers (`walk`: the walk area too).
DispatchBuffers dispatch_buffers(ops::OpCall& call, const void* tokens, const int32_t* experts,
                                 const MoeShape& shape, void* workspace, size_t workspace_bytes, DType dtype,
                                 bool walk) {
  Rank& rank = call.rank;
  check_dispatch_args(call, tokens, experts, shape, workspace, workspace_bytes, dtype);
  DispatchBuffers b{Sizes(rank.world(), rank.rank(), shape)};
  const Sizes& z = b.z;
  ops::WorkspaceLayout sized;
  carve_area(sized, z, b);
  ops::WorkspaceLayout area(call.workspace(sized.bytes(), kArea));
  carve_area(area, z, b);
  ops::WorkspaceLayout own(workspace);
  const WorkspaceParts parts = carve_workspace(own, z);
  b.counts = parts.counts, b.row_of = parts.row_of, b.kept = parts.kept;
  b.group_end = b.table + size_t(z.d.world) * (z.d.experts + 1);
  if (walk) {
    ops::WorkspaceLayout walk_sized;
    carve_walk(walk_sized, z, b);
    ops::WorkspaceLayout walk_area(call.workspace(walk_sized.bytes(), kWalkArea));
    carve_walk(walk_area, z, b);
  }
  return b;
}

// The layout on the device: slots per expert, the counts exchanged, every slot's row (and with a walk, the
// walk and the padding rows' states and tile counts: zeroed first, before the exchange's meetings, so no
// peer pushes into them before they are).
void place_rows(Communicator& comm, Rank& rank, const int32_t* experts, const MoeShape& shape,
                const DispatchBuffers& b, cudaStream_t stream) {
  const Sizes& z = b.z;
  if (b.walk.walk != nullptr) {
    WEFT_CUDA_CHECK(cudaMemsetAsync(b.walk.row_state, 0, size_t(z.capacity) * 8, stream));
    WEFT_CUDA_CHECK(cudaMemsetAsync(b.walk.tile_rows, 0, size_t(z.capacity / 128 + 2) * 8, stream));
  }
  const int64_t slots = shape.tokens * shape.top_k;
  WEFT_CUDA_CHECK(cudaMemsetAsync(b.counts, 0, z.counts_bytes, stream));
  detail::preload<&count_slots>();
  if (slots > 0) {
    count_slots<<<ops::grid_stride_blocks(rank, slots), 256, 0, stream>>>(
        experts, slots, shape.num_experts, b.counts, b.row_of, b.kept, rank.view().timeline);
    WEFT_CUDA_CHECK(cudaGetLastError());
  }
  detail::preload<&exchange_counts>();
  exchange_counts<<<1, 256, 0, stream>>>(rank.view(), ops::meeting_slots(comm, rank), b.counts,
                                         static_cast<int32_t>(shape.tokens), b.table, shape.num_experts);
  WEFT_CUDA_CHECK(cudaGetLastError());
  detail::preload<&place_slots>();
  place_slots<<<shape.num_experts, 256, 0, stream>>>(b.table, experts, z.d, b.row_of, b.group_end,
                                                     b.row_source, b.walk, rank.view().timeline);
  WEFT_CUDA_CHECK(cudaGetLastError());
  if (z.d.zero_padding && b.walk.walk != nullptr) {  // else dispatch_tokens' expanders zero them
    detail::preload<&zero_padding_rows>();
    zero_padding_rows<<<2 * rank.sm_budget(), 256, 0, stream>>>(b.table, b.group_end, z.d, b.rows,
                                                                rank.view().timeline);
    WEFT_CUDA_CHECK(cudaGetLastError());
  }
}

MoeDispatched handle(const DispatchBuffers& b) {
  MoeDispatched out;
  out.rows = b.rows;
  out.group_end = b.group_end;
  out.row_of = b.row_of;
  out.experts = b.kept;
  out.capacity = b.z.capacity;
  out.counts = b.table;
  out.row_source = b.row_source;
  return out;
}

}  // namespace

namespace {

// An MoE op planning (OpCall::planning): its name and path, and the grid of its main kernel, or the plan of
// the grouped GEMM it runs inside (`gemm`: its grid, tiles and shared memory); true (launch nothing). Else
// false.
bool moe_planned(ops::OpCall& call, const char* op, const std::string& path, int blocks,
                 const Plan* gemm = nullptr) {
  if (!call.planning()) return false;
  if (gemm == nullptr) return call.planned_op(op, path, blocks, 0);
  call.plan->tiles = gemm->tiles;
  call.plan->cluster = gemm->cluster;
  return call.planned_op(op, path, std::max(blocks, gemm->blocks), gemm->smem_bytes);
}

void carve_low_latency(ops::WorkspaceLayout& a, const Sizes& z, LowLatencyParts& x) {
  const size_t per = round256(size_t(z.d.per_rank) * 4),
               slots = size_t(z.d.world) * z.d.max_tokens * z.d.top_k;
  x.rows = a.take<uint4>(round256(size_t(z.capacity) * z.d.hidden * 2));
  x.group_end = a.take<int32_t>(per);
  x.group_rows = a.take<int32_t>(per);
  x.records = a.take<uint64_t>(round256(slots * 8));
}
void carve_low_latency_state(ops::WorkspaceLayout& a, LowLatencyParts& x) {
  x.blocks_done = a.take<uint32_t>(256);
  x.counters = a.take<int32_t>(size_t(kLowLatencyMaxExperts) * 4);
  x.words = a.take<uint64_t>(256);
}
LowLatencyParts low_latency_parts(ops::OpCall& call, const Sizes& z) {
  LowLatencyParts x{};
  ops::WorkspaceLayout sized;
  carve_low_latency(sized, z, x);
  ops::WorkspaceLayout area(call.workspace(sized.bytes(), kLowLatencyArea));
  carve_low_latency(area, z, x);
  ops::WorkspaceLayout state_sized;
  carve_low_latency_state(state_sized, x);
  ops::WorkspaceLayout state(call.workspace(state_sized.bytes(), kLowLatencyStateArea));
  carve_low_latency_state(state, x);
  return x;
}

// The grid of the low-latency dispatch for `warps` units of a warp each: 8 warps a block, at most
// kLowLatencyBlocksPerSm blocks an SM of the rank's budget.
int low_latency_blocks(const Rank& rank, int64_t warps) {
  return std::min(ops::grid_stride_blocks(warps, 8), kLowLatencyBlocksPerSm * rank.sm_budget());
}

MoeDispatched dispatch_low_latency(Communicator& comm, ops::OpCall& call, const void* tokens,
                                   const int32_t* experts, const MoeShape& shape, void* workspace,
                                   size_t workspace_bytes, DType dtype) {
  Rank& rank = call.rank;
  check_dispatch_args(call, tokens, experts, shape, workspace, workspace_bytes, dtype);
  WEFT_CHECK(shape.num_experts / rank.world() <= kLowLatencyMaxExperts,
             call.where + "the low-latency dispatch counts rows for at most " +
                 std::to_string(kLowLatencyMaxExperts) + " experts per rank");
  const Sizes z(rank.world(), rank.rank(), shape);
  ops::WorkspaceLayout own(workspace);
  const WorkspaceParts parts = carve_workspace(own, z);
  LowLatency x{};
  static_cast<LowLatencyParts&>(x) = low_latency_parts(call, z);
  x.team = rank.view();
  x.flags = comm.resources(rank, kLowLatencyFlags).flags;
  x.tokens = static_cast<const uint4*>(tokens);
  x.experts = experts;
  x.row_of = parts.row_of;
  x.kept = parts.kept;
  x.d = z.d;
  x.group = low_latency_group(rank.world(), shape);
  MoeDispatched out;
  out.rows = x.rows;
  out.group_end = x.group_end;
  out.group_rows = x.group_rows;
  out.row_of = x.row_of;
  out.experts = x.kept;
  out.capacity = z.capacity;
  // A warp per (token, rank), then per (source, token): 8 a block, every block resident at once.
  const int blocks = low_latency_blocks(rank, std::max(shape.tokens, shape.max_tokens) * rank.world());
  if (moe_planned(call, "moe_dispatch",
                  "low latency: one kernel, each token's row pushed once to each rank of its experts (rows "
                  "taken by atomics there), then copied there into its other rows",
                  blocks))
    return out;
  // Ranks sharing a GPU meet in a one-block kernel first: a grid waiting for its peers would hold SMs that a
  // slower peer's kernels on the same GPU still need.
  if (comm.ranks_per_gpu() > 1)
    launch_team_barrier(rank.view(), ops::meeting_slots(comm, rank)[0], call.stream);
  detail::preload<&low_latency_rows>();
  low_latency_rows<<<blocks, 256, 0, call.stream>>>(x);
  WEFT_CUDA_CHECK(cudaGetLastError());
  return out;
}

MoeDispatched dispatch(Communicator& comm, Rank& rank, const void* tokens, const int32_t* experts,
                       const MoeShape& shape, void* workspace, size_t workspace_bytes, DType dtype,
                       cudaStream_t stream, Plan* plan) {
  ops::OpCall call(comm, rank, stream, ops::team_where("weft::moe_dispatch", rank), plan);
  stream = call.stream;
  if (shape.low_latency)
    return dispatch_low_latency(comm, call, tokens, experts, shape, workspace, workspace_bytes, dtype);
  const DispatchBuffers b =
      dispatch_buffers(call, tokens, experts, shape, workspace, workspace_bytes, dtype, false);
  const int blocks =
      ops::collective_blocks(rank, uint64_t(shape.max_tokens) * shape.hidden * 2 * rank.world());
  if (moe_planned(call, "moe_dispatch",
                  "expert counts exchanged, slots placed, then one kernel pushing each token to its experts' "
                  "ranks",
                  blocks))
    return handle(b);
  place_rows(comm, rank, experts, shape, b, stream);
  WEFT_CUDA_CHECK(cudaMemsetAsync(b.landed, 0, b.z.landed_bytes, stream));  // before this kernel's meetings
  detail::preload<&dispatch_tokens>();
  dispatch_tokens<<<blocks, kDispatchWarps * 32, 0, stream>>>(
      rank.view(), ops::meeting_slots(comm, rank), static_cast<const uint4*>(tokens), experts, b.row_of,
      b.table, b.group_end, b.z.d, b.records, b.rows, b.row_source, b.landed);
  WEFT_CUDA_CHECK(cudaGetLastError());
  return handle(b);
}

MoeDispatched dispatch_grouped_gemm(Communicator& comm, Rank& rank, const void* tokens,
                                    const int32_t* experts, const MoeShape& shape, void* workspace,
                                    size_t workspace_bytes, const void* b, BLayout b_layout, int64_t n,
                                    Activation activation, void* c, cudaStream_t stream, Plan* plan) {
  ops::OpCall call(comm, rank, stream, ops::team_where("weft::moe_dispatch_grouped_gemm", rank), plan);
  const std::string& where = call.where;
  WEFT_CHECK(!shape.low_latency, where +
                                     "not with the low-latency dispatch (MoeShape::low_latency): "
                                     "run moe_dispatch, then grouped_gemm with options.group_rows");
  WEFT_CHECK(shape.align % 128 == 0,
             where + "the GEMM's tiles wait for 128 rows each: align must be a multiple of 128, got " +
                 std::to_string(shape.align));
  stream = call.stream;
  const DispatchBuffers buf =
      dispatch_buffers(call, tokens, experts, shape, workspace, workspace_bytes, DType::kBF16, true);
  const Sizes& z = buf.z;
  const ops::MoeDispatchRows rows{rank.view(),
                                  static_cast<const uint4*>(tokens),
                                  experts,
                                  buf.row_of,
                                  buf.walk.walk,
                                  buf.walk.walk_begin,
                                  buf.group_end,
                                  buf.rows,
                                  buf.row_source,
                                  buf.walk.row_state,
                                  buf.record,
                                  buf.walk.tile_rows,
                                  reinterpret_cast<int*>(buf.walk.tile_rows + z.capacity / 128 + 1),
                                  z.d.per_rank,
                                  z.d.top_k,
                                  static_cast<int>(shape.hidden * 2 / 16),
                                  z.d.per_rank,
                                  shape.max_tokens};
  GemmOptions o;
  o.activation = activation;
  o.max_blocks = rank.sm_budget();  // it waits for peers: every rank's blocks must run at once
  // The GEMM planned (its shapes and options checked) before the count exchange is queued, and its
  // pointers below (a plan does not read them): a refusal after the exchange would leave the peers waiting in
  // their meetings.
  const Plan gemm =
      ops::grouped_gemm_dispatch(b, c, z.capacity, n, shape.hidden, b_layout, rows, stream, o, false);
  if (call.planning()) {
    moe_planned(
        call, "moe_dispatch_grouped_gemm",
        "expert counts exchanged, slots placed, then one grouped GEMM whose idle loader warps move the "
        "tokens (each tile starts once its rows have landed)",
        0, &gemm);
    return handle(buf);
  }
  ops::check_pointer_alignment(b, "b", 16, where);
  ops::check_pointer_alignment(c, "c", 16, where);
  place_rows(comm, rank, experts, shape, buf, stream);
  ops::grouped_gemm_dispatch(b, c, z.capacity, n, shape.hidden, b_layout, rows, stream, o);
  return handle(buf);
}

}  // namespace

MoeDispatched moe_dispatch(Communicator& comm, Rank& rank, const void* tokens, const int32_t* experts,
                           const MoeShape& shape, void* workspace, size_t workspace_bytes, DType dtype,
                           cudaStream_t stream) {
  return dispatch(comm, rank, tokens, experts, shape, workspace, workspace_bytes, dtype, stream, nullptr);
}

Plan moe_dispatch_plan(Communicator& comm, Rank& rank, const void* tokens, const int32_t* experts,
                       const MoeShape& shape, void* workspace, size_t workspace_bytes, DType dtype,
                       cudaStream_t stream) {
  Plan plan;
  dispatch(comm, rank, tokens, experts, shape, workspace, workspace_bytes, dtype, stream, &plan);
  return plan;
}

MoeDispatched moe_dispatch_grouped_gemm(Communicator& comm, Rank& rank, const void* tokens,
                                        const int32_t* experts, const MoeShape& shape, void* workspace,
                                        size_t workspace_bytes, const void* b, BLayout b_layout, int64_t n,
                                        Activation activation, void* c, cudaStream_t stream) {
  return dispatch_grouped_gemm(comm, rank, tokens, experts, shape, workspace, workspace_bytes, b, b_layout, n,
                               activation, c, stream, nullptr);
}

Plan moe_dispatch_grouped_gemm_plan(Communicator& comm, Rank& rank, const void* tokens,
                                    const int32_t* experts, const MoeShape& shape, void* workspace,
                                    size_t workspace_bytes, const void* b, BLayout b_layout, int64_t n,
                                    Activation activation, void* c, cudaStream_t stream) {
  Plan plan;
  dispatch_grouped_gemm(comm, rank, tokens, experts, shape, workspace, workspace_bytes, b, b_layout, n,
                        activation, c, stream, &plan);
  return plan;
}

namespace {

// The FP8 dispatch's packed row (moe_dispatch_fp8): the e4m3 values, then the fp32 scales of the row's
// 128-column blocks; 16-byte rows, moved by moe_dispatch as rows of row_bytes / 2 bf16 elements.
int64_t fp8_row_bytes(int64_t hidden) {
  return (hidden + 4 * ((hidden + 127) / 128) + 15) / 16 * 16;
}
MoeShape fp8_packed_shape(const MoeShape& s) {
  MoeShape p = s;
  p.hidden = fp8_row_bytes(s.hidden) / 2;
  return p;
}
struct Fp8Parts {
  char* inner;  // moe_dispatch's workspace
  size_t inner_bytes;
  uint8_t* packed;  // [max_tokens, row_bytes]
};
Fp8Parts carve_fp8(ops::WorkspaceLayout& w, int world, const MoeShape& s) {
  Fp8Parts p{};
  p.inner_bytes = moe_dispatch_workspace_bytes(world, fp8_packed_shape(s));
  p.inner = w.take(p.inner_bytes);
  const size_t rows = size_t(std::max<int64_t>(s.max_tokens, 1));
  p.packed = w.take<uint8_t>(rows * fp8_row_bytes(s.hidden));
  return p;
}

}  // namespace

size_t moe_dispatch_fp8_workspace_bytes(int world, const MoeShape& shape) {
  return ops::bytes_carved_by([&](ops::WorkspaceLayout& w) { carve_fp8(w, world, shape); });
}

namespace {

// moe_dispatch_fp8, or with `plan` its plan: the checks, then moe_dispatch's plan of the packed rows (the
// quantization is one elementwise kernel on the stream; nothing of it needs planning).
MoeDispatchedFp8 dispatch_fp8(Communicator& comm, Rank& rank, const void* tokens, const int32_t* experts,
                              const MoeShape& shape, void* workspace, size_t workspace_bytes, DType dtype,
                              cudaStream_t stream, Plan* plan) {
  ops::OpCall call(comm, rank, stream, ops::team_where("weft::moe_dispatch_fp8", rank));
  const std::string& where = call.where;
  check(shape, rank.world(), where);
  WEFT_CHECK(dtype == DType::kBF16 || dtype == DType::kFP16, where + "tokens must be bf16 or fp16");
  WEFT_CHECK(shape.hidden % 16 == 0, where +
                                         "hidden must be a multiple of 16 for FP8 rows (16-byte rows), got " +
                                         std::to_string(shape.hidden));
  check_workspace(call, workspace, workspace_bytes, moe_dispatch_fp8_workspace_bytes(rank.world(), shape),
                  "moe_dispatch_fp8_workspace_bytes");
  ops::WorkspaceLayout w(workspace);
  const Fp8Parts p = carve_fp8(w, rank.world(), shape);
  const int64_t row_bytes = fp8_row_bytes(shape.hidden);
  if (plan != nullptr) {
    *plan = moe_dispatch_plan(comm, rank, p.packed, experts, fp8_packed_shape(shape), p.inner, p.inner_bytes,
                              DType::kBF16, call.stream);
    plan->op = "moe_dispatch_fp8";
    plan->path = "quantize_fp8, then " + plan->path;
    return {};
  }
  if (shape.tokens > 0)  // the values, and each row's scales behind them (4-byte aligned: hidden % 16 == 0)
    quantize_fp8(tokens, dtype, p.packed, Fp8Type::kE4M3, reinterpret_cast<float*>(p.packed + shape.hidden),
                 shape.tokens, shape.hidden, Fp8Scaling::kBlock, Fp8Operand::kA, call.stream, 0, row_bytes, 0,
                 row_bytes / 4);
  MoeDispatchedFp8 d;
  d.dispatched = moe_dispatch(comm, rank, p.packed, experts, fp8_packed_shape(shape), p.inner, p.inner_bytes,
                              DType::kBF16, call.stream);
  d.values = static_cast<const uint8_t*>(d.dispatched.rows);
  d.scales = reinterpret_cast<const float*>(d.values + shape.hidden);
  d.row_bytes = row_bytes;
  d.scale_stride = row_bytes / 4;
  return d;
}

}  // namespace

MoeDispatchedFp8 moe_dispatch_fp8(Communicator& comm, Rank& rank, const void* tokens, const int32_t* experts,
                                  const MoeShape& shape, void* workspace, size_t workspace_bytes, DType dtype,
                                  cudaStream_t stream) {
  return dispatch_fp8(comm, rank, tokens, experts, shape, workspace, workspace_bytes, dtype, stream, nullptr);
}

Plan moe_dispatch_fp8_plan(Communicator& comm, Rank& rank, const void* tokens, const int32_t* experts,
                           const MoeShape& shape, void* workspace, size_t workspace_bytes, DType dtype,
                           cudaStream_t stream) {
  Plan plan;
  dispatch_fp8(comm, rank, tokens, experts, shape, workspace, workspace_bytes, dtype, stream, &plan);
  return plan;
}

MoeCounts moe_counts(Rank& rank, const MoeDispatched& dispatched, const MoeShape& shape,
                     cudaStream_t stream) {
  const std::string where = ops::team_where("weft::moe_counts", rank);
  check(shape, rank.world(), where);
  WEFT_CHECK(!shape.low_latency,
             where + "the low-latency dispatch keeps its counts on the device (dispatched.group_rows)");
  WEFT_CHECK(dispatched.counts != nullptr && dispatched.group_end != nullptr,
             where + "`dispatched` is not a dispatch's handle");
  if (stream == nullptr) stream = rank.stream();
  const int W = rank.world(), E = shape.num_experts, per = E / W;
  std::vector<int32_t> table(size_t(W) * (E + 1)), ends(per);
  WEFT_CUDA_CHECK(
      cudaMemcpyAsync(table.data(), dispatched.counts, table.size() * 4, cudaMemcpyDeviceToHost, stream));
  WEFT_CUDA_CHECK(
      cudaMemcpyAsync(ends.data(), dispatched.group_end, ends.size() * 4, cudaMemcpyDeviceToHost, stream));
  WEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
  MoeCounts c;
  for (int e = 0; e < per; ++e) {
    int64_t n = 0;
    for (int s = 0; s < W; ++s) n += table[size_t(s) * (E + 1) + rank.rank() * per + e];
    c.expert_rows.push_back(n);
    c.group_end.push_back(ends[e]);
  }
  c.rows = per > 0 ? c.group_end.back() : 0;
  return c;
}

namespace {
// The bytes of [capacity, hidden] rows of dtype: the expert outputs the combine reads, or the gradients its
// backward writes.
size_t expert_rows_bytes(int world, const MoeShape& shape, DType dtype) {
  return size_t(moe_capacity(world, shape)) * shape.hidden * dtype_size(dtype);
}

// A symmetric area of expert_rows_bytes: the combine's input, or its backward's output.
void* expert_rows_area(Communicator& comm, Rank& rank, const MoeShape& shape, DType dtype, const char* op,
                       const char* area) {
  const std::string where = ops::team_where(op, rank);
  check(shape, rank.world(), where);
  return ops::workspace_of(comm, rank, round256(expert_rows_bytes(rank.world(), shape, dtype)), false, where,
                           area);
}

// row_of and experts hold one entry per (token, slot): a rank without tokens may pass empty (null) tables,
// as torch gives for its empty tensors.
bool has_slot_tables(const MoeDispatched& dispatched, const MoeShape& shape) {
  return shape.tokens == 0 || (dispatched.row_of != nullptr && dispatched.experts != nullptr);
}

// What combine and its backward check alike: the shape, dtype, the handle, the weights; the forward's
// expert_out where peers read it (the backward copies its own there, after a meeting).
void check_combine(Communicator& comm, Rank& rank, const MoeShape& shape, DType dtype,
                   const MoeDispatched& dispatched, const float* weights, const std::string& where) {
  check(shape, rank.world(), where);
  WEFT_CHECK(dtype == DType::kBF16 || dtype == DType::kFP16, where + "expert outputs must be bf16 or fp16");
  WEFT_CHECK(has_slot_tables(dispatched, shape), where + "`dispatched` is not a dispatch's handle");
  WEFT_CHECK((dispatched.group_rows != nullptr) == shape.low_latency,
             where + "the handle and the shape disagree on MoeShape::low_latency");
  if (shape.tokens > 0) ops::check_pointer_alignment(weights, "weights", 4, where);
}
}  // namespace

void* moe_combine_input(Communicator& comm, Rank& rank, const MoeShape& shape, DType dtype) {
  // The low-latency dispatch's fixed groups make a larger area: one of its own, so that switching between
  // the two never outgrows (and frees) the area an earlier call, or a captured graph, names.
  return expert_rows_area(comm, rank, shape, dtype, "weft::moe_combine_input",
                          shape.low_latency ? kCombineLowLatencyArea : kCombineArea);
}

namespace {

void combine(Communicator& comm, Rank& rank, const void* expert_out, const MoeDispatched& dispatched,
             const float* weights, void* out, const MoeShape& shape, DType dtype, cudaStream_t stream,
             Plan* plan) {
  ops::OpCall call(comm, rank, stream, ops::team_where("weft::moe_combine", rank), plan);
  const std::string& where = call.where;
  check_combine(comm, rank, shape, dtype, dispatched, weights, where);
  const size_t in_bytes = expert_rows_bytes(rank.world(), shape, dtype);
  // A low-latency handle's outputs may be anywhere: the rows its groups received are copied into the area
  // first (its worst-case capacity is most of the rows); the area is written after this call's dispatch, as
  // the expert GEMM writing there would.
  const void* input = expert_out;
  if (shape.low_latency) {
    input = call.workspace(round256(in_bytes), kCombineLowLatencyArea);
    ops::check_pointer_alignment(expert_out, "expert_out", 16, where);
  } else {
    WEFT_CHECK(comm.in_heap(rank, expert_out, in_bytes),
               where + "expert_out must be the buffer moe_combine_input() gives (peers read it)");
  }
  if (shape.tokens > 0) ops::check_pointer_alignment(out, "out", 16, where);
  stream = call.stream;
  const Sizes z(rank.world(), rank.rank(), shape);
  const bool copy_in = input != expert_out;
  // Sized by the rows it reads (top_k per token), from max_tokens: every rank launches the same grid (its
  // blocks meet their counterparts).
  const int blocks =
      ops::collective_blocks(rank, uint64_t(shape.max_tokens) * shape.top_k * shape.hidden * 2);
  // Ranks sharing a GPU meet in a one-block kernel first: a grid of blocks waiting at the meeting would hold
  // SMs that a slower peer's expert GEMMs on the same GPU still need.
  const bool shared_gpu = comm.ranks_per_gpu() > 1;
  if (moe_planned(call, "moe_combine",
                  std::string(copy_in ? "the received rows copied in, " : "") +
                      (shared_gpu ? "a meeting, then " : "") +
                      "one kernel: each token's slots read from their experts' ranks and summed",
                  blocks))
    return;
  const int groups = shape.num_experts / rank.world();
  if (copy_in && groups > 0) {
    detail::preload<&copy_received_rows>();
    const dim3 grid(std::max(1, 4 * rank.sm_budget() / groups), groups);
    copy_received_rows<<<grid, 256, 0, stream>>>(
        static_cast<const uint4*>(expert_out), static_cast<uint4*>(const_cast<void*>(input)),
        dispatched.group_rows, low_latency_group(rank.world(), shape), shape.hidden * dtype_size(dtype) / 16);
    WEFT_CUDA_CHECK(cudaGetLastError());
  }
  if (shared_gpu) launch_team_barrier(rank.view(), ops::meeting_slots(comm, rank)[0], stream);
  auto launch = [&](auto* typed_out) {
    using T = std::remove_pointer_t<decltype(typed_out)>;
    constexpr auto kernel = &combine_tokens<T>;
    detail::preload<kernel>();
    kernel<<<blocks, 256, 0, stream>>>(rank.view(), ops::meeting_slots(comm, rank),
                                       static_cast<const T*>(input), dispatched.experts, dispatched.row_of,
                                       weights, z.d, typed_out, !shared_gpu);
  };
  if (dtype == DType::kFP16)
    launch(static_cast<__half*>(out));
  else
    launch(static_cast<__nv_bfloat16*>(out));
  WEFT_CUDA_CHECK(cudaGetLastError());
}

void combine_backward(Communicator& comm, Rank& rank, const void* expert_out, int64_t expert_rows,
                      const MoeDispatched& dispatched, const float* weights, const void* dout,
                      void* d_expert_out, float* d_weights, const MoeShape& shape, DType dtype,
                      cudaStream_t stream, Plan* plan) {
  ops::OpCall call(comm, rank, stream, ops::team_where("weft::moe_combine_backward", rank), plan);
  const std::string& where = call.where;
  WEFT_CHECK(!shape.low_latency,
             where +
                 "the low-latency dispatch is for inference: rows of its groups past their counts hold no "
                 "values a weight's gradient may meet");
  check_combine(comm, rank, shape, dtype, dispatched, weights, where);
  const int64_t capacity = moe_capacity(rank.world(), shape);
  const size_t row_bytes = size_t(shape.hidden) * dtype_size(dtype);
  const size_t bytes = expert_rows_bytes(rank.world(), shape, dtype);
  WEFT_CHECK(comm.in_heap(rank, d_expert_out, bytes),
             where + "d_expert_out must be the buffer moe_combine_grad_input() gives (peers write it)");
  WEFT_CHECK(expert_rows >= 0 && expert_rows <= capacity,
             where + "expert_rows must be 0.." + std::to_string(capacity) + " (the capacity), got " +
                 std::to_string(expert_rows));
  if (expert_rows > 0) call.check_buffer(expert_out, "expert_out", uint64_t(expert_rows) * row_bytes);
  if (shape.tokens > 0) {
    ops::check_pointer_alignment(dout, "dout", 16, where);
    ops::check_pointer_alignment(d_weights, "d_weights", 4, where);
  }
  stream = call.stream;
  // The rows the peers read: the forward's combine area (its expert outputs no longer needed there).
  char* area = call.workspace(round256(bytes), kCombineArea);
  const char* from = static_cast<const char*>(expert_out);
  WEFT_CHECK(
      expert_rows == 0 || from == area || from + expert_rows * row_bytes <= area || from >= area + bytes,
      where + "expert_out overlaps the combine area (moe_combine_input()) without starting there");
  const Sizes z(rank.world(), rank.rank(), shape);
  const int blocks = ops::collective_blocks(rank, uint64_t(shape.max_tokens) * shape.hidden * 2);
  if (moe_planned(call, "moe_combine_backward",
                  "a meeting, expert_out copied where peers read it and d_expert_out zeroed, a meeting, one "
                  "kernel writing each slot's gradient into its expert's rank (and the weights' gradients), "
                  "a meeting",
                  blocks))
    return;
  // The first meeting: every peer's earlier combine, which read this rank's combine area (no meeting ends a
  // combine), is over, so expert_out may go there; e.g. a model's MoE layers, whose backward runs one
  // layer's dispatch backward (a combine) and then the next layer's combine backward with no dispatch
  // between. Rows no slot fills keep a zero gradient; every rank has zeroed its buffer and written its expert
  // outputs before the second meeting, and every push into it is complete after the third, which also ends
  // every peer's reads of this rank's combine area: the caller may write it next (the dispatch's backward
  // copying its rows' gradient there for its combine).
  const BarrierSlots meetings = ops::meeting_slots(comm, rank);
  launch_team_barrier(rank.view(), meetings[0], stream);
  if (expert_rows > 0 && expert_out != area)
    WEFT_CUDA_CHECK(
        cudaMemcpyAsync(area, expert_out, size_t(expert_rows) * row_bytes, cudaMemcpyDeviceToDevice, stream));
  WEFT_CUDA_CHECK(cudaMemsetAsync(d_expert_out, 0, bytes, stream));
  launch_team_barrier(rank.view(), meetings[0], stream);
  auto launch = [&](auto* typed) {
    using T = std::remove_pointer_t<decltype(typed)>;
    constexpr auto kernel = &combine_backward_tokens<T>;
    detail::preload<kernel>();
    kernel<<<blocks, 256, 0, stream>>>(rank.view(), reinterpret_cast<const T*>(area),
                                       static_cast<T*>(d_expert_out), dispatched.experts, dispatched.row_of,
                                       weights, static_cast<const T*>(dout), z.d, d_weights);
  };
  if (dtype == DType::kFP16)
    launch(static_cast<__half*>(nullptr));
  else
    launch(static_cast<__nv_bfloat16*>(nullptr));
  WEFT_CUDA_CHECK(cudaGetLastError());
  launch_team_barrier(rank.view(), meetings[0], stream);
}

void grouped_gemm_combine(Communicator& comm, Rank& rank, const void* a, const void* b, BLayout b_layout,
                          int64_t rows, int64_t inter, const MoeDispatched& dispatched, const float* weights,
                          void* out, const MoeShape& shape, cudaStream_t stream, Plan* plan) {
  ops::OpCall call(comm, rank, stream, ops::team_where("weft::moe_grouped_gemm_combine", rank), plan);
  const std::string& where = call.where;
  check(shape, rank.world(), where);
  WEFT_CHECK(
      dispatched.row_source != nullptr && has_slot_tables(dispatched, shape),
      where + "`dispatched` is not a dispatch's handle (the low-latency dispatch's has no row sources)");
  WEFT_CHECK(shape.align % 128 == 0,
             where +
                 "the grouped GEMM runs on whole 128-row tiles: dispatch with align a multiple of 128, got " +
                 std::to_string(shape.align));
  WEFT_CHECK(rows >= 0 && rows <= dispatched.capacity && rows % 128 == 0,
             where + "rows must be a multiple of 128 up to the dispatch's capacity (" +
                 std::to_string(dispatched.capacity) + "), got " + std::to_string(rows));
  if (shape.tokens > 0) {
    ops::check_pointer_alignment(out, "out", 16, where);
    ops::check_pointer_alignment(weights, "weights", 4, where);
  }
  stream = call.stream;
  const Sizes z(rank.world(), rank.rank(), shape);
  const int64_t slots = std::max<int64_t>(shape.max_tokens * shape.top_k, 1);
  char* staging = call.workspace(round256(size_t(slots) * shape.hidden * 2), kStagingArea);
  const int groups = shape.num_experts / rank.world();
  const ops::ScatterRows scatter{rank.view(), dispatched.row_source, staging, slots};
  if (call.planning()) {
    const Plan gemm = rows > 0
                          ? ops::grouped_gemm_scatter(a, b, dispatched.group_end, groups, rows, shape.hidden,
                                                      inter, b_layout, scatter, stream, {}, false)
                          : Plan{};
    moe_planned(call, "moe_grouped_gemm_combine",
                "a meeting, one grouped GEMM sending each output row to its token's rank, a meeting, the "
                "staged slots summed",
                ops::grid_stride_blocks(rank, shape.tokens * 32), &gemm);
    return;
  }
  const BarrierSlots meetings = ops::meeting_slots(comm, rank);
  // Every rank has summed the previous call's staging before any row of this call is pushed into it.
  launch_team_barrier(rank.view(), meetings[0], stream);
  // The GEMM waits for nothing, so it takes every SM as grouped_gemm does (ranks sharing a GPU share them;
  // a rank's SM budget is for kernels that wait for peers).
  if (rows > 0)
    ops::grouped_gemm_scatter(a, b, dispatched.group_end, groups, rows, shape.hidden, inter, b_layout,
                              scatter, stream);
  launch_team_barrier(rank.view(), meetings[0], stream);  // every row pushed here has landed
  if (shape.tokens > 0) {
    detail::preload<&sum_staged_slots>();
    sum_staged_slots<<<ops::grid_stride_blocks(rank, shape.tokens * 32), 256, 0, stream>>>(
        reinterpret_cast<const __nv_bfloat16*>(staging), dispatched.experts, weights, z.d,
        static_cast<__nv_bfloat16*>(out), rank.view().timeline);
    WEFT_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace

void moe_combine(Communicator& comm, Rank& rank, const void* expert_out, const MoeDispatched& dispatched,
                 const float* weights, void* out, const MoeShape& shape, DType dtype, cudaStream_t stream) {
  combine(comm, rank, expert_out, dispatched, weights, out, shape, dtype, stream, nullptr);
}

Plan moe_combine_plan(Communicator& comm, Rank& rank, const void* expert_out, const MoeDispatched& dispatched,
                      const float* weights, void* out, const MoeShape& shape, DType dtype,
                      cudaStream_t stream) {
  Plan plan;
  combine(comm, rank, expert_out, dispatched, weights, out, shape, dtype, stream, &plan);
  return plan;
}

void* moe_combine_grad_input(Communicator& comm, Rank& rank, const MoeShape& shape, DType dtype) {
  return expert_rows_area(comm, rank, shape, dtype, "weft::moe_combine_grad_input", kCombineGradArea);
}

void moe_combine_backward(Communicator& comm, Rank& rank, const void* expert_out, int64_t expert_rows,
                          const MoeDispatched& dispatched, const float* weights, const void* dout,
                          void* d_expert_out, float* d_weights, const MoeShape& shape, DType dtype,
                          cudaStream_t stream) {
  combine_backward(comm, rank, expert_out, expert_rows, dispatched, weights, dout, d_expert_out, d_weights,
                   shape, dtype, stream, nullptr);
}

Plan moe_combine_backward_plan(Communicator& comm, Rank& rank, const void* expert_out, int64_t expert_rows,
                               const MoeDispatched& dispatched, const float* weights, const void* dout,
                               void* d_expert_out, float* d_weights, const MoeShape& shape, DType dtype,
                               cudaStream_t stream) {
  Plan plan;
  combine_backward(comm, rank, expert_out, expert_rows, dispatched, weights, dout, d_expert_out, d_weights,
                   shape, dtype, stream, &plan);
  return plan;
}

void moe_grouped_gemm_combine(Communicator& comm, Rank& rank, const void* a, const void* b, BLayout b_layout,
                              int64_t rows, int64_t inter, const MoeDispatched& dispatched,
                              const float* weights, void* out, const MoeShape& shape, cudaStream_t stream) {
  grouped_gemm_combine(comm, rank, a, b, b_layout, rows, inter, dispatched, weights, out, shape, stream,
                       nullptr);
}

Plan moe_grouped_gemm_combine_plan(Communicator& comm, Rank& rank, const void* a, const void* b,
                                   BLayout b_layout, int64_t rows, int64_t inter,
                                   const MoeDispatched& dispatched, const float* weights, void* out,
                                   const MoeShape& shape, cudaStream_t stream) {
  Plan plan;
  grouped_gemm_combine(comm, rank, a, b, b_layout, rows, inter, dispatched, weights, out, shape, stream,
                       &plan);
  return plan;
}

}  // namespace weft
