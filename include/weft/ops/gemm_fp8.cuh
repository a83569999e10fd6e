// weft's FP8 GEMM as an LCSC op: C = (A . B) scaled, A row-major [M,K] and B an [N,K] weight, both e4m3
// (or e5m2), fp32 accumulation promoted every 128 of K (lcsc::Fp8PromotingMainloop), C row-major [M,N] bf16
// or f32, stored or reduce-added wherever C's map points. The scales (fp32, device memory) come in three
// kinds (ops/gemm_fp8_types.hpp):
//   kTensor  one scale for A and one for B: C = sa sb (A . B), applied after the mainloop;
//   kRowCol  one per row of A and one per column of C (one per row of B):
//            C[i][j] = sa[i] sb[j] (A . B)[i][j];
//   kBlock   DeepSeek-V3's: A per row and 128-column group of K, [M, K / 128] (row-major, or M-major:
//            Params::sa_row_step / sa_k_step); B per 128 x 128 block, [N / 128, K / 128] row-major (both
//            rounded up); each k-block's product is promoted times sa sb. kStagedScaleA (M-major scales
//            TMA can read): the loader's TMA brings each k-block's A scales into its stage
//            (Params::scale_a_map); otherwise each consumer thread loads its rows' scales itself.
// Tile 128 x 128 x 128: two consumer warpgroups of 64 x 128 (m64n128k32 wgmma), each holding its fp32
// accumulator and the k-block's product (64 + 64 registers), so a tile's column block is one B scale block.
// kScalesFromPeers: A's scales are written by peers while the kernel runs (all_gather_scaled_matmul, after
// its consumers' wait for them): read through L2 (ld.global.cg), never the non-coherent read-only path.
#pragma once
#include <cuda.h>

#include "weft/lcsc/epilogue.cuh"
#include "weft/lcsc/kernel.cuh"
#include "weft/lcsc/grouped_scheduler.cuh"
#include "weft/lcsc/mainloop.cuh"
#include "weft/lcsc/scheduler.cuh"
#include "weft/ops/gemm_fp8_types.hpp"

namespace weft::ops {

// TileScheduler: which output tiles, in which order (the grouped op's: lcsc::GroupedTileScheduler).
// kOverlappedPromotion: the mainloop's two register tiles (lcsc::Fp8PromotingMainloop::mma), where the op's
// hooks leave the registers for them (the fused reduce-scatter's spill with them: one tile there).
template <class OutT, Fp8Scaling kScaling, bool kE5M2 = false, bool kScalesFromPeers = false,
          class TileScheduler = lcsc::GemmTileScheduler, bool kOverlappedPromotion = true,
          bool kStagedScaleA_ = false>
struct Fp8GemmOp {
  static constexpr bool kStagedScaleA = kStagedScaleA_;
  // Six stages fill the 227 KiB of shared memory with the epilogue's; staged scales (512 bytes a stage)
  // leave five.
  static constexpr int kBM = 128, kBN = 128, kStages = kStagedScaleA ? 5 : 6;
  static constexpr int kConsumerWarpgroups = kBM / 64;
  static constexpr int kClusterSize = 1;
  static constexpr int kLoaderRegs = 40, kConsumerRegs = 232;
  static constexpr bool kGrouped = false;

  using Scheduler = TileScheduler;
  using Mainloop = lcsc::Fp8PromotingMainloop<kBM, kBN, kStages, kStagedScaleA>;
  static constexpr int kBK = Mainloop::kBK;
  using Epilogue = lcsc::TmaStoreEpilogue<OutT, kBN, kConsumerWarpgroups>;
  using Pipeline = typename Mainloop::Pipeline;
  using Accum = typename Mainloop::Accum;
  using StoreState = typename Epilogue::State;
  static_assert(kBN == kFp8ScaleBlock && kBK == kFp8ScaleBlock, "a tile's columns and k-block: one block");
  static_assert(!kStagedScaleA || (kScaling == Fp8Scaling::kBlock && !kScalesFromPeers),
                "staged scales: M-major block scales of A, none written by peers while the kernel runs");

  struct Params {
    typename Scheduler::Params sched;
    CUtensorMap a;  // [M,K] fp8, box kBM x kBK
    CUtensorMap b;  // [N,K] fp8, box kBN x kBK
    CUtensorMap c;  // [M,N] OutT, box 64 x Epilogue::kChunkCols
    int m, n, k_blocks;
    const float* scale_a;  // see the header, per kScaling
    const float* scale_b;
    // kBlock: A's scale of row i and k-block j at scale_a[i * sa_row_step + j * sa_k_step]; 0 picks the dense
    // row-major layout's (sa_row_step k_blocks, sa_k_step 1). The M-major layout (sa_row_step 1, sa_k_step
    // >= M: torch's for 1 x 128 blockwise scales) gives a warp's 16 rows of a k-block in two 32-byte
    // sectors where the row-major one takes sixteen, but every k-block in a new one, where the row-major
    // layout's rows share a sector over eight k-blocks (L1 hits): measured slower on this path (RESULTS).
    int sa_row_step, sa_k_step;
    CUtensorMap scale_a_map;  // kStagedScaleA: A's M-major scales, [k_blocks][M], box 1 x kBM
    lcsc::StoreMode store_mode;
  };
  struct Smem {
    typename Mainloop::Smem main;
    typename Epilogue::Smem epi;
    typename Pipeline::Storage pipe;
  };

