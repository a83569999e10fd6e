// Flash attention forward as an LCSC op (lcsc/kernel.cuh): O = softmax(scale * Q K^T [+ causal mask]) V per
// (batch, head), with the fp32 log-sum-exp of every row. Host launcher: src/ops/attention.cu.
//
// Tensors are [batch, seq, heads, head_dim] bf16 (flash-attn's layout), seen through 4-D tensor maps
// {dim, head, seq, batch} whose boxes clip at each sequence's end: loads past it read zeros, stores past it
// write nothing. K / V have `kv_heads` heads; query head h reads K / V head h / (heads / kv_heads) (GQA).
// The causal mask is aligned to the bottom right: query row i sees keys j <= i + seq_k - seq_q (rows with
// no key get O = 0 and LSE = -inf).
//
// Work items are (batch, head, 128-row query block) from lcsc::AttentionScheduler. A compute block has one
// loader thread and two consumer warpgroups of 64 query rows each:
//   loader     Q of the item once (q_full / q_empty, one phase per item), then K and V of each key block
//              into two rings of kStages 128-row stages, key blocks from the last to the first (so only the
//              first one a tile sees can be a partial block at the sequence's end).
//   consumers  per key block: S = Q K^T (wgmma, both operands in shared memory), the mask where the block
//              needs one, the online softmax (tile/softmax.cuh) turning S into P in registers and rescaling
//              O, then O += P V (wgmma with P from registers, V as the MN-major B operand: no transpose).
//   store      O normalised by the row sums, through the TMA storer into O's 4-D map; LSE by the lanes that
//              own a row.
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "weft/device/ptx.cuh"
#include "weft/lcsc/attention_scheduler.cuh"
#include "weft/lcsc/epilogue.cuh"
#include "weft/lcsc/kernel.cuh"
#include "weft/lcsc/pipeline.cuh"
#include "weft/tile/fragment.cuh"
#include "weft/tile/layout.cuh"
#include "weft/tile/softmax.cuh"
#include "weft/tile/tma.cuh"
#include "weft/tile/wgmma.cuh"

namespace weft::ops {

inline constexpr int kAttentionBlockM = 128;  // query rows per work item
inline constexpr int kAttentionBlockN = 128;  // keys per block

// The key blocks [0, end) a query block attends to, and from which block on a block needs a mask (the
// sequence's partial last block, the causal diagonal). The loader and the consumers both use it.
struct KeyBlocks {
  int end = 0;          // blocks of kAttentionBlockN keys; 0: the block sees no key
  int masked_from = 0;  // blocks >= this one need the mask
};
__host__ __device__ inline KeyBlocks key_blocks(int q_block, int seq_q, int seq_k, bool causal) {
  constexpr int kBM = kAttentionBlockM, kBN = kAttentionBlockN;
  KeyBlocks kb;
  kb.end = (seq_k + kBN - 1) / kBN;
  kb.masked_from = seq_k / kBN;  // the partial last block, if any
  if (causal) {
    const int64_t first_row = int64_t(q_block) * kBM;
    const int64_t last_row = (first_row + kBM < seq_q ? first_row + kBM : seq_q) - 1;
    const int64_t last_key = last_row + seq_k - seq_q;  // the last row's last visible key
    const int64_t end = last_key < 0 ? 0 : last_key / kBN + 1;
    if (end < kb.end) kb.end = static_cast<int>(end);
    // Keys past the first row's limit need the mask: from the block holding key first_row + seq_k - seq_q
    // + 1.
    const int64_t first_masked_key = first_row + seq_k - seq_q + 1;
    const int64_t from = first_masked_key <= 0 ? 0 : first_masked_key / kBN;
    if (from < kb.masked_from) kb.masked_from = static_cast<int>(from);
  }
  if (kb.masked_from > kb.end) kb.masked_from = kb.end;
  return kb;
}

template <int kHeadDim>
struct AttentionFwdOp {
  using bf16 = __nv_bfloat16;
  static constexpr int kD = kHeadDim, kBM = kAttentionBlockM, kBN = kAttentionBlockN, kStages = 2;
  static constexpr int kConsumerWarpgroups = kBM / 64;
  static constexpr int kClusterSize = 1;
  // 384 threads start with 168 registers; S (64), P (32) and O (D / 2) live together in a consumer.
  static constexpr int kLoaderRegs = 40, kConsumerRegs = 232;
  static_assert(kD == 64 || kD == 128, "head dims 64 and 128");

