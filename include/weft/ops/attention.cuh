// Flash attention forward as an LCSC op (lcsc/kernel.cuh): O = softmax(scale * Q K^T [+ causal mask]) V per
// (batch, head), with the fp32 log-sum-exp of every row. Host launcher: src/ops/attention.cu.
//
// Tensors are [batch, seq, heads, head_dim] bf16 or fp16 (flash-attn's layout), seen through 4-D tensor maps
// {dim, head, seq, batch} whose boxes clip at each sequence's end: loads past it read zeros, stores past it
// write nothing. K / V have `kv_heads` heads; query head h reads K / V head h / (heads / kv_heads) (GQA).
// The causal mask is aligned to the bottom right: query row i sees keys j <= i + seq_k - seq_q (rows with
// no key get O = 0 and LSE = -inf). Packed sequences (AttentionRows) are one long sequence of the maps
// (batch 1) cut into ranges: loads past a range read the next one's rows (masked like keys past seq_k),
// and the query block that ends a range is stored row by row, straight from registers, where a TMA box
// would write into the next range.
//
// Work items are (batch, head, query block) from lcsc::AttentionScheduler (L2 sections, heavy first when
// causal). A compute block has one loader thread and W consumer warpgroups of 64 query rows each (W = 2 at
// D = 128, 3 at D = 64):
//   loader     Q of the item once (q_full / q_empty, one phase per item), then K and V of each key block
//              into two rings of kStages 128-row stages, key blocks from the last to the first (so only the
//              first one a tile sees can be a partial block at the sequence's end).
//   consumers  per key block n, in the warpgroup's turn at the tensor cores (lcsc/turns.cuh): issue
//              S_n = Q K_n^T (both operands in shared memory) and O += P_{n+1} V_{n+1} (P from registers,
//              V as the MN-major B operand: no transpose); while the P V runs, the mask where the block
//              needs one and the online softmax (tile/softmax.cuh) turn S_n into P_n; O is rescaled to
//              the new row maxima while the next block's S runs (see compute()).
//   store      O normalised by the row sums, through the TMA storer into O's 4-D map; LSE by the lanes that
//              own a row. Accumulating (a ring step): merged into the running fp32 O and LSE instead.
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "weft/device/ptx.cuh"
#include "weft/lcsc/attention_scheduler.cuh"
#include "weft/lcsc/epilogue.cuh"
#include "weft/lcsc/kernel.cuh"
#include "weft/ops/attention_types.hpp"
#include "weft/lcsc/pipeline.cuh"
#include "weft/lcsc/turns.cuh"
#include "weft/tile/fragment.cuh"
#include "weft/tile/layout.cuh"
#include "weft/tile/softmax.cuh"
#include "weft/tile/tma.cuh"
#include "weft/tile/wgmma.cuh"
#include "weft/timeline.hpp"

