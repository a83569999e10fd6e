// The attention scheduler: a scheduler of the LCSC template (lcsc/kernel.cuh) for ops whose work items are
// (batch, head, query block) triples, as flash attention's are.
//
// Items are ordered by query block, heads fastest: the heads of one (batch, query block) run side by side, so
// query heads sharing a K/V head (GQA) read it from L2 together. Persistent block c of C takes one item of
// each run of C in that order. Causal attention gives query block j a cost growing with j (its keys end at
// its last row), so `heavy_first` walks the query blocks from the last to the first and deals each run of C
// in a snake (block c takes position c of even runs and C - 1 - c of odd ones): a block that took a heavy
// item of one run takes a light one of the next, and long items come first, so the blocks end together
// (tests/host/test_scheduler.cpp: the busiest block within 0.5% of the mean at 132 blocks, against 6% for
// the plain order). Variable-length batches give each sequence its own count of query blocks
// (`seq_q_blocks`, readable where the scheduler runs); the items past a sequence's count are skipped. One CTA
// per item: ops using it run clusters of 1.
#pragma once
#include <cstdint>

namespace weft::lcsc {

struct AttentionSchedulerParams {
  int batch = 0, heads = 0;
  int q_blocks = 0;                   // query blocks of the longest sequence
  const int* seq_q_blocks = nullptr;  // variable lengths: query blocks of each sequence (else all q_blocks)
  bool heavy_first = false;           // causal: the query blocks with the most keys first
  int compute_blocks = 0;             // blocks [0, compute_blocks) compute; the rest of the grid communicates
  __host__ __device__ int64_t units() const { return int64_t(batch) * heads * q_blocks; }
};

struct AttentionWork {
  int batch = 0, head = 0, q_block = 0;
  int iteration = 0;  // how many items this block took before this one
};

class AttentionScheduler {
 public:
  using Params = AttentionSchedulerParams;
  using Work = AttentionWork;
  static constexpr int kMaxClusterSize = 1;  // one CTA per item (lcsc/kernel.cuh checks the op's clusters)
  __host__ __device__ static int compute_blocks(const Params& p) { return p.compute_blocks; }

  __host__ __device__ AttentionScheduler(const Params& p, int cluster_index, int /*cluster_rank*/)
      : p_(p), block_(cluster_index), per_row_(p.batch * p.heads) {}

  // The next item of this block, or false when it has none left. 32-bit arithmetic (the host keeps units()
  // below 2^31): a 64-bit division is a subroutine call, which caps the registers of the whole consumer.
  __host__ __device__ __forceinline__ bool next(Work& w) {
    const int runs = p_.compute_blocks, units = static_cast<int>(p_.units());
    if (runs <= 0) return false;
    while (run_ < (units + runs - 1) / runs) {
      const int u = run_ * runs + (p_.heavy_first && (run_ & 1) ? runs - 1 - block_ : block_);
      ++run_;
      if (u >= units) continue;  // the last run is short
      const int row = u / per_row_;
      const int r = u - row * per_row_;
      const int b = r / p_.heads;
      const int q = p_.heavy_first ? p_.q_blocks - 1 - row : row;
      if (p_.seq_q_blocks && q >= p_.seq_q_blocks[b]) continue;  // past this sequence's end
      w.batch = b;
      w.head = r - b * p_.heads;
      w.q_block = q;
      w.iteration = iteration_++;
      return true;
    }
    return false;
  }

 private:
  Params p_;
  int block_, per_row_, run_ = 0;
  int iteration_ = 0;
};

}  // namespace weft::lcsc
