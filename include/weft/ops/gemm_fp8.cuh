// weft's FP8 GEMM as an LCSC op: C = (A . B) scaled, A row-major [M,K] and B an [N,K] weight, both e4m3
// (or e5m2), fp32 accumulation promoted every 128 of K (lcsc::Fp8PromotingMainloop), C row-major [M,N] bf16
// or f32, stored or reduce-added wherever C's map points. The scales (fp32, device memory) come in three
// kinds (ops/gemm_fp8_types.hpp):
//   kTensor  one scale for A and one for B: C = sa sb (A . B), applied after the mainloop;
//   kRowCol  one per row of A and one per column of C (one per row of B): C[i][j] = sa[i] sb[j] (A .
//   B)[i][j]; kBlock   DeepSeek-V3's: A per row and 128-column group of K, [M, K / 128]; B per 128 x 128
//   block,
//            [N / 128, K / 128] (both rounded up); each k-block's product is promoted times sa sb.
// Tile 128 x 128 x 128: two consumer warpgroups of 64 x 128 (m64n128k32 wgmma), each holding its fp32
// accumulator and the k-block's product (64 + 64 registers), so a tile's column block is one B scale block.
// kScalesFromPeers: A's scales are written by peers while the kernel runs (all_gather_scaled_matmul, after
// its consumers' wait for them): read through L2 (ld.global.cg), never the non-coherent read-only path.
#pragma once
#include <cuda.h>

#include "weft/lcsc/epilogue.cuh"
#include "weft/lcsc/kernel.cuh"
#include "weft/lcsc/mainloop.cuh"
#include "weft/lcsc/scheduler.cuh"
#include "weft/ops/gemm_fp8_types.hpp"

namespace weft::ops {

template <class OutT, Fp8Scaling kScaling, bool kE5M2 = false, bool kScalesFromPeers = false>
struct Fp8GemmOp {
  static constexpr int kBM = 128, kBN = 128, kStages = 6;
  static constexpr int kConsumerWarpgroups = kBM / 64;
  static constexpr int kClusterSize = 1;
  static constexpr int kLoaderRegs = 40, kConsumerRegs = 232;

  using Scheduler = lcsc::GemmTileScheduler;
  using Mainloop = lcsc::Fp8PromotingMainloop<kBM, kBN, kStages>;
  static constexpr int kBK = Mainloop::kBK;
  using Epilogue = lcsc::TmaStoreEpilogue<OutT, kBN, kConsumerWarpgroups>;
  using Pipeline = typename Mainloop::Pipeline;
  using Accum = typename Mainloop::Accum;
  using StoreState = typename Epilogue::State;
  static_assert(kBN == kFp8ScaleBlock && kBK == kFp8ScaleBlock, "a tile's columns and k-block: one block");

  struct Params {
    lcsc::SchedulerParams sched;
    CUtensorMap a;  // [M,K] fp8, box kBM x kBK
    CUtensorMap b;  // [N,K] fp8, box kBN x kBK
    CUtensorMap c;  // [M,N] OutT, box 64 x Epilogue::kChunkCols
    int m, n, k_blocks;
    const float* scale_a;  // see the header, per kScaling
    const float* scale_b;
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
  }
  __device__ static void load(const Params& p, Smem& s, Pipeline& pipe, lcsc::PipeState& st,
                              const lcsc::Tile& t) {
    Mainloop::load(s.main, pipe, st, &p.a, &p.b, t.m * kBM, t.n * kBN, p.k_blocks);
  }
  __device__ static void compute(const Params& p, Smem& s, Pipeline& pipe, lcsc::PipeState& st,
                                 const lcsc::Tile& t, int wg, Accum& acc) {
    // The two rows this thread holds (AccumM64), in C.
    const int row = t.m * kBM + 64 * wg + Accum::row(0), row8 = row + 8;
    if constexpr (kScaling == Fp8Scaling::kBlock) {
      // Rows past M read no scale (their products are zero: TMA filled A's rows with zeros).
      const float* sa = p.scale_a + int64_t(row) * p.k_blocks;
      const float* sa8 = p.scale_a + int64_t(row8) * p.k_blocks;
      const float* sb = p.scale_b + int64_t(t.n) * p.k_blocks;
      const bool in = row < p.m, in8 = row8 < p.m;
      Mainloop::template mma<kE5M2>(s.main, pipe, st, p.k_blocks, wg, acc, [&](int kb) {
        const float b = __ldg(sb + kb);
        return make_float2(in ? scale_a_at(sa + kb) * b : 0.f, in8 ? scale_a_at(sa8 + kb) * b : 0.f);
      });
    } else {
      Mainloop::template mma<kE5M2>(s.main, pipe, st, p.k_blocks, wg, acc,
                                    [](int) { return make_float2(1.f, 1.f); });
      scale_after(p, t, row, row8, acc);
    }
  }
  __device__ static void store(const Params& p, Smem& s, const lcsc::Tile& t, int wg, const Accum& acc,
                               StoreState& es) {
    Epilogue::store(&p.c, p.store_mode, s.epi, es, wg, acc, t.m * kBM + 64 * wg, t.n * kBN);
  }
  __device__ static void finish(const Params&, Smem&, int, StoreState& es) { Epilogue::finish(es); }

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

}  // namespace weft::ops
