// Collectives over a team spanning nodes (weft/runtime/multi_node.hpp): weft's kernels inside each node,
// NCCL between nodes, each rank's network leg carrying only its own share. Every rank of the job calls the
// same collective with the same arguments; work is queued on `stream` (default: the node rank's stream),
// the node's weft collective and the NCCL call one after the other. Buffers are device pointers on the rank's
// GPU, anywhere in device memory; in == out is allowed for all_reduce. Ranks: rank = node x node_size + i.
//
//   all_reduce      count elements: a reduce-scatter in the node, an NCCL all-reduce of this rank's
//                   1 / node_size shard among the i-th ranks of the nodes, an all-gather in the node; the
//                   last count % node_size elements by NCCL's all-reduce over every rank. From 16 MiB on in
//                   pieces of >= 8 MiB (at most 8), pipelined: each piece's NCCL leg on the team's side
//                   stream beside the next piece's reduce-scatter and the previous one's all-gather.
//   all_gather      in: count elements; out: world x count, rank r's at r x count. NCCL all-gather among the
//                   i-th ranks (out of each node: this rank's count), then weft's all-gather in the node
//                   along the inner dimension, which puts every block where its rank's place is.
//   reduce_scatter  in: world x count; out: this rank's count of the reduction. weft's reduce-scatter in the
//                   node along the inner dimension (the i-th rank gets the node's sum of every node's i-th
//                   block), then an NCCL reduce-scatter among the i-th ranks.
//   all_to_all      in and out: world blocks of count_per_rank elements; out block j on rank r is in block r
//                   of rank j. Between nodes first: NCCL send / recv among the i-th ranks, each node's
//                   row of blocks (node_size blocks) to that node; then, blocks regrouped by their
//                   destination's index in the node, weft's all-to-all in the node, and the blocks put in
//                   rank order. Not in place.
//
// Tensor-parallel GEMMs across nodes (bf16, fp32 accumulation; B [K, N] or an [N, K] weight, BLayout; K and N
// multiples of 8; rows per rank any count the node's fused op takes):
//   all_gather_matmul      a_shard [m, K] on each rank; out [world x m, N] = the ranks' shards in rank order
//                          times B (the same B on every rank), and gathered_a [world x m, K] when not null.
//                          NCCL's all-gather of the shards over every rank on a side stream, beside weft's
//                          all_gather_matmul in the node (its sequential path: this node's rows of out); then
//                          weft's GEMM over the other nodes' rows.
//   matmul_reduce_scatter  a [world x m, K] and B on each rank; out [m, N] = rows [rank x m, +m) of the sum
//   over
//                          every rank of a . B. a's row blocks regrouped by their owner's index in its node,
//                          weft's matmul_reduce_scatter in the node (the i-th rank gets the node's sums of
//                          the i-th ranks' rows of every node), then NCCL's reduce-scatter among the i-th
//                          ranks.
//   broadcast       count elements from rank `root` (in read there only) into every rank's out: NCCL's
//                   broadcast among the ranks with root's index in their node (from root's node), then
//                   weft's broadcast in every node from that index. in == out is allowed.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

#include "weft/dtype.hpp"
#include <cstdint>

#include <vector>

#include "weft/ops/attention.hpp"
#include "weft/ops/collectives.hpp"
#include "weft/ops/gemm.hpp"
#include "weft/ops/moe.hpp"
#include "weft/runtime/multi_node.hpp"

