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

namespace {

// Blocks of `block` bytes as a [rows, cols] grid, transposed: dst block (c, r) = src block (r, c).
void transpose_blocks(const void* src, void* dst, size_t rows, size_t cols, size_t block,
                      cudaStream_t stream) {
  for (size_t c = 0; c < cols; ++c)  // src column c -> dst row c
    WEFT_CUDA_CHECK(cudaMemcpy2DAsync(static_cast<char*>(dst) + c * rows * block, block,
                                      static_cast<const char*>(src) + c * block, cols * block, block, rows,
                                      cudaMemcpyDeviceToDevice, stream));
}

}  // namespace

void hierarchical_all_to_all(MultiNodeTeam& t, const void* in, void* out, size_t count, DType dtype,
                             cudaStream_t stream) {
  stream = stream_of(t, stream);
  WEFT_CHECK(in != out, "hierarchical_all_to_all: in and out must differ (not in place)");
  t.check_alive();
  if (count == 0) return;
  const size_t nodes = t.nodes(), ns = t.node_size(), es = dtype_size(dtype), row = ns * count;
  // Block (m, i) of a [nodes, node_size] grid: in's block for rank m x node_size + i.
  char* scratch = static_cast<char*>(t.scratch(2 * nodes * row * es, stream));
  char *landed = scratch, *grouped = scratch + nodes * row * es;
  // 1. Among the i-th ranks: row m of in (every block for node m) to node m; landed row m: node m's i-th
  //    rank's blocks for this node, by destination index.
  const auto& n = nccl::api();
  nccl_call(t, "hierarchical_all_to_all: ncclSend / ncclRecv", [&](nccl::Comm across, nccl::Comm) {
    const int type = nccl::data_type(dtype);
    int rc = n.GroupStart();
    for (size_t m = 0; m < nodes && rc == 0; ++m) {
      rc = n.Send(static_cast<const char*>(in) + m * row * es, row, type, int(m), across, stream);
      if (rc == 0) rc = n.Recv(landed + m * row * es, row, type, int(m), across, stream);
    }
    const int end = n.GroupEnd();
    return rc != 0 ? rc : end;
  });
  // 2. Grouped by destination index (grouped row i': every node's blocks for this node's rank i'), then
  //    weft's all-to-all in the node: landed row i holds node rank i's blocks for this rank, from each node.
  transpose_blocks(landed, grouped, nodes, ns, count * es, stream);
  all_to_all(t.node_team(), t.node_rank(), grouped, landed, nodes * count, dtype, stream);
  // 3. Rank order: out block (m, i) = landed block (i, m).
  transpose_blocks(landed, out, ns, nodes, count * es, stream);
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
