// The GEMM mainloop of the LCSC template: TMA loads of A and B k-blocks into the pipeline (loader role) and
// wgmma over them (consumer role), bf16 in, fp32 accumulate.
//
// Tile kBM x kBN x kBK with kBM / 64 consumer warpgroups; warpgroup w owns rows [64 w, 64 w + 64) and all
// kBN columns (one m64nNk16 wgmma per 16 of K). A is row-major [M,K] (K-major). B is either an [N,K]
// weight (K-major, kBKMajor) or row-major [K,N] (N-major). With kCluster > 1, the kCluster CTAs of a
// cluster hold tiles stacked along M that share the same B tile: CTA rank r loads the r-th slice of B and
// multicasts it to all of them, so each CTA reads its A tile and 1 / kCluster of B from L2.
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "weft/lcsc/pipeline.cuh"
#include "weft/tile/cluster.cuh"
#include "weft/tile/fragment.cuh"
#include "weft/tile/layout.cuh"
#include "weft/tile/tma.cuh"
#include "weft/tile/wgmma.cuh"

namespace weft::lcsc {

template <int kBM, int kBN, int kBK, int kStages, bool kBKMajor, int kCluster>
struct WgmmaMainloop {
  using bf16 = __nv_bfloat16;
  static constexpr int kConsumers = kBM / 64;
  using Pipeline = lcsc::Pipeline<kStages, kConsumers, kCluster>;
  using ATile = tile::Sw128Tile<bf16, kBM, kBK>;                               // rows M, columns K
  using BTile = std::conditional_t<kBKMajor, tile::Sw128Tile<bf16, kBN, kBK>,  // rows N, columns K
                                   tile::Sw128Tile<bf16, kBK, kBN>>;           // rows K, columns N
  struct Stage {
    ATile a;
    BTile b;
  };
  struct Smem {
    Stage stage[kStages];
  };
  using Accum = tile::AccumM64<kBN>;

  // Every byte that lands in one CTA's stage, from its own loads and its peers' multicasts.
  static constexpr uint32_t kStageTxBytes = sizeof(ATile) + sizeof(BTile);
  // TMA boxes (rows x columns of the global tensor) the host encodes the maps with.
  static constexpr int kABoxRows = kBM, kABoxCols = kBK;
  static constexpr int kBBoxRows = kBKMajor ? kBN / kCluster : kBK;
  static constexpr int kBBoxCols = kBKMajor ? kBK : BTile::kBlockCols;

  static_assert(kBM % 64 == 0 && kBM <= 256, "one to four consumer warpgroups of 64 rows");
  static_assert(kBK == 64, "one 128-byte row of bf16 K per stage");
  static_assert(kCluster == 1 || kCluster == 2 || kCluster == 4, "cluster of 1, 2 or 4 CTAs");
  static_assert(!kBKMajor || ((kBN / kCluster) % 8 == 0 && kBN / kCluster <= 256), "B slice per CTA");
  static_assert(kBKMajor || BTile::kBlocks % kCluster == 0, "B column blocks split evenly over the cluster");

