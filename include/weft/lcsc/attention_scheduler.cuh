// The attention scheduler: a scheduler of the LCSC template (lcsc/kernel.cuh) for ops whose work items are
// (batch, head, query block) triples, as flash attention's are.
//
// Order: the (batch, head) pairs are cut into L2 sections of `section_pairs` pairs (sized by the host so a
// section's streamed operands fit in L2); a section's items run before the next section's, query block by
// query block, the pairs of the section fastest. The items running at one time then read the K / V (or Q /
// dO) of a few heads, each from L2 after its first read, where an order over all heads at once would stream
// every head's operands from memory once per block. GQA heads sharing a K / V head are adjacent pairs.
// Persistent block c of C takes unit (c + r) mod C of run r of C units in that order.
// Causal attention gives block j a cost growing (forward) or shrinking (backward, over key blocks) linearly
// with j, so `paired` makes a unit the two blocks j and count - 1 - j of one pair, the heavier first, taken
// one after the other by the same persistent block: every unit costs the same, the blocks end within one
// unit of each other whatever the section size, and sections stay as small as L2 wants
// (tests/host/test_scheduler.cpp).
// Packed variable-length sequences give each sequence its own count of blocks, from its rows [row_begin[b],
// row_end[b]) (device memory) in blocks of `block_rows`; the items past a sequence's count are skipped. One
// CTA per item: ops using it run clusters of 1.
// `reversed` hands a pair's blocks out last first (the deterministic attention backward's dQ turns wait for
// later key blocks, which must be handed out before the waiting ones).
// `heads_outer` numbers the pairs head by head (pair = head * batch + b) instead of sequence by sequence:
// with sections of whole heads, the items of head h all come before those of head h + 1 (an op whose heads
// arrive one after another, e.g. Ulysses attention's pushes, starts on the first).
#pragma once
#include <cstdint>

namespace weft::lcsc {

struct AttentionSchedulerParams {
  int batch = 0, heads = 0;
  int q_blocks = 0;                // query blocks of the longest sequence
  const int* row_begin = nullptr;  // packed sequences: each one's rows (else all have q_blocks blocks)
  const int* row_end = nullptr;
  int block_rows = 0;        // rows per block (packed sequences)
  bool paired = false;       // causal: blocks j and count - 1 - j as one unit (see above)
  bool reversed = false;     // blocks in descending order: unit row r is block count - 1 - r (not paired)
  int section_pairs = 0;     // (batch, head) pairs per L2 section; 0: one section
  int compute_blocks = 0;    // blocks [0, compute_blocks) compute; the rest of the grid communicates
  bool heads_outer = false;  // pairs numbered head-major (see above)
  // Rows of units per (batch, head) pair, and units in all.
  __host__ __device__ int unit_rows() const { return paired ? (q_blocks + 1) / 2 : q_blocks; }
  __host__ __device__ int64_t units() const { return int64_t(batch) * heads * unit_rows(); }
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
        pairs_(p.batch * p.heads),
        section_pairs_(p.section_pairs > 0 && p.section_pairs < pairs_ ? p.section_pairs : pairs_),
        section_units_(section_pairs_ * p.unit_rows()),
        position_(cluster_index) {}

  // The next item of this block, or false when it has none left. 32-bit arithmetic (the host keeps units()
  // below 2^31): a 64-bit division is a subroutine call, which caps the registers of the whole consumer.
  __host__ __device__ __forceinline__ bool next(Work& w) {
    if (second_ >= 0) {  // the light block of a pair
      w.batch = second_batch_;
      w.head = second_head_;
      w.q_block = second_;
      second_ = -1;
      w.iteration = iteration_++;
      return true;
    }
    const int runs = p_.compute_blocks, units = static_cast<int>(p_.units());
    if (runs <= 0) return false;
    while (run_ < (units + runs - 1) / runs) {
      // Rotated by the run: a block does not take the same position of every run (with an odd count of
      // blocks, a pair's middle block is a unit of half the cost, and the same position would give it to
      // the same persistent blocks each run).
      const int u = run_ * runs + position_;
      ++run_;
      if (++position_ == runs) position_ = 0;
      if (u >= units || !item(u, w)) continue;  // the last run is short; units past a sequence's end
      w.iteration = iteration_++;
      return true;
    }
    return false;
  }
  // Claimed units (lcsc::ClaimedTiles): unit u as this block's next item, or false where u lies past its
  // sequence's end. Unpaired schedules only (a paired unit's light block would be lost: the launchers that
  // set `claims` check `paired` is off).
  __host__ __device__ __forceinline__ bool at(int u, Work& w) {
    if (!item(u, w)) return false;
    w.iteration = iteration_++;
    return true;
  }
  __host__ __device__ int units() const { return static_cast<int>(p_.units()); }

 private:
  // Unit u's item (with a pair's light block due next), or false past its sequence's end.
  __host__ __device__ __forceinline__ bool item(int u, Work& w) {
    const int section = u / section_units_;
    const int first_pair = section * section_pairs_;
    const int pairs = min(section_pairs_, pairs_ - first_pair);  // the last section may be short
    const int r = u - section * section_units_;
    const int row = r / pairs;
    const int pair = first_pair + r - row * pairs;
    const int b = p_.heads_outer ? pair % p_.batch : pair / p_.heads;
    const int count =
        p_.row_begin ? min(p_.q_blocks, (p_.row_end[b] - p_.row_begin[b] + p_.block_rows - 1) / p_.block_rows)
                     : p_.q_blocks;
    if (p_.paired ? 2 * row >= count : row >= count) return false;
    w.batch = b;
    w.head = p_.heads_outer ? pair / p_.batch : pair - b * p_.heads;
    w.q_block = p_.paired || p_.reversed ? count - 1 - row : row;
    if (p_.paired && row != count - 1 - row) {
      second_ = row;
      second_batch_ = w.batch;
      second_head_ = w.head;
    }
    return true;
  }

  Params p_;
  int pairs_, section_pairs_, section_units_, position_, run_ = 0;
  int iteration_ = 0;
  int second_ = -1, second_batch_ = 0, second_head_ = 0;  // paired: the light block still due (-1: none)
};

}  // namespace weft::lcsc
