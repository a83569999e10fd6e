// weft::flash_attention_forward: softmax(scale * Q K^T) V on the current GPU with weft's own Hopper kernel
// (an LCSC op, weft/ops/attention.cuh), its backward (weft/ops/attention_backward.cuh), and their plans.
// Host-only header.
//
// Layout (flash-attn's): q [batch, seq_q, heads, head_dim], k and v [batch, seq_k, kv_heads, head_dim], out
// like q, all dense bf16 or all fp16; lse [batch, heads, seq_q] fp32 (natural log of each row's softmax
// denominator, scale included), optional. Query head h reads K / V head h / (heads / kv_heads) (GQA, MQA).
// Any sequence lengths >= 1. Causal masks are aligned to the bottom right (query row i sees keys j <= i +
// seq_k - seq_q, as flash-attn); a row that sees no key gets O = 0 and LSE = -inf. fp32 accumulation, P
// rounded to the inputs' type for the P V product (as flash-attn does).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "weft/dtype.hpp"
#include "weft/ops/plan.hpp"

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

struct AttentionOptions {
  bool causal = false;
  float softmax_scale = 0.f;       // 0: 1 / sqrt(head_dim)
  int max_blocks = 0;              // cap on persistent blocks (an SM budget); 0: every SM
  AttentionSegments segments;      // packed sequences; default: dense [batch, seq, heads, head_dim]
  AttentionAccumulate accumulate;  // forward only: merge into a running fp32 result (see above)
  bool deterministic = false;      // backward only: dQ bit-reproducible run to run (slower; see below)
  AttentionGradAccumulate accumulate_grads;  // backward only: dK / dV added in fp32 (see above)
};

// Enqueues the forward pass on `stream`. Head dims 64 and 128, bf16 or fp16 (dtype kBF16, kFP16); pointers
// 16-byte aligned device memory on the current GPU. Anything else throws weft::Error saying what and why.
// With options.accumulate, `lse` must be null (the running LSE is accumulate.lse) and `out` may be.
void flash_attention_forward(const void* q, const void* k, const void* v, void* out, float* lse,
                             const AttentionShape& shape, DType dtype, cudaStream_t stream,
                             const AttentionOptions& options = {});

// What that call would do (weft/ops/plan.hpp): tiles, grid, shared memory; throws what the call would.
Plan flash_attention_forward_plan(const AttentionShape& shape, DType dtype,
                                  const AttentionOptions& options = {});

// The backward pass: dq, dk, dv (layouts and type of q, k, v) from q, k, v, the forward's out and lse, and
// dout (out's gradient, out's layout). `options` must be the forward's (causal, softmax_scale). The
// workspace (fp32 dQ accumulator and per-row terms) is device memory of at least
// flash_attention_backward_workspace_bytes(shape, options) bytes, 256-byte aligned, owned by the caller;
// calls on one stream may share it. dQ is accumulated in fp32 in whatever order blocks finish: results agree
// to fp32 rounding, not bit for bit, from run to run; with options.deterministic the additions into each
// query block take turns in a fixed order, and dq, dk, dv are the same bits every run (at some cost in
// speed).
size_t flash_attention_backward_workspace_bytes(const AttentionShape& shape,
                                                const AttentionOptions& options = {});
void flash_attention_backward(const void* q, const void* k, const void* v, const void* out, const void* dout,
                              const float* lse, void* dq, void* dk, void* dv, void* workspace,
                              size_t workspace_bytes, const AttentionShape& shape, DType dtype,
                              cudaStream_t stream, const AttentionOptions& options = {});
Plan flash_attention_backward_plan(const AttentionShape& shape, DType dtype,
                                   const AttentionOptions& options = {});

}  // namespace weft