  // ---- loader: one thread. The k_blocks stages of the tile whose first element is (m0, n0). ----
  // b_row0: B's first row (a grouped GEMM's expert in a stacked [E, N, K] or [E, K, N] tensor); k_block0:
  // the first k-block (a split-K slice's).
  __device__ static void load(Smem& s, Pipeline& pipe, PipeState& st, const CUtensorMap* a,
                              const CUtensorMap* b, int m0, int n0, int k_blocks, int b_row0 = 0,
                              int k_block0 = 0) {
    const uint32_t rank = kCluster > 1 ? tile::cluster_ctarank() : 0u;
    constexpr uint16_t kAll = static_cast<uint16_t>((1u << kCluster) - 1u);
    for (int kb = 0; kb < k_blocks; ++kb) {
      Stage& stage = s.stage[st.stage];
      uint64_t* full = pipe.producer_acquire(st, kStageTxBytes);
      const int k0 = (k_block0 + kb) * kBK;
      tma::load_2d(stage.a.bytes, a, k0, m0, full);
      if constexpr (kBKMajor) {
        constexpr int kRows = kBN / kCluster;
        uint8_t* dst = stage.b.bytes + rank * kRows * tile::kSwizzleBytes;
        if constexpr (kCluster == 1)
          tma::load_2d(dst, b, k0, b_row0 + n0, full);
        else
          tma::load_2d_multicast(dst, b, k0, b_row0 + n0 + static_cast<int>(rank) * kRows, full, kAll);
      } else {
        constexpr int kPerCta = BTile::kBlocks / kCluster;
#pragma unroll
        for (int i = 0; i < kPerCta; ++i) {
          const int blk = static_cast<int>(rank) * kPerCta + i;
          if constexpr (kCluster == 1)
            tma::load_2d(stage.b.block(blk), b, n0 + blk * BTile::kBlockCols, b_row0 + k0, full);
          else
            tma::load_2d_multicast(stage.b.block(blk), b, n0 + blk * BTile::kBlockCols, b_row0 + k0, full,
                                   kAll);
        }
      }
      st.advance(kStages);
    }
  }

  // ---- consumer: warpgroup `wg` accumulates rows [64 wg, 64 wg + 64) of the tile into acc. ----
  // One batch of kBK / 16 wgmmas per stage, one batch kept in flight: a stage is released as soon as the
  // batch after it has been issued and the batch reading it has completed. after_issue(kb), called by every
  // thread while k-block kb's batch runs, is work that overlaps the mainloop (it touches no accumulator and
  // leaves each warp converged).
  __device__ static void mma(Smem& s, Pipeline& pipe, PipeState& st, int k_blocks, int wg, Accum& acc) {
    mma(s, pipe, st, k_blocks, wg, acc, [](int) {});
  }
  template <class AfterIssue>
  __device__ static void mma(Smem& s, Pipeline& pipe, PipeState& st, int k_blocks, int wg, Accum& acc,
                             AfterIssue&& after_issue) {
    PipeState prev = st;
    for (int kb = 0; kb < k_blocks; ++kb) {
      pipe.consumer_wait(st);
      const Stage& stage = s.stage[st.stage];
      const uint64_t da = wgmma::desc_k_major(stage.a, 64 * wg, 0);
      uint64_t db;
      if constexpr (kBKMajor)
        db = wgmma::desc_k_major(stage.b, 0, 0);
      else
        db = wgmma::desc_mn_major(stage.b, 0);
      wgmma::fence_operands(acc.d);
      wgmma::fence();
#pragma unroll
      for (int k = 0; k < kBK / 16; ++k) {
        constexpr uint32_t kStepA = 16 * sizeof(bf16);  // 16 K columns inside the 128-byte row
        constexpr uint32_t kStepB = kBKMajor ? 16 * sizeof(bf16) : 16 * tile::kSwizzleBytes;  // or 16 K rows
        wgmma::mma_bf16<kBN, kBKMajor ? 0 : 1>(acc.d, wgmma::desc_advance(da, k * kStepA),
                                               wgmma::desc_advance(db, k * kStepB),
                                               (kb > 0 || k > 0) ? 1 : 0);
      }
      wgmma::commit();
      wgmma::fence_operands(acc.d);
      after_issue(kb);
      wgmma::wait<1>();
      if (kb > 0) pipe.consumer_release(prev);
      prev = st;
      st.advance(kStages);
    }
    wgmma::wait<0>();
    wgmma::fence_operands(acc.d);
    if (k_blocks > 0) pipe.consumer_release(prev);
  }
};

}  // namespace weft::lcsc