namespace weft::ops {

// Query rows per work item for a head dim: 64 per consumer warpgroup, 3 warpgroups at D = 64 (where the
// softmax's exponentials weigh as much as the MMAs, so more warpgroups take turns), 2 at D = 128.
__host__ __device__ constexpr int attention_warpgroups(int head_dim) {
  return head_dim == 64 ? 3 : 2;
}

// Where sequence b's rows lie. Dense tensors are [batch, seq, heads, dim]: the maps' batch coordinate
// selects the sequence. Packed ones are [total, heads, dim] with sequence b at rows [q_begin[b], q_end[b])
// (keys: k_begin, k_end) of one long sequence (the maps have batch 1). Shared by the forward and backward.
struct AttentionRows {
  const int32_t *q_begin, *q_end, *k_begin, *k_end;  // packed; null: dense
  int seq_q, seq_k;                                  // dense lengths; packed: the longest ranges
  int total_q;                                       // packed: rows of q (the LSE's row stride)
};
// The rows of a call (host): dense, or packed by `seg`.
inline AttentionRows attention_rows(const AttentionShape& s, const AttentionSegments& seg) {
  return {seg.q_begin,
          seg.q_end,
          seg.k_begin,
          seg.k_end,
          static_cast<int>(s.seq_q),
          static_cast<int>(s.seq_k),
          static_cast<int>(seg.total_q)};
}
struct SeqRows {
  int q0, q_len, k0, k_len;  // first row (map coordinate) and length of the sequence's queries and keys
  int batch;                 // the maps' batch coordinate
  int64_t q_base;            // row of [rows, heads, dim] (q's layout seen as 3-D) holding query 0
  int64_t k_base;            // the same for k / v
};
__device__ __forceinline__ SeqRows seq_rows(const AttentionRows& r, int b) {
  SeqRows s;
  if (r.q_begin != nullptr) {
    s.q0 = __ldg(r.q_begin + b);
    s.q_len = __ldg(r.q_end + b) - s.q0;
    s.k0 = __ldg(r.k_begin + b);
    s.k_len = __ldg(r.k_end + b) - s.k0;
    s.batch = 0;
    s.q_base = s.q0;
    s.k_base = s.k0;
  } else {
    s.q0 = s.k0 = 0;
    s.q_len = r.seq_q;
    s.k_len = r.seq_k;
    s.batch = b;
    s.q_base = int64_t(b) * r.seq_q;
    s.k_base = int64_t(b) * r.seq_k;
  }
  return s;
}
// Element offset of the LSE of (sequence, head, query row): dense [batch, heads, seq_q], packed [heads,
// total_q].
__device__ __forceinline__ int64_t lse_index(const AttentionRows& r, const SeqRows& s, int heads, int head,
                                             int row) {
  if (r.q_begin != nullptr) return int64_t(head) * r.total_q + s.q0 + row;
  return (int64_t(s.batch) * heads + head) * r.seq_q + row;
}
// A packed sequence longer than the launch's longest (shape.seq_q / seq_k) would lose its last rows: the
// kernel traps instead of answering wrong (the stream reports an illegal instruction). No printf: a call
// in the kernel would serialise its wgmma pipeline. Called by the loader thread.
__device__ __forceinline__ void check_sequence_fits(int rows, int blocks, int block_rows) {
  if (rows > blocks * block_rows) __trap();
}

// Loads rows [row0, row0 + Tile::kRows) of one head of a [batch, seq, heads, dim] tensor (a 4-D map with box
// {64, 1, rows, 1}) into a tile, 64 columns per TMA load; rows past the sequence's end read zeros.
template <class Tile>
__device__ __forceinline__ void load_head_rows(Tile& t, const CUtensorMap* map, int head, int row0, int batch,
                                               uint64_t* bar) {
#pragma unroll
  for (int b = 0; b < Tile::kBlocks; ++b)
    tma::load_4d(t.block(b), map, b * Tile::kBlockCols, head, row0, batch, bar);
}

// kWarpgroups: consumer warpgroups (64 query rows each); the single-GPU forward takes 2 at D = 64 for a
// causal mask up to 2048 query rows, 3 otherwise (src/ops/attention.cu; AttentionOptions::query_rows forces
// one). kTimed: the kernel that records a timeline (AttentionOptions::timeline; weft/timeline.hpp's Timed).
template <int kHeadDim, class T = __nv_bfloat16, int kWarpgroups = attention_warpgroups(kHeadDim),
          bool kTimed = false>
struct AttentionFwdOp {
  static_assert(tile::kIs16Bit<T>, "bf16 or fp16 tensors");
  static_assert(kWarpgroups == 2 || kWarpgroups == 3, "2 or 3 consumer warpgroups");
  static constexpr int kConsumerWarpgroups = kWarpgroups;
  static constexpr int kD = kHeadDim, kBM = 64 * kConsumerWarpgroups, kBN = kAttentionBlockN, kStages = 2;
  static constexpr int kClusterSize = 1;
  // 2 consumers: 384 threads start with 168 registers each, 3: 512 with 128. Live together in a consumer:
  // S of the next block (kBN / 2), P of the previous one (kBN / 4) and O (kD / 2), about 184 at D = 128;
  // the loader thread (scheduler, key blocks, TMA coordinates) needs 72 not to spill at D = 128. At D = 64
  // the loader spills at 32, but 160 for the consumers measures faster than 48 / 152 (fewer spills in all,
  // but in the consumers).
  static constexpr int kLoaderRegs = kConsumerWarpgroups == 2 ? 72 : 32;
  static constexpr int kConsumerRegs = kConsumerWarpgroups == 2 ? 216 : 160;
  static_assert(kD == 64 || kD == 128, "head dims 64 and 128");