  __device__ static void init(const Params& p, Smem&) {
    tma::prefetch_map(&p.a);
    tma::prefetch_map(&p.b);
    tma::prefetch_map(&p.c);
    if constexpr (kStagedScaleA) tma::prefetch_map(&p.scale_a_map);
  }
  __device__ static void load(const Params& p, Smem& s, Pipeline& pipe, lcsc::PipeState& st,
                              const lcsc::Tile& t) {
    Mainloop::load(s.main, pipe, st, &p.a, &p.b, t.m * kBM, t.n * kBN, p.k_blocks, &p.scale_a_map);
  }
  __device__ static void compute(const Params& p, Smem& s, Pipeline& pipe, lcsc::PipeState& st,
                                 const lcsc::Tile& t, int wg, Accum& acc) {
    // The two rows this thread holds (AccumM64), in C.
    const int row = t.m * kBM + 64 * wg + Accum::row(0);
    [[maybe_unused]] const int row8 = row + 8;
    if constexpr (kScaling == Fp8Scaling::kBlock) {
      block_scaled_mma(p, s, pipe, st, wg, acc, row, p.scale_b + int64_t(t.n) * p.k_blocks);
    } else {
      Mainloop::template mma<kE5M2, kOverlappedPromotion>(s.main, pipe, st, p.k_blocks, wg, acc,
                                                          [](int, int) { return make_float2(1.f, 1.f); });
      scale_after(p, t, row, row8, acc);
    }
  }
  __device__ static void store(const Params& p, Smem& s, const lcsc::Tile& t, int wg, const Accum& acc,
                               StoreState& es) {
    Epilogue::store(&p.c, p.store_mode, s.epi, es, wg, acc, t.m * kBM + 64 * wg, t.n * kBN);
  }
  __device__ static void finish(const Params&, Smem&, int, StoreState& es) { Epilogue::finish(es); }

 protected:
  // kBlock: the k-blocks promoted times A's scales of the thread's two rows and B's of the tile's column
  // block, sb (rows past M read no scale: their products are zero, TMA filled A's rows with zeros).
  __device__ static void block_scaled_mma(const Params& p, Smem& s, Pipeline& pipe, lcsc::PipeState& st,
                                          int wg, Accum& acc, int row, const float* sb) {
    if constexpr (kStagedScaleA) {
      const int in_tile = 64 * wg + Accum::row(0);  // the thread's first row in the tile (and in + 8)
      Mainloop::template mma<kE5M2, kOverlappedPromotion>(
          s.main, pipe, st, p.k_blocks, wg, acc, [&](int kb, int stage) {
            const float b = __ldg(sb + kb);
            return make_float2(Mainloop::staged_scale_a(s.main, stage, in_tile) * b,
                               Mainloop::staged_scale_a(s.main, stage, in_tile + 8) * b);
          });
      return;
    }
    const int row8 = row + 8;
    // (0, a launcher that sets none: dense row-major)
    const int64_t row_step = p.sa_row_step > 0 ? p.sa_row_step : p.k_blocks;
    const int64_t k_step = p.sa_k_step > 0 ? p.sa_k_step : 1;
    const float* sa = p.scale_a + int64_t(row) * row_step;
    const float* sa8 = p.scale_a + int64_t(row8) * row_step;
    const bool in = row < p.m, in8 = row8 < p.m;
    Mainloop::template mma<kE5M2, kOverlappedPromotion, true>(
        s.main, pipe, st, p.k_blocks, wg, acc, [&](int kb, int) {
          const float b = __ldg(sb + kb);
          const int64_t at = kb * k_step;
          return make_float2(in ? scale_a_at(sa + at) * b : 0.f, in8 ? scale_a_at(sa8 + at) * b : 0.f);
        });
  }