  using Scheduler = lcsc::AttentionScheduler;
  using QTile = tile::Sw128Tile<bf16, kBM, kD>;  // rows: queries; the K-major A of S = Q K^T
  using KTile = tile::Sw128Tile<bf16, kBN, kD>;  // rows: keys; the K-major B of S
  using VTile = tile::Sw128Tile<bf16, kBN, kD>;  // rows: keys; the MN-major B of O += P V
  using Epilogue = lcsc::TmaStoreEpilogue<bf16, kD, kConsumerWarpgroups>;
  using StoreState = typename Epilogue::State;
  using Ring = lcsc::Pipeline<kStages, kConsumerWarpgroups, 1>;
  static constexpr int kBoxRows = 128, kBoxCols = 64;  // Q / K / V maps' box {64, 1, 128, 1}; O: the storer's

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

  struct Params {
    lcsc::AttentionSchedulerParams sched;
    CUtensorMap q, k, v, o;          // 4-D {dim, head, seq, batch}
    float* lse;                      // [batch, heads, seq_q] fp32, or null
    int seq_q, seq_k, heads, group;  // group: query heads per K / V head
    float scale, scale_log2;         // softmax scale, and times log2(e)
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
  template <class Tile>
  __device__ static void load_rows(Tile& t, const CUtensorMap* map, int head, int row0, int batch,
                                   uint64_t* bar) {
#pragma unroll
    for (int b = 0; b < Tile::kBlocks; ++b)
      tma::load_4d(t.block(b), map, b * Tile::kBlockCols, head, row0, batch, bar);
  }
  __device__ static void load(const Params& p, Smem& s, Pipeline& pipe, lcsc::PipeState& st,
                              const lcsc::AttentionWork& w) {
    const KeyBlocks kb = key_blocks(w.q_block, p.seq_q, p.seq_k, p.causal != 0);
    const int kv_head = w.head / p.group;
    // Q: once the consumers are done with the previous item's (a fresh barrier passes the first wait).
    tile::mbarrier_wait_bounded(&pipe.s_.q_empty, (static_cast<uint32_t>(w.iteration) & 1u) ^ 1u);
    mbarrier_arrive_expect_tx(&pipe.s_.q_full, sizeof(QTile));
    load_rows(s.q, &p.q, w.head, w.q_block * kBM, w.batch, &pipe.s_.q_full);
    for (int n = kb.end - 1; n >= 0; --n) {
      load_rows(s.k[st.stage], &p.k, kv_head, n * kBN, w.batch, pipe.k.producer_acquire(st, sizeof(KTile)));
      load_rows(s.v[st.stage], &p.v, kv_head, n * kBN, w.batch, pipe.v.producer_acquire(st, sizeof(VTile)));
      st.advance(kStages);
    }
  }

  // ---- consumers ----
  // Scores of keys past the sequence's end, or (causal) past the row's last visible key, become -inf.
  __device__ static void mask(const Params& p, tile::AccumM64<kBN>& s, int row0, int key0) {
#pragma unroll
    for (int i = 0; i < tile::AccumM64<kBN>::kRegs; ++i) {
      const int row = row0 + tile::AccumM64<kBN>::row(i);
      int limit = p.seq_k - 1;
      if (p.causal) limit = min(limit, row + p.seq_k - p.seq_q);
      if (key0 + tile::AccumM64<kBN>::col(i) > limit) s.d[i] = tile::kNegInf;
    }
  }

