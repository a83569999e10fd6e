// The GEMM of weft, written as an LCSC op: C = A.B with A row-major [M,K] bf16, B either an [N,K] weight
// (nn.Linear layout) or row-major [K,N] bf16, fp32 accumulation, C row-major [M,N] in bf16 or f32, stored,
// or reduce-added, wherever C's tensor map points (this rank's memory or a peer's).
//
// Tile 128 x 256 x 64: two consumer warpgroups of 64 x 256 (m64n256k16 wgmma), one loader warpgroup, a
// 4-stage TMA pipeline with 128-byte swizzle (48 KiB per stage), 2 x 8 KiB epilogue buffers per consumer
// warpgroup, persistent grid over a grouped tile order. With kCluster = 2, the two CTAs of a cluster take
// vertically adjacent tiles and multicast halves of their common B tile to each other. A 128 x 128 tile
// (m64n128k16, 6 stages of 32 KiB) serves problems whose 128 x 256 tiles would leave SMs idle
// (src/ops/gemm.cu picks by the count of tiles per wave).
//
// Fused ops reuse it by wrapping it: the same roles with a wait_inputs() hook (AG + GEMM), a C map per
// destination rank (GEMM + RS), communicator blocks (lcsc/kernel.cuh).
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>

#include "weft/lcsc/epilogue.cuh"
#include "weft/lcsc/kernel.cuh"
#include "weft/lcsc/mainloop.cuh"
#include "weft/lcsc/scheduler.cuh"

namespace weft::ops {

template <int kTileN>
struct GemmTile {
  static_assert(kTileN == 128 || kTileN == 256, "tiles of 128 x 128 or 128 x 256");
  static constexpr int kBM = 128, kBN = kTileN, kBK = 64, kStages = kTileN == 256 ? 4 : 6;
};

template <class OutT, bool kBKMajor, int kCluster, int kTileN = 256>
struct GemmOp {
  using Tile = GemmTile<kTileN>;
  static constexpr int kBM = Tile::kBM, kBN = Tile::kBN, kBK = Tile::kBK, kStages = Tile::kStages;
  static constexpr int kConsumerWarpgroups = kBM / 64;
  static constexpr int kClusterSize = kCluster;
  // 384 threads start with 168 registers each; the loader gives 128 x 128 back, the consumers take them.
  static constexpr int kLoaderRegs = 40, kConsumerRegs = 232;

  using Scheduler = lcsc::GemmTileScheduler;  // output tiles (lcsc::Tile) in grouped order
  using Mainloop = lcsc::WgmmaMainloop<kBM, kBN, kBK, kStages, kBKMajor, kCluster>;
  using Epilogue = lcsc::TmaStoreEpilogue<OutT, kBN, kConsumerWarpgroups>;
  using Pipeline = typename Mainloop::Pipeline;
  using Accum = typename Mainloop::Accum;
  using StoreState = typename Epilogue::State;

  struct Params {
    lcsc::SchedulerParams sched;
    CUtensorMap a;  // [M,K] bf16, box kABoxRows x kABoxCols
    CUtensorMap b;  // [N,K] or [K,N] bf16, box kBBoxRows x kBBoxCols
    CUtensorMap c;  // [M,N] OutT, box 64 x Epilogue::kChunkCols
    int k_blocks;   // ceil(K / kBK); the tail block is zero-filled by TMA
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
                                 const lcsc::Tile&, int wg, Accum& acc) {
    Mainloop::mma(s.main, pipe, st, p.k_blocks, wg, acc);
  }
  __device__ static void store(const Params& p, Smem& s, const lcsc::Tile& t, int wg, const Accum& acc,
                               StoreState& es) {
    Epilogue::store(&p.c, p.store_mode, s.epi, es, wg, acc, t.m * kBM + 64 * wg, t.n * kBN);
  }
  __device__ static void finish(const Params&, Smem&, int, StoreState& es) { Epilogue::finish(es); }
};

// Grouped GEMM (an MoE layer's experts): rows of A come in groups laid out back to back, group e being
// rows [group_end[e - 1], group_end[e]) (device int32, each end a multiple of kBM), and C's rows of group e
// = A's rows of group e times B_e, B stacked [E, N, K] (kBKMajor) or [E, K, N]. The tiles are the GEMM's
// over the rows' capacity; a tile past the last group's end is skipped by the loader and the consumers
// alike (both read the same end), a tile's group found by the loader thread's scan of group_end. A
// K-tail block reads the next expert's first rows of B, which meet A's zero-filled columns: zeros.
template <class OutT, bool kBKMajor, int kTileN = 256>
struct GroupedGemmOp : GemmOp<OutT, kBKMajor, 1, kTileN> {
  using Base = GemmOp<OutT, kBKMajor, 1, kTileN>;
  using Base::kBM, Base::kBN;
  using typename Base::Accum, typename Base::Mainloop, typename Base::Epilogue, typename Base::Pipeline,
      typename Base::Smem, typename Base::StoreState;

