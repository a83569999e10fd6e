// Host side of weft::hybrid_attention_forward / _backward (weft/ops/context_attention.hpp): Ulysses inside
// sub-teams of U consecutive ranks, ring attention across them. Rank r = g U + u is member u of Ulysses
// group g (Communicator::subteam(rank, U)) and rank g of ring u (subteam(rank, W / U, U)). The team's layout
// with every U consecutive ranks merged is a ring layout of W / U ranks (RingLayout::grain U): group g's
// rows are exactly ring rank g's rows. So a call is three of weft's own passes, on sub-teams:
//   1. within the group, each member pushes each member's head share of its rows (q, k, v; the backward
//      also out, dO and LSE) into that member's buffers, in the merged layout's local order (the
//      communicator's workspace area "hybrid attention");
//   2. ring u attends those heads over the whole sequence (the ring ops on a layout of grain U);
//   3. each member pulls its rows of the output (O and LSE; the backward dQ, dK, dV, dK / dV summed over the
//      members sharing a K / V head) back from the group.
// The passes do not overlap one another; the ring overlaps its own K / V (or Q / dO) travel.
#include <algorithm>
#include <string>
#include <vector>

#include "attention_args.hpp"
#include "op_args.hpp"
#include "sequence_parallel.hpp"
#include "weft/ops/context_attention.hpp"
#include "weft/runtime/error.hpp"

