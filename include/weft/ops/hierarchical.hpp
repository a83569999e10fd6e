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

#include "weft/ops/collectives.hpp"
#include "weft/ops/gemm.hpp"
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
void hierarchical_broadcast(MultiNodeTeam& team, const void* in, void* out, size_t count, DType dtype,
                            int root, cudaStream_t stream = nullptr);

}  // namespace weft
