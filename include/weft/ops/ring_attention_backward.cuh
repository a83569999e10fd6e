// Ring attention backward as one persistent LCSC kernel per pass (host launcher:
// src/ops/ring_attention_backward.cu; the pass: src/ops/ring_attention_plan.hpp, ring_pass_of with
// RingTravel::kQueries). The mirror of the forward (weft/ops/ring_attention.cuh): here the keys stay and the
// queries travel.
//
// Every rank holds its local rows of q, k, v, out, dout and LSE. A prepare kernel turns its own rows' LSE and
// D = rowsum(dO o O) into the per-row terms (index 0 of the terms, symmetric memory). At step s a rank meets
// the query rows of rank r - s: the idle warps of every compute block's loader warpgroup push this rank's Q,
// dO and terms into the receive slots of ranks r + 1, r + 2, ... (ring_push: slot s - 1 of rank r + s for Q
// and dO, terms index s), in pieces with a release add per piece into the receiver's chunk flag.
//
// A work item is (key segment, K / V head, key block of 128 keys): one document's part of this rank's key
// rows against the query rows of all W ranges in turn, as the single-GPU backward runs one key block against
// its sequence's query blocks (weft/ops/attention_backward.cuh, whose step() this op reuses): dK and dV in
// registers from the first query block of step 0 to the last of step W - 1, rounded once at the item's end.
// Where those items are too few for the SMs (a short sequence a rank; Params::head_split_log2), an item takes
// a part of the K / V head's query heads (GQA) and reduce-adds its dK / dV into fp32 accumulators instead.
// Each query block's dQ part is reduce-added (TMA, fp32) through the step's map (one per step, in global
// memory): every key block adds into every query block it meets, so adding straight into the owner's memory
// would move (key blocks) x (the dQ rows) over the links. So when the rows' owner (rank r - s) is on another
// GPU the parts go into this rank's accumulator slot s, which the owner reads once after the kernel
// (ring_bwd_sum_dq); when it is on this GPU (virtual ranks) they go straight into the owner's slot 0. The
// loader waits, before the first load of a step's range, until every chunk of the slot up to the range's last
// loaded row has landed.
//
// Calls: the host zeroes this rank's slot 0 and runs the prepare kernel before a meeting (every rank has
// finished the previous call, its reads of the peers' slots included: receive slots free), zeroes the slots
// of the other GPUs' rows after it, then runs this kernel; each consumer warpgroup completes its reduce-adds
// (and makes them visible system-wide) before it counts itself finished. A second meeting after the kernel
// (every rank's adds complete) comes before dQ = scale * (slot 0 + slot s of rank r + s for each such rank on
// another GPU).
#pragma once
#include "weft/ops/attention_backward.cuh"
#include "weft/ops/ring_attention.cuh"

namespace weft::ops {

// kTimed: the kernel that records its rank's timeline (AttentionBwdOp's).
template <int kHeadDim, class T = __nv_bfloat16, bool kTimed = false>
struct RingAttentionBwdOp : AttentionBwdOp<kHeadDim, T, false, 64, kTimed> {
  using Base = AttentionBwdOp<kHeadDim, T, false, 64, kTimed>;
  using Base::kBM;
  using Base::kBN;
  using Base::kD;
  using Base::kStages;
  using typename Base::Accum;
  using typename Base::Lengths;
  using typename Base::Pipeline;
  using typename Base::QTile;
  using typename Base::StoreState;

  struct Params : Base::Params {
    lcsc::PushSync sync;
    CUtensorMap slot_q, slot_dout;           // 4-D {dim, head, row, slot}: slot s - 1 holds step s's rows
    const CUtensorMap* dq_maps;              // [steps]: where step s's dQ parts go, 4-D {dim, head, row, 1}
    const int32_t *query_begin, *query_end;  // [segment * steps + step]: rows of the step source's local Q
    int steps;                               // the world size
    RingSlots slots;
    const uint4 *q_src, *dout_src;  // this rank's Q / dO: local_rows rows of row_vecs 16-byte vectors
    uint4 *slots_q, *slots_dout;    // this rank's slots [steps - 1][slot_rows][row_vecs] (symmetric)
    int row_vecs;
    // The per-row terms (symmetric): LSE * log2(e), then D, each [steps][heads][term_stride], index 0 this
    // rank's own rows, index s the rows of rank r - s; a query range beginning at local row x has its rows'
    // terms at term rows 4 x, 4 x + 1, ... (ring_query_ranges). Base::lse_map / dsum_map view each as 2-D
    // {term_stride, steps * heads}.
    float* terms;
    int term_stride;
  };
  using Smem = lcsc::WithHelperStaging<typename Base::Smem>;

