// Flash attention backward as an LCSC op (lcsc/kernel.cuh), with its two small companion kernels. Host
// launcher: src/ops/attention_backward.cu. Forward and notation: weft/ops/attention.cuh.
//
// With S = scale * Q K^T (masked), P = softmax(S) recomputed from the forward's LSE, and dO the output's
// gradient:
//   dV = P^T dO     dP = dO V^T     dS = P o (dP - D),  D = rowsum(dO o O)     dQ = scale dS K    dK = scale
//   dS^T Q
//
//   prepare    (plain kernel) per query row (rows of q's layout seen as [rows, heads, dim]): D, and LSE *
//              log2(e) (+inf for a row that sees no key, so that its P is 0), into the workspace, [heads,
//              rows].
//   LCSC op    work items are (batch, K/V head, key block of 128 keys); each consumer warpgroup owns 64 of
//              the keys and keeps their dK and dV (64 x D fp32 each) in registers across the item. The
//              loader brings K and V once per item, then Q, dO, LSE and D of every query block (kBM = 64 or
//              128 rows) of every query head of the GQA group that sees the key block (causal: from the
//              diagonal on) into a ring of stages. Per query block, each warpgroup computes (from its own
//              key rows)
//                S^T = K Q^T, then dP^T = V dO^T (shared-memory operands) while P^T = exp2(S^T log2e scale -
//                LSE) is computed, dS^T = P^T o (dP^T - D), dV += P^T dO (P from registers; issued before
//                the meeting below, so that it runs while the warpgroups wait for each other),
//              writes dS^T to shared memory and meets the other warpgroup; then its part of dQ = dS K over
//              all 128 keys (dS^T read M-major; kBM = 64: columns [w D/2, (w+1) D/2), kBM = 128: rows [64 w,
//              64 w + 64)), then dK += dS^T Q; while dK runs, the dQ part is added to the fp32 dQ accumulator
//              (q's layout) with TMA reduce-adds (staged in the warpgroup's half of the epilogue's buffers).
//              Query rows past the sequence have P = 0, so their dQ rows add zeros: harmless where a packed
//              sequence's block reaches into the next one. At the item's end dK (times scale) and dV go out
//              through the TMA storer (row by row from registers where a packed sequence's last key block
//              ends inside the TMA box).
//   convert    (plain kernel) dQ = scale * accumulator, to q's type.
// Every item adds into dQ in whatever order the blocks reach it (fp32 sums, not bit-reproducible run to run),
// unless the call asks for determinism: then the adds into one query block take turns in descending key-block
// order (a counter per query block; each add completes before the next one starts), made by a writer warp
// per consumer warpgroup (helper warps of the loader's warpgroup), so that a turn's wait and the add's
// completion run beside the warpgroup's next step instead of holding it.
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>
#include <utility>

#include "weft/device/numeric.cuh"  // to_float2
#include "weft/device/ptx.cuh"
#include "weft/lcsc/attention_scheduler.cuh"
#include "weft/lcsc/epilogue.cuh"
#include "weft/lcsc/kernel.cuh"
#include "weft/lcsc/pipeline.cuh"
#include "weft/ops/attention.cuh"
#include "weft/ops/attention_backward_types.hpp"
#include "weft/tile/fragment.cuh"
#include "weft/tile/layout.cuh"
#include "weft/tile/softmax.cuh"
#include "weft/tile/tma.cuh"
#include "weft/tile/wgmma.cuh"
#include "weft/timeline.hpp"

namespace weft::ops {

// Where sequence b's per-row terms (LSE, D) begin in the workspace's rows: a multiple of 4, so that every
// query block's 64 floats start on a 16-byte boundary (TMA boxes do in the innermost dimension). Packed:
// 4 q_begin[b] (the ranges do not overlap, so neither do these); dense: b times seq_q rounded up to 4.
__host__ __device__ inline int64_t attention_term_rows(bool packed, int64_t total_q, int64_t batch,
                                                       int64_t seq_q) {
  return packed ? 4 * total_q : batch * ((seq_q + 3) / 4 * 4);
}
__device__ __forceinline__ int term_row(const AttentionRows& r, const SeqRows& s) {
  return r.q_begin != nullptr ? 4 * s.q0 : s.batch * ((r.seq_q + 3) & ~3);
}

// kDeterministic: dQ's additions take turns in a fixed order (a kernel of its own: the turns' code in the
// default kernel costs it registers, and wgmma serialisation). kBlockM: query rows per step, 64, or 128 at
// D = 64 (D = 128 leaves no registers for more: dK and dV take 64 x 128 fp32 each per warpgroup). 128 rows
// halve the steps, and with them each step's fixed cost (waits, the warpgroups' meeting, the dQ staging),
// for the same work; the host picks (src/ops/attention_backward.cu). kTimed: the kernel that records a
// timeline (AttentionOptions::timeline; weft/timeline.hpp's Timed).
template <int kHeadDim, class T = __nv_bfloat16, bool kDeterministic = false, int kBlockM = 64,
          bool kTimed = false>
struct AttentionBwdOp {
  static_assert(tile::kIs16Bit<T>, "bf16 or fp16 tensors");
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kD = kHeadDim, kBM = kBlockM, kBN = kAttentionBwdBlockN, kStages = 2;
  static constexpr int kClusterSize = 1;
  // Live in a consumer: dK and dV (kD / 2 each), then either S / P and dP / dS (kBM / 2 each) or P as an A
  // operand (kBM / 4) and the dQ part (32): about 192 at D = 128 (kBM 64) and at D = 64 (kBM 128).
  static constexpr int kLoaderRegs = 24, kConsumerRegs = 240;
  static_assert(kD == 64 || kD == 128, "head dims 64 and 128");
  static_assert(kBM == 64 || (kBM == 128 && kD == 64), "64 query rows per step, or 128 at D = 64");
  static_assert(kBN == 64 * kConsumerWarpgroups, "64 keys per consumer warpgroup");
  // D = 64 has the registers for dS^T as dK's A operand (packed as dV's P^T): dK then reads only Q from
  // shared memory, whose port, not the tensor cores, limits that step; dP^T is issued right behind S^T, and
  // each LSE / D pair is loaded once for both of a thread's rows. 1.02-1.06x at D = 64 (2026-11-28, H200,
  // bench/RESULTS.md); at D = 128 the same step spills more and ran 0.94-1.0x, so it keeps dS^T in shared
  // memory for dK.
  static constexpr bool kDsInRegisters = kD == 64;