  using Scheduler = lcsc::AttentionScheduler;
  using QTile = tile::Sw128Tile<T, kBM, kD>;  // rows: queries; the K-major A of S = Q K^T
  using KTile = tile::Sw128Tile<T, kBN, kD>;  // rows: keys; the K-major B of S
  using VTile = tile::Sw128Tile<T, kBN, kD>;  // rows: keys; the MN-major B of O += P V
  using Epilogue = lcsc::TmaStoreEpilogue<T, kD, kConsumerWarpgroups>;
  using StoreState = typename Epilogue::State;
  using Ring = lcsc::Pipeline<kStages, kConsumerWarpgroups, 1>;
  using Turns = lcsc::Turns<kConsumerWarpgroups, lcsc::kEpilogueFirstBarrierId + kConsumerWarpgroups>;
  static constexpr int kBoxCols = 64;  // Q / K / V maps' box: {64, 1, kBM (Q) or kBN (K, V), 1}

  // Q's barriers (one phase per work item) and the K and V rings.
  class Pipeline {
   public:
    struct Storage {
      uint64_t q_full, q_empty;
      typename Ring::Storage k, v;
    };
    __device__ explicit Pipeline(Storage& s) : s_(s), k(s.k), v(s.v) {}
    __device__ void init() {
      k.init();
      v.init();
      mbarrier_init(&s_.q_full, 1);
      mbarrier_init(&s_.q_empty, kConsumerWarpgroups);
    }
    Storage& s_;
    Ring k, v;
  };

  using SchedulerParams =
      std::conditional_t<kTimed, Timed<lcsc::AttentionSchedulerParams>, lcsc::AttentionSchedulerParams>;
  struct Params {
    SchedulerParams sched;
    CUtensorMap q, k, v, o;  // 4-D {dim, head, seq, batch}
    AttentionRows rows;
    float* lse;               // [batch, heads, seq_q] (packed: [heads, total_q]) fp32, or null
    T* out;                   // O itself: the row-by-row stores (packed sequences' last block, accumulating)
    int64_t out_heads_first;  // 0: out is [rows, heads, dim]; else [heads, rows, dim] with this many rows
    float *acc_o, *acc_lse;   // accumulating: the running O (q's layout) and LSE (lse's); else null
    int heads, group;         // group: query heads per K / V head
    float scale, scale_log2;  // softmax scale, and times log2(e)
    int causal;
  };
  struct Smem {
    QTile q;
    KTile k[kStages];
    VTile v[kStages];
    typename Epilogue::Smem epi;
    typename Pipeline::Storage pipe;
  };
  struct Accum {
    tile::AccumM64<kD> o;
    float lse[2];
  };

  __device__ static void init(const Params& p, Smem&) {
    tma::prefetch_map(&p.q);
    tma::prefetch_map(&p.k);
    tma::prefetch_map(&p.v);
    tma::prefetch_map(&p.o);
  }

  // ---- loader (one thread) ----
  __device__ static void load(const Params& p, Smem& s, Pipeline& pipe, lcsc::PipeState& st,
                              const lcsc::AttentionWork& w) {
    const SeqRows sr = seq_rows(p.rows, w.batch);
    check_sequence_fits(sr.q_len, p.sched.q_blocks, kBM);
    const KeyBlocks kb = key_blocks(w.q_block, kBM, sr.q_len, sr.k_len, p.causal != 0);
    load_q(p, s, pipe, w, sr);
    load_keys(&p.k, &p.v, s, pipe, st, w.head / p.group, sr.k0, sr.batch, kb.end);
  }