  // The query rows of the step's source that a key segment meets. Step 0 has this rank's rows on both
  // sides: causal when the pass is, a key visible iff its local row is not after the query's.
  struct QueryRange {
    int begin, length, shift;
    bool causal;
  };
  __device__ static QueryRange query_range(const Params& p, const SeqRows& keys, int segment, int step) {
    const int i = segment * p.steps + step, begin = __ldg(p.query_begin + i);
    return {begin, __ldg(p.query_end + i) - begin, begin - keys.k0, p.causal != 0 && step == 0};
  }

  __device__ static void init(const Params& p, Smem& s) {
    Base::init(p, s);
    tma::prefetch_map(&p.slot_q);
    tma::prefetch_map(&p.slot_dout);
  }

  // ---- loader (one thread) ----
  __device__ static void load(const Params& p, Smem& s, Pipeline& pipe, lcsc::PipeState& st,
                              const lcsc::AttentionWork& w) {
    const int n = Base::key_block(w);
    const SeqRows sr = seq_rows(p.rows, w.batch);
    const typename Base::Heads hs = Base::heads_of(p, w);
    check_sequence_fits(sr.k_len, p.sched.q_blocks, kBN);
    tile::mbarrier_wait_bounded(&pipe.s_.kv_empty, (static_cast<uint32_t>(w.iteration) & 1u) ^ 1u);
    mbarrier_arrive_expect_tx(&pipe.s_.kv_full, sizeof(typename Base::KTile) + sizeof(typename Base::VTile));
    load_head_rows(s.k, &p.k, hs.kv, sr.k0 + n * kBN, 0, &pipe.s_.kv_full);
    load_head_rows(s.v, &p.v, hs.kv, sr.k0 + n * kBN, 0, &pipe.s_.kv_full);
    for (int step = 0; step < p.steps; ++step) {
      const QueryRange r = query_range(p, sr, w.batch, step);
      const QueryBlocks qb = query_blocks_shifted(n, r.length, r.shift, r.causal, kBM);
      if (qb.begin >= qb.end) continue;
      if (step > 0) ring_wait_landed(p.sync, p.slots, step - 1, r.begin + qb.end * kBM, timeline_of(p));
      const CUtensorMap* q = step == 0 ? &p.q : &p.slot_q;
      const CUtensorMap* dout = step == 0 ? &p.dout : &p.slot_dout;
      const int slot = step == 0 ? 0 : step - 1;
      const int first = qb.begin * kBM, last = qb.end * kBM;
      for (int h = hs.first, y = step * p.heads + h; h < hs.first + hs.count; ++h, ++y) {
        // Q / dO rows from r.begin on; their terms from term row 4 r.begin on (TMA boxes start 16-byte
        // aligned).
        for (int row = first; row < last; row += kBM) {
          uint64_t* bar = pipe.qdo.producer_acquire(st, 2 * sizeof(QTile) + 2 * kBM * sizeof(float));
          load_head_rows(s.q[st.stage], q, h, r.begin + row, slot, bar);
          load_head_rows(s.dout[st.stage], dout, h, r.begin + row, slot, bar);
          tma::load_2d(s.lse_log2[st.stage], &p.lse_map, 4 * r.begin + row, y, bar);
          tma::load_2d(s.dsum[st.stage], &p.dsum_map, 4 * r.begin + row, y, bar);
          st.advance(kStages);
        }
      }
    }
  }

  // ---- consumers ----
  __device__ static void compute(const Params& p, Smem& s, Pipeline& pipe, lcsc::PipeState& st,
                                 const lcsc::AttentionWork& w, int wg, Accum& acc) {
    if (w.iteration == 0 && tile::thread_in_warpgroup() == 0)
      for (int j = 0; j < p.steps; ++j) tma::acquire_global_map(p.dq_maps + j);
    const int n = Base::key_block(w);
#pragma unroll
    for (int i = 0; i < tile::AccumM64<kD>::kRegs; ++i) acc.dk.d[i] = acc.dv.d[i] = 0.f;
    tile::mbarrier_wait_bounded(&pipe.s_.kv_full, static_cast<uint32_t>(w.iteration) & 1u);
    __syncwarp();
    const SeqRows sr = seq_rows(p.rows, w.batch);
    const typename Base::Heads hs = Base::heads_of(p, w);
    const int key0 = n * kBN + 64 * wg;  // this warpgroup's first key (of the segment)
    for (int step = 0; step < p.steps; ++step) {
      const QueryRange r = query_range(p, sr, w.batch, step);
      const Lengths len{r.length, sr.k_len, r.shift, r.causal};
      const QueryBlocks qb = query_blocks_shifted(n, len.q, len.shift, len.causal, kBM);
      for (int g = 0; g < hs.count; ++g) {
        const int h = hs.first + g;
        for (int m = qb.begin; m < qb.end; ++m) {
          pipe.qdo.consumer_wait(st);
          const lcsc::TmaRows4d dq_rows{p.dq_maps + step, h, r.begin + m * kBM, 0,
                                        lcsc::StoreMode::kReduceAdd};
          Base::step(p, len, s, st.stage, wg, key0, m, acc, dq_rows, typename Base::DqTurn{0, h, n});
          pipe.qdo.consumer_release(st);
          st.advance(kStages);
        }
      }
    }
    if (tile::thread_in_warpgroup() == 0) tile::mbarrier_arrive(&pipe.s_.kv_empty);
#pragma unroll
    for (int i = 0; i < tile::AccumM64<kD>::kRegs; ++i) acc.dk.d[i] *= p.scale;
  }

