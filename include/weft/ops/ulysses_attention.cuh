// Ulysses attention forward as one persistent LCSC kernel per call (host launcher:
// src/ops/ulysses_attention.cu).
//
// Every rank holds its local rows of q, k and v ([local rows, heads, dim], ring attention's layout) and
// attends its share of the heads (query heads [r * Hs, (r + 1) * Hs), Hs = heads / W, and their K / V heads)
// over the whole sequence, in natural order, out of head-major buffers in its symmetric heap
// ([Hs][total][dim]: a head's rows are contiguous, so a run of rows of one head moves in one piece and the
// attention's TMA maps read it like any packed tensor). The shares travel in head chunks, the heads of a
// chunk attended as soon as they have landed while the later chunks still travel; each rank's output comes
// back chunk by chunk while later chunks are attended. The kernel's roles:
//   helper warps  (the compute blocks' idle loader warps) first push this rank's rows: task (chunk c, peer
//                 d, segment) copies the segment's rows of chunk c's query heads of peer d's share (and the
//                 K / V heads that chunk needs first) into d's buffers, through the bulk-copy engine. The
//                 last task of (c, d) at this rank adds 1 to d's arrival flag of chunk c. Then they pull:
//                 task (c, peer s, segment) waits until s has finished chunk c (s's signal at this rank; a
//                 poll every 20 us, wait_ge_napping: faster polls by every helper warp slow the attention),
//                 and copies this rank's rows of those heads, O and LSE, from s's buffers into out / lse.
//   loader        before an item's Q, waits until every rank's pushes of the item's chunk have landed (W
//                 arrivals per flag and call).
//   consumers     the attention over packed documents (AttentionFwdOp), items head-major (the scheduler's
//                 heads_outer, one head per L2 section); after an item's stores have completed, the last
//                 warpgroup to finish an item of chunk c signals every rank that this rank's chunk c is done.
// A task count per (chunk, peer) and a finished count per chunk live in the caller's workspace, zeroed
// before each call; the flags only grow: each by one per source and call (CallEpoch numbers the calls), the
// flags of chunks a call does not have signalled at its start. A meeting before each call: every peer is
// done reading the buffers (and pulling O) of its previous call.
#pragma once
#include "weft/comm/call_epoch.cuh"
#include "weft/comm/copy_rows.cuh"
#include "weft/comm/signal.cuh"
#include "weft/ops/attention.cuh"
#include "weft/lcsc/helper_push.cuh"

namespace weft::ops {

inline constexpr int kUlyssesArrivalFlags = 32;  // head chunks of a call, at most
inline constexpr int kUlyssesDoneFlags = 512;    // [source rank][chunk] finished flags
inline constexpr int kUlyssesSegmentRows = 64;   // rows of a copy task, at most
inline constexpr int kUlyssesMaxBlocks = 1024;   // compute blocks (the loaders' landed counts)

// Chunk flags per source rank: a function of the world size alone, so every call signals the same flags.
__host__ __device__ inline int ulysses_chunk_flags(int world) {
  const int by_done = kUlyssesDoneFlags / (world > 0 ? world : 1);
  return by_done < kUlyssesArrivalFlags ? by_done : kUlyssesArrivalFlags;
}

// How a rank's query heads (its share of Hs) fall into the call's chunks: chunk c holds local heads
// [first(c), first(c + 1)), c = head * chunks / Hs.
struct UlyssesChunks {
  int chunks, share;  // chunks of the call (<= ulysses_chunk_flags), query heads per rank
  __host__ __device__ int first(int c) const { return (c * share + chunks - 1) / chunks; }
  __host__ __device__ int of(int head) const { return head * chunks / share; }
};

// This rank's local rows cut into segments of at most kUlyssesSegmentRows rows that are contiguous in
// natural order too: segment i is local rows [local[i], local[i] + rows[i]) = natural [natural[i], ..).
struct UlyssesSegments {
  const int32_t *local, *natural, *rows;
  int count;
};

// kTimed: the kernel that records its rank's timeline (AttentionFwdOp's).
template <int kHeadDim, class T = __nv_bfloat16, bool kTimed = false>
struct UlyssesAttentionFwdOp : AttentionFwdOp<kHeadDim, T, attention_warpgroups(kHeadDim), kTimed> {
  using Base = AttentionFwdOp<kHeadDim, T, attention_warpgroups(kHeadDim), kTimed>;
  using Base::kConsumerWarpgroups;
  using Base::kD;
  using typename Base::Pipeline;
  static constexpr int kRowBytes = kD * 2;  // a head's row