  using Scheduler = lcsc::AttentionScheduler;  // items: (batch, K/V head, key block); see key_block()
  using KTile = tile::Sw128Tile<T, kBN, kD>;   // rows: keys (K-major A of S^T, MN-major B of dQ)
  using VTile = tile::Sw128Tile<T, kBN, kD>;   // rows: keys (K-major A of dP^T)
  using QTile = tile::Sw128Tile<T, kBM, kD>;   // rows: queries (K-major B of S^T, MN-major B of dK); dO alike
  using DsTile = tile::Sw128Tile<T, kBN, kBM>;  // dS^T: rows keys, columns queries (M-major A of dQ)
  using Epilogue = lcsc::TmaStoreEpilogue<T, kD, kConsumerWarpgroups>;
  using StoreState = typename Epilogue::State;
  using Ring = lcsc::Pipeline<kStages, kConsumerWarpgroups, 1>;
  // dQ = dS K of a step (kBM x kD) is split between the warpgroups by columns when kBM = 64 and by rows when
  // kBM = 128: either way a warpgroup's part is 64 rows x 64 columns.
  static constexpr bool kDqSplitRows = kBM == 128;
  static constexpr int kDqCols = kDqSplitRows ? kD : kD / 2;  // dQ columns per warpgroup
  static constexpr int kWgRows = 64;                          // keys per warpgroup; dQ rows per warpgroup
  static constexpr int kDqPartFloats = kBM * kDqCols;
  using DqChunk = tile::OutChunk<float>;  // 32 fp32 columns of 64 rows: the dQ accumulator map's box
  static constexpr int kDqChunks = kDqCols / DqChunk::kCols;
  static constexpr int kDsBarrierId = lcsc::kEpilogueFirstBarrierId + kConsumerWarpgroups;  // both warpgroups
  static_assert(sizeof(typename Epilogue::Chunk) == sizeof(DqChunk) && kDqChunks <= 2,
                "a warpgroup's dQ part is staged in its two epilogue buffers");

  // K and V: one phase per item (kv_full / kv_empty); Q, dO, LSE, D: the ring.
  class Pipeline {
   public:
    struct Storage {
      uint64_t kv_full, kv_empty;
      typename Ring::Storage qdo;
    };
    __device__ explicit Pipeline(Storage& s) : s_(s), qdo(s.qdo) {}
    __device__ void init() {
      qdo.init();
      mbarrier_init(&s_.kv_full, 1);
      mbarrier_init(&s_.kv_empty, kConsumerWarpgroups);
    }
    Storage& s_;
    Ring qdo;
  };