 private:
  __device__ static float scale_a_at(const float* s) {
    if constexpr (kScalesFromPeers) return __ldcg(s);
    return __ldg(s);
  }
  // kTensor / kRowCol: the accumulator times sa sb (a row past M or a column past N reads no scale; TMA's
  // store clips them).
  __device__ static void scale_after(const Params& p, const lcsc::Tile& t, int row, int row8, Accum& acc) {
    if constexpr (kScaling == Fp8Scaling::kTensor) {
      const float f = scale_a_at(p.scale_a) * __ldg(p.scale_b);
#pragma unroll
      for (int i = 0; i < Accum::kRegs; ++i) acc.d[i] *= f;
    } else {
      const float a = row < p.m ? scale_a_at(p.scale_a + row) : 0.f,
                  a8 = row8 < p.m ? scale_a_at(p.scale_a + row8) : 0.f;
      const int col0 = t.n * kBN;
#pragma unroll
      for (int i = 0; i < Accum::kRegs; ++i) {
        const int col = col0 + Accum::col(i);
        const float b = col < p.n ? __ldg(p.scale_b + col) : 0.f;
        acc.d[i] *= ((i / 2) % 2 ? a8 : a) * b;
      }
    }
  }
};

// Grouped FP8 GEMM (an MoE layer's experts on FP8 rows, DeepSeek-V3's block scales): A's rows come in groups
// back to back as GroupedGemmOp's (weft/ops/gemm.cuh: group_end device int32, each end a multiple of kBM, in
// p.sched; the same scheduler, lcsc::GroupedTileScheduler, so with group_rows only the tiles holding counted
// rows are walked, each with its group: a low-latency dispatch's fixed groups; without, every tile of the
// capacity, a tile's group found by a search of group_end and tiles past the last end skipped by the loader
// and consumers alike), B stacked [E, N, K] (K-major weights, one map of E x N rows), C's rows of group e =
// A's rows of group e times B_e, promoted per k-block times A's row scales [rows, K / 128] and B_e's block
// scales [E, ceil(N / 128), K / 128]. A column tile past N of expert e reads expert e + 1's first rows: the
// store clips them. kStagedScaleA: A's scales M-major, brought into the stages by TMA (as Fp8GemmOp's).
// kCountedGroups: group_rows taken (the scheduler's walk of live tiles); a call without group_rows runs the
// kernel without that walk, whose data-dependent branches make the consumers' k-block loop compile into
// per-thread stage registers and divergence checks (0.90 of the kernel without them, bench/RESULTS.md
// 2026-11-29; since shared memory is addressed straight from the array, 1.04-1.09x of it in one run: see
// docs/DESIGN.md's schedulers).
template <class OutT, bool kE5M2 = false, bool kStagedScaleA = false, bool kCountedGroups = true>
struct GroupedFp8GemmOp : Fp8GemmOp<OutT, Fp8Scaling::kBlock, kE5M2, false,
                                    lcsc::GroupedTileScheduler<128, kCountedGroups>, true, kStagedScaleA> {
  using Base = Fp8GemmOp<OutT, Fp8Scaling::kBlock, kE5M2, false,
                         lcsc::GroupedTileScheduler<128, kCountedGroups>, true, kStagedScaleA>;
  using Base::kBM, Base::kBN;
  using typename Base::Accum, typename Base::Mainloop, typename Base::Pipeline, typename Base::Scheduler,
      typename Base::StoreState;
  static_assert(kBM == 128, "the scheduler's tiles are 128 rows");
  static constexpr bool kGrouped = true;

  struct Params : Base::Params {
    int n_blocks;  // ceil(N / kBN): one expert's column blocks of B scales
  };
  struct Smem : Base::Smem {
    typename Scheduler::Storage sched;  // the scheduler's table of live tile rows (lcsc/kernel.cuh)
  };

  // Tile t's group (named by the scheduler with group_rows, else found), or groups: past the last end.
  __device__ static int group(const Params& p, const lcsc::GroupTile& t) {
    return t.group >= 0 ? t.group : p.sched.group_holding(t.m * kBM);
  }
  __device__ static void load(const Params& p, Smem& s, Pipeline& pipe, lcsc::PipeState& st,
                              const lcsc::GroupTile& t) {
    const int m0 = t.m * kBM, e = group(p, t);
    if (e == p.sched.groups) return;
    if (__ldg(p.sched.group_end + e) % kBM != 0) __trap();  // group ends must be whole tiles (see the header)
    Mainloop::load(s.main, pipe, st, &p.a, &p.b, m0, e * p.n + t.n * kBN, p.k_blocks, &p.scale_a_map);
  }
  __device__ static void compute(const Params& p, Smem& s, Pipeline& pipe, lcsc::PipeState& st,
                                 const lcsc::GroupTile& t, int wg, Accum& acc) {
    const int e = group(p, t);
    if (e == p.sched.groups) return;
    Base::block_scaled_mma(p, s, pipe, st, wg, acc, t.m * kBM + 64 * wg + Accum::row(0),
                           p.scale_b + (int64_t(e) * p.n_blocks + t.n) * p.k_blocks);
  }
  __device__ static void store(const Params& p, Smem& s, const lcsc::GroupTile& t, int wg, const Accum& acc,
                               StoreState& es) {
    if (group(p, t) < p.sched.groups) Base::store(p, s, t, wg, acc, es);
  }
};

}  // namespace weft::ops
