// Which key blocks of the attention backward meet which query blocks: host and device, so that host tests
// check what the kernels compute (tests/host/test_attention_backward_blocks.cpp).
#pragma once
#include <cuda_runtime.h>  // __host__ / __device__

#include <cstdint>

namespace weft::ops {

inline constexpr int kAttentionBwdBlockN = 128;  // keys per work item, 64 per consumer warpgroup

// The query blocks [begin, end) of block_rows rows that see some key of key block n. Causal: query row i
// sees key j iff j <= i + shift (bottom-right: shift = seq_k - seq_q), so the first row that sees the block's
// first key, n * kBN, is n * kBN - shift.
struct QueryBlocks {
  int begin = 0, end = 0;
};
__host__ __device__ inline QueryBlocks query_blocks_shifted(int key_block, int seq_q, int shift, bool causal,
                                                            int block_rows) {
  constexpr int kBN = kAttentionBwdBlockN;
  QueryBlocks qb;
  qb.end = (seq_q + block_rows - 1) / block_rows;
  if (causal) {
    const int64_t first_row = int64_t(key_block) * kBN - shift;
    if (first_row > 0)
      qb.begin = static_cast<int>(first_row / block_rows < qb.end ? first_row / block_rows : qb.end);
  }
  return qb;
}
__host__ __device__ inline QueryBlocks query_blocks(int key_block, int seq_q, int seq_k, bool causal,
                                                    int block_rows) {
  return query_blocks_shifted(key_block, seq_q, seq_k - seq_q, causal, block_rows);
}

// The last key block whose keys some row of query block m (of block_rows rows) sees: the key blocks that add
// into query block m are exactly 0 .. this one (query_blocks_shifted: a key block's first query block grows
// with the block); below 0 where none does. Causal: the block's last row, (m + 1) block_rows - 1, sees keys
// up to that row + shift.
__host__ __device__ inline int last_key_block_of(int m, int seq_k, int shift, bool causal, int block_rows) {
  constexpr int kBN = kAttentionBwdBlockN;
  const int last = (seq_k + kBN - 1) / kBN - 1;
  if (!causal) return last;
  const int64_t last_key = int64_t(m + 1) * block_rows - 1 + shift;
  if (last_key < 0) return -1;
  const int64_t seen = last_key / kBN;
  return seen < last ? static_cast<int>(seen) : last;
}

}  // namespace weft::ops
