// The GEMM of weft, written as an LCSC op: C = A.B with A row-major [M,K] bf16, B either an [N,K] weight
// (nn.Linear layout) or row-major [K,N] bf16, fp32 accumulation, C row-major [M,N] in bf16 or f32, stored,
// or reduce-added, wherever C's tensor map points (this rank's memory or a peer's).
//
// Tile 128 x 256 x 64: two consumer warpgroups of 64 x 256 (m64n256k16 wgmma), one loader warpgroup, a
// 4-stage TMA pipeline with 128-byte swizzle (48 KiB per stage), 2 x 8 KiB epilogue buffers per consumer
// warpgroup (the fused reduce-scatter's storers: 3 stages and 5 buffers, ops/fused.cuh), persistent grid over
// a grouped tile order. With kCluster = 2, the two CTAs of a cluster take vertically adjacent tiles and
// multicast halves of their common B tile to each other. A 128 x 128 tile (m64n128k16, 6 stages of 32 KiB)
// serves problems whose 128 x 256 tiles would leave SMs idle (src/ops/gemm.cu picks by the count of tiles per
// wave).
//
// Fused ops reuse it by wrapping it: the same roles with a wait_inputs() hook (AG + GEMM), a C map per
// destination rank (GEMM + RS), communicator blocks (lcsc/kernel.cuh).
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>

#include <utility>

#include "weft/lcsc/epilogue.cuh"
#include "weft/lcsc/grouped_scheduler.cuh"
#include "weft/lcsc/kernel.cuh"
#include "weft/lcsc/mainloop.cuh"
#include "weft/lcsc/scheduler.cuh"
#include "weft/team_view.hpp"

namespace weft::ops {

// kStageCount 0: as many pipeline stages as shared memory holds; an op that needs some of it for other
// buffers asks for fewer.
template <int kTileN, int kStageCount = 0>
struct GemmTile {
  static_assert(kTileN == 128 || kTileN == 256, "tiles of 128 x 128 or 128 x 256");
  static constexpr int kBM = 128, kBN = kTileN, kBK = 64,
                       kStages = kStageCount > 0 ? kStageCount
                                 : kTileN == 256 ? 4
                                                 : 6;
};

// kEpilogueBuffers: the storer's ring of output chunks a consumer warpgroup (lcsc/epilogue.cuh).
// TileScheduler: which output tiles, in which order (a grouped GEMM's: lcsc::GroupedTileScheduler).
template <class OutT, bool kBKMajor, int kCluster, int kTileN = 256, int kStageCount = 0,
          int kEpilogueBuffers = 2, class TileScheduler = lcsc::GemmTileScheduler>
struct GemmOp {
  using Tile = GemmTile<kTileN, kStageCount>;
  static constexpr int kBM = Tile::kBM, kBN = Tile::kBN, kBK = Tile::kBK, kStages = Tile::kStages;
  static constexpr int kConsumerWarpgroups = kBM / 64;
  static constexpr int kClusterSize = kCluster;
  // 384 threads start with 168 registers each; the loader gives 128 x 128 back, the consumers take them.
  static constexpr int kLoaderRegs = 40, kConsumerRegs = 232;

  using Scheduler = TileScheduler;  // output tiles in grouped order (its Work: lcsc::Tile or a subtype)
  using Mainloop = lcsc::WgmmaMainloop<kBM, kBN, kBK, kStages, kBKMajor, kCluster>;
  using Epilogue = lcsc::TmaStoreEpilogue<OutT, kBN, kConsumerWarpgroups, kEpilogueBuffers>;
  using Pipeline = typename Mainloop::Pipeline;
  using Accum = typename Mainloop::Accum;
  using StoreState = typename Epilogue::State;

