// Sequence-parallel attention (context parallelism): attention over a sequence sharded across a team, each
// rank holding its local rows of q, k and v in ring attention's layout (src/ops/ring_attention_plan.hpp;
// Python: weft.ring_shard). Two methods, one set of arguments:
//   context_attention_*  every rank pushes its K / V rows into every rank's natural-order K / V, then
//                        attends its own queries in one call of weft's attention over packed segments (per
//                        document and query part, the keys up to the part's end under a bottom-right causal
//                        mask, or the whole document). The backward sums dK / dV over the team in fp32.
//   ulysses_attention_*  every rank sends each rank that rank's share of the heads of its rows; each attends
//                        its heads over the whole sequence; the outputs come back.
// Host-only header.
//
// q, out: [local_rows, heads, head_dim]; k, v: [local_rows, kv_heads, head_dim]; lse (optional): [heads,
// local_rows] fp32; bf16 or fp16; local_rows is this rank's row count of the layout of `doc_lengths` (the
// packed documents' lengths, the same on every rank) over the team, zigzag when options.causal (contiguous
// with options.contiguous_shards; context_attention_local_rows). Every rank of the team calls it with the
// same doc_lengths and options (single-process: once per local rank). The workspace (device memory on the
// rank's GPU, the op's workspace_bytes(), 256-byte aligned) holds the layout and the attention backward's
// scratch; calls on one stream may share it. The natural-order buffers live in the communicator's workspace
// area named after the method (symmetric memory, grown by the first call of a size: run a call before
// capturing a CUDA graph).
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
// What the call would do (weft/ops/plan.hpp: the communicator workspace areas it uses, the attention kernel's
// grid), or the weft::Error it would throw; the same arguments, nothing launched. Likewise the _plan of each
// op below that has one.
Plan context_attention_forward_plan(Communicator& comm, Rank& rank, const void* q, const void* k,
                                    const void* v, void* out, float* lse,
                                    const std::vector<int64_t>& doc_lengths, int64_t heads, int64_t kv_heads,
                                    int64_t head_dim, void* workspace, size_t workspace_bytes, DType dtype,
                                    cudaStream_t stream = nullptr, const AttentionOptions& options = {});

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
Plan context_attention_backward_plan(Communicator& comm, Rank& rank, const void* q, const void* k,
                                     const void* v, const void* out, const void* dout, const float* lse,
                                     void* dq, void* dk, void* dv, const std::vector<int64_t>& doc_lengths,
                                     int64_t heads, int64_t kv_heads, int64_t head_dim, void* workspace,
                                     size_t workspace_bytes, DType dtype, cudaStream_t stream = nullptr,
                                     const AttentionOptions& options = {});

// Ulysses: heads / W query heads per rank over the whole sequence. The forward runs in three passes (push,
// attention, pull); WEFT_ULYSSES_FORWARD=pipelined runs it as one kernel that moves the heads in chunks
// beside the attention of earlier ones (weft/ops/ulysses_attention.cuh). Needs heads % W == 0 and either
// kv_heads % W == 0 (each rank gets kv_heads / W K / V heads) or W % kv_heads == 0 (a K / V head goes to the
// W / kv_heads ranks that attend its query heads; their dK / dV are summed in fp32). Each rank sends and
// receives about 4 (forward) or 8 (backward) of its activation-sized tensors where context_attention receives
// the whole K / V; the attention work is the same.
size_t ulysses_attention_workspace_bytes(int world, const std::vector<int64_t>& doc_lengths, bool causal,
                                         int64_t heads, int64_t kv_heads, int64_t head_dim);
void ulysses_attention_forward(Communicator& comm, Rank& rank, const void* q, const void* k, const void* v,
                               void* out, float* lse, const std::vector<int64_t>& doc_lengths, int64_t heads,
                               int64_t kv_heads, int64_t head_dim, void* workspace, size_t workspace_bytes,
                               DType dtype, cudaStream_t stream = nullptr,
                               const AttentionOptions& options = {});
Plan ulysses_attention_forward_plan(Communicator& comm, Rank& rank, const void* q, const void* k,
                                    const void* v, void* out, float* lse,
                                    const std::vector<int64_t>& doc_lengths, int64_t heads, int64_t kv_heads,
                                    int64_t head_dim, void* workspace, size_t workspace_bytes, DType dtype,
                                    cudaStream_t stream = nullptr, const AttentionOptions& options = {});
