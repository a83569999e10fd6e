// Host side of weft::context_attention_forward / _backward (weft/ops/context_attention.hpp): every rank
// pushes its K / V rows into every rank's natural-order K / V (the communicator's workspace area "context
// attention", symmetric), then attends its own queries against them in one packed call (gathered_call_of);
// the backward adds each rank's dK / dV in fp32 into its own natural-order buffers, and every rank pulls
// its rows' sums from all of them. Across nodes (weft::hierarchical_context_attention_*, weft/ops/
// hierarchical.hpp) the same inside each node, over the node team, with one NCCL all-reduce among the i-th
// ranks of the nodes between: of the natural-order K / V (zeroed first, so each row is one node's, the sum
// their union), and of the fp32 dK / dV sums before the node's pull.
#include <algorithm>
#include <string>
#include <vector>

#include "attention_args.hpp"
#include "hierarchical_legs.hpp"
#include "op_args.hpp"
#include "sequence_parallel.hpp"
#include "weft/ops/context_attention.hpp"
#include "weft/ops/hierarchical.hpp"
#include "weft/runtime/error.hpp"

namespace weft {
namespace {

const char* const kArea = "context attention";

// What a call needs: the layout, this rank's segments, the symmetric area ([total] rows of K, V, and fp32
// dK, dV) and the caller's workspace (local -> natural rows, segments, the attention backward's own).
struct Sizes {
  ops::RingLayout L;
  ops::RingCall call;
  int rank = 0;  // in the layout's team (the job's, across nodes)
  int64_t max_local = 0, total = 0, local = 0, kv_heads = 0, head_dim = 0, max_q = 1, max_k = 1;
  Sizes(int world, int rank_, const std::vector<int64_t>& doc_lengths, ops::Sharding sharding, int64_t kv,
        int64_t d)
      : L(ops::ring_layout(doc_lengths, world, sharding.causal, 1, sharding.zigzag)),
        rank(rank_),
        kv_heads(kv),
        head_dim(d) {
    max_local = ops::max_local_rows(L);
    for (int64_t n : doc_lengths) total += n;
    local = L.local_rows(rank_);
    call = ops::gathered_call_of(L, rank_);
    for (const ops::RingSegment& s : call.segments) {
      max_q = std::max(max_q, s.q_end - s.q_begin);
      max_k = std::max(max_k, s.k_end - s.k_begin);
    }
  }
  int64_t nseg() const { return static_cast<int64_t>(call.segments.size()); }
  size_t kv_elements() const { return size_t(total * kv_heads * head_dim); }
  AttentionShape shape(int64_t heads) const {
    return {std::max<int64_t>(nseg(), 1), max_q, max_k, heads, kv_heads, head_dim};
  }
  AttentionSegments segments(const int32_t* seg) const {
    const int64_t s = nseg();
    return {seg, seg + s, seg + 2 * s, seg + 3 * s, std::max<int64_t>(local, 1), std::max<int64_t>(total, 1)};
  }
  size_t attention_backward(int64_t heads, const AttentionOptions& options) const {
    static const int32_t kAny[4] = {};  // the size does not read the ranges
    AttentionOptions o = options;
    o.segments = segments(kAny);
    return flash_attention_backward_workspace_bytes(shape(heads), o);
  }
};

// The symmetric area: every rank's K and V rows in natural order, then this rank's fp32 dK and dV sums
// (backward). Carved by this one function, with a base or without (sizing).
struct Area {
  char *k = nullptr, *v = nullptr;
  float *dk = nullptr, *dv = nullptr;
};
Area carve_area(ops::WorkspaceLayout& a, const Sizes& z) {
  Area p;
  p.k = a.take(z.kv_elements() * 2);
  p.v = a.take(z.kv_elements() * 2);
  p.dk = a.take<float>(z.kv_elements() * 4);
  p.dv = a.take<float>(z.kv_elements() * 4);
  return p;
}
size_t area_bytes(const Sizes& z) {
  return ops::bytes_carved_by([&](ops::WorkspaceLayout& a) { carve_area(a, z); });
}

// The caller's workspace: this rank's local -> natural rows, its segments' ranges, then (backward) the
// attention backward's own.
struct Own {
  int32_t *local_nat = nullptr, *seg = nullptr;
  char* attention = nullptr;
};
Own carve_own(ops::WorkspaceLayout& w, const Sizes& z, size_t attention_bytes) {
  Own p;
  p.local_nat = w.take<int32_t>(size_t(std::max<int64_t>(z.max_local, 1)) * 4);
  p.seg = w.take<int32_t>(size_t(4 * std::max<int64_t>(z.nseg(), 1)) * 4);
  p.attention = attention_bytes ? w.take(attention_bytes) : nullptr;
  return p;
}
size_t own_bytes(const Sizes& z, size_t attention_bytes) {
  return ops::bytes_carved_by([&](ops::WorkspaceLayout& w) { carve_own(w, z, attention_bytes); });
}

// Across nodes: `count` elements at p summed in place among the i-th ranks of the nodes (NCCL).
void sum_across_nodes(MultiNodeTeam& t, void* p, size_t count, DType dtype, const std::string& where,
                      cudaStream_t stream) {
  if (t.nodes() == 1 || count == 0) return;
  ops::nccl_call(t, where + "ncclAllReduce across the nodes", [&](nccl::Comm across, nccl::Comm) {
    return nccl::api().AllReduce(p, p, count, nccl::data_type(dtype), nccl::kSum, across, stream);
  });
}

// The caller's workspace and the area carved, the layout uploaded; K / V pushed into every rank's area.
struct Gathered {
  Area area;
  Own own;
};

// Checks, the workspace carved; then (not when planning) the layout tables and K / V pushed to every rank
// of the team (with `nodes`: the node team, then NCCL's sum across the nodes of the zeroed-first buffers).
Gathered gather(ops::OpCall& call, const Sizes& z, const void* k, const void* v, void* workspace,
                size_t workspace_bytes, size_t attention_bytes, DType dtype, MultiNodeTeam* nodes) {
  Communicator& comm = call.comm;
  Rank& rank = call.rank;
  const cudaStream_t stream = call.stream;
  const std::string& where = call.where;
  const size_t need = own_bytes(z, attention_bytes);
  // (Across nodes the layout is the job's by construction: the public functions build it from the team.)
  WEFT_CHECK(nodes || z.L.world == rank.world(), where + "the layout's world size differs from the team's");
  WEFT_CHECK(z.head_dim == 64 || z.head_dim == 128, where + "head_dim must be 64 or 128");
  WEFT_CHECK(dtype == DType::kBF16 || dtype == DType::kFP16, where + "tensors must be bf16 or fp16");
  ops::check_workspace(workspace, workspace_bytes, need, "the op's workspace_bytes()", where);
  Gathered g;
  ops::WorkspaceLayout area(call.workspace(area_bytes(z), kArea));
  g.area = carve_area(area, z);
  ops::WorkspaceLayout own(workspace);
  g.own = carve_own(own, z, attention_bytes);
  if (call.planning()) return g;
  ops::write_local_to_natural(z.L, z.rank, g.own.local_nat, stream);
  const int64_t s = z.nseg();
  std::vector<int32_t> segs(4 * std::max<int64_t>(s, 1), 0);
  for (int64_t i = 0; i < s; ++i) {
    const ops::RingSegment& seg = z.call.segments[i];
    segs[i] = static_cast<int32_t>(seg.q_begin);
    segs[s + i] = static_cast<int32_t>(seg.q_end);
    segs[2 * s + i] = static_cast<int32_t>(seg.k_begin);
    segs[3 * s + i] = static_cast<int32_t>(seg.k_end);
  }
  ops::upload_words(g.own.seg, segs, stream);
  const ops::HeadShare all = ops::HeadShare::all(z.kv_heads);
  // K and V are neighbours in the area (with the layout's padding between): one memset, one all-reduce.
  // (The push's entry meeting keeps the node's pushes out until every rank of it has zeroed.)
  const size_t es = dtype_size(dtype), span = g.area.v + z.kv_elements() * es - g.area.k;
  if (nodes) WEFT_CUDA_CHECK(cudaMemsetAsync(g.area.k, 0, span, stream));
  ops::push_rows(comm, rank, k, z.local, g.area.k, g.own.local_nat, all, z.head_dim, z.max_local, stream);
  ops::push_rows(comm, rank, v, z.local, g.area.v, g.own.local_nat, all, z.head_dim, z.max_local, stream);
  if (nodes) sum_across_nodes(*nodes, g.area.k, span / es, dtype, where, stream);
  return g;
}

// The prefix of a call's error messages: the op and this rank in its team (across nodes: the job's rank).
std::string where_of(const char* op, const char* across_nodes, const Rank& rank, const MultiNodeTeam* nodes) {
  if (!nodes) return ops::team_where(op, rank);
  return std::string(across_nodes) + "(rank " + std::to_string(nodes->rank()) + " of " +
         std::to_string(nodes->world()) + "): ";
}

// `nodes`: across nodes (comm and rank its node team's), else null.
void forward(Communicator& comm, Rank& rank, const void* q, const void* k, const void* v, void* out,
             float* lse, const std::vector<int64_t>& doc_lengths, int64_t heads, int64_t kv_heads,
             int64_t head_dim, void* workspace, size_t workspace_bytes, DType dtype, cudaStream_t stream,
             const AttentionOptions& options, Plan* plan, MultiNodeTeam* nodes = nullptr) {
  ops::OpCall call(comm, rank, stream,
                   where_of("weft::context_attention_forward", "weft::hierarchical_context_attention_forward",
                            rank, nodes),
                   plan);
  const std::string& where = call.where;
  ops::check_team_attention_options(options, false, where);
  const Sizes z(nodes ? nodes->world() : rank.world(), nodes ? nodes->rank() : rank.rank(), doc_lengths,
                ops::sharding_of(options), kv_heads, head_dim);
  ops::check_attention_operands(call, {q, k, v, out, lse}, false, z.local, heads, kv_heads, head_dim);
  const Gathered g = gather(call, z, k, v, workspace, workspace_bytes, 0, dtype, nodes);
  AttentionOptions o = options;
  o.segments = z.segments(g.own.seg);
  o.timeline = ops::team_attention_timeline(rank, dtype);
  if (call.planning()) {
    const Plan core = z.nseg() > 0 ? flash_attention_forward_plan(z.shape(heads), dtype, o) : Plan{};
    call.planned_op("context_attention_forward",
                    "K / V pushed to every rank, then flash attention of this rank's queries over every key",
                    core.blocks, core.smem_bytes);
    return;
  }
  if (z.nseg() == 0) return;  // no query rows here (short documents)
  flash_attention_forward(q, g.area.k, g.area.v, out, lse, z.shape(heads), dtype, call.stream, o);
}

void backward(Communicator& comm, Rank& rank, const void* q, const void* k, const void* v, const void* out,
              const void* dout, const float* lse, void* dq, void* dk, void* dv,
              const std::vector<int64_t>& doc_lengths, int64_t heads, int64_t kv_heads, int64_t head_dim,
              void* workspace, size_t workspace_bytes, DType dtype, cudaStream_t stream,
              const AttentionOptions& options, Plan* plan, MultiNodeTeam* nodes = nullptr) {
  ops::OpCall call(comm, rank, stream,
                   where_of("weft::context_attention_backward",
                            "weft::hierarchical_context_attention_backward", rank, nodes),
                   plan);
  const std::string& where = call.where;
  ops::check_team_attention_options(options, true, where);
  const Sizes z(nodes ? nodes->world() : rank.world(), nodes ? nodes->rank() : rank.rank(), doc_lengths,
                ops::sharding_of(options), kv_heads, head_dim);
  stream = call.stream;
  const size_t attention_bytes = z.attention_backward(heads, options);
  ops::check_attention_operands(call, {q, k, v, out, lse, dout, dq, dk, dv}, true, z.local, heads, kv_heads,
                                head_dim);
  const Gathered g = gather(call, z, k, v, workspace, workspace_bytes, attention_bytes, dtype, nodes);
  // This rank's queries against every key: dK / dV added in fp32 into its own natural-order buffers (zero
  // where it sees none; zeroed after the pushes' meeting, when every peer has pulled the previous call's).
  float *dk32 = g.area.dk, *dv32 = g.area.dv;
  AttentionOptions o = options;
  o.segments = z.segments(g.own.seg);
  o.accumulate_grads = {dk32, dv32};
  o.timeline = ops::team_attention_timeline(rank, dtype);
  if (call.planning()) {
    const Plan core = z.nseg() > 0 ? flash_attention_backward_plan(z.shape(heads), dtype, o) : Plan{};
    call.planned_op(
        "context_attention_backward",
        "K / V pushed to every rank, flash attention backward into fp32 dK / dV sums, the sums pulled",
        core.blocks, core.smem_bytes);
    return;
  }
  // dK and dV are neighbours in the area: one memset clears both.
  const auto* dv_end = reinterpret_cast<const char*>(dv32 + z.kv_elements());
  WEFT_CUDA_CHECK(cudaMemsetAsync(dk32, 0, dv_end - reinterpret_cast<const char*>(dk32), stream));
  if (z.nseg() > 0)
    flash_attention_backward(q, g.area.k, g.area.v, out, dout, lse, dq, nullptr, nullptr, g.own.attention,
                             attention_bytes, z.shape(heads), dtype, stream, o);
  // Across nodes: each i-th rank's sums added up over the nodes first (the pull then sums the node's ranks).
  if (nodes)
    sum_across_nodes(*nodes, dk32, (dv_end - reinterpret_cast<const char*>(dk32)) / 4, DType::kFP32, where,
                     stream);
  // Every rank's sums for this rank's rows, rounded once.
  const ops::HeadShare all = ops::HeadShare::all(kv_heads);
  ops::pull_rows(comm, rank, dk32, true, dk, z.local, g.own.local_nat, all, head_dim, z.max_local, dtype,
                 stream);
  ops::pull_rows(comm, rank, dv32, true, dv, z.local, g.own.local_nat, all, head_dim, z.max_local, dtype,
                 stream);
}

}  // namespace

int64_t context_attention_local_rows(int world, int rank, const std::vector<int64_t>& doc_lengths,
                                     bool causal, bool contiguous) {
  return ops::ring_layout(doc_lengths, world, causal, 1, !contiguous).local_rows(rank);
}

std::vector<int64_t> context_attention_local_tokens(int world, int rank,
                                                    const std::vector<int64_t>& doc_lengths, bool causal,
                                                    bool contiguous) {
  WEFT_CHECK(rank >= 0 && rank < world,
             "weft: rank " + std::to_string(rank) + " outside a team of " + std::to_string(world));
  return ops::ring_tokens(ops::ring_layout(doc_lengths, world, causal, 1, !contiguous), rank);
}

size_t context_attention_workspace_bytes(int world, const std::vector<int64_t>& doc_lengths, bool causal,
                                         int64_t kv_heads, int64_t head_dim) {
  size_t most = 0;
  for (int r = 0; r < world; ++r)
    for (const ops::Sharding s : ops::Sharding(causal).both()) {
      const Sizes z(world, r, doc_lengths, s, kv_heads, head_dim);
      most = std::max(most, own_bytes(z, 0));
    }
  return most;
}

size_t context_attention_backward_workspace_bytes(int world, const std::vector<int64_t>& doc_lengths,
                                                  bool causal, int64_t heads, int64_t kv_heads,
                                                  int64_t head_dim) {
  AttentionOptions o;
  o.causal = causal;
  size_t most = 0;
  for (int r = 0; r < world; ++r)
    for (const ops::Sharding s : ops::Sharding(causal).both()) {
      const Sizes z(world, r, doc_lengths, s, kv_heads, head_dim);
      most = std::max(most, own_bytes(z, z.attention_backward(heads, o)));
    }
  return most;
}

void context_attention_forward(Communicator& comm, Rank& rank, const void* q, const void* k, const void* v,
                               void* out, float* lse, const std::vector<int64_t>& doc_lengths, int64_t heads,
                               int64_t kv_heads, int64_t head_dim, void* workspace, size_t workspace_bytes,
                               DType dtype, cudaStream_t stream, const AttentionOptions& options) {
  forward(comm, rank, q, k, v, out, lse, doc_lengths, heads, kv_heads, head_dim, workspace, workspace_bytes,
          dtype, stream, options, nullptr);
}

Plan context_attention_forward_plan(Communicator& comm, Rank& rank, const void* q, const void* k,
                                    const void* v, void* out, float* lse,
                                    const std::vector<int64_t>& doc_lengths, int64_t heads, int64_t kv_heads,
                                    int64_t head_dim, void* workspace, size_t workspace_bytes, DType dtype,
                                    cudaStream_t stream, const AttentionOptions& options) {
  Plan plan;
  forward(comm, rank, q, k, v, out, lse, doc_lengths, heads, kv_heads, head_dim, workspace, workspace_bytes,
          dtype, stream, options, &plan);
  return plan;
}

void context_attention_backward(Communicator& comm, Rank& rank, const void* q, const void* k, const void* v,
                                const void* out, const void* dout, const float* lse, void* dq, void* dk,
                                void* dv, const std::vector<int64_t>& doc_lengths, int64_t heads,
                                int64_t kv_heads, int64_t head_dim, void* workspace, size_t workspace_bytes,
                                DType dtype, cudaStream_t stream, const AttentionOptions& options) {
  backward(comm, rank, q, k, v, out, dout, lse, dq, dk, dv, doc_lengths, heads, kv_heads, head_dim, workspace,
           workspace_bytes, dtype, stream, options, nullptr);
}

Plan context_attention_backward_plan(Communicator& comm, Rank& rank, const void* q, const void* k,
                                     const void* v, const void* out, const void* dout, const float* lse,
                                     void* dq, void* dk, void* dv, const std::vector<int64_t>& doc_lengths,
                                     int64_t heads, int64_t kv_heads, int64_t head_dim, void* workspace,
                                     size_t workspace_bytes, DType dtype, cudaStream_t stream,
                                     const AttentionOptions& options) {
  Plan plan;
  backward(comm, rank, q, k, v, out, dout, lse, dq, dk, dv, doc_lengths, heads, kv_heads, head_dim, workspace,
           workspace_bytes, dtype, stream, options, &plan);
  return plan;
}

void hierarchical_context_attention_forward(MultiNodeTeam& team, const void* q, const void* k, const void* v,
                                            void* out, float* lse, const std::vector<int64_t>& doc_lengths,
                                            int64_t heads, int64_t kv_heads, int64_t head_dim,
                                            void* workspace, size_t workspace_bytes, DType dtype,
                                            cudaStream_t stream, const AttentionOptions& options) {
  forward(team.node_team(), team.node_rank(), q, k, v, out, lse, doc_lengths, heads, kv_heads, head_dim,
          workspace, workspace_bytes, dtype, ops::stream_of(team, stream), options, nullptr, &team);
}

void hierarchical_context_attention_backward(MultiNodeTeam& team, const void* q, const void* k, const void* v,
                                             const void* out, const void* dout, const float* lse, void* dq,
                                             void* dk, void* dv, const std::vector<int64_t>& doc_lengths,
                                             int64_t heads, int64_t kv_heads, int64_t head_dim,
                                             void* workspace, size_t workspace_bytes, DType dtype,
                                             cudaStream_t stream, const AttentionOptions& options) {
  backward(team.node_team(), team.node_rank(), q, k, v, out, dout, lse, dq, dk, dv, doc_lengths, heads,
           kv_heads, head_dim, workspace, workspace_bytes, dtype, ops::stream_of(team, stream), options,
           nullptr, &team);
}

}  // namespace weft