  struct Params {
    typename Scheduler::Params sched;
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
// rows [group_end[e - 1], group_end[e]) (device int32, each end a multiple of kBM; in p.sched, the
// scheduler's), and C's rows of group e = A's rows of group e times B_e, B stacked [E, N, K] (kBKMajor) or
// [E, K, N]. The tiles are the GEMM's over the rows' capacity; a tile past the last group's end is skipped by
// the loader and the consumers alike (both read the same end), a tile's group found by a search of group_end.
// With group_rows (device int32, optional), only the first group_rows[e] rows of group e count
// (fixed-capacity groups that fill partly, as a low-latency dispatch leaves them): the scheduler
// (lcsc/grouped_scheduler.cuh) then walks only the tiles holding counted rows, spread over all blocks, and
// names each one's group; a tile the count ends inside is computed whole (its rows past the count hold no
// result). kCountedGroups false: group_rows is not taken (the scattering and dispatching variants refuse it;
// calls without group_rows run it too) and the scheduler's walk of live tiles is left out of the kernel. A
// K-tail block reads the next expert's first rows of B, which meet A's zero-filled columns: zeros.
template <class OutT, bool kBKMajor, int kTileN = 256, int kStageCount = 0, bool kCountedGroups = true>
struct GroupedGemmOp
    : GemmOp<OutT, kBKMajor, 1, kTileN, kStageCount, 2, lcsc::GroupedTileScheduler<128, kCountedGroups>> {
  using Base =
      GemmOp<OutT, kBKMajor, 1, kTileN, kStageCount, 2, lcsc::GroupedTileScheduler<128, kCountedGroups>>;
  using Base::kBM, Base::kBN;
  static_assert(kBM == 128, "the scheduler's tiles are 128 rows");
  using typename Base::Accum, typename Base::Mainloop, typename Base::Epilogue, typename Base::Pipeline,
      typename Base::Scheduler, typename Base::StoreState;

  struct Params : Base::Params {
    int b_rows;  // rows of one expert's B: N (kBKMajor) or K
  };
  struct Smem : Base::Smem {
    typename Scheduler::Storage sched;  // the scheduler's table of live tile rows (lcsc/kernel.cuh)
  };

  // Whether tile t is skipped. With group_rows the scheduler walks live tiles only, each with its group;
  // without, every tile of the capacity, and those past the last group's end are skipped.
  __device__ static bool skipped(const Params& p, const lcsc::GroupTile& t) {
    return t.group < 0 && p.sched.past_last_group(t.m * kBM);
  }
  __device__ static void load(const Params& p, Smem& s, Pipeline& pipe, lcsc::PipeState& st,
                              const lcsc::GroupTile& t) {
    if (skipped(p, t)) return;
    const int m0 = t.m * kBM;
    const int e = t.group >= 0 ? t.group : p.sched.group_holding(m0);
    if (__ldg(p.sched.group_end + e) % kBM != 0) __trap();  // group ends must be whole tiles (see the header)
    Mainloop::load(s.main, pipe, st, &p.a, &p.b, m0, t.n * kBN, p.k_blocks, e * p.b_rows);
  }
  __device__ static void compute(const Params& p, Smem& s, Pipeline& pipe, lcsc::PipeState& st,
                                 const lcsc::GroupTile& t, int wg, Accum& acc) {
    if (!skipped(p, t)) Mainloop::mma(s.main, pipe, st, p.k_blocks, wg, acc);
  }
  __device__ static void store(const Params& p, Smem& s, const lcsc::GroupTile& t, int wg, const Accum& acc,
                               StoreState& es) {
    if (!skipped(p, t)) Base::store(p, s, t, wg, acc, es);
  }
};

// A grouped GEMM whose epilogue applies SwiGLU (an MoE expert's first projection): B's columns come in
// blocks of 256, the first 128 of a block the gate and the last 128 the up projection of output columns
// [128 b, 128 b + 128); C [rows, N / 2] = silu(A.B_gate) * (A.B_up), from the fp32 accumulators. In a
// consumer warpgroup's 64 x 256 accumulator a thread holds column c and column c + 128 in registers i and
// i + 64, so the activation needs no data movement, and half the tile goes out.
template <class OutT, bool kBKMajor, int kStageCount = 0, bool kCountedGroups = true>
struct GroupedGemmSwigluOp : GroupedGemmOp<OutT, kBKMajor, 256, kStageCount, kCountedGroups> {
  using Base = GroupedGemmOp<OutT, kBKMajor, 256, kStageCount, kCountedGroups>;
  using Base::kBM, Base::kBN, Base::kConsumerWarpgroups;
  using typename Base::Accum, typename Base::Params, typename Base::Smem, typename Base::StoreState;
  using Epilogue = lcsc::TmaStoreEpilogue<OutT, kBN / 2, kConsumerWarpgroups>;

