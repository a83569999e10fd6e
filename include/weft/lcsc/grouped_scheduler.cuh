// The grouped GEMM's tile scheduler: a scheduler of the LCSC template (lcsc/kernel.cuh) for a GEMM whose rows
// come in groups (an MoE layer's experts), group e being rows [group_end[e - 1], group_end[e]) (device int32,
// ascending, whole tiles of kTileRows rows), each group multiplied by its own B.
//
// Without group_rows it is GemmTileScheduler over every tile row of the rows' capacity, in the same order,
// and names no group: the op finds a tile's group, and skips the tiles past the last group's end.
//
// With group_rows (device int32 [groups]) only the first group_rows[e] rows of group e count, and only the
// tile rows holding any of them are walked: group e's first ceil(group_rows[e] / kTileRows) tile rows,
// within its span and the capacity (its live rows). The live rows are numbered group after group, walked in
// GemmTileScheduler's grouped order over that numbering, and each placed at its tile row of the capacity,
// with its group. The blocks thus share the live tiles evenly wherever they lie. Walking the capacity
// instead, fixed-capacity groups (a low-latency dispatch's) put the live rows a fixed stride of tile rows
// apart, and block c of C takes units c, c + C, ...: where C is a multiple of the stride, only the blocks
// c = 0 mod stride meet a live tile (groups of 4 tile rows, one of them live, 132 blocks: 33 blocks run every
// tile).
//
// Each block counts the live rows once, at the kernel's start (prepare, every thread), into a table in shared
// memory (Storage): the live rows before each of kChunks chunks of consecutive groups, a group a chunk up to
// kChunks groups, else 2, 4, ... A live row is placed by a binary search over the table for its chunk, then
// a walk over the chunk's groups (one group up to kChunks groups; 64 at a low-latency dispatch's limit of
// 8192). The loader and the consumers read the same table and the same group arrays, so they walk the same
// tiles.
#pragma once
#include <cstdint>

#include "weft/device/search.cuh"
#include "weft/lcsc/scheduler.cuh"

namespace weft::lcsc {

struct GroupedSchedulerParams : SchedulerParams {  // GroupedTileScheduler::Params
  const int32_t* group_end = nullptr;   // [groups], device: each group's end row (ascending, whole tiles)
  const int32_t* group_rows = nullptr;  // [groups], device: the rows of each group that count; null: all
  int groups = 0;

#ifdef __CUDACC__
  // The group holding row `row`: the first whose end is past it (groups: past the last end). A binary
  // search, ceil(log2(groups + 1)) loads in a chain, where a walk from group 0 took one a group before it
  // (an MoE rank's 32-64 experts: a tile's consumers asked twice a tile).
  __device__ __forceinline__ int group_holding(int row) const {
    return first_greater(group_end, groups, row);
  }
  // Whether row `row` lies past the last group's end (its tile holds no group: skipped).
  __device__ __forceinline__ bool past_last_group(int row) const {
    return row >= __ldg(group_end + groups - 1);
  }
#endif
};

struct GroupTile : Tile {  // GroupedTileScheduler::Work
  int group = -1;          // the tile's group; -1: not named (no group_rows: the op finds it)
};

// kCounts false: group_rows is not taken (ignored) and the walk of live tiles is left out of the code: for
// ops that refuse group_rows (their loaders have no registers to spare for it), and for grouped GEMM calls
// without group_rows (the walk in the consumers' tile step costs their k-block loop).
template <int kTileRows, bool kCounts = true>
class GroupedTileScheduler {
 public:
  using Params = GroupedSchedulerParams;
  using Work = GroupTile;
  static constexpr int kMaxClusterSize = 1;  // a live row's neighbour need not be live: no cluster pairs
  static constexpr int kChunks = 128;        // 520 bytes: the grouped GEMM then takes all of Hopper's 227 KiB
  static_assert(kChunks % 32 == 0, "the table is scanned by one warp, kChunks / 32 entries a lane");
  struct Storage {
    int live_before[kChunks + 1];  // live rows in the chunks before chunk c; [kChunks]: all of them
    int chunk_log2;                // groups per chunk: 1 << chunk_log2
  };

  __host__ __device__ static int compute_blocks(const Params& p) { return p.compute_blocks; }

