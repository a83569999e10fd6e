// The attention backward's key-block arithmetic (weft/ops/attention_backward_types.hpp): the key blocks that
// add into a query block are 0 .. last_key_block_of (the deterministic backward's dQ turns wait for exactly
// those after a key block; a gap or an off-by-one there would be a wait that never ends).
#include <gtest/gtest.h>

#include "weft/ops/attention_backward_types.hpp"

using weft::ops::kAttentionBwdBlockN;
using weft::ops::last_key_block_of;
using weft::ops::query_blocks;

namespace {

// Every query block of a (seq_q, seq_k) pair: the key blocks whose query blocks hold it are 0 .. last.
void check_shape(int seq_q, int seq_k, bool causal, int block_rows) {
  const int key_blocks = (seq_k + kAttentionBwdBlockN - 1) / kAttentionBwdBlockN;
  const int query_blocks_total = (seq_q + block_rows - 1) / block_rows;
  for (int m = 0; m < query_blocks_total; ++m) {
    int adders = 0, highest = -1;
    for (int n = 0; n < key_blocks; ++n) {
      const auto qb = query_blocks(n, seq_q, seq_k, causal, block_rows);
      if (qb.begin <= m && m < qb.end) {
        ASSERT_EQ(n, adders) << "a gap below key block " << n << ": q " << seq_q << " k " << seq_k << " m "
                             << m;
        ++adders;
        highest = n;
      }
    }
    ASSERT_EQ(last_key_block_of(m, seq_k, seq_k - seq_q, causal, block_rows), highest)
        << "q " << seq_q << " k " << seq_k << (causal ? " causal" : "") << " rows " << block_rows << " m "
        << m;
  }
}

}  // namespace

TEST(AttentionBlocks, KeyBlocksAddingIntoAQueryBlockAreZeroToLast) {
  for (int block_rows : {64, 128})
    for (bool causal : {false, true}) {
      for (int q = 1; q <= 300; q += 7)
        for (int k = 1; k <= 300; k += 3) check_shape(q, k, causal, block_rows);
      for (int q : {1, 63, 64, 65, 1000, 4096, 4099, 4500, 8192})
        for (int k : {1, 127, 128, 129, 1000, 4096, 4100, 4500, 16384}) check_shape(q, k, causal, block_rows);
    }
}
