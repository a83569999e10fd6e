// Host side and kernels of weft's MoE across nodes (weft/ops/hierarchical.hpp): the routing of each slot to
// its expert's node, the NCCL legs among the i-th ranks of the nodes, weft's moe_dispatch / moe_combine in
// the node, and the sum of the nodes' partial outputs.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "hierarchical_legs.hpp"
#include "op_args.hpp"
#include "weft/ops/hierarchical.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/kernel_preload.hpp"

namespace weft {
namespace {

// Per slot (t < max_tokens, j < top_k): for every node g, the slot's expert among node g's (or -1: dropped,
// another node's, or a row past `tokens`), and its weight (0 past `tokens`).
__global__ void route_to_nodes(const int32_t* experts, const float* weights, int64_t tokens,
                               int64_t max_tokens, int top_k, int num_experts, int nodes,
                               int32_t* node_experts, float* slot_weights) {
  const int64_t slots = max_tokens * top_k, per_node = num_experts / nodes;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < slots;
       i += int64_t(gridDim.x) * blockDim.x) {
    const bool real = i / top_k < tokens;
    const int e = real ? experts[i] : -1;
    if (e >= num_experts) __trap();  // an expert id past the count: stop rather than route it anywhere
    for (int g = 0; g < nodes; ++g)
      node_experts[g * slots + i] = e >= 0 && e / per_node == g ? e % int(per_node) : -1;
    slot_weights[i] = real ? weights[i] : 0.f;
  }
}

// out[t] = the sum over nodes of partials[g][t] (fp32), for this rank's tokens.
template <class T>
__global__ void sum_node_partials(const T* partials, int64_t max_tokens, int64_t tokens, int64_t hidden,
                                  int nodes, T* out) {
  const int64_t n = tokens * hidden;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    float s = 0.f;
    for (int g = 0; g < nodes; ++g) s += static_cast<float>(partials[g * max_tokens * hidden + i]);
    out[i] = static_cast<T>(s);
  }
}

// The workspace's parts, carved alike for sizing and use.
struct Parts {
  char* send_rows;        // [max_tokens, hidden]: this rank's tokens, padded
  int32_t* send_experts;  // [nodes, max_tokens, top_k]: each slot's expert on node g, or -1
  float* send_weights;    // [max_tokens, top_k]
  char* recv_rows;        // [nodes, max_tokens, hidden]: the rows node g's i-th rank sent here
  int32_t* recv_experts;  // [nodes, max_tokens, top_k]
  float* recv_weights;    // [nodes, max_tokens, top_k]
  char* node_workspace;   // the in-node dispatch's
  size_t node_workspace_bytes;
  char* node_out;  // [nodes x max_tokens, hidden]
  char* partials;  // [nodes, max_tokens, hidden]
};

Parts carve(ops::WorkspaceLayout& w, const MultiNodeTeam& t, const MoeShape& s, DType dtype) {
  const size_t nodes = t.nodes(), rows = size_t(s.max_tokens) * s.hidden * dtype_size(dtype),
               slots = size_t(s.max_tokens) * s.top_k;
  Parts p{};
  p.send_rows = w.take(rows);
  p.send_experts = w.take<int32_t>(nodes * slots * 4);
  p.send_weights = w.take<float>(slots * 4);
  p.recv_rows = w.take(nodes * rows);
  p.recv_experts = w.take<int32_t>(nodes * slots * 4);
  p.recv_weights = w.take<float>(nodes * slots * 4);
  p.node_workspace_bytes = moe_dispatch_workspace_bytes(t.node_size(), hierarchical_moe_node_shape(t, s));
  p.node_workspace = w.take(p.node_workspace_bytes);
  p.node_out = w.take(nodes * rows);
  p.partials = w.take(nodes * rows);
  return p;
}

void check(const MultiNodeTeam& t, const MoeShape& s, DType dtype, const std::string& where) {
  WEFT_CHECK(dtype == DType::kBF16 || dtype == DType::kFP16, where + "tokens must be bf16 or fp16");
  WEFT_CHECK(!s.low_latency, where + "not with the low-latency dispatch (MoeShape::low_latency) yet");
  WEFT_CHECK(s.num_experts > 0 && s.num_experts % t.world() == 0,
             where + "num_experts (" + std::to_string(s.num_experts) +
                 ") must be a positive multiple of the job's world size (" + std::to_string(t.world()) + ")");
  WEFT_CHECK(s.top_k >= 1 && s.max_tokens >= 0 && s.tokens >= 0 && s.tokens <= s.max_tokens && s.hidden > 0 &&
                 s.hidden % 8 == 0,
             where + "top_k >= 1, 0 <= tokens <= max_tokens and hidden a positive multiple of 8, got top_k " +
                 std::to_string(s.top_k) + ", tokens " + std::to_string(s.tokens) + ", max_tokens " +
                 std::to_string(s.max_tokens) + ", hidden " + std::to_string(s.hidden));
}

}  // namespace

MoeShape hierarchical_moe_node_shape(const MultiNodeTeam& t, const MoeShape& s) {
  MoeShape n = s;
  n.num_experts = s.num_experts / t.nodes();
  n.tokens = n.max_tokens = int64_t(t.nodes()) * s.max_tokens;
  return n;
}