  using SchedulerParams =
      std::conditional_t<kTimed, Timed<lcsc::AttentionSchedulerParams>, lcsc::AttentionSchedulerParams>;
  struct Params {
    SchedulerParams sched;                 // heads = K/V heads x 2^head_split_log2, q_blocks = key blocks
    CUtensorMap q, k, v, dout, dk, dv;     // 4-D {dim, head, seq, batch}
    CUtensorMap dq_accum;                  // fp32, q's layout, 4-D like q (box 32 columns): reduce-adds
    CUtensorMap lse_map, dsum_map;         // LSE log2(e) and D (prepare): 2-D {term rows, heads}, box kBM
    AttentionRows rows;
    T *dk_out, *dv_out;  // dK, dV themselves: the row-by-row stores
    int dkv_fp32;        // dk / dv are fp32 maps that dK / dV are reduce-added into
    // Items per K / V head: its query heads (the GQA group) in 2^head_split_log2 parts, an item each, where
    // the unsplit items are too few for the SMs (see heads_of); above 1 dK / dV are reduce-added
    // (dkv_fp32). A power of two: the split costs the loop shifts, not divisions.
    int head_split_log2;
    uint64_t* dq_order;  // kDeterministic: contributions so far per (sequence, head, query
                         // block), [batch, heads, dq_blocks]
    int dq_blocks;       // query blocks of the longest sequence
    int heads, group;
    float scale, scale_log2;
    int causal;
    int* claims;  // kDeterministic: the unit claims counter, zeroed before the kernel (lcsc::ClaimedTiles)
  };
  // kDeterministic: a consumer warpgroup hands each staged dQ part to its writer warp (helper_warp): where
  // it goes and its turn, then `full`; the writer waits for the turn, reduce-adds the part, counts it done
  // and frees the staging buffers (`empty`). A handoff with `end` set ends the writer.
  struct DqHandoff {
    uint64_t full, empty;
    int posted;                        // parts handed over so far (the warpgroup's first thread's count)
    int head, row0, batch_coord, seq;  // the dQ accumulator's rows (head, first row, batch coordinate)
    int m, turn;                       // sequence `seq`'s query block m, after `turn` key blocks' adds
    int end;                           // no more parts
  };
  struct Smem {
    KTile k;
    VTile v;
    QTile q[kStages], dout[kStages];
    DsTile ds[kStages];  // one per ring stage: written at a step, read by both warpgroups' dQ MMAs
    alignas(128) float lse_log2[kStages][kBM];  // a query block's LSE * log2(e) and D
    alignas(128) float dsum[kStages][kBM];
    typename Epilogue::Smem epi;  // dK / dV staging; a warpgroup's two buffers also stage its dQ part
    typename Pipeline::Storage pipe;
    DqHandoff dq_handoff[kConsumerWarpgroups];  // kDeterministic
    // kDeterministic: units claimed in order (lcsc::ClaimedTiles, Params::claims; see dq_turn). (No
    // [[no_unique_address]]: with it g++ lays out a derived Smem, the ring backward's, in this one's tail
    // padding, which the device compiler does not: host and device would disagree on its size.)
    std::conditional_t<kDeterministic, lcsc::TileQueue, lcsc::NoTileQueue> tile_queue;
  };
  struct Accum {
    tile::AccumM64<kD> dk, dv;
  };

  __device__ static void init(const Params& p, Smem& s) {
    if constexpr (kDeterministic)
      for (DqHandoff& h : s.dq_handoff) {
        mbarrier_init(&h.full, 1);
        mbarrier_init(&h.empty, 1);
        h.posted = 0;
        h.end = 0;
      }
    tma::prefetch_map(&p.q);
    tma::prefetch_map(&p.k);
    tma::prefetch_map(&p.v);
    tma::prefetch_map(&p.dout);
    tma::prefetch_map(&p.dk);
    tma::prefetch_map(&p.dv);
    tma::prefetch_map(&p.lse_map);
    tma::prefetch_map(&p.dsum_map);
    tma::prefetch_map(&p.dq_accum);
  }

  // The item's key block: the scheduler's blocks (AttentionWork::q_block) run along the keys here.
  __device__ static int key_block(const lcsc::AttentionWork& w) { return w.q_block; }
  // The item's K / V head and its query heads [first, first + count): the scheduler's head is K / V head x
  // 2^head_split_log2 + part, part taking count = group / 2^head_split_log2 of the group's query heads.
  struct Heads {
    int kv, first, count;
  };
  __device__ static Heads heads_of(const Params& p, const lcsc::AttentionWork& w) {
    const int kv = w.head >> p.head_split_log2, count = p.group >> p.head_split_log2;
    return {kv, kv * p.group + (w.head & ((1 << p.head_split_log2) - 1)) * count, count};
  }

  // ---- loader (one thread) ----
  __device__ static void load(const Params& p, Smem& s, Pipeline& pipe, lcsc::PipeState& st,
                              const lcsc::AttentionWork& w) {
    const int n = key_block(w);
    const SeqRows sr = seq_rows(p.rows, w.batch);
    check_sequence_fits(sr.k_len, p.sched.q_blocks, kBN);
    if constexpr (kDeterministic) check_sequence_fits(sr.q_len, p.dq_blocks, kBM);  // dq_order's counters
    const Heads hs = heads_of(p, w);
    tile::mbarrier_wait_bounded(&pipe.s_.kv_empty, (static_cast<uint32_t>(w.iteration) & 1u) ^ 1u);
    mbarrier_arrive_expect_tx(&pipe.s_.kv_full, sizeof(KTile) + sizeof(VTile));
    load_head_rows(s.k, &p.k, hs.kv, sr.k0 + n * kBN, sr.batch, &pipe.s_.kv_full);
    load_head_rows(s.v, &p.v, hs.kv, sr.k0 + n * kBN, sr.batch, &pipe.s_.kv_full);
    const QueryBlocks qb = query_blocks(n, sr.q_len, sr.k_len, p.causal != 0, kBM);
    for (int g = 0; g < hs.count; ++g) {
      const int h = hs.first + g;
      for (int m = qb.begin; m < qb.end; ++m) {
        uint64_t* bar = pipe.qdo.producer_acquire(st, 2 * sizeof(QTile) + 2 * kBM * sizeof(float));
        load_head_rows(s.q[st.stage], &p.q, h, sr.q0 + m * kBM, sr.batch, bar);
        load_head_rows(s.dout[st.stage], &p.dout, h, sr.q0 + m * kBM, sr.batch, bar);
        const int row = term_row(p.rows, sr) + m * kBM;  // of the LSE / D maps
        tma::load_2d(s.lse_log2[st.stage], &p.lse_map, row, h, bar);
        tma::load_2d(s.dsum[st.stage], &p.dsum_map, row, h, bar);
        st.advance(kStages);
      }
    }
  }

