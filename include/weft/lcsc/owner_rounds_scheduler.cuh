// The tile order of the fused GEMM + reduce-scatter whose partials are summed in the owner's epilogue
// (ops/fused.cuh, EpilogueSummedC): a scheduler of the LCSC template (lcsc/kernel.cuh says what a scheduler
// is) over a GEMM's output tiles, whose tile rows fall into `world` equal shards, shard o owned by rank o.
//
// Every rank computes every tile; the owner of a tile must compute it after every other rank has stored its
// partial of it, since the owner's epilogue adds those partials. Each owner's shard is walked in one order,
// tile k = 0..T-1 of it (T = shard_tiles_m x tiles_n; grouped as GemmTileScheduler groups, `group_m` tile
// rows a band, inside the shard), in rounds: in round t, rank r's slots j = 0..W-2 take owner (r + j + 1)
// mod W's tile t (a permutation a slot over the ranks, so every owner receives one partial a slot and the
// links stay balanced), and its last slot its OWN tile t - L: its own tiles come L (`delay`) rounds late,
// so that a wave or two of the peers' blocks have stored their partials by then. With L' = min(L, T), the
// positions of the sequence are
//   [0, A), A = L' (W - 1)           rounds 0..L'-1: the peers' tiles only (i = t (W - 1) + j)
//   [A, A + B), B = (T - L') W       rounds L'..T-1: W slots, the last the own tile t - L'
//   [A + B, W T)                     the own tiles T - L'..T - 1
// so each rank takes each of the W T tiles once, and an owner's own tile k comes after every peer's
// position of it. Persistent: compute block c takes positions c, c + C, c + 2C, ... (C compute blocks).
#pragma once
#include <cstdint>

#include "weft/lcsc/scheduler.cuh"

namespace weft::lcsc {

struct OwnerRoundsParams
    : SchedulerParams {   // OwnerRoundsScheduler::Params (tiles_m = world x shard_tiles_m)
  int world = 1;          // owners
  int rank = 0;           // this rank: its own shard's tiles come `delay` rounds late
  int shard_tiles_m = 0;  // tile rows of an owner's shard
  int delay = 0;          // L, in rounds
  __host__ __device__ int shard_tiles() const { return shard_tiles_m * tiles_n; }
};

struct OwnerTile : Tile {  // OwnerRoundsScheduler::Work
  int owner = 0;           // the rank whose rows these are (tile row m / shard_tiles_m)
};

class OwnerRoundsScheduler {
 public:
  using Params = OwnerRoundsParams;
  using Work = OwnerTile;
  static constexpr int kMaxClusterSize = 1;
  __host__ __device__ static int compute_blocks(const Params& p) { return p.compute_blocks; }

  __host__ __device__ OwnerRoundsScheduler(const Params& p, int cluster_index, int)
      : p_(p), next_(cluster_index) {}

  __host__ __device__ __forceinline__ bool next(OwnerTile& t) {
    if (next_ >= units()) return false;
    at(next_, t);
    next_ += p_.compute_blocks;
    return true;
  }
  __host__ __device__ int units() const { return p_.world * p_.shard_tiles(); }

  // Position i of this rank's sequence: the owner and the index k of the tile in that owner's shard order.
  __host__ __device__ static void place(const Params& p, int i, int& owner, int& k) {
    const int W = p.world, T = p.shard_tiles(), L = p.delay < T ? p.delay : T;
    const int A = L * (W - 1), B = (T - L) * W;
    int j;  // the slot in the round; W - 1: the own tile
    if (i < A) {
      k = i / (W - 1);
      j = i - k * (W - 1);
    } else if (i < A + B) {
      const int t = L + (i - A) / W;
      j = i - A - (t - L) * W;
      k = j < W - 1 ? t : t - L;
    } else {
      k = T - L + (i - A - B);
      j = W - 1;
    }
    owner = p.rank + (j < W - 1 ? j + 1 : 0);
    if (owner >= W) owner -= W;
  }
  // Tile k of an owner's shard (grouped order inside the shard) as tile row (in the shard) and column.
  __host__ __device__ static void in_shard(const Params& p, int k, int& row, int& col) {
    const int rows = p.shard_tiles_m, group = p.group_m < 1 ? 1 : p.group_m;
    const int per_group = group * p.tiles_n, band = k / per_group, first = band * group;
    const int in_band = rows - first < group ? rows - first : group;
    const int r = k - band * per_group;
    row = first + r % in_band;
    col = r / in_band;
  }
  __host__ __device__ __forceinline__ bool at(int i, OwnerTile& t) {
    int owner, k, row, col;
    place(p_, i, owner, k);
    in_shard(p_, k, row, col);
    t.m = owner * p_.shard_tiles_m + row;
    t.n = col;
    t.owner = owner;
    t.unit = i;
    t.iteration = iteration_++;
    return true;
  }

 private:
  Params p_;
  int next_, iteration_ = 0;
};

}  // namespace weft::lcsc
