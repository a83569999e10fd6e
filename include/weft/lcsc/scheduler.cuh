// The GEMM tile scheduler: a scheduler of the LCSC template (lcsc/kernel.cuh says what a scheduler is) for
// ops whose work items are output tiles of a GEMM.
//
// Output tiles are grouped for L2 reuse: the tile grid is cut into bands of `group_m` tile rows, and a band
// is walked column by column (down the rows of the band first), so the blocks running at the same time share
// a few A row-blocks and a few B column-blocks. With clusters of kCluster CTAs along M, the unit of work is a
// cluster tile (kCluster tiles stacked along M that share their B tile); CTA rank r of the cluster takes tile
// row kCluster * unit_row + r.
//
// Persistent: compute block-cluster c takes units c, c + C, c + 2C, ... (C compute clusters). Hooks for
// fused ops: `start_unit` rotates the sequence (a per-rank offset, so ranks start on different tiles, e.g.
// their local rows first), and the op's wait_inputs() runs in the loader before each tile's loads.
// `parts_log2` > 0 cuts the unit rows into 2^parts_log2 equal parts (it must divide them) and walks the
// rows of part 0, 1, 2, .. in turn, so every band, and so the tiles in flight, spans all parts: the fused
// reduce-scatter, whose parts are the owners' rows, then sends to every owner at once. (Powers of two
// only: shifts, where a division would cost the consumers registers they do not have.)
#pragma once
#include <cstdint>
#include "weft/timeline.hpp"

namespace weft::lcsc {

struct SchedulerParams {   // GemmTileScheduler::Params
  int tiles_m = 0;         // CTA tiles along M
  int tiles_n = 0;         // CTA tiles along N
  int cluster_m = 1;       // CTAs per cluster, stacked along M (must match the op's kClusterSize)
  int group_m = 16;        // tile rows per band of the grouped order (rounded to whole clusters)
  int start_unit = 0;      // rotation of the unit sequence (any integer; taken modulo the unit count)
  int parts_log2 = 0;      // unit rows dealt round-robin over 2^parts_log2 equal parts of M (see above)
  int compute_blocks = 0;  // blocks [0, compute_blocks) compute; the rest of the grid communicates
  // Non-null: the blocks claim units in sequence order from this counter (zeroed before the kernel) instead
  // of taking every C-th one (lcsc/kernel.cuh, ClaimedTiles): for ops whose tiles wait for their inputs, so a
  // block that waited does not fall behind the others for the rest of the kernel.
  int* claims = nullptr;
  // Non-null: the kernel records its blocks' phases there (weft/timeline.hpp, lcsc/kernel.cuh).
  TimelineBuffer* timeline = nullptr;
  __host__ __device__ int units_m() const { return (tiles_m + cluster_m - 1) / cluster_m; }
  __host__ __device__ int units() const { return units_m() * tiles_n; }
};

struct Tile {         // GemmTileScheduler::Work
  int m = 0, n = 0;   // tile coordinates (multiply by the tile shape for element offsets)
  int unit = 0;       // position in the grouped order (after rotation)
  int iteration = 0;  // how many tiles this block took before this one
};

// Communicator tasks [0, n) dealt round-robin: block `index` of `count` takes index, index + count, ...
class StridedTasks {
 public:
  using Task = int;
  __host__ __device__ StridedTasks(int n, int index, int count) : next_(index), end_(n), step_(count) {}
  __host__ __device__ bool next(Task& t) {
    if (next_ >= end_) return false;
    t = next_;
    next_ += step_;
    return true;
  }

 private:
  int next_, end_, step_;
};

class GemmTileScheduler {
 public:
  using Params = SchedulerParams;
  using Work = Tile;
  // Blocks [0, compute_blocks) of the grid compute; the rest communicate.
  __host__ __device__ static int compute_blocks(const Params& p) { return p.compute_blocks; }

  __host__ __device__ GemmTileScheduler(const SchedulerParams& p, int cluster_index, int cluster_rank)
      : p_(p),
        next_(cluster_index),
        stride_(p.compute_blocks / p.cluster_m),
        rank_(cluster_rank),
        units_(p.units()) {
    const int g = p.group_m / p.cluster_m;
    group_ = g < 1 ? 1 : g;
    int s = units_ > 0 ? p.start_unit % units_ : 0;
    start_ = s < 0 ? s + units_ : s;
  }

  // The next tile of this block, or false when it has none left.
  __host__ __device__ __forceinline__ bool next(Tile& t) {
    if (next_ >= units_) return false;
    at(next_, t);
    next_ += stride_;
    return true;
  }

  __host__ __device__ int units() const { return units_; }
  // Position i of the unit sequence (before rotation) as this block's next tile (every unit has one).
  __host__ __device__ __forceinline__ bool at(int i, Tile& t) {
    int u = i + start_;
    if (u >= units_) u -= units_;
    const int rows = p_.units_m();
    const int per_group = group_ * p_.tiles_n;
    const int band = u / per_group;
    const int first = band * group_;
    const int in_band = rows - first < group_ ? rows - first : group_;
    const int r = u - band * per_group;
    int row = first + r % in_band;
    const int k = p_.parts_log2;
    row = ((row & ((1 << k) - 1)) * (rows >> k)) + (row >> k);
    t.m = row * p_.cluster_m + rank_;
    t.n = r / in_band;
    t.unit = u;
    t.iteration = iteration_++;
    return true;
  }

 private:
  SchedulerParams p_;
  int next_, stride_, rank_, units_, group_ = 1, start_ = 0, iteration_ = 0;
};

}  // namespace weft::lcsc