  // ---- consumers ----
  __device__ static void compute(const Params& p, Smem& s, Pipeline& pipe, lcsc::PipeState& st,
                                 const lcsc::AttentionWork& w, int wg, Accum& acc) {
    const int n = key_block(w);
#pragma unroll
    for (int i = 0; i < tile::AccumM64<kD>::kRegs; ++i) acc.dk.d[i] = acc.dv.d[i] = 0.f;
    tile::mbarrier_wait_bounded(&pipe.s_.kv_full, static_cast<uint32_t>(w.iteration) & 1u);
    __syncwarp();
    const SeqRows sr = seq_rows(p.rows, w.batch);
    const Lengths len{sr.q_len, sr.k_len, sr.k_len - sr.q_len, p.causal != 0};
    const QueryBlocks qb = query_blocks(n, len.q, len.k, len.causal, kBM);
    const int key0 = n * kBN + 64 * wg;  // this warpgroup's first key (of the sequence)
    const Heads hs = heads_of(p, w);
    for (int g = 0; g < hs.count; ++g) {
      const int h = hs.first + g;
      for (int m = qb.begin; m < qb.end; ++m) {
        pipe.qdo.consumer_wait(st);
        const lcsc::TmaRows4d dq_rows{&p.dq_accum, h, sr.q0 + m * kBM, sr.batch, lcsc::StoreMode::kReduceAdd};
        step(p, len, s, st.stage, wg, key0, m, acc, dq_rows, DqTurn{w.batch, h, n});
        pipe.qdo.consumer_release(st);
        st.advance(kStages);
      }
    }
    if (tile::thread_in_warpgroup() == 0) tile::mbarrier_arrive(&pipe.s_.kv_empty);
#pragma unroll
    for (int i = 0; i < tile::AccumM64<kD>::kRegs; ++i) acc.dk.d[i] *= p.scale;
  }

  __device__ static void store(const Params& p, Smem& s, const lcsc::AttentionWork& w, int wg,
                               const Accum& acc, StoreState& es) {
    // The epilogue's buffers staged this warpgroup's dQ parts: wait until the last reduce-add has read them.
    wait_staging_free(s, wg);
    const SeqRows sr = seq_rows(p.rows, w.batch);
    const int row0 = key_block(w) * kBN + 64 * wg, kv = heads_of(p, w).kv;
    if (p.dkv_fp32) {  // rows past the sequence's keys hold exact zeros: harmless to add
      reduce_add_rows(s, wg, acc.dk,
                      lcsc::TmaRows4d{&p.dk, kv, sr.k0 + row0, sr.batch, lcsc::StoreMode::kReduceAdd});
      reduce_add_rows(s, wg, acc.dv,
                      lcsc::TmaRows4d{&p.dv, kv, sr.k0 + row0, sr.batch, lcsc::StoreMode::kReduceAdd});
      return;
    }
    // A TMA box clips at a dense sequence's end but would write into the next packed sequence.
    if (p.rows.q_begin == nullptr || row0 + 64 <= sr.k_len) {
      Epilogue::store_to(lcsc::TmaRows4d{&p.dk, kv, sr.k0 + row0, sr.batch}, s.epi, es, wg, acc.dk, 0);
      Epilogue::store_to(lcsc::TmaRows4d{&p.dv, kv, sr.k0 + row0, sr.batch}, s.epi, es, wg, acc.dv, 0);
    } else {
      const int64_t stride = int64_t(p.sched.heads >> p.head_split_log2) * kD;  // (the K / V heads)
      const int64_t first = (sr.k_base + row0) * stride + int64_t(kv) * kD;
      tile::store_rows(acc.dk, p.dk_out + first, stride, sr.k_len - row0);
      tile::store_rows(acc.dv, p.dv_out + first, stride, sr.k_len - row0);
    }
  }
  __device__ static void finish(const Params&, Smem& s, int wg, StoreState& es) {
    Epilogue::finish(es);
    if constexpr (kDeterministic)  // the writer's last part: none
      if (tile::thread_in_warpgroup() == 0) {
        DqHandoff& h = s.dq_handoff[wg];
        tile::mbarrier_wait_bounded(&h.empty, (static_cast<uint32_t>(h.posted) & 1u) ^ 1u);
        h.end = 1;
        ++h.posted;
        tile::mbarrier_arrive(&h.full);
      }
  }