  // ---- consumers ----
  // Per key block n, from the last to the first, in the warpgroup's turn (lcsc/turns.cuh): issue S_n =
  // Q K_n^T; while it runs, wait for V_{n+1} and rescale O to the row maxima of P_{n+1}; issue O += P_{n+1}
  // V_{n+1}; turn over. While the P V MMAs run, the softmax turns S_n into P_n (after the mask where the
  // block needs one). The first block issues only its S, the last P V runs after the loop.
  __device__ static void compute(const Params& p, Smem& s, Pipeline& pipe, lcsc::PipeState& st,
                                 const lcsc::AttentionWork& w, int wg, Accum& acc) {
    if (w.iteration == 0) Turns::start(wg);
    const SeqRows sr = seq_rows(p.rows, w.batch);
    const Lengths len{sr.q_len, sr.k_len, p.causal != 0};
    const KeyBlocks kb = key_blocks(w.q_block, kBM, len.q, len.k, len.causal);
    const int row0 = w.q_block * kBM + 64 * wg;  // this warpgroup's first query row (of the sequence)
    tile::OnlineSoftmax<kBN> softmax;
#pragma unroll
    for (int i = 0; i < tile::AccumM64<kD>::kRegs; ++i) acc.o.d[i] = 0.f;
    tile::mbarrier_wait_bounded(&pipe.s_.q_full, static_cast<uint32_t>(w.iteration) & 1u);
    if (kb.end == 0) {  // no key: O = 0, LSE = -inf
      release_q(pipe);
      finish_rows(p, softmax, acc);
      return;
    }
    lcsc::PipeState kst = st, vst = st;  // the V ring runs one block behind the K ring
    tile::AccumM64<kBN> sc;              // S_n, turned into P_n in place
    uint32_t pa[kBN / 4];                // P of the block whose P V is next, as the MMA's A operand
    float rescale[2];
    int n = kb.end - 1;
    // The first block: S only.
    pipe.k.consumer_wait(kst);
    Turns::begin(wg);
    wgmma::fence();
    issue_scores(s, wg, kst.stage, sc);
    Turns::end(wg);
    wgmma::wait<0>();
    scores_landed(pipe, kst, sc, n);
    to_probabilities(p, len, kb, n, row0, softmax, sc, rescale);
    tile::pack_a<T>(sc, pa);
    for (--n; n >= 0; --n) {
      pipe.k.consumer_wait(kst);
      Turns::begin(wg);
      wgmma::fence();
      issue_scores(s, wg, kst.stage, sc);
      // While S_n's MMAs run: V_{n+1}'s wait and O to the row maxima P_{n+1} was taken at, off the path from
      // one block's P V to the next block's S.
      pipe.v.consumer_wait(vst);
      tile::scale_rows(acc.o, rescale);
      wgmma::fence_operands(acc.o.d);  // the multiplies stay before the fence (PTX: no accumulator write
      wgmma::fence();                  // between a wgmma.fence and the wgmma that reads the registers)
      issue_pv(s, vst.stage, pa, acc.o);
      Turns::end(wg);
      wgmma::wait<1>();  // S_n has landed; P_{n+1} V_{n+1} may still run
      scores_landed(pipe, kst, sc, n);
      to_probabilities(p, len, kb, n, row0, softmax, sc, rescale);
      wgmma::wait<0>();
      pv_landed(pipe, vst, pa, acc.o);
      tile::pack_a<T>(sc, pa);
    }
    // The last block's P V.
    tile::scale_rows(acc.o, rescale);
    wgmma::fence_operands(acc.o.d);
    pipe.v.consumer_wait(vst);
    Turns::begin(wg);
    wgmma::fence();
    issue_pv(s, vst.stage, pa, acc.o);
    Turns::end(wg);
    wgmma::wait<0>();
    pv_landed(pipe, vst, pa, acc.o);
    st = kst;  // both rings have advanced by the item's blocks
    finish_rows(p, softmax, acc);
  }