size_t ulysses_attention_backward_workspace_bytes(int world, const std::vector<int64_t>& doc_lengths,
                                                  bool causal, int64_t heads, int64_t kv_heads,
                                                  int64_t head_dim);
void ulysses_attention_backward(Communicator& comm, Rank& rank, const void* q, const void* k, const void* v,
                                const void* out, const void* dout, const float* lse, void* dq, void* dk,
                                void* dv, const std::vector<int64_t>& doc_lengths, int64_t heads,
                                int64_t kv_heads, int64_t head_dim, void* workspace, size_t workspace_bytes,
                                DType dtype, cudaStream_t stream = nullptr,
                                const AttentionOptions& options = {});
Plan ulysses_attention_backward_plan(Communicator& comm, Rank& rank, const void* q, const void* k,
                                     const void* v, const void* out, const void* dout, const float* lse,
                                     void* dq, void* dk, void* dv, const std::vector<int64_t>& doc_lengths,
                                     int64_t heads, int64_t kv_heads, int64_t head_dim, void* workspace,
                                     size_t workspace_bytes, DType dtype, cudaStream_t stream = nullptr,
                                     const AttentionOptions& options = {});

// Ring attention: each rank attends its queries against every rank's K / V rows while they travel (one
// persistent kernel per pass: the compute blocks' idle loader warps push this rank's K / V into the ranks
// after it, the attention of each query block runs over the W steps' key ranges in one online softmax, each
// range as soon as its rows have landed). Receive slots: the communicator's workspace area "ring attention",
// (W - 1) x this rank's K / V. The workspace holds the pass's segment table.
size_t ring_attention_workspace_bytes(int world, const std::vector<int64_t>& doc_lengths, bool causal,
                                      int64_t kv_heads, int64_t head_dim);
void ring_attention_forward(Communicator& comm, Rank& rank, const void* q, const void* k, const void* v,
                            void* out, float* lse, const std::vector<int64_t>& doc_lengths, int64_t heads,
                            int64_t kv_heads, int64_t head_dim, void* workspace, size_t workspace_bytes,
                            DType dtype, cudaStream_t stream = nullptr, const AttentionOptions& options = {});
Plan ring_attention_forward_plan(Communicator& comm, Rank& rank, const void* q, const void* k, const void* v,
                                 void* out, float* lse, const std::vector<int64_t>& doc_lengths,
                                 int64_t heads, int64_t kv_heads, int64_t head_dim, void* workspace,
                                 size_t workspace_bytes, DType dtype, cudaStream_t stream = nullptr,
                                 const AttentionOptions& options = {});

// The ring backward: the same arguments as context_attention_backward. The keys stay and the queries
// travel: the idle loader warps push this rank's Q, dO and per-row terms (LSE, D) to the ranks after it; each
// key block's dK / dV accumulate in fp32 registers over all W steps (rounded once); each query block's dQ
// part is added in fp32 into this rank's accumulator slot for the step when the rows' owner is on another
// GPU (the owner reads it once after the kernel), else straight into the owner's accumulator. Receive slots
// and accumulators: the communicator's workspace area "ring attention backward", (W - 1) x this rank's Q and
// dO plus fp32 dQ (W x fp32 dQ on a team of several GPUs). The workspace holds the pass's table, a tensor map
// per step and the dQ parts' addresses. options.deterministic is refused (dQ parts are added in arrival
// order).
size_t ring_attention_backward_workspace_bytes(int world, const std::vector<int64_t>& doc_lengths,
                                               bool causal, int64_t heads, int64_t kv_heads,
                                               int64_t head_dim);
void ring_attention_backward(Communicator& comm, Rank& rank, const void* q, const void* k, const void* v,
                             const void* out, const void* dout, const float* lse, void* dq, void* dk,
                             void* dv, const std::vector<int64_t>& doc_lengths, int64_t heads,
                             int64_t kv_heads, int64_t head_dim, void* workspace, size_t workspace_bytes,
                             DType dtype, cudaStream_t stream = nullptr,
                             const AttentionOptions& options = {});