  struct Params : Base::Params {  // Base: the attention over this rank's heads in its natural buffers
    lcsc::PushSync sync;          // arrived: chunk c's flag
    Flags finished_flags;         // [source][flag]: chunk done at the source
    UlyssesChunks chunk;
    int flags_per_source;  // ulysses_chunk_flags(W)
    UlyssesSegments seg;
    int total;                               // natural rows
    int heads_all, kv_heads_all, kv_share;   // the call's heads; K / V heads per rank (1: replicated)
    int item_blocks;                         // query blocks of one head over all documents
    const uint8_t *q_src, *k_src, *v_src;    // this rank's rows
    uint8_t *q_nat, *k_nat, *v_nat, *o_nat;  // this rank's natural buffers (symmetric)
    float* lse_nat;                          // [Hs][total] (symmetric)
    uint8_t* out_rows;                       // out: [local rows][heads_all][dim]
    float* lse_rows;                         // lse: [heads_all][local rows], or null
    int local_rows;
    int* landed;               // [block]: chunks its loader knows to have landed
    uint64_t *pushed, *ended;  // [chunk][peer] tasks done; [chunk] items' warpgroups finished
  };
  using Smem = lcsc::WithHelperStaging<typename Base::Smem>;

  __device__ static int kv_first(const Params& p, int rank) {  // rank's first K / V head
    return rank * p.kv_heads_all / p.sync.team.world;
  }
  // The K / V heads (of the peer's share) that chunk c of peer `rank` needs first: [lo, hi).
  __device__ static int2 chunk_kv(const Params& p, int rank, int c) {
    const int q0 = rank * p.chunk.share, group = p.heads_all / p.kv_heads_all, k0 = kv_first(p, rank);
    const int last = p.chunk.first(c + 1) - 1;
    return {c == 0 ? 0 : (q0 + p.chunk.first(c) - 1) / group - k0 + 1, (q0 + last) / group - k0 + 1};
  }

  // ---- loader (one thread) ----
  __device__ static void load(const Params& p, Smem& s, Pipeline& pipe, lcsc::PipeState& st,
                              const lcsc::AttentionWork& w) {
    wait_landed(p, p.chunk.of(w.head));
    Base::load(p, s, pipe, st, w);
  }
  // Chunks [0, c] have landed from every rank.
  __device__ static void wait_landed(const Params& p, int c) {
    int* landed = p.landed + blockIdx.x;
    int have = *landed;
    if (have > c) return;
    const TeamView& t = p.sync.team;
    const uint64_t target = p.sync.epoch() * uint64_t(t.world);
    for (; have <= c; ++have) (void)wait_ge(t, t.flag(p.sync.arrived, have), target);
    *landed = have;
    acquire_for_tma();  // the peers' bulk stores before our TMA loads
  }

  // ---- consumers: the store, then (stores complete) the chunk's count ----
  using typename Base::StoreState;
  __device__ static void store(const Params& p, Smem& s, const lcsc::AttentionWork& w, int wg,
                               const typename Base::Accum& acc, StoreState& es) {
    Base::store(p, s, w, wg, acc, es);
    // Every thread's stores of the item (the row-by-row ones, LSE) before the leader's release.
    tile::named_barrier_sync(lcsc::kEpilogueFirstBarrierId + wg, tile::kWarpgroupThreads);
    if (tile::thread_in_warpgroup() != 0) return;
    bulk_wait<0>();
    release_after_tma();
    const int c = p.chunk.of(w.head);
    const uint64_t items = uint64_t(p.chunk.first(c + 1) - p.chunk.first(c)) * p.item_blocks;
    if (ptx::atom_add_acq_rel_gpu(p.ended + c, 1) + 1 != items * kConsumerWarpgroups) return;
    const TeamView& t = p.sync.team;
    fence_release();
    for (int d = 0; d < t.world; ++d)
      signal_add<Order::kRelaxed>(t, t.flag(p.finished_flags, t.rank * p.flags_per_source + c), d, 1);
  }
  __device__ static void finish(const Params& p, Smem& s, int wg, StoreState& es) {
    Base::finish(p, s, wg, es);
    if (tile::thread_in_warpgroup() == 0) p.sync.done();
  }