size_t hierarchical_moe_workspace_bytes(const MultiNodeTeam& t, const MoeShape& shape, DType dtype) {
  check(t, shape, dtype, "weft::hierarchical_moe_workspace_bytes: ");
  return ops::bytes_carved_by([&](ops::WorkspaceLayout& w) { carve(w, t, shape, dtype); });
}

HierarchicalMoeDispatched hierarchical_moe_dispatch(MultiNodeTeam& t, const void* tokens,
                                                    const int32_t* experts, const float* weights,
                                                    const MoeShape& shape, void* workspace,
                                                    size_t workspace_bytes, DType dtype,
                                                    cudaStream_t stream) {
  const std::string where = "weft::hierarchical_moe_dispatch (rank " + std::to_string(t.rank()) + "): ";
  check(t, shape, dtype, where);
  stream = ops::stream_of(t, stream);
  t.check_alive();
  WEFT_CUDA_CHECK(cudaSetDevice(t.node_rank().device()));
  const size_t need = hierarchical_moe_workspace_bytes(t, shape, dtype);
  ops::check_workspace(workspace, workspace_bytes, need, "hierarchical_moe_workspace_bytes()", where);
  if (shape.tokens > 0) {
    WEFT_CHECK(tokens != nullptr && experts != nullptr && weights != nullptr,
               where + "tokens, experts and weights must not be null");
    ops::check_pointer_alignment(experts, "experts", 4, where);
    ops::check_pointer_alignment(weights, "weights", 4, where);
  }
  ops::WorkspaceLayout w(workspace);
  const Parts p = carve(w, t, shape, dtype);
  const size_t rows = size_t(shape.max_tokens) * shape.hidden * dtype_size(dtype),
               slots = size_t(shape.max_tokens) * shape.top_k;
  if (shape.tokens > 0)
    WEFT_CUDA_CHECK(cudaMemcpyAsync(p.send_rows, tokens,
                                    size_t(shape.tokens) * shape.hidden * dtype_size(dtype),
                                    cudaMemcpyDeviceToDevice, stream));
  if (slots > 0) {
    detail::preload<&route_to_nodes>();
    route_to_nodes<<<ops::grid_stride_blocks(int64_t(slots)), 256, 0, stream>>>(
        experts, weights, shape.tokens, shape.max_tokens, shape.top_k, shape.num_experts, t.nodes(),
        p.send_experts, p.send_weights);
    WEFT_CUDA_CHECK(cudaGetLastError());
  }
  ops::exchange_across(t, "hierarchical_moe_dispatch (rows)", p.send_rows, 0, rows, p.recv_rows, rows,
                       stream);
  ops::exchange_across(t, "hierarchical_moe_dispatch (experts)", p.send_experts, slots * 4, slots * 4,
                       p.recv_experts, slots * 4, stream);
  ops::exchange_across(t, "hierarchical_moe_dispatch (weights)", p.send_weights, 0, slots * 4, p.recv_weights,
                       slots * 4, stream);
  HierarchicalMoeDispatched d;
  d.node_shape = hierarchical_moe_node_shape(t, shape);
  d.node = moe_dispatch(t.node_team(), t.node_rank(), p.recv_rows, p.recv_experts, d.node_shape,
                        p.node_workspace, p.node_workspace_bytes, dtype, stream);
  d.weights = p.recv_weights;
  d.node_out = p.node_out;
  d.partials = p.partials;
  return d;
}

void hierarchical_moe_combine(MultiNodeTeam& t, const void* expert_out, const HierarchicalMoeDispatched& d,
                              void* out, const MoeShape& shape, DType dtype, cudaStream_t stream) {
  const std::string where = "weft::hierarchical_moe_combine (rank " + std::to_string(t.rank()) + "): ";
  check(t, shape, dtype, where);
  WEFT_CHECK(d.node_out != nullptr && d.partials != nullptr && d.weights != nullptr,
             where + "`dispatched` is not hierarchical_moe_dispatch's handle");
  stream = ops::stream_of(t, stream);
  t.check_alive();
  WEFT_CUDA_CHECK(cudaSetDevice(t.node_rank().device()));
  if (shape.tokens > 0) ops::check_pointer_alignment(out, "out", 16, where);
  moe_combine(t.node_team(), t.node_rank(), expert_out, d.node, d.weights, d.node_out, d.node_shape, dtype,
              stream);
  const size_t rows = size_t(shape.max_tokens) * shape.hidden * dtype_size(dtype);
  ops::exchange_across(t, "hierarchical_moe_combine", d.node_out, rows, rows, d.partials, rows, stream);
  if (shape.tokens == 0) return;
  const int64_t n = shape.tokens * shape.hidden;
  const auto sum = [&](auto* typed) {
    using T = std::remove_pointer_t<decltype(typed)>;
    constexpr auto kernel = &sum_node_partials<T>;
    detail::preload<kernel>();
    kernel<<<ops::grid_stride_blocks(n), 256, 0, stream>>>(static_cast<const T*>(d.partials),
                                                           shape.max_tokens, shape.tokens, shape.hidden,
                                                           t.nodes(), static_cast<T*>(out));
  };
  if (dtype == DType::kFP16)
    sum(static_cast<__half*>(nullptr));
  else
    sum(static_cast<__nv_bfloat16*>(nullptr));
  WEFT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace weft