  __device__ static void store(const Params& p, Smem& s, const lcsc::AttentionWork& w, int wg,
                               const Accum& acc, StoreState& es) {
    const SeqRows sr = seq_rows(p.rows, w.batch);
    const int row0 = w.q_block * kBM + 64 * wg;
    if (p.acc_o != nullptr) {
      merge_rows(p, sr, w.head, row0, acc);
      return;
    }
    // A TMA box clips at a dense sequence's end but would write into the next packed sequence.
    if (p.rows.q_begin == nullptr || row0 + 64 <= sr.q_len)
      Epilogue::store_to(lcsc::TmaRows4d{&p.o, w.head, sr.q0 + row0, sr.batch}, s.epi, es, wg, acc.o, 0);
    else if (p.out_heads_first == 0)
      tile::store_rows(acc.o, p.out + ((sr.q_base + row0) * p.heads + w.head) * kD, int64_t(p.heads) * kD,
                       sr.q_len - row0);
    else
      tile::store_rows(acc.o, p.out + (w.head * p.out_heads_first + sr.q_base + row0) * kD, int64_t(kD),
                       sr.q_len - row0);
    // LSE by the first lane of each quad (the four hold the same value), as predicated stores: a branch
    // here could leave the warp split when the next item's (warp-aligned) wgmma begins.
    if (p.lse != nullptr) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = row0 + tile::AccumM64<kD>::row(2 * h);
        ptx::st_global_if(tile::lane_id() % 4 == 0 && row < sr.q_len,
                          p.lse + lse_index(p.rows, sr, p.heads, w.head, row), acc.lse[h]);
      }
    }
  }
  __device__ static void finish(const Params&, Smem&, int, StoreState& es) {
    Epilogue::finish(es);
  }

 protected:
  struct Lengths {
    int q, k;     // the sequence's query and key rows
    bool causal;  // under the bottom-right causal mask
  };
  // Q of the item, once the consumers are done with the previous item's (a fresh barrier passes the first
  // wait).
  __device__ static void load_q(const Params& p, Smem& s, Pipeline& pipe, const lcsc::AttentionWork& w,
                                const SeqRows& sr) {
    tile::mbarrier_wait_bounded(&pipe.s_.q_empty, (static_cast<uint32_t>(w.iteration) & 1u) ^ 1u);
    mbarrier_arrive_expect_tx(&pipe.s_.q_full, sizeof(QTile));
    load_head_rows(s.q, &p.q, w.head, sr.q0 + w.q_block * kBM, sr.batch, &pipe.s_.q_full);
  }
  // K and V of key blocks [0, blocks) from row k0 (map coordinates), the last block first.
  __device__ static void load_keys(const CUtensorMap* k, const CUtensorMap* v, Smem& s, Pipeline& pipe,
                                   lcsc::PipeState& st, int kv_head, int k0, int batch, int blocks) {
    for (int n = blocks - 1; n >= 0; --n) {
      load_head_rows(s.k[st.stage], k, kv_head, k0 + n * kBN, batch,
                     pipe.k.producer_acquire(st, sizeof(KTile)));
      load_head_rows(s.v[st.stage], v, kv_head, k0 + n * kBN, batch,
                     pipe.v.producer_acquire(st, sizeof(VTile)));
      st.advance(kStages);
    }
  }
  // S = Q K^T over the head dim (both K-major; async, one commit group).
  __device__ static void issue_scores(Smem& s, int wg, int stage, tile::AccumM64<kBN>& sc) {
    wgmma::mma_ss_group<kBN, kD, QTile, 0, KTile, 0>(sc.d, wgmma::desc_k_major(s.q, 64 * wg, 0),
                                                     wgmma::desc_k_major(s.k[stage], 0, 0), false);
  }
  // O += P V: P from registers, V (rows = keys) as the MN-major B operand (async, one commit group).
  __device__ static void issue_pv(Smem& s, int stage, uint32_t (&pa)[kBN / 4], tile::AccumM64<kD>& o) {
    wgmma::mma_rs_group<kD, kBN, VTile, 1>(o.d, pa, wgmma::desc_mn_major(s.v[stage], 0));
  }
  // After S_n's MMAs: K_n's stage goes back to the loader, and Q after the item's last block.
  __device__ static void scores_landed(Pipeline& pipe, lcsc::PipeState& kst, tile::AccumM64<kBN>& sc, int n) {
    wgmma::fence_operands(sc.d);
    pipe.k.consumer_release(kst);
    kst.advance(kStages);
    if (n == 0) release_q(pipe);
  }
  // After a P V's MMAs: V's stage goes back to the loader; P's and O's registers are free again.
  __device__ static void pv_landed(Pipeline& pipe, lcsc::PipeState& vst, uint32_t (&pa)[kBN / 4],
                                   tile::AccumM64<kD>& o) {
    wgmma::fence_operands(o.d);
    wgmma::fence_operands(pa);
    pipe.v.consumer_release(vst);
    vst.advance(kStages);
  }
  // S_n -> P_n: the mask where block n needs one, then the online softmax step (rescale: O's factor).
  __device__ static void to_probabilities(const Params& p, const Lengths& len, const KeyBlocks& kb, int n,
                                          int row0, tile::OnlineSoftmax<kBN>& softmax,
                                          tile::AccumM64<kBN>& sc, float (&rescale)[2]) {
    if (n >= kb.masked_from) mask(len, sc, row0, n * kBN);
    softmax.step(sc, p.scale_log2, rescale);
  }
  // Scores of keys past the sequence's end, or (causal) past the row's last visible key, become -inf.
  __device__ static void mask(const Lengths& len, tile::AccumM64<kBN>& s, int row0, int key0) {
#pragma unroll
    for (int i = 0; i < tile::AccumM64<kBN>::kRegs; ++i) {
      const int row = row0 + tile::AccumM64<kBN>::row(i);
      int limit = len.k - 1;
      if (len.causal) limit = min(limit, row + len.k - len.q);
      if (key0 + tile::AccumM64<kBN>::col(i) > limit) s.d[i] = tile::kNegInf;
    }
  }
  // Accumulating: this call's O and LSE of the warpgroup's rows merged into the running ones (see
  // AttentionAccumulate), and O in T too where the call has `out`. A row's four lanes read its running
  // LSE before the first of them writes the new one.
  __device__ static void merge_rows(const Params& p, const SeqRows& sr, int head, int row0,
                                    const Accum& acc) {
    float a[2], b[2], lse[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + tile::AccumM64<kD>::row(2 * h);
      const float old = row < sr.q_len ? p.acc_lse[lse_index(p.rows, sr, p.heads, head, row)] : tile::kNegInf;
      const float now = acc.lse[h];
      const float top = fmaxf(old, now);
      lse[h] = top == tile::kNegInf ? top : top + logf(expf(old - top) + expf(now - top));
      a[h] = old == tile::kNegInf ? 0.f : expf(old - lse[h]);
      b[h] = now == tile::kNegInf ? 0.f : expf(now - lse[h]);
    }
    __syncwarp();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + tile::AccumM64<kD>::row(2 * h);
      ptx::st_global_if(tile::lane_id() % 4 == 0 && row < sr.q_len,
                        p.acc_lse + lse_index(p.rows, sr, p.heads, head, row), lse[h]);
    }
    tile::AccumM64<kD> o;
    const int64_t stride = int64_t(p.heads) * kD;
    const int64_t first = (sr.q_base + row0) * p.heads * kD + int64_t(head) * kD;
    tile::merge_rows(p.acc_o + first, stride, sr.q_len - row0, acc.o, a, b, o);
    if (p.out != nullptr) tile::store_rows(o, p.out + first, stride, sr.q_len - row0);
  }
  // O normalised by the row sums, and the rows' LSE.
  __device__ static void finish_rows(const Params& p, const tile::OnlineSoftmax<kBN>& softmax, Accum& acc) {
    float inv[2];
    softmax.finish(p.scale, inv, acc.lse);
    tile::scale_rows(acc.o, inv);
  }
  __device__ static void release_q(Pipeline& pipe) {
    if (tile::thread_in_warpgroup() == 0) tile::mbarrier_arrive(&pipe.s_.q_empty);
  }
};

