// Ring attention forward as one persistent LCSC kernel per pass (host launcher: src/ops/ring_attention.cu;
// the layout and the pass: src/ops/ring_attention_plan.hpp, ring_pass_of).
//
// Every rank holds its local rows of q, k and v. At step s it attends with the K / V rows of rank r - s,
// which arrive while it computes: the idle warps of every compute block's loader warpgroup push this rank's
// K / V rows into the receive slots of ranks r + 1, r + 2, ... (slot s - 1 of rank r + s; that order makes
// the pushes of all ranks a permutation at every moment and lands each step's rows before later ones), in
// pieces, each adding 1 to its chunk's arrival flag at the receiver (release, system scope).
//
// A work item is (query segment, head, query block): one document's part of this rank's query rows against
// all W of its key ranges in turn (step 0 from k / v themselves, causal; the rest from the slots, no mask),
// one online softmax over all of them, O and LSE in registers from the first key to the last: no partial
// output leaves the SM and nothing is merged. The loader waits, before the first load of a step's range,
// until every chunk of the slot up to the range's last loaded row has landed (a count per block and slot
// in global memory remembers what it has seen: RingSlots::landed), then loads as the forward does. The
// boxes past a range's end read rows of the same slot that have landed (masked, multiplied by exact zeros),
// or zeros past the slot.
//
// Calls: a meeting kernel runs before each pass (every rank has finished reading its slots in the previous
// one); flags only grow, by a constant per chunk and call, so a chunk has landed in call e when its flag
// reaches e * kRingPiecesPerChunk (CallEpoch, finishers: every consumer warpgroup and helper warp).
#pragma once
#include "weft/comm/call_epoch.cuh"
#include "weft/comm/copy_rows.cuh"
#include "weft/comm/signal.cuh"
#include "weft/lcsc/helper_push.cuh"
#include "weft/ops/attention.cuh"

namespace weft::ops {

inline constexpr int kRingChunkFlags = 1024;      // arrival flags, shared by the slots of a pass
inline constexpr int kRingMaxChunksPerSlot = 32;  // finer chunks only cost the loader more waits
inline constexpr int kRingPiecesPerChunk = 16;    // pushes per chunk: enough tasks for every helper warp
inline constexpr int kRingMaxBlocks = 1024;       // compute blocks of a ring kernel (RingSlots::landed)

// The receive slots of a pass, chunked alike on every rank (slot_rows: the longest rank's rows; chunks per
// slot: a function of the world size alone, so each flag grows by kRingPiecesPerChunk per call).
struct RingSlots {
  int slot_rows, chunk_rows, chunks;  // chunk j of a slot: rows [j * chunk_rows, ..) of slot_rows
  int local_rows;                     // this rank's rows: pushes write zeros past them
  // Per slot, the rows its receiver reads: [push_begin, push_end) (ring_push_rows). Only those are copied;
  // every chunk's flag is still signalled, so a receiver's waits count chunks from the slot's start.
  const int32_t *push_begin, *push_end;
  // Per compute block and slot, the chunks its loader knows to have landed in this call ([block][world -
  // 1], zeroed before the kernel). Global memory, not shared: the attention kernels fill shared memory to
  // the edge of a carveout step, and a step more leaves L1 too small for their register spills.
  int* landed;
};

// Helper warp `index` of `count` (lcsc helper_warp): this rank's rows into the peers' slots. Task u is piece
// u % P of chunk (u / P) % chunks of slot u / (P * chunks), i.e. to rank + slot + 1 (slot s - 1 of rank r + s
// holds step s's rows: in that order the pushes of all ranks form a permutation at every moment and each
// step's rows land before later ones'). push(slot, dst, r0, r1, lane) copies rows [r0, r1) of the slot;
// then one release add per piece into the chunk's flag at dst covers the warp's stores.
template <class Push>
__device__ void ring_push(const lcsc::PushSync& sync, const RingSlots& sl, int index, int count,
                          Push&& push) {
  const TeamView& t = sync.team;
  const int lane = threadIdx.x % 32;
  const int per_slot = sl.chunks * kRingPiecesPerChunk, tasks = (t.world - 1) * per_slot;
  const int piece_rows = (sl.chunk_rows + kRingPiecesPerChunk - 1) / kRingPiecesPerChunk;
  for (int u = index; u < tasks; u += count) {
    const int slot = u / per_slot, j = (u - slot * per_slot) / kRingPiecesPerChunk;
    const int piece = u % kRingPiecesPerChunk, dst = (t.rank + slot + 1) % t.world;
    const int chunk_end = min((j + 1) * sl.chunk_rows, sl.slot_rows);
    const int first = min(j * sl.chunk_rows + piece * piece_rows, chunk_end);
    const int r0 = max(first, __ldg(sl.push_begin + slot));
    const int r1 = min(min(first + piece_rows, chunk_end), __ldg(sl.push_end + slot));
    if (r0 < r1) push(slot, dst, r0, r1, lane);
    __syncwarp();  // the warp's stores, then one release covers them
    if (lane == 0) signal_add(t, t.flag(sync.arrived, slot * sl.chunks + j), dst, 1);
  }
  __syncwarp();
  if (lane == 0) sync.done();
}

// Loader: waits until chunks [0, c) of slot `slot` have landed, c covering rows below `rows_end`. A timed
// kernel passes its timeline: a wait that was not already over is marked (TimelinePhase::kWaitInputs, arg:
// the slot).
__device__ inline void ring_wait_landed(const lcsc::PushSync& sync, const RingSlots& sl, int slot,
                                        int rows_end, TimelineBuffer* timeline = nullptr) {
  const int rows = min(rows_end, sl.slot_rows);
  const int need = min(sl.chunks, (rows + sl.chunk_rows - 1) / sl.chunk_rows);
  int* landed = sl.landed + blockIdx.x * (sync.team.world - 1) + slot;
  int have = *landed;
  if (have >= need) return;
  const TimelineSpan waiting(timeline, TimelinePhase::kWaitInputs, static_cast<uint32_t>(slot));
  const uint64_t target = sync.epoch() * kRingPiecesPerChunk;
  // A failed wait is recorded (synchronize() reports it); the loads still go out so the kernel drains.
  for (; have < need; ++have)
    (void)wait_ge(sync.team, sync.team.flag(sync.arrived, slot * sl.chunks + have), target);
  *landed = have;
  acquire_for_tma();  // the peers' generic stores before our TMA loads
}

// kTimed: the kernel that records its rank's timeline (AttentionFwdOp's).
// The timeline a ring kernel's loader marks its waits on: the timed kernel's (kTimed: Params::sched is
// Timed<...>), else none.
template <class Params>
__device__ __forceinline__ TimelineBuffer* timeline_of(const Params& p) {
  if constexpr (requires { p.sched.timeline; })
    return p.sched.timeline;
  else
    return nullptr;
}

template <int kHeadDim, class T = __nv_bfloat16, bool kTimed = false>
struct RingAttentionFwdOp : AttentionFwdOp<kHeadDim, T, attention_warpgroups(kHeadDim), kTimed> {
  using Base = AttentionFwdOp<kHeadDim, T, attention_warpgroups(kHeadDim), kTimed>;
  using Base::kBM;
  using Base::kBN;
  using Base::kD;
  using typename Base::Lengths;
  using typename Base::Pipeline;

