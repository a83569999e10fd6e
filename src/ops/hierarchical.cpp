#include "weft/ops/hierarchical.hpp"

#include <mutex>
#include <string>

#include "../runtime/nccl_api.hpp"
#include "weft/runtime/error.hpp"

namespace weft {

namespace {

nccl::RedOp red_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return nccl::kSum;
    case ReduceOp::kMax:
      return nccl::kMax;
    case ReduceOp::kMin:
      return nccl::kMin;
  }
  throw_error("weft: no NCCL reduction for this op");
}

cudaStream_t stream_of(MultiNodeTeam& t, cudaStream_t s) {
  return s ? s : t.node_rank().stream();
}

// Enqueues enqueue(across, all) (the team's NCCL communicators) unless the team has failed. The lock covers
// taking the pointers, not the enqueue (which can block on the host until the GPU drains NCCL's queue, or
// until an abort): the watchdog takes them away under it before it aborts them, as torch's does. A call
// already past the check may still reach an aborting communicator, whose flag makes it return.
template <class Enqueue>
void nccl_call(MultiNodeTeam& t, const std::string& what, Enqueue&& enqueue) {
  nccl::Comm across = nullptr, all = nullptr;
  {
    std::lock_guard<std::mutex> hold(t.nccl_lock());
    across = static_cast<nccl::Comm>(t.nccl_across());
    all = static_cast<nccl::Comm>(t.nccl_all());
  }
  t.check_alive();
  WEFT_CHECK(across != nullptr && all != nullptr, what + ": the team was aborted");
  nccl::check(enqueue(across, all), "weft: " + what);
}

}  // namespace

void hierarchical_all_reduce(MultiNodeTeam& t, const void* in, void* out, size_t count, DType dtype,
                             ReduceOp op, cudaStream_t stream) {
  stream = stream_of(t, stream);
  Communicator& node = t.node_team();
  const auto& n = nccl::api();
  const int ns = t.node_size();
  if (count == 0) return;
  // The elements past the last whole shard (fewer than node_size): NCCL's all-reduce over every rank (they
  // are apart from the main part's, so in == out stays safe).
  const size_t shard = count / ns, main = shard * ns, es = dtype_size(dtype);
  if (main < count)
    nccl_call(t, "hierarchical_all_reduce: ncclAllReduce (the last count % node_size elements)",
              [&](nccl::Comm, nccl::Comm all) {
                return n.AllReduce(static_cast<const char*>(in) + main * es,
                                   static_cast<char*>(out) + main * es, count - main, nccl::data_type(dtype),
                                   red_op(op), all, stream);
              });
  if (shard == 0) return;
  void* part = t.scratch(shard * es, stream);
  reduce_scatter(node, t.node_rank(), in, part, Shape2D{shard, 1}, 0, dtype, op, stream);
  nccl_call(t, "hierarchical_all_reduce: ncclAllReduce", [&](nccl::Comm across, nccl::Comm) {
    return n.AllReduce(part, part, shard, nccl::data_type(dtype), red_op(op), across, stream);
  });
  all_gather(node, t.node_rank(), part, out, Shape2D{shard, 1}, 0, dtype, stream);
}

void hierarchical_all_gather(MultiNodeTeam& t, const void* in, void* out, size_t count, DType dtype,
                             cudaStream_t stream) {
  stream = stream_of(t, stream);
  if (count == 0) return;
  // [nodes, count]: row m the i-th rank of node m's; gathered along columns in the node: row m becomes
  // node m's ranks' blocks side by side, which is out's layout.
  void* rows = t.scratch(size_t(t.nodes()) * count * dtype_size(dtype), stream);
  nccl_call(t, "hierarchical_all_gather: ncclAllGather", [&](nccl::Comm across, nccl::Comm) {
    return nccl::api().AllGather(in, rows, count, nccl::data_type(dtype), across, stream);
  });
  all_gather(t.node_team(), t.node_rank(), rows, out, Shape2D{size_t(t.nodes()), count}, 1, dtype, stream);
}

void hierarchical_reduce_scatter(MultiNodeTeam& t, const void* in, void* out, size_t count, DType dtype,
                                 ReduceOp op, cudaStream_t stream) {
  stream = stream_of(t, stream);
  if (count == 0) return;
  // in as [nodes, node_size x count]: reduced in the node along columns, the i-th rank keeps [nodes, count],
  // the node's sum of each node's i-th block; then among the i-th ranks, node m keeps row m.
  void* rows = t.scratch(size_t(t.nodes()) * count * dtype_size(dtype), stream);
  reduce_scatter(t.node_team(), t.node_rank(), in, rows, Shape2D{size_t(t.nodes()), count}, 1, dtype, op,
                 stream);
  nccl_call(t, "hierarchical_reduce_scatter: ncclReduceScatter", [&](nccl::Comm across, nccl::Comm) {
    return nccl::api().ReduceScatter(rows, out, count, nccl::data_type(dtype), red_op(op), across, stream);
  });
}

void hierarchical_broadcast(MultiNodeTeam& t, const void* in, void* out, size_t count, DType dtype, int root,
                            cudaStream_t stream) {
  stream = stream_of(t, stream);
  WEFT_CHECK(root >= 0 && root < t.world(), "hierarchical_broadcast: root " + std::to_string(root) +
                                                " is not a rank of the job's " + std::to_string(t.world()));
  t.check_alive();
  if (count == 0) return;
  const int index = root % t.node_size();  // root's place in its node
  if (t.rank() % t.node_size() == index)   // the index-th ranks: out of root's node into every node's
    nccl_call(t, "hierarchical_broadcast: ncclBroadcast", [&](nccl::Comm across, nccl::Comm) {
      return nccl::api().Broadcast(in, out, count, nccl::data_type(dtype), root / t.node_size(), across,
                                   stream);
    });
  broadcast(t.node_team(), t.node_rank(), out, out, count, dtype, index, stream);
}

}  // namespace weft