  // ---- helper warps (kDeterministic): warp w < kConsumerWarpgroups writes consumer warpgroup w's dQ parts
  // in their turns (see DqHandoff), its first lane alone. ----
  __device__ static void helper_warp(const Params& p, Smem& s, int index, int) requires kDeterministic {
    const int wg = index % lcsc::kHelperWarps;
    if (wg >= kConsumerWarpgroups || threadIdx.x % 32 != 0) return;
    DqHandoff& h = s.dq_handoff[wg];
    for (uint32_t k = 0;; ++k) {
      tile::mbarrier_wait_bounded(&h.full, k & 1u);
      if (h.end) return;
      if (h.turn < 0) __trap();  // (dq_turn of an adder is >= 0: a bug, not a wait that never ends)
      uint64_t* counter = p.dq_order + (int64_t(h.seq) * p.heads + h.head) * p.dq_blocks + h.m;
      tile::wait_ge_bounded(counter, 2 * static_cast<uint64_t>(h.turn));
      ptx::fence_proxy_async_global();  // the earlier adds are complete and visible to this one's TMA
      const lcsc::TmaRows4d part{&p.dq_accum, h.head, h.row0, h.batch_coord, lcsc::StoreMode::kReduceAdd};
      const int col0 = kDqSplitRows ? 0 : wg * kDqCols;
#pragma unroll
      for (int c = 0; c < kDqChunks; ++c) part.issue(col0 + c * DqChunk::kCols, staging(s, wg, c));
      bulk_commit();
      bulk_wait<0>();  // this add complete (written, not only read) before the next one's turn
      ptx::fence_proxy_async_global();
      ptx::red_release_gpu_add(counter, 1);
      tile::mbarrier_arrive(&h.empty);  // the staging buffers free
    }
  }

 protected:
  // One query block of kBM rows against the warpgroup's 64 keys (see the header comment).
  struct Lengths {
    int q, k;   // the sequence's query and key rows
    int shift;  // causal: query row i sees key j iff j <= i + shift
    bool causal;
  };
  // Deterministic dQ (kDeterministic, Params::dq_order): the adds into one query block's accumulator happen
  // in descending key-block order; a counter per (sequence, head, query block) counts the warpgroup halves
  // added so far, and key block n waits for 2 (last - n) of them, where the key blocks that add into query
  // block m are 0 .. last (dq_turn). Descending, because under a causal mask key block n + 1 reaches a query
  // block two steps before key block n does (it starts two 64-row blocks later): ascending, each key block
  // would idle those steps at its start, two more than the one before it. The scheduler hands a sequence's
  // key blocks out last first (AttentionSchedulerParams::reversed), and the blocks claim the units in that
  // order (lcsc::ClaimedTiles: a block takes the next unit when it is free, where a fixed share would start
  // a key block before its predecessors whenever its block's earlier items were shorter, as a causal mask
  // makes them): every add's predecessors are in units claimed, so started, before its own, and a
  // persistent block runs its claims in order: no wait can close a cycle. What an add needs to find its
  // turn:
  struct DqTurn {
    int batch, head, key_block;
  };
  // The key blocks that add into query block m before key block n (one of them): those after n up to the
  // last one (last_key_block_of).
  __device__ static int dq_turn(const Lengths& len, int n, int m) {
    return last_key_block_of(m, len.k, len.shift, len.causal, kBM) - n;
  }
  __device__ static void step(const Params& p, const Lengths& len, Smem& s, int stage, int wg, int key0,
                              int m, Accum& acc, const lcsc::TmaRows4d& dq_rows, const DqTurn& turn) {
    tile::AccumM64<kBM> sp;  // S^T, then P^T: rows keys, columns queries
    tile::AccumM64<kBM> ds;  // dP^T, then dS^T
    wgmma::fence();
    issue_scores(s.k, s.q[stage], wg, sp);
    if constexpr (kDsInRegisters) {  // dP^T queued behind S^T: the tensor pipe stays busy during P^T's exp2
      issue_scores(s.v, s.dout[stage], wg, ds);
      wgmma::wait<1>();
      wgmma::fence_operands(sp.d);
    } else {
      wgmma::wait<0>();
      wgmma::fence_operands(sp.d);
      wgmma::fence();
      issue_scores(s.v, s.dout[stage], wg, ds);
    }
    // One branch per block, not one per element: most blocks need no mask.
    if (block_needs_mask(len, key0, m * kBM))
      scores_to_ds<true>(p, len, s.lse_log2[stage], s.dsum[stage], key0, m * kBM, sp, ds);
    else
      scores_to_ds<false>(p, len, s.lse_log2[stage], s.dsum[stage], key0, m * kBM, sp, ds);
    // P as the A operand of dV (S and dP die here). dV needs nothing of the other warpgroup, so it runs on
    // the tensor cores while dS^T goes to shared memory (the A operand of dQ) and the warpgroups meet.
    uint32_t pa[kBM / 4];
    tile::pack_a<T>(sp, pa);
    wgmma::fence();
    issue_dv(pa, s.dout[stage], acc.dv);  // dV += P^T dO
    store_ds(ds, s.ds[stage], wg);
    [[maybe_unused]] uint32_t dsa[kBM / 4];
    if constexpr (kDsInRegisters) tile::pack_a<T>(ds, dsa);
    // Both warpgroups' dS^T in shared memory, visible to the tensor cores.
    fence_proxy_async_smem();
    tile::named_barrier_sync(kDsBarrierId, kConsumerWarpgroups * tile::kWarpgroupThreads);
    // dQ before dK: dQ's part is staged and sent while dK runs.
    tile::AccumM64<kDqCols> dq;
    wgmma::fence();
    issue_dq(s.ds[stage], s.k, wg, dq);  // the warpgroup's part of dQ = dS K
    if constexpr (kDsInRegisters)
      issue_dk_rs(dsa, s.q[stage], acc.dk);  // dK += dS^T Q
    else
      issue_dk(s.ds[stage], s.q[stage], wg, acc.dk);  // dK += dS^T Q
    wgmma::wait<1>();                                 // dV and dQ (groups complete in order)
    wgmma::fence_operands(dq.d);
    wgmma::fence_operands(acc.dv.d);
    wgmma::fence_operands(pa);
    add_dq_part(p, len, s, wg, m, dq, dq_rows, turn);
    // dK reads this stage's Q and dS^T: complete before the stage is released.
    wgmma::wait<0>();
    wgmma::fence_operands(acc.dk.d);
    if constexpr (kDsInRegisters) wgmma::fence_operands(dsa);
  }