  struct Params : Base::Params {
    lcsc::PushSync sync;
    CUtensorMap slot_k, slot_v;          // 4-D {dim, kv_head, row, slot}: slot s - 1 holds step s's rows
    const int32_t *key_begin, *key_end;  // [segment * steps + step]: rows of the step source's local K / V
    int steps;                           // the world size
    RingSlots slots;
    const uint4 *k_src, *v_src;  // this rank's K / V: local_rows rows of row_vecs 16-byte vectors
    uint4 *slots_k, *slots_v;    // this rank's slots [steps - 1][slot_rows][row_vecs] (symmetric)
    int row_vecs;
  };
  using Smem = lcsc::WithHelperStaging<typename Base::Smem>;
  struct KeyRange {
    int begin, length;  // rows of the step source's local K / V
    bool causal;
  };
  __device__ static KeyRange key_range(const Params& p, int segment, int step) {
    const int i = segment * p.steps + step, begin = __ldg(p.key_begin + i);
    return {begin, __ldg(p.key_end + i) - begin, p.causal != 0 && step == 0};
  }

  __device__ static void init(const Params& p, Smem& s) {
    Base::init(p, s);
    tma::prefetch_map(&p.slot_k);
    tma::prefetch_map(&p.slot_v);
  }

  // ---- loader (one thread) ----
  __device__ static void load(const Params& p, Smem& s, Pipeline& pipe, lcsc::PipeState& st,
                              const lcsc::AttentionWork& w) {
    const SeqRows sr = seq_rows(p.rows, w.batch);
    check_sequence_fits(sr.q_len, p.sched.q_blocks, kBM);
    Base::load_q(p, s, pipe, w, sr);
    const int kv_head = w.head / p.group;
    for (int step = 0; step < p.steps; ++step) {
      const KeyRange r = key_range(p, w.batch, step);
      const KeyBlocks kb = key_blocks(w.q_block, kBM, sr.q_len, r.length, r.causal);
      if (kb.end == 0) continue;
      if (step == 0) {
        Base::load_keys(&p.k, &p.v, s, pipe, st, kv_head, r.begin, 0, kb.end);
      } else {
        ring_wait_landed(p.sync, p.slots, step - 1, r.begin + kb.end * kBN, timeline_of(p));
        Base::load_keys(&p.slot_k, &p.slot_v, s, pipe, st, kv_head, r.begin, step - 1, kb.end);
      }
    }
  }

