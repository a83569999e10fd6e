// The storer role of the LCSC template: a consumer warpgroup's 64 x kBN fp32 accumulator goes to global
// memory through shared memory and TMA, chunk by chunk (64 bf16 or 32 f32 columns = 128-byte rows, 8 KiB).
// The destination is whatever the tensor map points at: this rank's C, a peer's C (symmetric heap), with a
// plain store or an element-wise reduce-add (cp.reduce.async.bulk.tensor .add).
//
// Each warpgroup rings its chunks through kBuffers buffers (2 by default): it converts chunk i into buffer
// i % kBuffers while the TMA engine reads the chunks before it from the others. Thread 0 of the warpgroup
// issues the stores; before the barrier of chunk i it waits until the store of chunk i - kBuffers + 1 has
// read its buffer, so once past that barrier the warpgroup may overwrite that buffer with chunk i + 1. The
// chunk count runs on across tiles, so the invariant holds from one tile to the next (for a kBuffers that is
// not a power of two, up to 2^32 chunks a warpgroup and launch). With more buffers than a tile's chunks, a
// tile's chunks leave without waiting on each other: a store into a peer's memory reads its buffer only as
// fast as the link takes it (the fused reduce-scatter's storers, ops/fused.cuh).
#pragma once
#include <cuda.h>

#include <cstdint>
#include <utility>

#include "weft/device/bulk_copy.cuh"
#include "weft/tile/fragment.cuh"
#include "weft/tile/tma.cuh"
#include "weft/tile/warp_roles.cuh"

namespace weft::lcsc {

enum class StoreMode : int {
  kStore = 0,      // C = A.B
  kReduceAdd = 1,  // C += A.B (element-wise reduction in C's type; concurrent adders welcome)
};

// Named barrier ids used by this epilogue: kEpilogueFirstBarrierId + consumer warpgroup index.
inline constexpr int kEpilogueFirstBarrierId = 1;

// Where a warpgroup's 64 rows go: issue(col, chunk) stores (or reduce-adds) a 64-row chunk whose first
// column is `col`, by TMA. A 2-D tensor at row `row0`:
struct TmaRows2d {
  const CUtensorMap* map;
  StoreMode mode;
  int row0;
  __device__ __forceinline__ void issue(int col, const void* chunk) const {
    if (mode == StoreMode::kStore)
      tma::store_2d(map, col, row0, chunk);
    else
      tma::reduce_add_2d(map, col, row0, chunk);
  }
};
// A 4-D tensor (dims: columns, c1, rows, c3), rows from `row0`: e.g. one head of a [batch, seq, heads,
// dim] tensor, whose map clips at each sequence's end (no row of the next batch is written).
struct TmaRows4d {
  const CUtensorMap* map;
  int c1, row0, c3;
  StoreMode mode = StoreMode::kStore;
  __device__ __forceinline__ void issue(int col, const void* chunk) const {
    if (mode == StoreMode::kStore)
      tma::store_4d(map, col, c1, row0, c3, chunk);
    else
      tma::reduce_add_4d(map, col, c1, row0, c3, chunk);
  }
};

// The same rows, stored into each of `count` 2-D tensors (maps[0], maps[1], ...) at row `row0`: e.g. a final
// tile of the fused all-reduce into every rank's copy of the output, one chunk in shared memory for all.
struct TmaRowsToEach {
  const CUtensorMap* maps;
  int count, row0;
  __device__ __forceinline__ void issue(int col, const void* chunk) const {
    for (int i = 0; i < count; ++i) tma::store_2d(maps + i, col, row0, chunk);
  }
};

// The epilogue's shared buffers and per-warpgroup state depend on the output type and the consumer count
// only, not on the tile's width: an op may store tiles of more than one width through them (e.g. a GEMM
// whose epilogue halves its tile, weft/ops/gemm.cuh GroupedGemmSwigluOp).
template <class OutT, int kConsumers, int kBuffers = 2>
struct EpilogueBuffers {
  tile::OutChunk<OutT> buf[kConsumers][kBuffers];
};
struct EpilogueState {
  uint32_t chunks = 0;  // chunks this warpgroup has stored so far (selects the buffer)
};

template <class OutT, int kBN, int kConsumers, int kBuffers = 2>
struct TmaStoreEpilogue {
  static_assert(kBuffers >= 2, "a chunk converts while the one before it is read");
  using Chunk = tile::OutChunk<OutT>;
  static constexpr int kChunkCols = Chunk::kCols;
  static constexpr int kChunks = kBN / kChunkCols;
  static constexpr int kBoxRows = 64, kBoxCols = kChunkCols;  // the C tensor map's box
  static_assert(kBN % kChunkCols == 0, "whole chunks");

  using Smem = EpilogueBuffers<OutT, kConsumers, kBuffers>;
  using State = EpilogueState;

  // Stores acc (the warpgroup's 64 rows) at element (row0, col0) of the map's tensor.
  template <int N>
  __device__ static void store(const CUtensorMap* map, StoreMode mode, Smem& s, State& es, int wg,
                               const tile::AccumM64<N>& acc, int row0, int col0) {
    store_to(TmaRows2d{map, mode, row0}, s, es, wg, acc, col0);
  }
  // Stores acc's columns from `col0` on wherever `dest` (TmaRows2d, TmaRows4d) puts the rows.
  template <class Dest, int N>
  __device__ static void store_to(const Dest& dest, Smem& s, State& es, int wg, const tile::AccumM64<N>& acc,
                                  int col0) {
    static_assert(N == kBN, "accumulator width");
    store_chunks(dest, s, es, wg, acc, col0, std::make_integer_sequence<int, kChunks>{});
  }

  // After the warpgroup's last tile: every store has completed (its writes are done, not just its reads).
  __device__ static void finish(State&) {
    if (tile::thread_in_warpgroup() == 0) bulk_wait<0>();
  }

 private:
  template <class Dest, int... kI>
  __device__ __forceinline__ static void store_chunks(const Dest& dest, Smem& s, State& es, int wg,
                                                      const tile::AccumM64<kBN>& acc, int col0,
                                                      std::integer_sequence<int, kI...>) {
    (store_chunk<kI>(dest, s, es, wg, acc, col0), ...);
  }

  template <int kI, class Dest>
  __device__ __forceinline__ static void store_chunk(const Dest& dest, Smem& s, State& es, int wg,
                                                     const tile::AccumM64<kBN>& acc, int col0) {
    const bool leader = tile::thread_in_warpgroup() == 0;
    Chunk& buf = s.buf[wg][es.chunks % kBuffers];
    tile::store_accum_chunk<kI, OutT>(acc, buf);
    fence_proxy_async_smem();
    if (leader) bulk_wait_read<kBuffers - 2>();  // the buffer chunk i + 1 takes has been read
    tile::named_barrier_sync(kEpilogueFirstBarrierId + wg, tile::kWarpgroupThreads);
    if (leader) {
      dest.issue(col0 + kI * kChunkCols, buf.bytes);
      bulk_commit();
    }
    ++es.chunks;
  }
};

}  // namespace weft::lcsc