namespace weft {

void hierarchical_all_reduce(MultiNodeTeam& team, const void* in, void* out, size_t count, DType dtype,
                             ReduceOp op = ReduceOp::kSum, cudaStream_t stream = nullptr);
void hierarchical_all_gather(MultiNodeTeam& team, const void* in, void* out, size_t count, DType dtype,
                             cudaStream_t stream = nullptr);
void hierarchical_reduce_scatter(MultiNodeTeam& team, const void* in, void* out, size_t count, DType dtype,
                                 ReduceOp op = ReduceOp::kSum, cudaStream_t stream = nullptr);
void hierarchical_all_to_all(MultiNodeTeam& team, const void* in, void* out, size_t count_per_rank,
                             DType dtype, cudaStream_t stream = nullptr);
void hierarchical_all_gather_matmul(MultiNodeTeam& team, const void* a_shard, const void* b, void* out,
                                    void* gathered_a, int64_t m, int64_t n, int64_t k, BLayout b_layout,
                                    cudaStream_t stream = nullptr);
void hierarchical_matmul_reduce_scatter(MultiNodeTeam& team, const void* a, const void* b, void* out,
                                        int64_t m, int64_t n, int64_t k, BLayout b_layout,
                                        cudaStream_t stream = nullptr);
// Expert-parallel MoE across nodes (weft/ops/moe.hpp's dispatch and combine inside each node, NCCL between
// nodes). shape: as moe_dispatch's over the job (num_experts a multiple of the world size, node g holding
// experts [g E / nodes, (g + 1) E / nodes), its ranks E / world each; tokens, max_tokens, top_k, hidden,
// align, zero_padding this rank's and the in-node dispatch's). tokens [tokens, hidden], experts [tokens,
// top_k] int32 (< 0: a dropped slot), weights [tokens, top_k] fp32; bf16 or fp16.
//   dispatch  every rank sends its max_tokens rows to the i-th rank of every node (the same rows to each:
//             with top_k of several experts a token mostly meets every node), each slot's expert there (or
//             -1) and its weight; then weft's moe_dispatch in the node over the nodes x max_tokens rows
//             received. The handle's `node` is that dispatch's: the expert GEMMs run on node.rows /
//             node.group_end as after moe_dispatch, into moe_combine_input(node_team, node_rank,
//             node_shape, dtype).
//   combine   weft's moe_combine in the node (each received token's sum over this node's experts), the sums
//             sent back to the ranks that sent the tokens, and there summed over the nodes (fp32) into
//             out [tokens, hidden].
// The workspace (device memory, hierarchical_moe_workspace_bytes(), 256-byte aligned) holds the legs'
// buffers and the in-node dispatch's; it lives from dispatch to combine. Not captured in CUDA graphs before a
// first call (the in-node ops grow their workspace areas). The legs are not pipelined with the in-node work.
struct HierarchicalMoeDispatched {
  MoeDispatched node;              // the in-node dispatch's handle
  MoeShape node_shape;             // its shape: E / nodes experts, nodes x max_tokens tokens
  const float* weights = nullptr;  // each received slot's weight [nodes x max_tokens, top_k] (combine's)
  void* node_out = nullptr;        // combine's in-node sums [nodes x max_tokens, hidden]
  void* partials = nullptr;        // the sums sent back [nodes, max_tokens, hidden]
};
size_t hierarchical_moe_workspace_bytes(const MultiNodeTeam& team, const MoeShape& shape, DType dtype);
// The in-node dispatch's shape (HierarchicalMoeDispatched::node_shape) for a call of `shape`.
MoeShape hierarchical_moe_node_shape(const MultiNodeTeam& team, const MoeShape& shape);
HierarchicalMoeDispatched hierarchical_moe_dispatch(MultiNodeTeam& team, const void* tokens,
                                                    const int32_t* experts, const float* weights,
                                                    const MoeShape& shape, void* workspace,
                                                    size_t workspace_bytes, DType dtype,
                                                    cudaStream_t stream = nullptr);
void hierarchical_moe_combine(MultiNodeTeam& team, const void* expert_out,
                              const HierarchicalMoeDispatched& dispatched, void* out, const MoeShape& shape,
                              DType dtype, cudaStream_t stream = nullptr);

void hierarchical_broadcast(MultiNodeTeam& team, const void* in, void* out, size_t count, DType dtype,
                            int root, cudaStream_t stream = nullptr);

// Context-parallel attention across nodes: context_attention_forward / _backward (weft/ops/
// context_attention.hpp) over the whole job, with its arguments and layout (doc_lengths sharded over
// team.world() ranks; context_attention_local_rows(team.world(), team.rank(), ...) rows here; the workspace
// context_attention_workspace_bytes(team.world(), ...) / context_attention_backward_workspace_bytes). Inside
// each node as context_attention does (K / V pushed into the node's natural-order buffers by weft's
// kernels); between nodes one NCCL all-reduce among the i-th ranks of those buffers, zeroed first, so that
// each row, written by one node only, reaches every node (and in the backward one of the fp32 dK / dV sums
// before the node's pull). The simple form: the whole K / V crosses between nodes and the legs do not
// overlap the attention (a ring across nodes beside the attention is the form that would).
void hierarchical_context_attention_forward(MultiNodeTeam& team, const void* q, const void* k, const void* v,
                                            void* out, float* lse, const std::vector<int64_t>& doc_lengths,
                                            int64_t heads, int64_t kv_heads, int64_t head_dim,
                                            void* workspace, size_t workspace_bytes, DType dtype,
                                            cudaStream_t stream = nullptr,
                                            const AttentionOptions& options = {});
void hierarchical_context_attention_backward(MultiNodeTeam& team, const void* q, const void* k, const void* v,
                                             const void* out, const void* dout, const float* lse, void* dq,
                                             void* dk, void* dv, const std::vector<int64_t>& doc_lengths,
                                             int64_t heads, int64_t kv_heads, int64_t head_dim,
                                             void* workspace, size_t workspace_bytes, DType dtype,
                                             cudaStream_t stream = nullptr,
                                             const AttentionOptions& options = {});

}  // namespace weft