Plan ring_attention_backward_plan(Communicator& comm, Rank& rank, const void* q, const void* k, const void* v,
                                  const void* out, const void* dout, const float* lse, void* dq, void* dk,
                                  void* dv, const std::vector<int64_t>& doc_lengths, int64_t heads,
                                  int64_t kv_heads, int64_t head_dim, void* workspace, size_t workspace_bytes,
                                  DType dtype, cudaStream_t stream = nullptr,
                                  const AttentionOptions& options = {});

// The hybrid of the two (USP): the team split into groups of `ulysses` consecutive ranks (W % ulysses == 0).
// Within a group the heads are split as Ulysses splits them (heads / ulysses per member), and each member's
// heads travel a ring across the groups (rank r's ring: the ranks r % ulysses, r % ulysses + ulysses, ...),
// over the group's rows of the sequence; the outputs come back within the group. Each rank sends and
// receives Ulysses' volume within its group and a ring's over its ring of W / ulysses: on several nodes,
// the groups inside a node and the rings across them. The same arguments and layout as the others; needs
// heads % ulysses == 0 and kv_heads and ulysses dividing one another. ulysses == W is Ulysses' forward and
// backward, ulysses == 1 the ring's. The communicator's workspace area "hybrid attention" holds a member's
// heads of its group's rows; the ring's areas and resources are its sub-teams' own
// (Communicator::subteam).
size_t hybrid_attention_workspace_bytes(int world, int ulysses, const std::vector<int64_t>& doc_lengths,
                                        bool causal, int64_t heads, int64_t kv_heads, int64_t head_dim);
void hybrid_attention_forward(Communicator& comm, Rank& rank, const void* q, const void* k, const void* v,
                              void* out, float* lse, const std::vector<int64_t>& doc_lengths, int64_t heads,
                              int64_t kv_heads, int64_t head_dim, int ulysses, void* workspace,
                              size_t workspace_bytes, DType dtype, cudaStream_t stream = nullptr,
                              const AttentionOptions& options = {});
Plan hybrid_attention_forward_plan(Communicator& comm, Rank& rank, const void* q, const void* k,
                                   const void* v, void* out, float* lse,
                                   const std::vector<int64_t>& doc_lengths, int64_t heads, int64_t kv_heads,
                                   int64_t head_dim, int ulysses, void* workspace, size_t workspace_bytes,
                                   DType dtype, cudaStream_t stream = nullptr,
                                   const AttentionOptions& options = {});
// The backward: dK / dV of a K / V head that several members of a group attend are summed in fp32 over
// them, each member's part rounded to 16 bits by its ring first.
size_t hybrid_attention_backward_workspace_bytes(int world, int ulysses,
                                                 const std::vector<int64_t>& doc_lengths, bool causal,
                                                 int64_t heads, int64_t kv_heads, int64_t head_dim);
void hybrid_attention_backward(Communicator& comm, Rank& rank, const void* q, const void* k, const void* v,
                               const void* out, const void* dout, const float* lse, void* dq, void* dk,
                               void* dv, const std::vector<int64_t>& doc_lengths, int64_t heads,
                               int64_t kv_heads, int64_t head_dim, int ulysses, void* workspace,
                               size_t workspace_bytes, DType dtype, cudaStream_t stream = nullptr,
                               const AttentionOptions& options = {});
Plan hybrid_attention_backward_plan(Communicator& comm, Rank& rank, const void* q, const void* k,
                                    const void* v, const void* out, const void* dout, const float* lse,
                                    void* dq, void* dk, void* dv, const std::vector<int64_t>& doc_lengths,
                                    int64_t heads, int64_t kv_heads, int64_t head_dim, int ulysses,
                                    void* workspace, size_t workspace_bytes, DType dtype,
                                    cudaStream_t stream = nullptr, const AttentionOptions& options = {});

// This rank's local rows in that layout (contiguous: AttentionOptions::contiguous_shards's).
int64_t context_attention_local_rows(int world, int rank, const std::vector<int64_t>& doc_lengths,
                                     bool causal, bool contiguous = false);
// Their positions in the packed sequence: local row i is token [i] (sharding gathers these rows,
// unsharding scatters them back). Throws weft::Error for a rank outside the team.
std::vector<int64_t> context_attention_local_tokens(int world, int rank,
                                                    const std::vector<int64_t>& doc_lengths, bool causal,
                                                    bool contiguous = false);

}  // namespace weft