  // Fills the table (with group_rows; untouched without). On the device every thread of the block calls it
  // (it syncs the block inside) and the caller syncs the block after; on the host, one call.
  __host__ __device__ static void prepare(const Params& p, Storage& s) {
    if (!kCounts || p.group_rows == nullptr) return;
    int log2 = 0;
    while (((p.groups - 1) >> log2) >= kChunks) ++log2;
#ifdef __CUDA_ARCH__
    for (int c = static_cast<int>(threadIdx.x); c < kChunks; c += static_cast<int>(blockDim.x))
      s.live_before[c + 1] = chunk_live_rows(p, c, log2);
    __syncthreads();
    if (threadIdx.x < 32) {  // exclusive scan of the lanes' sums, then each lane's kPerLane entries
      constexpr int kPerLane = kChunks / 32;
      const int lane = static_cast<int>(threadIdx.x);
      int* mine = s.live_before + 1 + lane * kPerLane;
      int sum = 0;
      for (int i = 0; i < kPerLane; ++i) sum += mine[i];
      int before = sum;
      for (int d = 1; d < 32; d *= 2) {
        const int x = __shfl_up_sync(0xffffffffu, before, d);
        if (lane >= d) before += x;
      }
      before -= sum;
      for (int i = 0; i < kPerLane; ++i) {
        before += mine[i];
        mine[i] = before;
      }
      if (lane == 0) {
        s.live_before[0] = 0;
        s.chunk_log2 = log2;
      }
    }
#else
    s.live_before[0] = 0;
    for (int c = 0; c < kChunks; ++c) s.live_before[c + 1] = s.live_before[c] + chunk_live_rows(p, c, log2);
    s.chunk_log2 = log2;
#endif
  }

  // On the device, after prepare and the block's sync.
  __host__ __device__ GroupedTileScheduler(const Params& p, const Storage& s, int cluster_index,
                                           int cluster_rank)
      : p_(p),
        live_(kCounts && p.group_rows != nullptr ? &s : nullptr),
        order_(walked(p, s), cluster_index, cluster_rank) {}

  // The next tile of this block, or false when it has none left.
  __host__ __device__ __forceinline__ bool next(GroupTile& t) {
    if (!order_.next(t)) return false;
    place(t);
    return true;
  }
  __host__ __device__ int units() const {
    return order_.units();
  }
  // Position i of the unit sequence as this block's next tile (lcsc::ClaimedTiles; every unit has one).
  __host__ __device__ __forceinline__ bool at(int i, GroupTile& t) {
    order_.at(i, t);
    place(t);
    return true;
  }

 private:
  __host__ __device__ __forceinline__ static int32_t read(const int32_t* p) {
#ifdef __CUDA_ARCH__
    return __ldg(p);
#else
    return *p;
#endif
  }
  // Group e's live rows, and its first tile row. Not negative, whatever the counts and ends.
  __host__ __device__ __forceinline__ static int live_rows(const Params& p, int e, int& first) {
    const int begin = e > 0 ? read(p.group_end + e - 1) : 0, end = read(p.group_end + e);
    const int rows = read(p.group_rows + e);
    first = begin / kTileRows;
    const int span = (end / kTileRows < p.tiles_m ? end / kTileRows : p.tiles_m) - first;
    const int counted = rows / kTileRows + (rows % kTileRows > 0 ? 1 : 0);
    const int live = counted < span ? counted : span;
    return live > 0 ? live : 0;
  }
  // The live rows of chunk c's groups. Checks the groups' ends: the tiles are whole tile rows of one group.
  __host__ __device__ static int chunk_live_rows(const Params& p, int c, int log2) {
    const int from = c << log2, left = p.groups - from, count = left < (1 << log2) ? left : (1 << log2);
    int live = 0;
    for (int e = from; e < from + count; ++e) {
#ifdef __CUDA_ARCH__
      if (read(p.group_end + e) % kTileRows != 0) __trap();  // group ends must be whole tiles
#endif
      int first;
      live += live_rows(p, e, first);
    }
    return live;
  }
  // GemmTileScheduler's params over the walked tile rows: the live rows, or every row of the capacity.
  // Without kCounts the kernel's own (a copy would keep the order's params in registers the loader does not
  // have).
  __host__ __device__ static decltype(auto) walked(const Params& p, const Storage& s) {
    if constexpr (kCounts) {
      SchedulerParams w = p;
      if (p.group_rows != nullptr) w.tiles_m = s.live_before[kChunks];
      return w;
    } else {
      return static_cast<const SchedulerParams&>(p);
    }
  }
  // t.m from the order: with group_rows a live row, placed at its tile row of the capacity, with its group.
  __host__ __device__ __forceinline__ void place(GroupTile& t) const {
    t.group = -1;
    if constexpr (kCounts) {
      if (live_ == nullptr) return;
      const int r = t.m;
      // The last chunk whose live rows start at or before r (a chunk without any shares its start).
      int c = 0;
      for (int step = kChunks / 2; step > 0; step /= 2)
        if (live_->live_before[c + step] <= r) c += step;
      int e = c << live_->chunk_log2, before = live_->live_before[c], first;
      for (int live = live_rows(p_, e, first); r - before >= live; live = live_rows(p_, ++e, first))
        before += live;
      t.m = first + (r - before);
      t.group = e;
    }
  }

  Params p_;
  const Storage* live_;  // null: no group_rows, every tile row walked
  GemmTileScheduler order_;
};

}  // namespace weft::lcsc