  // D (64 x kBM, rows: this warpgroup's keys) = A_rows B^T over the head dim, both K-major in shared memory.
  __device__ static void issue_scores(const KTile& a, const QTile& b, int wg, tile::AccumM64<kBM>& d) {
    wgmma::mma_ss_group<kBM, kD, KTile, 0, QTile, 0>(d.d, wgmma::desc_k_major(a, 64 * wg, 0),
                                                     wgmma::desc_k_major(b, 0, 0), false);
  }
  // dV (64 x D) += P^T (64 x kBM queries, registers) dO (kBM queries x D, the MN-major B).
  __device__ static void issue_dv(uint32_t (&pa)[kBM / 4], const QTile& dout, tile::AccumM64<kD>& dv) {
    wgmma::mma_rs_group<kD, kBM, QTile, 1>(dv.d, pa, wgmma::desc_mn_major(dout, 0));
  }
  // dK (64 x D) += dS^T (this warpgroup's 64 key rows of the tile, K-major A) Q (MN-major B).
  __device__ static void issue_dk(const DsTile& ds, const QTile& q, int wg, tile::AccumM64<kD>& dk) {
    wgmma::mma_ss_group<kD, kBM, DsTile, 0, QTile, 1>(dk.d, wgmma::desc_k_major(ds, 64 * wg, 0),
                                                      wgmma::desc_mn_major(q, 0), true);
  }
  // dK (64 x D) += dS^T (registers: this warpgroup's rows, packed as dV's P^T) Q (MN-major B).
  __device__ static void issue_dk_rs(uint32_t (&dsa)[kBM / 4], const QTile& q, tile::AccumM64<kD>& dk) {
    wgmma::mma_rs_group<kD, kBM, QTile, 1>(dk.d, dsa, wgmma::desc_mn_major(q, 0));
  }
  // The warpgroup's part of dQ = dS (queries x 128 keys: the dS^T tile read M-major) K (keys x columns,
  // MN-major): kBM = 64, all 64 rows and columns [wg D/2, (wg+1) D/2); kBM = 128, rows [64 wg, 64 wg + 64)
  // and all columns.
  __device__ static void issue_dq(const DsTile& ds, const KTile& k, int wg, tile::AccumM64<kDqCols>& dq) {
    wgmma::mma_ss_group<kDqCols, kBN, DsTile, 1, KTile, 1>(
        dq.d, wgmma::desc_mn_major(ds, 0, kDqSplitRows ? kWgRows * wg : 0),
        wgmma::desc_mn_major(k, 0, kDqSplitRows ? 0 : wg * kDqCols), false);
  }
  // The warpgroup's dS^T (its 64 keys x kBM queries) into rows [64 wg, 64 wg + 64) of the shared tile, one
  // 64-column block at a time.
  __device__ static void store_ds(const tile::AccumM64<kBM>& ds, DsTile& tile_ds, int wg) {
    [&]<int... kBlock>(std::integer_sequence<int, kBlock...>) {
      (tile::store_accum_chunk<kBlock, T>(
           ds, *reinterpret_cast<tile::OutChunk<T>*>(tile_ds.row_ptr(kBlock, kWgRows * wg))),
       ...);
    }
    (std::make_integer_sequence<int, kBM / 64>{});
  }