  // ---- helper warps: push the shares, then pull this rank's output ----
  __device__ static void helper_warp(const Params& p, Smem& s, int index, int count) {
    const TeamView& t = p.sync.team;
    const int lane = threadIdx.x % 32, W = t.world, segs = p.seg.count;
    auto copier = lcsc::helper_copier(s);
    if (index == 0)
      for (int dst = lane; dst < W; dst += 32) signal_unused(p, dst);
    const int per_chunk = W * segs;
    for (int u = index; u < p.chunk.chunks * per_chunk; u += count) {
      const int c = u / per_chunk, d = (u / segs) % W, i = u % segs;
      const int dst = (t.rank + d) % W;  // rank-staggered: the ranks' pushes form a permutation
      push(p, copier, c, dst, i);
      copier.complete();
      __syncwarp();
      if (lane == 0 && ptx::atom_add_acq_rel_gpu(p.pushed + c * W + dst, 1) + 1 == uint64_t(segs))
        signal_add(t, t.flag(p.sync.arrived, c), dst, 1);
    }
    const uint64_t epoch = p.sync.epoch();
    for (int u = index; u < p.chunk.chunks * per_chunk; u += count) {
      const int c = u / per_chunk, d = (u / segs) % W, i = u % segs;
      const int src = (t.rank + d) % W;
      if (lane == 0) {
        (void)wait_ge_napping(t, t.flag(p.finished_flags, src * p.flags_per_source + c), epoch);
        acquire_for_tma();
      }
      __syncwarp();
      pull(p, copier, c, src, i, lane);
    }
    copier.complete();
    __syncwarp();
    if (lane == 0) p.sync.done();
  }

 private:
  // Helper warp 0, one lane per rank dst: the flags this call has no task for (chunks past its count; every
  // chunk when this rank has no row), arrivals at rank dst and this rank's finished flags there.
  __device__ static void signal_unused(const Params& p, int dst) {
    const TeamView& t = p.sync.team;
    for (int c = p.seg.count == 0 ? 0 : p.chunk.chunks; c < p.flags_per_source; ++c)
      signal_add(t, t.flag(p.sync.arrived, c), dst, 1);
    for (int c = p.chunk.chunks; c < p.flags_per_source; ++c)
      signal_add(t, t.flag(p.finished_flags, t.rank * p.flags_per_source + c), dst, 1);
  }

  // Segment i of this rank's rows, chunk c's heads of rank dst's share, into dst's buffers.
  template <class Copier>
  __device__ static void push(const Params& p, Copier& copier, int c, int dst, int i) {
    const TeamView& t = p.sync.team;
    const int x0 = __ldg(p.seg.local + i), n0 = __ldg(p.seg.natural + i), rows = __ldg(p.seg.rows + i);
    const auto move = [&](const uint8_t* src, int heads, int head, uint8_t* nat, int nat_head) {
      copier.copy_strided(src + (int64_t(x0) * heads + head) * kRowBytes, int64_t(heads) * kRowBytes,
                          t.peer_ptr(nat + (int64_t(nat_head) * p.total + n0) * kRowBytes, dst), kRowBytes,
                          rows, kRowBytes);
    };
    for (int h = p.chunk.first(c); h < p.chunk.first(c + 1); ++h)
      move(p.q_src, p.heads_all, dst * p.chunk.share + h, p.q_nat, h);
    const int2 kv = chunk_kv(p, dst, c);
    for (int g = kv.x; g < kv.y; ++g) {
      move(p.k_src, p.kv_heads_all, kv_first(p, dst) + g, p.k_nat, g);
      move(p.v_src, p.kv_heads_all, kv_first(p, dst) + g, p.v_nat, g);
    }
  }

  // This rank's rows of segment i, chunk c's heads of rank src's share: O into out, LSE into lse.
  template <class Copier>
  __device__ static void pull(const Params& p, Copier& copier, int c, int src, int i, int lane) {
    const TeamView& t = p.sync.team;
    const int x0 = __ldg(p.seg.local + i), n0 = __ldg(p.seg.natural + i), rows = __ldg(p.seg.rows + i);
    for (int h = p.chunk.first(c); h < p.chunk.first(c + 1); ++h) {
      const int head = src * p.chunk.share + h;
      copier.copy_strided(t.peer_ptr(p.o_nat + (int64_t(h) * p.total + n0) * kRowBytes, src), kRowBytes,
                          p.out_rows + (int64_t(x0) * p.heads_all + head) * kRowBytes,
                          int64_t(p.heads_all) * kRowBytes, rows, kRowBytes);
      if (p.lse_rows != nullptr) {
        const float* from = t.peer_ptr(p.lse_nat + int64_t(h) * p.total + n0, src);
        float* to = p.lse_rows + int64_t(head) * p.local_rows + x0;
        for (int r = lane; r < rows; r += 32) to[r] = from[r];
      }
    }
  }
};

}  // namespace weft::ops