namespace weft {
namespace {

const char* const kArea = "hybrid attention";

// The sizes of a call. L: the team's layout; M: the merged one (ring rank g = the rows of group g).
struct Sizes {
  int world, ulysses, rings, rank;
  ops::RingLayout L, M;
  int64_t local = 0, max_local = 1, merged = 0, max_merged = 1, heads, kv_heads, head_dim;
  ops::HeadShare q_share, kv_share;
  Sizes(int w, int u, int r, const std::vector<int64_t>& doc_lengths, ops::Sharding sharding, int64_t h,
        int64_t kv, int64_t d)
      : world(w),
        ulysses(u),
        rings(w / u),
        rank(r),
        L(ops::ring_layout(doc_lengths, w, sharding.causal, 1, sharding.zigzag)),
        M(ops::ring_layout(doc_lengths, w / u, sharding.causal, u, sharding.zigzag)),
        heads(h),
        kv_heads(kv),
        head_dim(d),
        q_share(ops::HeadShare::split(h, u)),
        kv_share(ops::HeadShare::split(kv, u)) {
    local = L.local_rows(r);
    max_local = std::max<int64_t>(1, ops::max_local_rows(L));
    merged = M.local_rows(r / u);
    max_merged = std::max<int64_t>(1, ops::max_local_rows(M));
  }
  size_t q_elements() const { return size_t(max_merged * q_share.width * head_dim); }
  size_t kv_elements() const { return size_t(max_merged * kv_share.width * head_dim); }
};

// The area: this member's heads of its group's rows (q, out, dout, dq; k, v, dk, dv; LSE), carved by this
// one function, with a base or without (sizing).
struct Area {
  char *q, *out, *dout, *dq, *k, *v, *dk, *dv;
  float* lse;
};
Area carve_area(ops::WorkspaceLayout& a, const Sizes& z) {
  Area r{};
  for (char** p : {&r.q, &r.out, &r.dout, &r.dq}) *p = a.take(z.q_elements() * 2);
  for (char** p : {&r.k, &r.v, &r.dk, &r.dv}) *p = a.take(z.kv_elements() * 2);
  r.lse = a.take<float>(size_t(z.max_merged * z.q_share.width) * 4);
  return r;
}
size_t area_bytes(const Sizes& z) {
  return ops::bytes_carved_by([&](ops::WorkspaceLayout& a) { carve_area(a, z); });
}

// The caller's workspace: this rank's local -> merged rows, then the ring's (the rest).
int32_t* carve_index(ops::WorkspaceLayout& w, const Sizes& z) {
  return w.take<int32_t>(size_t(z.max_local) * 4);
}
size_t index_bytes(const Sizes& z) {
  return ops::bytes_carved_by([&](ops::WorkspaceLayout& w) { carve_index(w, z); });
}

// Ulysses alone (U == W) or the ring alone (U == 1).
bool degenerate(int world, int ulysses) {
  return ulysses == world || ulysses == 1;
}

void check_split(int world, int ulysses, int64_t heads, int64_t kv_heads, const std::string& where) {
  WEFT_CHECK(ulysses >= 1 && world % ulysses == 0, where + "the Ulysses size (" + std::to_string(ulysses) +
                                                       ") must divide the world size (" +
                                                       std::to_string(world) + ")");
  if (degenerate(world, ulysses)) return;
  WEFT_CHECK(heads > 0 && heads % ulysses == 0, where + "heads (" + std::to_string(heads) +
                                                    ") must be a multiple of the Ulysses size (" +
                                                    std::to_string(ulysses) + ")");
  WEFT_CHECK(kv_heads > 0 && heads % kv_heads == 0, where + "heads must be a multiple of kv_heads");
  WEFT_CHECK(kv_heads % ulysses == 0 || ulysses % kv_heads == 0,
             where + "kv_heads (" + std::to_string(kv_heads) + ") and the Ulysses size (" +
                 std::to_string(ulysses) + ") must divide one another");
}

// What both passes start with: checks, the sub-teams, the area, the local -> merged rows.
struct Start {
  Rank *group = nullptr, *ring = nullptr;
  Area area{};
  int32_t* index = nullptr;
  char* ring_workspace = nullptr;
  size_t ring_workspace_bytes = 0;
};
Start start(ops::OpCall& call, const Sizes& z, const AttentionOptions& options, void* workspace,
            size_t workspace_bytes, DType dtype) {
  const std::string& where = call.where;
  ops::check_team_attention_options(options, true, where);
  ops::check_attention_call({1, 1, 1, z.heads, z.kv_heads, z.head_dim}, dtype, options, where);
  const size_t need = index_bytes(z);  // the ring checks its own part
  ops::check_workspace(workspace, workspace_bytes, need, "the op's workspace_bytes()", where);
  Start s;
  s.group = &call.comm.subteam(call.rank, z.ulysses, 1);
  s.ring = &call.comm.subteam(call.rank, z.rings, z.ulysses);
  ops::WorkspaceLayout area(call.workspace(area_bytes(z), kArea));
  s.area = carve_area(area, z);
  ops::WorkspaceLayout own(workspace);
  s.index = carve_index(own, z);
  s.ring_workspace = static_cast<char*>(workspace) + own.bytes();
  s.ring_workspace_bytes = workspace_bytes - own.bytes();
  if (!call.planning()) ops::write_row_index(ops::merged_runs(z.L, z.M, z.rank), s.index, call.stream);
  return s;
}

}  // namespace

size_t hybrid_attention_workspace_bytes(int world, int ulysses, const std::vector<int64_t>& doc_lengths,
                                        bool causal, int64_t heads, int64_t kv_heads, int64_t head_dim) {
  check_split(world, ulysses, heads, kv_heads, "weft::hybrid_attention_workspace_bytes: ");
  if (ulysses == world)
    return ulysses_attention_workspace_bytes(world, doc_lengths, causal, heads, kv_heads, head_dim);
  if (ulysses == 1) return ring_attention_workspace_bytes(world, doc_lengths, causal, kv_heads, head_dim);
  size_t index = 0;
  for (const ops::Sharding s : ops::Sharding(causal).both())
    index = std::max(index, index_bytes(Sizes(world, ulysses, 0, doc_lengths, s, heads, kv_heads, head_dim)));
  const Sizes z(world, ulysses, 0, doc_lengths, causal, heads, kv_heads, head_dim);
  return index +
         ops::ring_forward_workspace_bytes(z.rings, doc_lengths, causal, z.kv_share.width, head_dim, ulysses);
}

size_t hybrid_attention_backward_workspace_bytes(int world, int ulysses,
                                                 const std::vector<int64_t>& doc_lengths, bool causal,
                                                 int64_t heads, int64_t kv_heads, int64_t head_dim) {
  check_split(world, ulysses, heads, kv_heads, "weft::hybrid_attention_backward_workspace_bytes: ");
  if (ulysses == world)
    return ulysses_attention_backward_workspace_bytes(world, doc_lengths, causal, heads, kv_heads, head_dim);
  if (ulysses == 1)
    return ring_attention_backward_workspace_bytes(world, doc_lengths, causal, heads, kv_heads, head_dim);
  size_t index = 0;
  for (const ops::Sharding s : ops::Sharding(causal).both())
    index = std::max(index, index_bytes(Sizes(world, ulysses, 0, doc_lengths, s, heads, kv_heads, head_dim)));
  const Sizes z(world, ulysses, 0, doc_lengths, causal, heads, kv_heads, head_dim);
  return index + ops::ring_backward_workspace_bytes(z.rings, doc_lengths, causal, z.q_share.width,
                                                    z.kv_share.width, head_dim, ulysses);
}

namespace {

void forward(Communicator& comm, Rank& rank, const void* q, const void* k, const void* v, void* out,
             float* lse, const std::vector<int64_t>& doc_lengths, int64_t heads, int64_t kv_heads,
             int64_t head_dim, int ulysses, void* workspace, size_t workspace_bytes, DType dtype,
             cudaStream_t stream, const AttentionOptions& options, Plan* plan) {
  ops::OpCall call(comm, rank, stream, ops::team_where("weft::hybrid_attention_forward", rank), plan);
  const int W = rank.world();
  check_split(W, ulysses, heads, kv_heads, call.where);
  if (ulysses == W || ulysses == 1) {  // Ulysses or the ring alone
    const auto with_args = [&](auto op) {
      return op(comm, rank, q, k, v, out, lse, doc_lengths, heads, kv_heads, head_dim, workspace,
                workspace_bytes, dtype, call.stream, options);
    };
    if (plan)
      *plan = with_args(ulysses == W ? &ulysses_attention_forward_plan : &ring_attention_forward_plan);
    else
      with_args(ulysses == W ? &ulysses_attention_forward : &ring_attention_forward);
    return;
  }
  const Sizes z(W, ulysses, rank.rank(), doc_lengths, ops::sharding_of(options), heads, kv_heads, head_dim);
  ops::check_attention_operands(call, {q, k, v, out, lse}, false, z.local, heads, kv_heads, head_dim);
  const Start s = start(call, z, options, workspace, workspace_bytes, dtype);
  const Area& a = s.area;
  Rank& group = *s.group;
  const int64_t d = head_dim;
  call.planned_op("hybrid_attention_forward", "q, k, v heads pushed within the Ulysses group", 0, 0);
  if (!call.planning()) {
    ops::push_rows(comm, group, q, z.local, a.q, s.index, z.q_share, d, z.max_local, call.stream);
    ops::push_rows(comm, group, k, z.local, a.k, s.index, z.kv_share, d, z.max_local, call.stream);
    ops::push_rows(comm, group, v, z.local, a.v, s.index, z.kv_share, d, z.max_local, call.stream);
  }
  ops::ring_forward(
      comm, *s.ring, a.q, a.k, a.v, a.out, lse != nullptr ? a.lse : nullptr, doc_lengths, z.q_share.width,
      z.kv_share.width, d, s.ring_workspace, s.ring_workspace_bytes, dtype, call.stream, options, ulysses,
      {"weft::hybrid_attention_forward (its ring)", "hybrid_attention_workspace_bytes()", plan});
  call.planned_op("hybrid_attention_forward", "outputs (and LSE) pulled back within the group", 0, 0);
  if (call.planning()) return;
  ops::pull_rows(comm, group, a.out, false, out, z.local, s.index, z.q_share, d, z.max_local, dtype,
                 call.stream);
  if (lse != nullptr) ops::pull_lse(group, a.lse, lse, z.local, s.index, heads, z.merged, call.stream);
}

void backward(Communicator& comm, Rank& rank, const void* q, const void* k, const void* v, const void* out,
              const void* dout, const float* lse, void* dq, void* dk, void* dv,
              const std::vector<int64_t>& doc_lengths, int64_t heads, int64_t kv_heads, int64_t head_dim,
              int ulysses, void* workspace, size_t workspace_bytes, DType dtype, cudaStream_t stream,
              const AttentionOptions& options, Plan* plan) {
  ops::OpCall call(comm, rank, stream, ops::team_where("weft::hybrid_attention_backward", rank), plan);
  const int W = rank.world();
  check_split(W, ulysses, heads, kv_heads, call.where);
  if (ulysses == W || ulysses == 1) {  // Ulysses or the ring alone
    const auto with_args = [&](auto op) {
      return op(comm, rank, q, k, v, out, dout, lse, dq, dk, dv, doc_lengths, heads, kv_heads, head_dim,
                workspace, workspace_bytes, dtype, call.stream, options);
    };
    if (plan)
      *plan = with_args(ulysses == W ? &ulysses_attention_backward_plan : &ring_attention_backward_plan);
    else
      with_args(ulysses == W ? &ulysses_attention_backward : &ring_attention_backward);
    return;
  }
  const Sizes z(W, ulysses, rank.rank(), doc_lengths, ops::sharding_of(options), heads, kv_heads, head_dim);
  ops::check_attention_operands(call, {q, k, v, out, lse, dout, dq, dk, dv}, true, z.local, heads, kv_heads,
                                head_dim);
  const Start s = start(call, z, options, workspace, workspace_bytes, dtype);
  const Area& a = s.area;
  Rank& group = *s.group;
  const int64_t d = head_dim;
  const cudaStream_t st = call.stream;
  call.planned_op("hybrid_attention_backward",
                  "q, k, v, out, dout heads and LSE pushed within the Ulysses group", 0, 0);
  if (!call.planning()) {
    ops::push_rows(comm, group, q, z.local, a.q, s.index, z.q_share, d, z.max_local, st);
    // After the first push's meeting (every member is done with its previous call's buffers), before the
    // last push's (every member's rows have landed).
    ops::push_lse(group, lse, z.local, a.lse, s.index, heads, z.merged, st);
    ops::push_rows(comm, group, k, z.local, a.k, s.index, z.kv_share, d, z.max_local, st);
    ops::push_rows(comm, group, v, z.local, a.v, s.index, z.kv_share, d, z.max_local, st);
    ops::push_rows(comm, group, out, z.local, a.out, s.index, z.q_share, d, z.max_local, st);
    ops::push_rows(comm, group, dout, z.local, a.dout, s.index, z.q_share, d, z.max_local, st);
  }
  ops::ring_backward(
      comm, *s.ring, a.q, a.k, a.v, a.out, a.dout, a.lse, a.dq, a.dk, a.dv, doc_lengths, z.q_share.width,
      z.kv_share.width, d, s.ring_workspace, s.ring_workspace_bytes, dtype, st, options, ulysses,
      {"weft::hybrid_attention_backward (its ring)", "hybrid_attention_backward_workspace_bytes()", plan});
  call.planned_op("hybrid_attention_backward", "dq, dk, dv pulled back within the group (dK / dV summed)", 0,
                  0);
  if (call.planning()) return;
  ops::pull_rows(comm, group, a.dq, false, dq, z.local, s.index, z.q_share, d, z.max_local, dtype, st);
  ops::pull_rows(comm, group, a.dk, false, dk, z.local, s.index, z.kv_share, d, z.max_local, dtype, st);
  ops::pull_rows(comm, group, a.dv, false, dv, z.local, s.index, z.kv_share, d, z.max_local, dtype, st);
}

}  // namespace

void hybrid_attention_forward(Communicator& comm, Rank& rank, const void* q, const void* k, const void* v,
                              void* out, float* lse, const std::vector<int64_t>& doc_lengths, int64_t heads,
                              int64_t kv_heads, int64_t head_dim, int ulysses, void* workspace,
                              size_t workspace_bytes, DType dtype, cudaStream_t stream,
                              const AttentionOptions& options) {
  forward(comm, rank, q, k, v, out, lse, doc_lengths, heads, kv_heads, head_dim, ulysses, workspace,
          workspace_bytes, dtype, stream, options, nullptr);
}

Plan hybrid_attention_forward_plan(Communicator& comm, Rank& rank, const void* q, const void* k,
                                   const void* v, void* out, float* lse,
                                   const std::vector<int64_t>& doc_lengths, int64_t heads, int64_t kv_heads,
                                   int64_t head_dim, int ulysses, void* workspace, size_t workspace_bytes,
                                   DType dtype, cudaStream_t stream, const AttentionOptions& options) {
  Plan plan;
  forward(comm, rank, q, k, v, out, lse, doc_lengths, heads, kv_heads, head_dim, ulysses, workspace,
          workspace_bytes, dtype, stream, options, &plan);
  return plan;
}

void hybrid_attention_backward(Communicator& comm, Rank& rank, const void* q, const void* k, const void* v,
                               const void* out, const void* dout, const float* lse, void* dq, void* dk,
                               void* dv, const std::vector<int64_t>& doc_lengths, int64_t heads,
                               int64_t kv_heads, int64_t head_dim, int ulysses, void* workspace,
                               size_t workspace_bytes, DType dtype, cudaStream_t stream,
                               const AttentionOptions& options) {
  backward(comm, rank, q, k, v, out, dout, lse, dq, dk, dv, doc_lengths, heads, kv_heads, head_dim, ulysses,
           workspace, workspace_bytes, dtype, stream, options, nullptr);
}

Plan hybrid_attention_backward_plan(Communicator& comm, Rank& rank, const void* q, const void* k,
                                    const void* v, const void* out, const void* dout, const float* lse,
                                    void* dq, void* dk, void* dv, const std::vector<int64_t>& doc_lengths,
                                    int64_t heads, int64_t kv_heads, int64_t head_dim, int ulysses,
                                    void* workspace, size_t workspace_bytes, DType dtype, cudaStream_t stream,
                                    const AttentionOptions& options) {
  Plan plan;
  backward(comm, rank, q, k, v, out, dout, lse, dq, dk, dv, doc_lengths, heads, kv_heads, head_dim, ulysses,
           workspace, workspace_bytes, dtype, stream, options, &plan);
  return plan;
}

}  // namespace weft