  __device__ static void store(const Params& p, Smem& s, const lcsc::GroupTile& t, int wg, const Accum& acc,
                               StoreState& es) {
    if (Base::skipped(p, t)) return;
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

// Where a scattering epilogue sends C's rows (GroupedGemmScatterOp): row r to rank s's `dest` at row q,
// where source[r] = s * dest_rows + q, or nowhere for -1 (a padding row). dest: a symmetric [dest_rows, N]
// buffer of OutT (this rank's pointer; a peer's through the team's view).
struct ScatterRows {
  TeamView team;
  const int32_t* source;
  void* dest;
  int64_t dest_rows;
};

// A grouped GEMM whose epilogue sends each row of C to its own place on some rank (an MoE layer's second
// expert GEMM, each output row straight to the staging slot of the token it was dispatched from: the
// combine's data movement inside the GEMM). A warpgroup's chunk (64 rows x 64 columns) goes to shared
// memory as for a TMA store; then its 128 threads copy it out in 16-byte units, 8 threads per 128-byte row
// piece, each row to its destination (peer stores, generic proxy: the kernel's end and a meeting order them
// before the destination reads). Rows past the last group, and padding rows, are not sent. No group_rows: a
// partly filled tile's rows past the count would reach destinations.
template <bool kBKMajor>
struct GroupedGemmScatterOp : GroupedGemmOp<__nv_bfloat16, kBKMajor, 256, 0, false> {
  using Base = GroupedGemmOp<__nv_bfloat16, kBKMajor, 256, 0, false>;
  using Base::kBM, Base::kBN;
  using typename Base::Accum, typename Base::Smem, typename Base::StoreState;
  using Chunk = tile::OutChunk<__nv_bfloat16>;
  static constexpr int kChunkCols = Chunk::kCols;  // 64: one 128-byte row piece
  static constexpr int kUnitsPerThread = 64 * (kChunkCols * 2 / 16) / tile::kWarpgroupThreads;  // 4

  struct Params : Base::Params {
    ScatterRows scatter;
    int n;  // C's columns
  };

  __device__ static void store(const Params& p, Smem& s, const lcsc::GroupTile& t, int wg, const Accum& acc,
                               StoreState& es) {
    if (Base::skipped(p, t)) return;
    const int tid = tile::thread_in_warpgroup();
    // This thread's units: unit u = tid + 128 k is (row u / 8, 16-byte piece u % 8) of every chunk.
    char* dst[kUnitsPerThread];
#pragma unroll
    for (int k = 0; k < kUnitsPerThread; ++k) {
      const int u = tid + tile::kWarpgroupThreads * k, row = t.m * kBM + 64 * wg + u / 8;
      const int src = __ldg(p.scatter.source + row);
      dst[k] = nullptr;
      if (src >= 0) {
        const int owner = static_cast<int>(src / p.scatter.dest_rows);
        const int64_t q = src - int64_t(owner) * p.scatter.dest_rows;
        dst[k] = reinterpret_cast<char*>(p.scatter.team.peer_ptr(p.scatter.dest, owner)) + (q * p.n) * 2 +
                 (u % 8) * 16;
      }
    }
    store_chunks(p, s, t, wg, acc, es, dst, std::make_integer_sequence<int, kBN / kChunkCols>{});
  }

 private:
  template <int... kI>
  __device__ __forceinline__ static void store_chunks(const Params& p, Smem& s, const lcsc::Tile& t, int wg,
                                                      const Accum& acc, StoreState& es,
                                                      char* const (&dst)[kUnitsPerThread],
                                                      std::integer_sequence<int, kI...>) {
    (store_chunk<kI>(p, s, t, wg, acc, es, dst), ...);
  }
  template <int kI>
  __device__ __forceinline__ static void store_chunk(const Params& p, Smem& s, const lcsc::Tile& t, int wg,
                                                     const Accum& acc, StoreState& es,
                                                     char* const (&dst)[kUnitsPerThread]) {
    Chunk& buf = s.epi.buf[wg][es.chunks & 1u];
    tile::store_accum_chunk<kI, __nv_bfloat16>(acc, buf);
    // Every thread's writes of this chunk, and (program order) its reads of the chunk before the previous
    // one, which used this buffer, are done.
    tile::named_barrier_sync(lcsc::kEpilogueFirstBarrierId + wg, tile::kWarpgroupThreads);
    const int col = t.n * kBN + kI * kChunkCols;
    const int tid = tile::thread_in_warpgroup();
#pragma unroll
    for (int k = 0; k < kUnitsPerThread; ++k) {
      const int u = tid + tile::kWarpgroupThreads * k, row = u / 8, piece = u % 8;
      if (dst[k] != nullptr && col + piece * 8 < p.n) {
        const uint4 v = *reinterpret_cast<const uint4*>(buf.bytes + tile::sw128_offset(row, piece * 16));
        *reinterpret_cast<uint4*>(dst[k] + int64_t(col) * 2) = v;
      }
    }
    ++es.chunks;
  }
};

}  // namespace weft::ops
