// weft::context_attention_forward: attention over a sequence sharded across a team (context parallelism),
// each rank holding its local rows of q, k and v in ring attention's layout (src/ops/ring_attention_plan.hpp;
// Python: weft.ring_shard): every rank gathers the whole K / V in natural order (weft::all_gather, then a row
// permutation), then attends its own queries in one call of weft's attention over packed segments (per
// document and query part, the keys up to the part's end under a bottom-right causal mask, or the whole
// document). Host-only header.
//
// q, out: [local_rows, heads, head_dim]; k, v: [local_rows, kv_heads, head_dim]; lse (optional): [heads,
// local_rows] fp32; bf16 or fp16; local_rows is this rank's row count of the layout of `doc_lengths` (the
// packed documents' lengths, the same on every rank) over the team, zigzag when options.causal. Every rank of
// the team calls it with the same doc_lengths and options (single-process: once per local rank). The
// workspace (device memory on the rank's GPU, context_attention_workspace_bytes(), 256-byte aligned) holds
// the gathered K / V; calls on one stream may share it.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "weft/dtype.hpp"
#include "weft/ops/attention.hpp"
#include "weft/runtime/communicator.hpp"

namespace weft {

size_t context_attention_workspace_bytes(int world, const std::vector<int64_t>& doc_lengths, bool causal,
                                         int64_t kv_heads, int64_t head_dim);

void context_attention_forward(Communicator& comm, Rank& rank, const void* q, const void* k, const void* v,
                               void* out, float* lse, const std::vector<int64_t>& doc_lengths, int64_t heads,
                               int64_t kv_heads, int64_t head_dim, void* workspace, size_t workspace_bytes,
                               DType dtype, cudaStream_t stream = nullptr,
                               const AttentionOptions& options = {});

// The backward: dq (q's layout), dk, dv (k's layout, this rank's rows) from the forward's out and lse and
// out's gradient dout. dK / dV are summed over the team in fp32 and rounded once. The workspace:
// context_attention_backward_workspace_bytes() (it includes the forward's).
size_t context_attention_backward_workspace_bytes(int world, const std::vector<int64_t>& doc_lengths,
                                                  bool causal, int64_t heads, int64_t kv_heads,
                                                  int64_t head_dim);
void context_attention_backward(Communicator& comm, Rank& rank, const void* q, const void* k, const void* v,
                                const void* out, const void* dout, const float* lse, void* dq, void* dk,
                                void* dv, const std::vector<int64_t>& doc_lengths, int64_t heads,
                                int64_t kv_heads, int64_t head_dim, void* workspace, size_t workspace_bytes,
                                DType dtype, cudaStream_t stream = nullptr,
                                const AttentionOptions& options = {});

// Ulysses: the same layout and arguments, another method. Every rank sends each other rank that rank's
// share of the heads for its own rows (all-to-all), attends heads / W query heads over the whole sequence in
// one packed call, and sends the output rows back (all-to-all). Needs heads % W == 0 and either kv_heads % W
// == 0 (each rank gets kv_heads / W K / V heads) or W % kv_heads == 0 (a K / V head goes to the W / kv_heads
// ranks that attend its query heads; their dK / dV are summed in fp32). It moves 4 (forward) or 10
// (backward) activation-sized tensors per rank where context_attention moves the whole K / V W-fold; the
// attention calls are the same work.
size_t ulysses_attention_workspace_bytes(int world, const std::vector<int64_t>& doc_lengths, bool causal,
                                         int64_t heads, int64_t kv_heads, int64_t head_dim);
void ulysses_attention_forward(Communicator& comm, Rank& rank, const void* q, const void* k, const void* v,
                               void* out, float* lse, const std::vector<int64_t>& doc_lengths, int64_t heads,
                               int64_t kv_heads, int64_t head_dim, void* workspace, size_t workspace_bytes,
                               DType dtype, cudaStream_t stream = nullptr,
                               const AttentionOptions& options = {});
size_t ulysses_attention_backward_workspace_bytes(int world, const std::vector<int64_t>& doc_lengths,
                                                  bool causal, int64_t heads, int64_t kv_heads,
                                                  int64_t head_dim);
void ulysses_attention_backward(Communicator& comm, Rank& rank, const void* q, const void* k, const void* v,
                                const void* out, const void* dout, const float* lse, void* dq, void* dk,
                                void* dv, const std::vector<int64_t>& doc_lengths, int64_t heads,
                                int64_t kv_heads, int64_t head_dim, void* workspace, size_t workspace_bytes,
                                DType dtype, cudaStream_t stream = nullptr,
                                const AttentionOptions& options = {});

// This rank's local rows in that layout.
int64_t context_attention_local_rows(int world, int rank, const std::vector<int64_t>& doc_lengths,
                                     bool causal);

}  // namespace weft