  struct Params : Base::Params {
    const int32_t* group_end;  // [groups], device
    int groups;
    int b_rows;  // rows of one expert's B: N (kBKMajor) or K
  };

  __device__ static bool skipped(const Params& p, int m0) { return m0 >= __ldg(p.group_end + p.groups - 1); }
  __device__ static void load(const Params& p, Smem& s, Pipeline& pipe, lcsc::PipeState& st,
                              const lcsc::Tile& t) {
    const int m0 = t.m * kBM;
    int e = 0;
    while (e < p.groups && __ldg(p.group_end + e) <= m0) ++e;
    if (e == p.groups) return;
    if (__ldg(p.group_end + e) % kBM != 0) __trap();  // group ends must be whole tiles (see the header)
    Mainloop::load(s.main, pipe, st, &p.a, &p.b, m0, t.n * kBN, p.k_blocks, e * p.b_rows);
  }
  __device__ static void compute(const Params& p, Smem& s, Pipeline& pipe, lcsc::PipeState& st,
                                 const lcsc::Tile& t, int wg, Accum& acc) {
    if (!skipped(p, t.m * kBM)) Mainloop::mma(s.main, pipe, st, p.k_blocks, wg, acc);
  }
  __device__ static void store(const Params& p, Smem& s, const lcsc::Tile& t, int wg, const Accum& acc,
                               StoreState& es) {
    if (!skipped(p, t.m * kBM)) Base::store(p, s, t, wg, acc, es);
  }
};

// A grouped GEMM whose epilogue applies SwiGLU (an MoE expert's first projection): B's columns come in
// blocks of 256, the first 128 of a block the gate and the last 128 the up projection of output columns
// [128 b, 128 b + 128); C [rows, N / 2] = silu(A.B_gate) * (A.B_up), from the fp32 accumulators. In a
// consumer warpgroup's 64 x 256 accumulator a thread holds column c and column c + 128 in registers i and
// i + 64, so the activation needs no data movement, and half the tile goes out.
template <class OutT, bool kBKMajor>
struct GroupedGemmSwigluOp : GroupedGemmOp<OutT, kBKMajor, 256> {
  using Base = GroupedGemmOp<OutT, kBKMajor, 256>;
  using Base::kBM, Base::kBN, Base::kConsumerWarpgroups;
  using typename Base::Accum, typename Base::Params, typename Base::Smem, typename Base::StoreState;
  using Epilogue = lcsc::TmaStoreEpilogue<OutT, kBN / 2, kConsumerWarpgroups>;

  __device__ static void store(const Params& p, Smem& s, const lcsc::Tile& t, int wg, const Accum& acc,
                               StoreState& es) {
    if (Base::skipped(p, t.m * kBM)) return;
    tile::AccumM64<kBN / 2> out;
#pragma unroll
    for (int i = 0; i < tile::AccumM64<kBN / 2>::kRegs; ++i) {
      const float gate = acc.d[i], up = acc.d[i + tile::AccumM64<kBN / 2>::kRegs];
      // The consumers store while no wgmma of theirs runs: IEEE division here cost ~9% of the GEMM.
      // __fdividef gives 0 for a denominator past 2^126 (silu's limit for a very negative gate).
      out.d[i] = __fdividef(gate, 1.f + __expf(-gate)) * up;
    }
    Epilogue::store(&p.c, lcsc::StoreMode::kStore, s.epi, es, wg, out, t.m * kBM + 64 * wg, t.n * (kBN / 2));
  }
};

}  // namespace weft::ops