namespace weft::lcsc {

// The FP8 GEMM mainloop: A row-major [M,K] and B an [N,K] weight, both e4m3 (or e5m2), K-major (8-bit
// wgmma reads no transposed operand), fp32 accumulation with promotion. Each k-block of kBK = 128 (one
// 128-byte row per operand row, one scale block of DeepSeek-V3's 1 x 128 / 128 x 128 scaling) is
// multiplied by four m64nNk32 wgmmas into a register tile of its own, which is then added into the fp32
// accumulator times a factor per row (its scale block's, or 1): Hopper's FP8 wgmma keeps fewer mantissa
// bits than fp32 while it accumulates, so over K = 16k an accumulation left to it alone drifts; one
// promotion per 128 of K bounds that. The wait for each block's wgmmas before its promotion leaves the
// tensor cores to the other consumer warpgroup meanwhile (two warpgroups per CTA, staggered by the
// pipeline), as in DeepGEMM's kernels.
// kStagedScaleA: A's block scales of each k-block (kBM fp32, one per row of the tile) ride in the stage
// beside A, one box of an M-major [K / 128][M] scale tensor copied by the loader's TMA, so a consumer reads
// them from shared memory once the stage is full, where a load from global memory just before the block's
// promotion would hold it up (B's scale, one per block and tile, stays a load of the consumers: L1 serves
// 31 of 32). (Row-major scales, [M][K / 128], would take a box of 4 k-blocks x kBM rows,
// TMA's box rows being 16 bytes at least, started at a multiple of 4 k-blocks, as a box must start
// 16-byte aligned: measured slower than the consumers' own loads, bench/RESULTS.md 2026-11-29.)
template <int kBM, int kBN, int kStages, bool kStagedScaleA = false>
struct Fp8PromotingMainloop {
  static constexpr int kBK = 128;
  static constexpr int kConsumers = kBM / 64;
  // Staged scales are read by the consumer threads themselves: each warp releases the stage on its own.
  using Pipeline = lcsc::Pipeline<kStages, kConsumers, 1, kStagedScaleA>;
  using ATile = tile::Sw128Tile<uint8_t, kBM, kBK>;  // rows M, columns K
  using BTile = tile::Sw128Tile<uint8_t, kBN, kBK>;  // rows N, columns K
  struct Stage {
    ATile a;
    BTile b;
  };
  struct PlainSmem {
    Stage stage[kStages];
  };
  struct StagedScalesSmem {
    Stage stage[kStages];
    alignas(128) float scale_a[kStages][kBM];  // stage i's: row r of the tile at [i][r]
  };
  using Smem = std::conditional_t<kStagedScaleA, StagedScalesSmem, PlainSmem>;
  using Accum = tile::AccumM64<kBN>;

  static constexpr uint32_t kScaleBytes = kStagedScaleA ? kBM * sizeof(float) : 0;
  static constexpr uint32_t kStageTxBytes = sizeof(ATile) + sizeof(BTile) + kScaleBytes;
  static constexpr int kABoxRows = kBM, kABoxCols = kBK;
  static constexpr int kBBoxRows = kBN, kBBoxCols = kBK;
  // The scale tensor's box (rows x columns): one k-block (row) of kBM rows of A (columns).
  static constexpr int kScaleABoxRows = 1, kScaleABoxCols = kBM;
  static_assert(kBM % 64 == 0 && kBM <= 256, "one to four consumer warpgroups of 64 rows");
  static_assert(kBN == 64 || kBN == 128 || kBN == 256, "FP8 wgmma wrappers exist for N = 64, 128, 256");

