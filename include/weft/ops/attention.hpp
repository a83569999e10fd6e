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
#include "weft/ops/attention_types.hpp"
#include "weft/ops/plan.hpp"
#include "weft/timeline.hpp"

namespace weft {

struct AttentionOptions {
  bool causal = false;
  float softmax_scale = 0.f;       // 0: 1 / sqrt(head_dim)
  int max_blocks = 0;              // cap on persistent blocks (an SM budget); 0: every SM
  AttentionSegments segments;      // packed sequences; default: dense [batch, seq, heads, head_dim]
  AttentionAccumulate accumulate;  // forward only: merge into a running fp32 result (see above)
  bool deterministic = false;      // backward only: dQ bit-reproducible run to run (slower; see below)
  AttentionGradAccumulate accumulate_grads;  // backward only: dK / dV added in fp32 (see above)
  // Sequence-parallel ops (weft/ops/context_attention.hpp), causal: each rank holds a contiguous 1 / W of
  // every document (rank r the r-th; the causal work then grows with the rank) instead of the zigzag layout
  // (balanced: weft.ring_shard's default). Ignored without a causal mask (both layouts are contiguous).
  bool contiguous_shards = false;
  // Single-GPU forward only: query rows per work item, 0 to let the call choose (at head dim 64 128 for a
  // causal mask up to 2048 query rows, else 192; 128 at head dim 128); 128, or 192 at head dim 64, to force
  // one (tuning, benchmarks).
  int query_rows = 0;
  // Single-GPU forward and backward: non-null, the kernel records its blocks' phases there (each block's
  // span, each consumer warpgroup's mainloop and store per work item; weft/timeline.hpp), bf16 calls only.
  // Timed calls run kernels of their own (Timed scheduler parameters), so the others carry no mark. The
  // team attention ops refuse it: they record into their rank's timeline (Communicator::timeline_start),
  // bf16 calls, with the same timed kernels.
  TimelineBuffer* timeline = nullptr;
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