  // ---- consumers ----
  // The forward's loop over key blocks (attention.cuh) in its earlier order (V waited for with K, O rescaled
  // once the previous P V landed), run over the item's W ranges as one sequence of blocks (KeyCursor): S of a
  // block is issued with P V of the block before it, whichever range that was in.
  // The first block is peeled off as in the forward (S only): no path merges with MMAs in flight on one side
  // only, where ptxas would serialise every wgmma of the kernel (C7517 / C7518).
  struct KeyCursor {
    int step = -1, n = -1;  // the current block: block n of step `step`'s range
    Lengths len{};
    KeyBlocks kb{};
  };
  // The next block, from the last of a range to its first, range after range; false after the last.
  __device__ static bool advance(const Params& p, const SeqRows& sr, const lcsc::AttentionWork& w,
                                 KeyCursor& c) {
    if (--c.n >= 0) return true;
    while (++c.step < p.steps) {
      const KeyRange r = key_range(p, w.batch, c.step);
      c.len = Lengths{sr.q_len, r.length, r.causal};
      c.kb = key_blocks(w.q_block, kBM, c.len.q, c.len.k, c.len.causal);
      if (c.kb.end > 0) {
        c.n = c.kb.end - 1;
        return true;
      }
    }
    return false;
  }

  __device__ static void compute(const Params& p, Smem& s, Pipeline& pipe, lcsc::PipeState& st,
                                 const lcsc::AttentionWork& w, int wg, typename Base::Accum& acc) {
    using Turns = typename Base::Turns;
    if (w.iteration == 0) Turns::start(wg);
    const SeqRows sr = seq_rows(p.rows, w.batch);
    const int row0 = w.q_block * kBM + 64 * wg;
    tile::OnlineSoftmax<kBN> softmax;
#pragma unroll
    for (int i = 0; i < tile::AccumM64<kD>::kRegs; ++i) acc.o.d[i] = 0.f;
    tile::mbarrier_wait_bounded(&pipe.s_.q_full, static_cast<uint32_t>(w.iteration) & 1u);
    KeyCursor c;
    if (!advance(p, sr, w, c)) {  // no key: O = 0, LSE = -inf
      Base::release_q(pipe);
      Base::finish_rows(p, softmax, acc);
      return;
    }
    lcsc::PipeState kst = st, vst = st;  // the V ring runs one block behind the K ring
    tile::AccumM64<kBN> sc;
    uint32_t pa[kBN / 4];
    float rescale[2];
    // The first block: S only.
    pipe.k.consumer_wait(kst);
    Turns::begin(wg);
    wgmma::fence();
    Base::issue_scores(s, wg, kst.stage, sc);
    Turns::end(wg);
    wgmma::wait<0>();
    Base::scores_landed(pipe, kst, sc, -1);
    Base::to_probabilities(p, c.len, c.kb, c.n, row0, softmax, sc, rescale);
    tile::pack_a<T>(sc, pa);
    while (advance(p, sr, w, c)) {
      pipe.k.consumer_wait(kst);
      pipe.v.consumer_wait(vst);
      Turns::begin(wg);
      wgmma::fence();
      Base::issue_scores(s, wg, kst.stage, sc);
      Base::issue_pv(s, vst.stage, pa, acc.o);
      Turns::end(wg);
      wgmma::wait<1>();  // S has landed; the previous block's P V may still run
      Base::scores_landed(pipe, kst, sc, -1);
      Base::to_probabilities(p, c.len, c.kb, c.n, row0, softmax, sc, rescale);
      wgmma::wait<0>();
      Base::pv_landed(pipe, vst, pa, acc.o);
      tile::scale_rows(acc.o, rescale);
      tile::pack_a<T>(sc, pa);
    }
    Base::release_q(pipe);  // every S has landed
    // The last block's P V.
    pipe.v.consumer_wait(vst);
    Turns::begin(wg);
    wgmma::fence();
    Base::issue_pv(s, vst.stage, pa, acc.o);
    Turns::end(wg);
    wgmma::wait<0>();
    Base::pv_landed(pipe, vst, pa, acc.o);
    st = kst;
    Base::finish_rows(p, softmax, acc);
  }

  __device__ static void finish(const Params& p, Smem& s, int wg, typename Base::StoreState& es) {
    Base::finish(p, s, wg, es);
    if (tile::thread_in_warpgroup() == 0) p.sync.done();
  }

  // ---- helper warps: this rank's K / V into the peers' slots ----
  __device__ static void helper_warp(const Params& p, Smem& s, int index, int count) {
    const TeamView& t = p.sync.team;
    auto copier = lcsc::helper_copier(s);
    ring_push(p.sync, p.slots, index, count, [&](int slot, int dst, int r0, int r1, int) {
      const int64_t at = (int64_t(slot) * p.slots.slot_rows + r0) * p.row_vecs;
      const int rows = p.slots.local_rows;
      copier.copy_rows(p.k_src, t.peer_ptr(p.slots_k + at, dst), r0, r1, rows, p.row_vecs);
      copier.copy_rows(p.v_src, t.peer_ptr(p.slots_v + at, dst), r0, r1, rows, p.row_vecs);
      copier.complete();
    });
  }
};

}  // namespace weft::ops