  // Whether the block of keys [key0, key0 + 64) and query rows [row0, row0 + kBM) needs the mask: it
  // reaches past the keys or the rows, or (causal) its last key lies past its first row's last visible key.
  __device__ static bool block_needs_mask(const Lengths& len, int key0, int row0) {
    return key0 + 64 > len.k || row0 + kBM > len.q || (len.causal && key0 + 63 > row0 + len.shift);
  }
  // S^T -> P^T = exp2(S^T scale log2(e) - LSE log2(e)) per query column (while dP^T's MMAs run), then, once
  // they are done, dP^T -> dS^T = P^T o (dP^T - D). kMasked: keys past the sequence's, query rows past its
  // rows (whose LSE and D are another sequence's, or garbage, even NaN) and (causal) keys past a row's last
  // visible one get P = 0 and dS = 0. Rows that see no key have LSE = +inf: P = 0. LSE and D are read two
  // adjacent columns at a time (a thread's columns come in pairs).
  template <bool kMasked>
  __device__ static void scores_to_ds(const Params& p, const Lengths& len, const float (&lse_log2)[kBM],
                                      const float (&dsum)[kBM], int key0, int row0, tile::AccumM64<kBM>& sp,
                                      tile::AccumM64<kBM>& ds) {
    using Frag = tile::AccumM64<kBM>;
    float2 lse{};
#pragma unroll
    for (int i = 0; i < Frag::kRegs; i += 2) {
      const int col = Frag::col(i);
      // Registers i and i + 2 share their columns (rows r and r + 8): kDsInRegisters loads the pair once.
      if (!kDsInRegisters || i % 4 == 0) lse = lds_float2(&lse_log2[col]);
      float v0 = tile::ex2(fmaf(sp.d[i], p.scale_log2, -lse.x));
      float v1 = tile::ex2(fmaf(sp.d[i + 1], p.scale_log2, -lse.y));
      if constexpr (kMasked) {
        const int key = key0 + Frag::row(i);
        const bool key_out = key >= len.k;
        if (key_out || row0 + col >= len.q || (len.causal && key > row0 + col + len.shift)) v0 = 0.f;
        if (key_out || row0 + col + 1 >= len.q || (len.causal && key > row0 + col + 1 + len.shift)) v1 = 0.f;
      }
      sp.d[i] = v0;
      sp.d[i + 1] = v1;
    }
    wgmma::wait<0>();
    wgmma::fence_operands(ds.d);
    float2 d{};
#pragma unroll
    for (int i = 0; i < Frag::kRegs; i += 2) {
      if (!kDsInRegisters || i % 4 == 0) d = lds_float2(&dsum[Frag::col(i)]);
      const float g0 = sp.d[i] * (ds.d[i] - d.x), g1 = sp.d[i + 1] * (ds.d[i + 1] - d.y);
      if constexpr (kMasked) {  // 0 * NaN would not be 0
        ds.d[i] = sp.d[i] == 0.f ? 0.f : g0;
        ds.d[i + 1] = sp.d[i + 1] == 0.f ? 0.f : g1;
      } else {
        ds.d[i] = g0;
        ds.d[i + 1] = g1;
      }
    }
  }
  // Two adjacent floats of shared memory (8-byte aligned).
  __device__ static float2 lds_float2(const float* p) {
    float2 v;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(smem_addr(p)));
    return v;
  }

  // The warpgroup's part of dQ (64 rows x 64 columns) into its two staging buffers (32-column chunks in
  // the accumulator map's 128-byte swizzle: conflict-free stores) and reduce-added into the accumulator.
  __device__ static void* staging(Smem& s, int wg, int chunk) {
    return s.epi.buf[wg][chunk].bytes;
  }
  // Until the staging buffers are free: the first thread's own reduce-adds have read them and
  // (kDeterministic) the writer warp has written every part handed to it.
  __device__ static void wait_staging_free(Smem& s, int wg) {
    if (tile::thread_in_warpgroup() == 0) {
      bulk_wait_read<0>();
      if constexpr (kDeterministic) {
        DqHandoff& h = s.dq_handoff[wg];
        tile::mbarrier_wait_bounded(&h.empty, (static_cast<uint32_t>(h.posted) & 1u) ^ 1u);
      }
    }
    tile::named_barrier_sync(lcsc::kEpilogueFirstBarrierId + wg, tile::kWarpgroupThreads);
  }
  template <int kChunk>
  __device__ static void stage_dq_chunk(Smem& s, int wg, const tile::AccumM64<kDqCols>& dq) {
    if constexpr (kChunk < kDqChunks)
      tile::store_accum_chunk<kChunk, float>(dq, *reinterpret_cast<DqChunk*>(staging(s, wg, kChunk)));
  }
  // The warpgroup's 64 x kD fp32 rows reduce-added into `dest` (an fp32 map, 32-column boxes), two chunks at
  // a time through its two staging buffers.
  template <int kChunk>
  __device__ static void reduce_add_pair(Smem& s, int wg, const tile::AccumM64<kD>& acc,
                                         const lcsc::TmaRows4d& dest) {
    constexpr int kChunks = kD / DqChunk::kCols;
    wait_staging_free(s, wg);
    tile::store_accum_chunk<kChunk, float>(acc, *reinterpret_cast<DqChunk*>(staging(s, wg, 0)));
    if constexpr (kChunk + 1 < kChunks)
      tile::store_accum_chunk<kChunk + 1, float>(acc, *reinterpret_cast<DqChunk*>(staging(s, wg, 1)));
    fence_proxy_async_smem();
    tile::named_barrier_sync(lcsc::kEpilogueFirstBarrierId + wg, tile::kWarpgroupThreads);
    if (tile::thread_in_warpgroup() == 0) {
      dest.issue(kChunk * DqChunk::kCols, staging(s, wg, 0));
      if constexpr (kChunk + 1 < kChunks) dest.issue((kChunk + 1) * DqChunk::kCols, staging(s, wg, 1));
      bulk_commit();
    }
  }
  __device__ static void reduce_add_rows(Smem& s, int wg, const tile::AccumM64<kD>& acc,
                                         const lcsc::TmaRows4d& dest) {
    reduce_add_pair<0>(s, wg, acc, dest);
    if constexpr (kD / DqChunk::kCols > 2) reduce_add_pair<2>(s, wg, acc, dest);
  }
  __device__ static void add_dq_part(const Params& p, const Lengths& len, Smem& s, int wg, int m,
                                     const tile::AccumM64<kDqCols>& dq, const lcsc::TmaRows4d& dq_rows,
                                     const DqTurn& turn) {
    wait_staging_free(s, wg);
    stage_dq_chunk<0>(s, wg, dq);
    stage_dq_chunk<1>(s, wg, dq);
    fence_proxy_async_smem();
    tile::named_barrier_sync(lcsc::kEpilogueFirstBarrierId + wg, tile::kWarpgroupThreads);
    if (tile::thread_in_warpgroup() != 0) return;
    lcsc::TmaRows4d part = dq_rows;
    if constexpr (kDqSplitRows) part.row0 += kWgRows * wg;
    if constexpr (kDeterministic) {  // to the writer warp, which takes the turn
      DqHandoff& h = s.dq_handoff[wg];
      h.head = part.c1;
      h.row0 = part.row0;
      h.batch_coord = part.c3;
      h.seq = turn.batch;
      h.m = m;
      h.turn = dq_turn(len, turn.key_block, m);
      ++h.posted;
      tile::mbarrier_arrive(&h.full);
    } else {
      const int col0 = kDqSplitRows ? 0 : wg * kDqCols;
#pragma unroll
      for (int c = 0; c < kDqChunks; ++c) part.issue(col0 + c * DqChunk::kCols, staging(s, wg, c));
      bulk_commit();
    }
  }
};

