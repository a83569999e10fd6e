// Host side of weft::context_attention_forward (weft/ops/context_attention.hpp): the layout and the call's
// segments from the ring plan, the gather of K / V (all-gather of every rank's rows padded to the longest
// rank, then a row permutation into natural order), and one packed attention call.
#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#include "attention_args.hpp"
#include "sequence_parallel.hpp"
#include "weft/ops/collectives.hpp"
#include "weft/ops/context_attention.hpp"
#include "weft/runtime/error.hpp"

namespace weft {
namespace {

using ops::round256;

// The workspace: K and V padded to the longest rank, both gathered in rank order, both in natural order,
// the permutation, the segments.
struct Workspace {
  int64_t max_local = 0, total = 0, segments = 0;
  size_t row_bytes = 0, pad = 0, ranked = 0, natural = 0, index = 0, seg = 0;
  Workspace(const ops::RingLayout& L, int64_t kv_heads, int64_t head_dim, int64_t nseg) {
    max_local = ops::max_local_rows(L);
    for (int64_t d : L.doc_length) total += d;
    segments = nseg;
    row_bytes = size_t(kv_heads * head_dim) * 2;
    pad = round256(max_local * row_bytes);
    ranked = round256(L.world * max_local * row_bytes);
    natural = round256(total * row_bytes);
    index = round256(total * 4);
    seg = round256(4 * std::max<int64_t>(nseg, 1) * 4);
  }
  size_t bytes() const { return 2 * (pad + ranked + natural) + index + seg; }
};

int64_t max_segments(const ops::RingLayout& L) {
  return int64_t(L.doc_length.size()) * (L.zigzag ? 2 : 1);
}

}  // namespace

int64_t context_attention_local_rows(int world, int rank, const std::vector<int64_t>& doc_lengths,
                                     bool causal) {
  return ops::ring_layout(doc_lengths, world, causal).local_rows(rank);
}

size_t context_attention_workspace_bytes(int world, const std::vector<int64_t>& doc_lengths, bool causal,
                                         int64_t kv_heads, int64_t head_dim) {
  const ops::RingLayout L = ops::ring_layout(doc_lengths, world, causal);
  return Workspace(L, kv_heads, head_dim, max_segments(L)).bytes();
}

namespace {

// What a call of either pass has once its K / V are gathered: the natural-order K / V and the segments.
struct Gathered {
  const void *k = nullptr, *v = nullptr;  // natural order, in the workspace
  int32_t* seg = nullptr;
  int64_t nseg = 0, max_q = 1, max_k = 1, local = 0, total = 0;
  AttentionSegments segments() const {
    return {seg, seg + nseg, seg + 2 * nseg, seg + 3 * nseg, std::max<int64_t>(local, 1), total};
  }
};

Gathered gather(Communicator& comm, Rank& rank, const ops::RingLayout& L, const Workspace& ws, const void* k,
                const void* v, void* workspace, size_t workspace_bytes, size_t need, DType dtype,
                cudaStream_t stream, const std::string& where, bool backward) {
  WEFT_CHECK(workspace != nullptr && workspace_bytes >= need,
             where + "the workspace must hold " + std::to_string(need) +
                 " bytes (the op's workspace_bytes()), got " + std::to_string(workspace_bytes));
  ops::check_pointer_alignment(workspace, "workspace", 256, where);
  WEFT_CHECK(ws.row_bytes % 16 == 0, where + "kv_heads x head_dim must be a multiple of 8");
  WEFT_CHECK(dtype == DType::kBF16 || dtype == DType::kFP16, where + "tensors must be bf16 or fp16");
  const int r = rank.rank(), W = rank.world();
  const ops::RingCall call = ops::gathered_call_of(L, r);
  Gathered g;
  g.local = L.local_rows(r);
  g.total = ws.total;
  char* p = static_cast<char*>(workspace);
  char *pad_k = p, *pad_v = p + ws.pad;
  p += 2 * ws.pad;
  char *ranked_k = p, *ranked_v = p + ws.ranked;
  p += 2 * ws.ranked;
  char *nat_k = p, *nat_v = p + ws.natural;
  p += 2 * ws.natural;
  auto* index = reinterpret_cast<int32_t*>(p);
  g.seg = reinterpret_cast<int32_t*>(p + ws.index);
  g.k = nat_k;
  g.v = nat_v;

  // The permutation (natural row -> rank-order row) and the segments.
  ops::write_rank_order_index(L, ws.max_local, index, stream);
  g.nseg = static_cast<int64_t>(call.segments.size());
  std::vector<int32_t> segs(4 * std::max<int64_t>(g.nseg, 1), 0);
  for (int64_t i = 0; i < g.nseg; ++i) {
    const ops::RingSegment& s = call.segments[i];
    segs[i] = static_cast<int32_t>(s.q_begin);
    segs[g.nseg + i] = static_cast<int32_t>(s.q_end);
    segs[2 * g.nseg + i] = static_cast<int32_t>(s.k_begin);
    segs[3 * g.nseg + i] = static_cast<int32_t>(s.k_end);
    g.max_q = std::max(g.max_q, s.q_end - s.q_begin);
    g.max_k = std::max(g.max_k, s.k_end - s.k_begin);
  }
  ops::upload_words(g.seg, segs, stream);

  // K and V of every rank, padded to the longest rank's rows, in rank order; then in natural order.
  const Shape2D shape{size_t(ws.max_local), ws.row_bytes / 2};
  {  // the collectives' workspace first (the planned calls read only the pointers' kind: the workspace's)
    char* a = static_cast<char*>(workspace);
    std::vector<Plan> plans = {all_gather_plan(comm, rank, a, a + ws.pad, shape, 0, dtype, stream)};
    if (backward)
      plans.push_back(reduce_scatter_plan(comm, rank, a + 2 * ws.ranked, a, shape, 0, DType::kFP32,
                                          ReduceOp::kSum, stream));
    ops::reserve_collective_workspace(comm, plans, stream);
  }
  for (auto [src, padded, ranked, natural] :
       {std::tuple{k, pad_k, ranked_k, nat_k}, std::tuple{v, pad_v, ranked_v, nat_v}}) {
    if (g.local > 0)
      WEFT_CUDA_CHECK(cudaMemcpyAsync(padded, src, g.local * ws.row_bytes, cudaMemcpyDeviceToDevice, stream));
    all_gather(comm, rank, padded, ranked, shape, 0, dtype, stream);
    ops::rows_to_natural(ranked, natural, index, ws.total, ws.row_bytes, stream);
  }
  return g;
}

std::string where_of(const char* op, const Rank& rank) {
  return std::string(op) + "(rank " + std::to_string(rank.rank()) + " of " + std::to_string(rank.world()) +
         "): ";
}

// The backward's extra workspace after the forward's: dK / dV in fp32 in natural order, in rank order
// (padded), this rank's reduced rows, and the attention backward's own workspace.
struct BackwardWorkspace {
  size_t natural32 = 0, ranked32 = 0, own32 = 0, attention = 0;
  BackwardWorkspace(const ops::RingLayout& L, const Workspace& ws, int64_t heads, int64_t kv_heads,
                    int64_t head_dim) {
    const size_t row32 = ws.row_bytes * 2;
    natural32 = round256(ws.total * row32);
    ranked32 = round256(L.world * ws.max_local * row32);
    own32 = round256(ws.max_local * row32);
    static const int32_t kAny[4] = {};  // the sizes do not read the ranges
    for (int r = 0; r < L.world; ++r) {
      const ops::RingCall call = ops::gathered_call_of(L, r);
      int64_t max_q = 1, max_k = 1;
      for (const ops::RingSegment& s : call.segments) {
        max_q = std::max(max_q, s.q_end - s.q_begin);
        max_k = std::max(max_k, s.k_end - s.k_begin);
      }
      AttentionOptions o;
      o.segments = {
          kAny, kAny, kAny, kAny, std::max<int64_t>(L.local_rows(r), 1), std::max<int64_t>(ws.total, 1)};
      const AttentionShape shape{
          std::max<int64_t>(int64_t(call.segments.size()), 1), max_q, max_k, heads, kv_heads, head_dim};
      attention = std::max(attention, round256(flash_attention_backward_workspace_bytes(shape, o)));
    }
  }
  size_t bytes() const { return 2 * (natural32 + ranked32 + own32) + attention; }
};

}  // namespace

void context_attention_forward(Communicator& comm, Rank& rank, const void* q, const void* k, const void* v,
                               void* out, float* lse, const std::vector<int64_t>& doc_lengths, int64_t heads,
                               int64_t kv_heads, int64_t head_dim, void* workspace, size_t workspace_bytes,
                               DType dtype, cudaStream_t stream, const AttentionOptions& options) {
  const std::string where = where_of("weft::context_attention_forward", rank);
  WEFT_CHECK(!options.segments.packed() && !options.accumulate.enabled(),
             where + "options.segments and options.accumulate are set by the op itself; leave them empty");
  const ops::RingLayout L = ops::ring_layout(doc_lengths, rank.world(), options.causal);
  const Workspace ws(L, kv_heads, head_dim, max_segments(L));
  if (stream == nullptr) stream = rank.stream();
  const Gathered g =
      gather(comm, rank, L, ws, k, v, workspace, workspace_bytes, ws.bytes(), dtype, stream, where, false);
  if (g.nseg == 0) return;  // no query rows here (short documents)
  AttentionOptions o = options;
  o.segments = g.segments();
  flash_attention_forward(q, g.k, g.v, out, lse,
                          AttentionShape{g.nseg, g.max_q, g.max_k, heads, kv_heads, head_dim}, dtype, stream,
                          o);
}

size_t context_attention_backward_workspace_bytes(int world, const std::vector<int64_t>& doc_lengths,
                                                  bool causal, int64_t heads, int64_t kv_heads,
                                                  int64_t head_dim) {
  const ops::RingLayout L = ops::ring_layout(doc_lengths, world, causal);
  const Workspace ws(L, kv_heads, head_dim, max_segments(L));
  return ws.bytes() + BackwardWorkspace(L, ws, heads, kv_heads, head_dim).bytes();
}

void context_attention_backward(Communicator& comm, Rank& rank, const void* q, const void* k, const void* v,
                                const void* out, const void* dout, const float* lse, void* dq, void* dk,
                                void* dv, const std::vector<int64_t>& doc_lengths, int64_t heads,
                                int64_t kv_heads, int64_t head_dim, void* workspace, size_t workspace_bytes,
                                DType dtype, cudaStream_t stream, const AttentionOptions& options) {
  const std::string where = where_of("weft::context_attention_backward", rank);
  WEFT_CHECK(
      !options.segments.packed() && !options.accumulate.enabled() && !options.accumulate_grads.enabled(),
      where + "options.segments / accumulate / accumulate_grads are set by the op itself; leave them empty");
  const ops::RingLayout L = ops::ring_layout(doc_lengths, rank.world(), options.causal);
  const Workspace ws(L, kv_heads, head_dim, max_segments(L));
  const BackwardWorkspace bws(L, ws, heads, kv_heads, head_dim);
  if (stream == nullptr) stream = rank.stream();
  const Gathered g = gather(comm, rank, L, ws, k, v, workspace, workspace_bytes, ws.bytes() + bws.bytes(),
                            dtype, stream, where, true);
  char* p = static_cast<char*>(workspace) + ws.bytes();
  auto *nat_dk = reinterpret_cast<float*>(p), *nat_dv = reinterpret_cast<float*>(p + bws.natural32);
  p += 2 * bws.natural32;
  auto *ranked_dk = reinterpret_cast<float*>(p), *ranked_dv = reinterpret_cast<float*>(p + bws.ranked32);
  p += 2 * bws.ranked32;
  auto *own_dk = reinterpret_cast<float*>(p), *own_dv = reinterpret_cast<float*>(p + bws.own32);
  p += 2 * bws.own32;
  void* attention_ws = p;

  // This rank's queries against every key, dK / dV added in fp32 in natural order (zero where it sees none).
  WEFT_CUDA_CHECK(cudaMemsetAsync(nat_dk, 0, 2 * bws.natural32, stream));
  if (g.nseg > 0) {
    AttentionOptions o = options;
    o.segments = g.segments();
    o.accumulate_grads = {nat_dk, nat_dv};
    flash_attention_backward(q, g.k, g.v, out, dout, lse, dq, nullptr, nullptr, attention_ws, bws.attention,
                             AttentionShape{g.nseg, g.max_q, g.max_k, heads, kv_heads, head_dim}, dtype,
                             stream, o);
  }
  // Back to the owners: rank order (padding rows zero), summed over the team, this rank's rows to T.
  const auto* index =
      reinterpret_cast<const int32_t*>(static_cast<char*>(workspace) + 2 * (ws.pad + ws.ranked + ws.natural));
  const int64_t row_elems = static_cast<int64_t>(ws.row_bytes / 2);
  for (auto [natural, ranked, own, grad] :
       {std::tuple{nat_dk, ranked_dk, own_dk, dk}, std::tuple{nat_dv, ranked_dv, own_dv, dv}}) {
    WEFT_CUDA_CHECK(cudaMemsetAsync(ranked, 0, bws.ranked32, stream));
    ops::rows_to_ranked(natural, ranked, index, ws.total, ws.row_bytes * 2, stream);
    reduce_scatter(comm, rank, ranked, own, Shape2D{size_t(ws.max_local), size_t(row_elems)}, 0, DType::kFP32,
                   ReduceOp::kSum, stream);
    ops::round_fp32(own, grad, g.local * row_elems, dtype, stream);
  }
}

}  // namespace weft
