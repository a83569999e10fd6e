// The plain types weft's attention kernels (weft/ops/attention.cuh) and their launchers
// (weft/ops/attention.hpp) share: the problem's shape, packed sequences, and the fp32 accumulations of the
// sequence-parallel callers. No functions beyond inline helpers; usable from device and host code.
#pragma once
#include <cstdint>

#include "weft/host_device.hpp"

namespace weft {

struct AttentionShape {
  int64_t batch = 1, seq_q = 0, seq_k = 0, heads = 0, kv_heads = 0, head_dim = 0;
};

// Packed sequences (flash-attn's variable-length layout, generalised): q is [total_q, heads, head_dim], k and
// v [total_k, kv_heads, head_dim], out like q, lse [heads, total_q]; sequence b is query rows [q_begin[b],
// q_end[b]) and key rows [k_begin[b], k_end[b]) (device int32 arrays of shape.batch entries). The ranges of
// one tensor may not overlap; rows in no range are not written by the forward (the backward writes 0 to
// their dq and leaves their dk / dv), and must hold finite values: the block that ends a range reads a few
// of the rows after it, and multiplies them by zero. shape.seq_q / seq_k are the longest ranges
// (flash-attn's max_seqlen): a longer one traps the kernel (the stream fails with an illegal-instruction
// error) rather than computing a wrong answer.
// From cu_seqlens (batch + 1 ascending offsets from 0): varlen_segments().
struct AttentionSegments {
  const int32_t *q_begin = nullptr, *q_end = nullptr, *k_begin = nullptr, *k_end = nullptr;
  int64_t total_q = 0, total_k = 0;  // rows of the packed q and of k / v
  bool packed() const { return q_begin != nullptr; }
};
inline AttentionSegments varlen_segments(const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k,
                                         int64_t total_q, int64_t total_k) {
  return {cu_seqlens_q, cu_seqlens_q + 1, cu_seqlens_k, cu_seqlens_k + 1, total_q, total_k};
}

// Partial attention (ring attention's step): the forward merges this call's attention into a running fp32
// result instead of writing a fresh one: per query row, lse = log(exp(lse) + exp(lse_call)) and o = o *
// exp(old lse - lse) + o_call * exp(lse_call - lse). o is fp32 in q's layout, lse fp32 in lse's layout,
// both device memory (start them at 0 and -inf). Attention over key blocks merged call by call equals
// attention over their concatenation to fp32 rounding: nothing goes through 16 bits between calls. Rows a
// call does not cover are left as they are. `out` may be null (o only) or receive the merged result in q's
// type.
struct AttentionAccumulate {
  float* o = nullptr;
  float* lse = nullptr;
  bool enabled() const { return o != nullptr; }
};

// Backward for sequence-parallel callers: scale dK and dV are reduce-added in fp32 into these (k's layout,
// device memory, zeroed by the caller) instead of written to dk / dv (which may then be null); rows in no
// key range add zeros.
struct AttentionGradAccumulate {
  float* dk = nullptr;
  float* dv = nullptr;
  bool enabled() const { return dk != nullptr; }
};

}  // namespace weft

namespace weft::ops {

inline constexpr int kAttentionBlockN = 128;  // keys per block

// The key blocks [0, end) a query block of `block_m` rows attends to, and from which block on a block needs
// a mask (the sequence's partial last block, the causal diagonal). The loader and the consumers both use it,
// and the host's cost models of a schedule (tests/host).
struct KeyBlocks {
  int end = 0;          // blocks of kAttentionBlockN keys; 0: the block sees no key
  int masked_from = 0;  // blocks >= this one need the mask
};
WEFT_HD KeyBlocks key_blocks(int q_block, int block_m, int seq_q, int seq_k, bool causal) {
  constexpr int kBN = kAttentionBlockN;
  KeyBlocks kb;
  kb.end = (seq_k + kBN - 1) / kBN;
  kb.masked_from = seq_k / kBN;  // the partial last block, if any
  if (causal) {
    const int64_t first_row = int64_t(q_block) * block_m;
    const int64_t last_row = (first_row + block_m < seq_q ? first_row + block_m : seq_q) - 1;
    const int64_t last_key = last_row + seq_k - seq_q;  // the last row's last visible key
    const int64_t end = last_key < 0 ? 0 : last_key / kBN + 1;
    if (end < kb.end) kb.end = static_cast<int>(end);
    // Keys past the first row's limit need the mask: from the block holding key first_row + seq_k - seq_q
    // + 1.
    const int64_t first_masked_key = first_row + seq_k - seq_q + 1;
    const int64_t from = first_masked_key <= 0 ? 0 : first_masked_key / kBN;
    if (from < kb.masked_from) kb.masked_from = static_cast<int>(from);
  }
  if (kb.masked_from > kb.end) kb.masked_from = kb.end;
  return kb;
}

}  // namespace weft::ops