// The single-GPU forward with a warpgroup's items chained: an item's last P V is issued in the same turn as
// the next item's first S and runs beside that S's softmax, then the item's O is normalised and stored, instead
// of ending each item with a turn of its own, a wait for that P V and the store, and starting the next with
// an S whose softmax no MMA of the warpgroup overlaps. compute() leaves the last P V (P, O's factor, the V
// stage, the row statistics and where O goes) in Accum; the next compute() or finish() completes it, so the
// timeline's mainloop of an item holds the previous item's store, and store() does nothing. (The ring's and
// Ulysses' forwards, whose stores are followed by a signal per item, keep AttentionFwdOp's order.)
template <int kHeadDim, class T = __nv_bfloat16, int kWarpgroups = attention_warpgroups(kHeadDim),
          bool kTimed = false>
struct ChainedAttentionFwdOp : AttentionFwdOp<kHeadDim, T, kWarpgroups, kTimed> {
  using Base = AttentionFwdOp<kHeadDim, T, kWarpgroups, kTimed>;
  using Base::kBN;
  using Base::kD;
  using typename Base::Lengths;
  using typename Base::Params;
  using typename Base::Pipeline;
  using typename Base::Smem;
  using typename Base::StoreState;
  using typename Base::Turns;

  struct Accum : Base::Accum {
    tile::OnlineSoftmax<kBN> softmax;  // the pending item's row statistics
    uint32_t pa[kBN / 4];              // its last block's P
    float rescale[2];                  // O's factor to the row maxima P was taken at
    lcsc::PipeState vst;               // V's stage of that block
    lcsc::AttentionWork item;          // where its O goes
    bool pending = false;              // an item's last P V and store are still to come
  };