  // ---- loader: one thread. The k_blocks stages of the tile whose first element is (m0, n0); with
  // kStagedScaleA, scale_a maps A's M-major scales (rows past M arrive as zeros). ----
  __device__ static void load(Smem& s, Pipeline& pipe, PipeState& st, const CUtensorMap* a,
                              const CUtensorMap* b, int m0, int n0, int k_blocks,
                              const CUtensorMap* scale_a = nullptr) {
    for (int kb = 0; kb < k_blocks; ++kb) {
      Stage& stage = s.stage[st.stage];
      uint64_t* full = pipe.producer_acquire(st, kStageTxBytes);
      tma::load_2d(stage.a.bytes, a, kb * kBK, m0, full);
      tma::load_2d(stage.b.bytes, b, kb * kBK, n0, full);
      if constexpr (kStagedScaleA) tma::load_2d(s.scale_a[st.stage], scale_a, m0, kb, full);
      st.advance(kStages);
    }
  }
  // kStagedScaleA: the scale of the tile's row r for the k-block in stage `stage` (valid from the consumer's
  // wait for that stage until its release). (ld.shared spelled out: through the generic reference the
  // compiler emits a generic load.)
  __device__ static float staged_scale_a(const Smem& s, int stage, int r) {
    return ld_shared_f32(&s.scale_a[stage][r]);
  }

  // ---- consumer: warpgroup `wg` sets acc to rows [64 wg, 64 wg + 64) of the tile's product. ----
  // factor(kb, stage) gives the promotion factors of k-block kb, held in stage `stage` (its shared memory
  // readable, not yet released), for the two rows this thread holds (AccumM64: row r in d[i] with
  // (i / 2) % 2 == 0, row r + 8 in the others); it is called before the block's wait, so loads it makes
  // overlap the wait. kOverlapped: two register tiles take the k-blocks in turn, block kb + 1's
  // wgmmas issued before block kb is waited for and promoted, so the tensor cores have this warpgroup's next
  // block while it promotes (both warpgroups wait for the same stage, so with one tile they promote at the
  // same time, the tensor cores idle meanwhile); 64 registers more a thread. Otherwise one tile, each block
  // waited for before the next is issued. kFactorsAhead (with kOverlapped): each block's factors read right
  // after its wgmmas are issued, a whole block before its promotion, for factors loaded from global memory
  // (a scale missing L1 then waits less than a block); factors read from the stage measured slower so
  // (bench/RESULTS.md 2026-11-29: 0.875 of per-tensor against 0.92).
  template <bool kE5M2, bool kOverlapped = true, bool kFactorsAhead = false, class Factor>
  __device__ static void mma(Smem& s, Pipeline& pipe, PipeState& st, int k_blocks, int wg, Accum& acc,
                             Factor factor) {
#pragma unroll
    for (int i = 0; i < Accum::kRegs; ++i) acc.d[i] = 0.f;
    if (k_blocks < 1) return;  // (every caller has K >= 1)
    if constexpr (!kOverlapped) {
      Accum part;
      for (int kb = 0; kb < k_blocks; ++kb) {
        const PipeState at = st;  // (issue waits for the stage before `last` reads factor(kb, at.stage))
        issue<kE5M2>(s, pipe, st, wg, part);
        float2 f;
        last<kE5M2, false>(pipe, at, kb, acc, part, f, factor);
      }
      return;
    }
    Accum part0, part1;
    PipeState issued = st;  // the stage of the oldest block in flight
    issue<kE5M2>(s, pipe, st, wg, part0);
    float2 f;  // kFactorsAhead: the oldest block's factors, read a block ahead
    if constexpr (kFactorsAhead) f = factor(0, issued.stage);
    int kb = 0;
    for (; kb + 2 < k_blocks; kb += 2) {
      step<kE5M2, kFactorsAhead>(s, pipe, st, issued, kb, wg, acc, part0, part1, f, factor);
      step<kE5M2, kFactorsAhead>(s, pipe, st, issued, kb + 1, wg, acc, part1, part0, f, factor);
    }
    if (kb + 1 < k_blocks) {
      step<kE5M2, kFactorsAhead>(s, pipe, st, issued, kb, wg, acc, part0, part1, f, factor);
      last<kE5M2, kFactorsAhead>(pipe, issued, kb + 1, acc, part1, f, factor);
    } else {
      last<kE5M2, kFactorsAhead>(pipe, issued, kb, acc, part0, f, factor);
    }
  }