  // Base::finish waits until this warpgroup's bulk operations (dQ reduce-adds, dK / dV stores) have
  // completed; then they are made visible to the peers (which read the accumulator slots after the kernel's
  // meeting) before the warpgroup counts itself finished.
  __device__ static void finish(const Params& p, Smem& s, int wg, StoreState& es) {
    Base::finish(p, s, wg, es);
    if (tile::thread_in_warpgroup() == 0) {
      ptx::fence_proxy_async_global();
      __threadfence_system();
      p.sync.done();
    }
  }

  // ---- helper warps: this rank's Q, dO and per-row terms into the peers' slots ----
  __device__ static void helper_warp(const Params& p, Smem& s, int index, int count) {
    const TeamView& t = p.sync.team;
    const int64_t terms_per_rank = int64_t(p.heads) * p.term_stride;
    auto copier = lcsc::helper_copier(s);
    ring_push(p.sync, p.slots, index, count, [&](int slot, int dst, int r0, int r1, int lane) {
      const int64_t at = (int64_t(slot) * p.slots.slot_rows + r0) * p.row_vecs;
      const int rows = p.slots.local_rows;
      copier.copy_rows(p.q_src, t.peer_ptr(p.slots_q + at, dst), r0, r1, rows, p.row_vecs);
      copier.copy_rows(p.dout_src, t.peer_ptr(p.slots_dout + at, dst), r0, r1, rows, p.row_vecs);
      // LSE and D: index 0 here to index slot + 1 there, term rows [4 r0, 4 r1) of every head (a range
      // beginning at row x keeps its rows' terms from term row 4 x on, so a chunk's landing covers its rows'
      // terms), as 16-byte vectors: vector x is term rows 4 x .. 4 x + 3.
      const auto* from = reinterpret_cast<const uint4*>(p.terms);
      auto* to = reinterpret_cast<uint4*>(t.peer_ptr(p.terms, dst));
      copy_terms(from, to, (slot + 1) * terms_per_rank / 4, p.steps * terms_per_rank / 4, r0, r1, rows,
                 p.heads, p.term_stride / 4, lane);
      copier.complete();
    });
  }

 private:
  // Vectors [r0, r1) of both terms' heads (LSE then D, `half` vectors apart; [heads][head_vecs] 16-byte
  // vectors each, vector x holding term rows 4 x .. 4 x + 3; zeros from vector `rows` on), index 0 of src to
  // index `at` of dst, by one warp: four loads in flight per lane before their stores (a dependent load per
  // element would leave the pushes waiting on one load latency per term row and head).
  __device__ static void copy_terms(const uint4* src, uint4* dst, int64_t at, int64_t half, int r0, int r1,
                                    int rows, int heads, int head_vecs, int lane) {
    const int n = r1 - r0, total = 2 * heads * n;
    for (int i0 = 0; i0 < total; i0 += 128) {
      uint4 v[4];
      int64_t offset[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int i = i0 + lane + 32 * q, y = i / n, r = r0 + i - y * n;  // y: half * heads + head
        offset[q] = (y >= heads ? half - int64_t(heads) * head_vecs : 0) + int64_t(y) * head_vecs + r;
        v[q] = i < total && r < rows ? src[offset[q]] : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int q = 0; q < 4; ++q)
        if (i0 + lane + 32 * q < total) dst[at + offset[q]] = v[q];
    }
  }
};

// dQ of this rank's rows = scale * the sum of its parts: parts[0] this rank's slot 0, then the slots of the
// peers on other GPUs that met its rows (read over the links, once each). In order.
template <class T>
__global__ void ring_bwd_sum_dq(const float* const* parts, int count, T* dq, int64_t elements, float scale) {
  const int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * 4;
  if (i >= elements) return;
  float4 sum = *reinterpret_cast<const float4*>(parts[0] + i);
  for (int s = 1; s < count; ++s) {
    const float4 v = *reinterpret_cast<const float4*>(parts[s] + i);
    sum.x += v.x, sum.y += v.y, sum.z += v.z, sum.w += v.w;
  }
  *reinterpret_cast<uint2*>(dq + i) =
      make_uint2(tile::pack2<T>(sum.x * scale, sum.y * scale), tile::pack2<T>(sum.z * scale, sum.w * scale));
}

}  // namespace weft::ops