  __device__ static void compute(const Params& p, Smem& s, Pipeline& pipe, lcsc::PipeState& st,
                                 const lcsc::AttentionWork& w, int wg, Accum& acc) {
    const KeyBlocks kb = key_blocks(w.q_block, p.seq_q, p.seq_k, p.causal != 0);
    const int row0 = w.q_block * kBM + 64 * wg;  // this warpgroup's first query row
    tile::mbarrier_wait_bounded(&pipe.s_.q_full, static_cast<uint32_t>(w.iteration) & 1u);
#pragma unroll
    for (int i = 0; i < tile::AccumM64<kD>::kRegs; ++i) acc.o.d[i] = 0.f;
    tile::OnlineSoftmax<kBN> softmax;
    for (int n = kb.end - 1; n >= 0; --n) {
      // S = Q K^T over the head dim, 16 at a time.
      tile::AccumM64<kBN> sc;
      pipe.k.consumer_wait(st);
      wgmma::fence();
#pragma unroll
      for (int k = 0; k < kD / 16; ++k)
        wgmma::mma_bf16<kBN, 0>(sc.d, q_desc_at(s.q, wg, k), wgmma::desc_k_major(s.k[st.stage], 0, 16 * k),
                                k > 0 ? 1 : 0);
      wgmma::commit();
      wgmma::wait<0>();
      wgmma::fence_operands(sc.d);
      pipe.k.consumer_release(st);
      if (n == 0) release_q(pipe);  // the item's last read of Q
      if (n >= kb.masked_from) mask(p, sc, row0, n * kBN);
      float rescale[2];
      softmax.step(sc, p.scale_log2, rescale);
      tile::scale_rows(acc.o, rescale);
      uint32_t pa[kBN / 4];
      tile::pack_a(sc, pa);
      // O += P V: P from registers, V (rows = keys) as the MN-major B operand, 16 keys at a time.
      pipe.v.consumer_wait(st);
      const uint64_t v_desc = wgmma::desc_mn_major(s.v[st.stage], 0);
      wgmma::fence_operands(acc.o.d);
      wgmma::fence();
#pragma unroll
      for (int k = 0; k < kBN / 16; ++k)
        wgmma::mma_rs_bf16<kD, 1>(acc.o.d, reinterpret_cast<const uint32_t(&)[4]>(pa[4 * k]),
                                  wgmma::desc_advance(v_desc, k * 16 * tile::kSwizzleBytes), 1);
      wgmma::commit();
      wgmma::wait<0>();
      wgmma::fence_operands(acc.o.d);
      wgmma::fence_operands(pa);
      pipe.v.consumer_release(st);
      st.advance(kStages);
    }
    if (kb.end == 0) release_q(pipe);
    float inv[2];
    softmax.finish(p.scale, inv, acc.lse);
    tile::scale_rows(acc.o, inv);
  }

  __device__ static void store(const Params& p, Smem& s, const lcsc::AttentionWork& w, int wg,
                               const Accum& acc, StoreState& es) {
    const int row0 = w.q_block * kBM + 64 * wg;
    Epilogue::store_to(lcsc::TmaRows4d{&p.o, w.head, row0, w.batch}, s.epi, es, wg, acc.o, 0);
    // LSE by the first lane of each quad (the four hold the same value), as predicated stores: a branch
    // here could leave the warp split when the next item's (warp-aligned) wgmma begins.
    if (p.lse != nullptr) {
      float* lse = p.lse + (int64_t(w.batch) * p.heads + w.head) * p.seq_q;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = row0 + 16 * tile::warp_in_warpgroup() + tile::lane_id() / 4 + 8 * h;
        ptx::st_global_if(tile::lane_id() % 4 == 0 && row < p.seq_q, lse + row, acc.lse[h]);
      }
    }
  }
  __device__ static void finish(const Params&, Smem&, int, StoreState& es) {
    Epilogue::finish(es);
  }

 private:
  __device__ static uint64_t q_desc_at(const QTile& q, int wg, int k) {
    return wgmma::desc_k_major(q, 64 * wg, 16 * k);
  }
  __device__ static void release_q(Pipeline& pipe) {
    if (tile::thread_in_warpgroup() == 0) tile::mbarrier_arrive(&pipe.s_.q_empty);
  }
};

}  // namespace weft::ops