 private:
  // Block st's four wgmmas into part (one commit group); st moves on.
  template <bool kE5M2>
  __device__ __forceinline__ static void issue(Smem& s, Pipeline& pipe, PipeState& st, int wg, Accum& part) {
    pipe.consumer_wait(st);
    const Stage& stage = s.stage[st.stage];
    const uint64_t da = wgmma::desc_k_major(stage.a, 64 * wg, 0);
    const uint64_t db = wgmma::desc_k_major(stage.b, 0, 0);
    wgmma::fence_operands(part.d);
    wgmma::fence();
#pragma unroll
    for (int k = 0; k < kBK / 32; ++k) {
      constexpr uint32_t kStep = 32;  // 32 K columns of one byte inside the 128-byte row
      mma_fp8<kE5M2>(part.d, wgmma::desc_advance(da, k * kStep), wgmma::desc_advance(db, k * kStep),
                     k > 0 ? 1 : 0);
    }
    wgmma::commit();
    wgmma::fence_operands(part.d);
    st.advance(kStages);
  }
  // Block kb (in `mine`, at stage `issued`) is in flight: block kb + 1 issued into `next`, then kb waited
  // for, its stage released and its product promoted into acc. kFactorsAhead: f holds block kb's factors
  // on entry and block kb + 1's, read right after its issue, on return; otherwise kb's are read first.
  template <bool kE5M2, bool kFactorsAhead, class Factor>
  __device__ __forceinline__ static void step(Smem& s, Pipeline& pipe, PipeState& st, PipeState& issued,
                                              int kb, int wg, Accum& acc, Accum& mine, Accum& next, float2& f,
                                              Factor& factor) {
    if constexpr (!kFactorsAhead) f = factor(kb, issued.stage);
    const PipeState done = issued;
    issued = st;
    issue<kE5M2>(s, pipe, st, wg, next);
    float2 f_next;
    if constexpr (kFactorsAhead) f_next = factor(kb + 1, issued.stage);
    wgmma::wait<1>();
    promote(pipe, done, f, acc, mine);
    if constexpr (kFactorsAhead) f = f_next;
  }
  // The last block kb (in `mine`): waited for, released and promoted (kFactorsAhead: f holds its factors).
  template <bool kE5M2, bool kFactorsAhead, class Factor>
  __device__ __forceinline__ static void last(Pipeline& pipe, const PipeState& issued, int kb, Accum& acc,
                                              Accum& mine, float2& f, Factor& factor) {
    if constexpr (!kFactorsAhead) f = factor(kb, issued.stage);
    wgmma::wait<0>();
    promote(pipe, issued, f, acc, mine);
  }
  __device__ __forceinline__ static void promote(Pipeline& pipe, const PipeState& done, float2 f, Accum& acc,
                                                 Accum& mine) {
    wgmma::fence_operands(mine.d);
    pipe.consumer_release(done);
#pragma unroll
    for (int i = 0; i < Accum::kRegs; ++i) acc.d[i] = fmaf((i / 2) % 2 ? f.y : f.x, mine.d[i], acc.d[i]);
  }

  __device__ __forceinline__ static float ld_shared_f32(const float* p) {
    float v;
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(smem_addr(p)));
    return v;
  }
  template <bool kE5M2>
  __device__ static void mma_fp8(float (&d)[Accum::kRegs], uint64_t da, uint64_t db, int scale_d) {
    if constexpr (kBN == 256)
      wgmma::mma_fp8_m64n256k32<kE5M2>(d, da, db, scale_d);
    else if constexpr (kBN == 128)
      wgmma::mma_fp8_m64n128k32<kE5M2>(d, da, db, scale_d);
    else
      wgmma::mma_fp8_m64n64k32<kE5M2>(d, da, db, scale_d);
  }
};

}  // namespace weft::lcsc