  __device__ static void compute(const Params& p, Smem& s, Pipeline& pipe, lcsc::PipeState& st,
                                 const lcsc::AttentionWork& w, int wg, Accum& acc, StoreState& es) {
    if (w.iteration == 0) Turns::start(wg);
    const SeqRows sr = seq_rows(p.rows, w.batch);
    const Lengths len{sr.q_len, sr.k_len, p.causal != 0};
    const KeyBlocks kb = key_blocks(w.q_block, Base::kBM, len.q, len.k, len.causal);
    const int row0 = w.q_block * Base::kBM + 64 * wg;
    tile::OnlineSoftmax<kBN> softmax;
    tile::mbarrier_wait_bounded(&pipe.s_.q_full, static_cast<uint32_t>(w.iteration) & 1u);
    if (kb.end == 0) {  // no key: the pending item first, then O = 0, LSE = -inf, stored now
      Base::release_q(pipe);
      if (acc.pending) complete_pending(p, s, pipe, wg, acc, es);
      zero(acc.o);
      Base::finish_rows(p, softmax, acc);
      Base::store(p, s, w, wg, acc, es);
      return;
    }
    lcsc::PipeState kst = st, vst = st;
    tile::AccumM64<kBN> sc;
    uint32_t pa[kBN / 4];
    float rescale[2];
    int n = kb.end - 1;
    // The first block's S, with the pending item's last P V in the same turn. Each branch ends with no MMA
    // in flight: where paths with different MMAs in flight merge, ptxas waits for them (C7517) and then
    // serialises every wgmma of the kernel (C7518).
    pipe.k.consumer_wait(kst);
    if (acc.pending) {
      Turns::begin(wg);
      wgmma::fence();
      Base::issue_scores(s, wg, kst.stage, sc);
      pipe.v.consumer_wait(acc.vst);
      tile::scale_rows(acc.o, acc.rescale);
      wgmma::fence_operands(acc.o.d);
      wgmma::fence();
      Base::issue_pv(s, acc.vst.stage, acc.pa, acc.o);
      Turns::end(wg);
      wgmma::wait<1>();  // S has landed; the P V may still run
      Base::scores_landed(pipe, kst, sc, n);
      Base::to_probabilities(p, len, kb, n, row0, softmax, sc, rescale);
      wgmma::wait<0>();
      Base::pv_landed(pipe, acc.vst, acc.pa, acc.o);
      tile::pack_a<T>(sc, pa);
      store_pending(p, s, wg, acc, es);  // the pending item's O complete: normalised and stored
    } else {
      Turns::begin(wg);
      wgmma::fence();
      Base::issue_scores(s, wg, kst.stage, sc);
      Turns::end(wg);
      wgmma::wait<0>();
      Base::scores_landed(pipe, kst, sc, n);
      Base::to_probabilities(p, len, kb, n, row0, softmax, sc, rescale);
      tile::pack_a<T>(sc, pa);
    }
    zero(acc.o);
    for (--n; n >= 0; --n) {
      pipe.k.consumer_wait(kst);
      Turns::begin(wg);
      wgmma::fence();
      Base::issue_scores(s, wg, kst.stage, sc);
      pipe.v.consumer_wait(vst);
      tile::scale_rows(acc.o, rescale);
      wgmma::fence_operands(acc.o.d);
      wgmma::fence();
      Base::issue_pv(s, vst.stage, pa, acc.o);
      Turns::end(wg);
      wgmma::wait<1>();
      Base::scores_landed(pipe, kst, sc, n);
      Base::to_probabilities(p, len, kb, n, row0, softmax, sc, rescale);
      wgmma::wait<0>();
      Base::pv_landed(pipe, vst, pa, acc.o);
      tile::pack_a<T>(sc, pa);
    }
    // The last block's P V: left to the next item (or finish()).
#pragma unroll
    for (int i = 0; i < kBN / 4; ++i) acc.pa[i] = pa[i];
    acc.rescale[0] = rescale[0];
    acc.rescale[1] = rescale[1];
    acc.softmax = softmax;
    acc.vst = vst;
    acc.item = w;
    acc.pending = true;
    st = kst;  // the K ring has advanced by the item's blocks; the V ring one block less
  }
  // O was stored by the next item's compute() (or finish()).
  __device__ static void store(const Params&, Smem&, const lcsc::AttentionWork&, int, const Accum&,
                               StoreState&) {}
  // The last item's P V, in a turn of its own, and its store; then the base's finish.
  __device__ static void finish(const Params& p, Smem& s, int wg, StoreState& es, Accum& acc) {
    if (acc.pending) {
      Pipeline pipe(s.pipe);
      complete_pending(p, s, pipe, wg, acc, es);
    }
    Base::finish(p, s, wg, es);
  }

 private:
  __device__ static void zero(tile::AccumM64<kD>& o) {
#pragma unroll
    for (int i = 0; i < tile::AccumM64<kD>::kRegs; ++i) o.d[i] = 0.f;
  }
  // The pending item's last P V in a turn of its own, then its store.
  __device__ static void complete_pending(const Params& p, Smem& s, Pipeline& pipe, int wg, Accum& acc,
                                          StoreState& es) {
    tile::scale_rows(acc.o, acc.rescale);
    wgmma::fence_operands(acc.o.d);
    pipe.v.consumer_wait(acc.vst);
    Turns::begin(wg);
    wgmma::fence();
    Base::issue_pv(s, acc.vst.stage, acc.pa, acc.o);
    Turns::end(wg);
    wgmma::wait<0>();
    Base::pv_landed(pipe, acc.vst, acc.pa, acc.o);
    store_pending(p, s, wg, acc, es);
  }
  __device__ static void store_pending(const Params& p, Smem& s, int wg, Accum& acc, StoreState& es) {
    Base::finish_rows(p, acc.softmax, acc);
    Base::store(p, s, acc.item, wg, acc, es);
    acc.pending = false;
  }
};

}  // namespace weft::ops