// ---- companion kernels ----------------------------------------------------------------------------------
// prepare: one warp per (sequence, query row, head). D = rowsum(dO o O) in fp32 from the T tensors; LSE
// in log2 units, +inf where P must be 0 (a row that sees no key, LSE = -inf); both into [heads,
// term_stride] arrays at the sequence's term_row.
template <int kD, class T>
__global__ void attention_bwd_prepare(const T* out, const T* dout, const float* lse, float* lse_log2,
                                      float* dsum, AttentionRows rows, int batch, int heads,
                                      int term_stride) {
  const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
  if (warp >= int64_t(batch) * rows.seq_q * heads) return;
  const int h = static_cast<int>(warp % heads);
  const int i = static_cast<int>(warp / heads % rows.seq_q), b = static_cast<int>(warp / heads / rows.seq_q);
  const SeqRows sr = seq_rows(rows, b);
  if (i >= sr.q_len) return;
  const int64_t off = ((sr.q_base + i) * heads + h) * kD;
  float d = 0.f;
#pragma unroll
  for (int c = lane * 2; c < kD; c += 64) {
    const float2 o = to_float2(out + off + c), g = to_float2(dout + off + c);
    d += o.x * g.x + o.y * g.y;
  }
#pragma unroll
  for (int s = 16; s > 0; s /= 2) d += __shfl_xor_sync(0xffffffffu, d, s);
  if (lane == 0) {
    const float l = lse[lse_index(rows, sr, heads, h, i)];
    const int64_t t = int64_t(h) * term_stride + term_row(rows, sr) + i;
    dsum[t] = d;
    lse_log2[t] = l == tile::kNegInf ? -tile::kNegInf : l * 1.4426950408889634f;
  }
}

// convert: dQ (T, q's layout) = scale * the accumulator (fp32, q's layout), four elements per thread.
template <class T>
__global__ void attention_bwd_convert_dq(const float* dq_accum, T* dq, int64_t elements, float scale) {
  const int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * 4;
  if (i >= elements) return;
  const float4 v = *reinterpret_cast<const float4*>(dq_accum + i);
  *reinterpret_cast<uint2*>(dq + i) =
      make_uint2(tile::pack2<T>(v.x * scale, v.y * scale), tile::pack2<T>(v.z * scale, v.w * scale));
}

// convert, the split items' dK / dV (AttentionBwdOp::Params::dkv_fp32): out (T) = the accumulator (fp32),
// both [rows][row_elements], over the key rows of each sequence only (blockIdx.y: sequence b's rows
// [begin[b], end[b]); begin null: rows [0, rows) as one): rows in no sequence keep what the caller's tensors
// hold, as the unsplit kernel leaves them. Four elements a thread, grid-striding over the range.
template <class T>
__global__ void attention_bwd_convert_key_rows(const float* accum, T* out, int64_t rows, int64_t row_elements,
                                               const int32_t* begin, const int32_t* end) {
  const int b = blockIdx.y;
  const int64_t first = begin ? int64_t(__ldg(begin + b)) * row_elements : 0;
  const int64_t last = begin ? int64_t(__ldg(end + b)) * row_elements : rows * row_elements;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x * 4;
  for (int64_t i = first + (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * 4; i < last; i += stride) {
    const float4 v = *reinterpret_cast<const float4*>(accum + i);
    *reinterpret_cast<uint2*>(out + i) = make_uint2(tile::pack2<T>(v.x, v.y), tile::pack2<T>(v.z, v.w));
  }
}

}  // namespace weft::ops
