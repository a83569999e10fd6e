// The attention scheduler: a scheduler of the LCSC template (lcsc/kernel.cuh) for ops whose work items are
// (batch, head, query block) triples, as flash attention's are.
//
// Order: the (batch, head) pairs are cut into L2 sections of `section_pairs` pairs (sized by the host so a
// section's K and V fit in L2); a section's items run before the next section's, query block by query
// block, the pairs of the section fastest. The items running at one time then read the K / V of a few
// heads, each from L2 after its first read, where an order over all heads at once would stream every
// head's K / V from memory once per query block. GQA heads sharing a K / V head are adjacent pairs.
// Persistent block c of C takes one item of each run of C in that order. Causal attention gives query
// block j a cost growing with j (its keys end at its last row), so `heavy_first` walks each section's query
// blocks from the last to the first and deals each run of C in a snake (block c takes position c of even
// runs and C - 1 - c of odd ones): a block that took a heavy item of one run takes a light one of the next,
// and long items come first, so the blocks end together (tests/host/test_scheduler.cpp: the busiest block
// within 1% of the mean at 132 blocks, against 6% for the plain order, when a section holds at least 16
// runs: the switch from a section's light items to the next one's heavy items unbalances shorter ones).
// Variable-length batches give each sequence its own count of query blocks (`seq_q_blocks`, readable where
// the scheduler runs); the items past a sequence's count are skipped. One CTA per item: ops using it run
// clusters of 1.
#pragma once
#include <cstdint>

namespace weft::lcsc {

struct AttentionSchedulerParams {
  int batch = 0, heads = 0;
  int q_blocks = 0;                   // query blocks of the longest sequence
  const int* seq_q_blocks = nullptr;  // variable lengths: query blocks of each sequence (else all q_blocks)
  bool heavy_first = false;           // causal: the query blocks with the most keys first
  int section_pairs = 0;              // (batch, head) pairs per L2 section; 0: one section
  int compute_blocks = 0;             // blocks [0, compute_blocks) compute; the rest of the grid communicates
  __host__ __device__ int64_t units() const { return int64_t(batch) * heads * q_blocks; }
};

struct AttentionWork {
  int batch = 0, head = 0, q_block = 0;
  int iteration = 0;  // how many items this block took before this one
};

class AttentionScheduler {
  __host__ __device__ static int min(int a, int b) { return a < b ? a : b; }

 public:
  using Params = AttentionSchedulerParams;
  using Work = AttentionWork;
  static constexpr int kMaxClusterSize = 1;  // one CTA per item (lcsc/kernel.cuh checks the op's clusters)
  __host__ __device__ static int compute_blocks(const Params& p) { return p.compute_blocks; }

  __host__ __device__ AttentionScheduler(const Params& p, int cluster_index, int /*cluster_rank*/)
      : p_(p),
        block_(cluster_index),
        pairs_(p.batch * p.heads),
        section_pairs_(p.section_pairs > 0 && p.section_pairs < pairs_ ? p.section_pairs : pairs_),
        section_units_(section_pairs_ * p.q_blocks) {}

  // The next item of this block, or false when it has none left. 32-bit arithmetic (the host keeps units()
  // below 2^31): a 64-bit division is a subroutine call, which caps the registers of the whole consumer.
  __host__ __device__ __forceinline__ bool next(Work& w) {
    const int runs = p_.compute_blocks, units = static_cast<int>(p_.units());
    if (runs <= 0) return false;
    while (run_ < (units + runs - 1) / runs) {
      const int u = run_ * runs + (p_.heavy_first && (run_ & 1) ? runs - 1 - block_ : block_);
      ++run_;
      if (u >= units) continue;  // the last run is short
      const int section = u / section_units_;
      const int first_pair = section * section_pairs_;
      const int pairs = min(section_pairs_, pairs_ - first_pair);  // the last section may be short
      const int r = u - section * section_units_;
      const int row = r / pairs;
      const int pair = first_pair + r - row * pairs;
      const int b = pair / p_.heads;
      const int q = p_.heavy_first ? p_.q_blocks - 1 - row : row;
      if (p_.seq_q_blocks && q >= p_.seq_q_blocks[b]) continue;  // past this sequence's end
      w.batch = b;
      w.head = pair - b * p_.heads;
      w.q_block = q;
      w.iteration = iteration_++;
      return true;
    }
    return false;
  }

 private:
  Params p_;
  int block_, pairs_, section_pairs_, section_units_, run_ = 0;
  int iteration_ = 0;
};

}  // namespace weft::lcsc
