#include "weft/ops/hierarchical.hpp"

#include <algorithm>
#include <climits>
#include <mutex>
#include <string>

#include "hierarchical_legs.hpp"
#include "weft/ops/fused.hpp"
#include "weft/runtime/error.hpp"

namespace weft {

using ops::exchange_across;
using ops::nccl_call;
using ops::red_op;
using ops::stream_of;

void hierarchical_all_reduce(MultiNodeTeam& t, const void* in, void* out, size_t count, DType dtype,
                             ReduceOp op, cudaStream_t stream) {
  stream = stream_of(t, stream);
  Communicator& node = t.node_team();
  const auto& n = nccl::api();
  const size_t ns = t.node_size();
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
  // Pieces of the main part (each a whole number of node_size x `per` elements), pipelined: the in-node
  // reduce-scatters on the caller's stream, each piece's NCCL all-reduce on the side stream as soon as its
  // shard is summed, the in-node all-gathers after. Piece p's NCCL leg runs beside piece p + 1's
  // reduce-scatter and piece p - 1's all-gather. One piece below 8 MiB (the legs' fixed costs). (Beside
  // NCCL's kernel only weft's collective kernels run here: small blocks, several to an SM, not a fused
  // kernel as wide as the SM budget whose blocks could wait for ones NCCL keeps off the SMs.)
  const size_t pieces = std::clamp<size_t>(main * es / (size_t(8) << 20), 1, MultiNodeTeam::kSidePieces);
  const size_t per = (shard + pieces - 1) / pieces;  // each rank's elements of a piece
  char* part = static_cast<char*>(t.scratch(shard * es, stream));
  const auto piece = [&](size_t p, size_t& first, size_t& rows) {  // rank elements [first, first + rows)
    first = p * per;
    rows = first < shard ? std::min(per, shard - first) : 0;
  };
  const MultiNodeTeam::SideStream* side = pieces > 1 ? &t.side_stream() : nullptr;
  for (size_t p = 0; p < pieces; ++p) {
    size_t first = 0, rows = 0;
    piece(p, first, rows);
    if (rows == 0) continue;
    const char* from = static_cast<const char*>(in) + first * ns * es;
    reduce_scatter(node, t.node_rank(), from, part + first * es, Shape2D{rows, 1}, 0, dtype, op, stream);
    cudaStream_t leg = stream;
    if (side) {
      WEFT_CUDA_CHECK(cudaEventRecord(side->fork[p], stream));
      WEFT_CUDA_CHECK(cudaStreamWaitEvent(side->stream, side->fork[p], 0));
      leg = side->stream;
    }
    nccl_call(t, "hierarchical_all_reduce: ncclAllReduce", [&](nccl::Comm across, nccl::Comm) {
      return n.AllReduce(part + first * es, part + first * es, rows, nccl::data_type(dtype), red_op(op),
                         across, leg);
    });
    if (side) WEFT_CUDA_CHECK(cudaEventRecord(side->join[p], side->stream));
  }
  for (size_t p = 0; p < pieces; ++p) {
    size_t first = 0, rows = 0;
    piece(p, first, rows);
    if (rows == 0) continue;
    if (side) WEFT_CUDA_CHECK(cudaStreamWaitEvent(stream, side->join[p], 0));
    all_gather(node, t.node_rank(), part + first * es, static_cast<char*>(out) + first * ns * es,
               Shape2D{rows, 1}, 0, dtype, stream);
  }
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

// Blocks of `block` bytes as a [rows, cols] grid, transposed: dst block (c, r) = src block (r, c). A strided
// copy per column, or a copy per block where the source's pitch passes what cudaMemcpy2D takes (2^31 - 1).
void transpose_blocks(const void* src, void* dst, size_t rows, size_t cols, size_t block,
                      cudaStream_t stream) {
  const auto* from = static_cast<const char*>(src);
  auto* to = static_cast<char*>(dst);
  for (size_t c = 0; c < cols; ++c) {  // src column c -> dst row c
    if (cols * block <= size_t(INT32_MAX)) {
      WEFT_CUDA_CHECK(cudaMemcpy2DAsync(to + c * rows * block, block, from + c * block, cols * block, block,
                                        rows, cudaMemcpyDeviceToDevice, stream));
      continue;
    }
    for (size_t r = 0; r < rows; ++r)
      WEFT_CUDA_CHECK(cudaMemcpyAsync(to + (c * rows + r) * block, from + (r * cols + c) * block, block,
                                      cudaMemcpyDeviceToDevice, stream));
  }
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
  exchange_across(t, "hierarchical_all_to_all", in, row * es, row * es, landed, row * es, stream);
  // 2. Grouped by destination index (grouped row i': every node's blocks for this node's rank i'), then
  //    weft's all-to-all in the node: landed row i holds node rank i's blocks for this rank, from each node.
  transpose_blocks(landed, grouped, nodes, ns, count * es, stream);
  all_to_all(t.node_team(), t.node_rank(), grouped, landed, nodes * count, dtype, stream);
  // 3. Rank order: out block (m, i) = landed block (i, m).
  transpose_blocks(landed, out, ns, nodes, count * es, stream);
}

namespace {

// What both TP ops check: bf16 operands of whole 16-byte rows, sizes the GEMMs take.
void check_tp(const char* op, int64_t m, int64_t n, int64_t k) {
  WEFT_CHECK(m >= 1 && n >= 1 && k >= 1, std::string(op) + ": m, n and k must be at least 1");
  WEFT_CHECK(n % 8 == 0 && k % 8 == 0, std::string(op) +
                                           ": n and k must be multiples of 8 (16-byte rows), got " +
                                           std::to_string(n) + " and " + std::to_string(k));
}

}  // namespace

void hierarchical_all_gather_matmul(MultiNodeTeam& t, const void* a_shard, const void* b, void* out,
                                    void* gathered_a, int64_t m, int64_t n, int64_t k, BLayout b_layout,
                                    cudaStream_t stream) {
  check_tp("hierarchical_all_gather_matmul", m, n, k);
  stream = stream_of(t, stream);
  t.check_alive();
  WEFT_CUDA_CHECK(cudaSetDevice(t.node_rank().device()));
  const int64_t ns = t.node_size(), node_rows = ns * m, first = int64_t(t.node()) * node_rows;
  char* ga = static_cast<char*>(gathered_a ? gathered_a : t.scratch(size_t(t.world()) * m * k * 2, stream));
  // The NCCL leg on the side stream (after what the caller queued before: a_shard written), beside this
  // node's rows on the caller's stream.
  const MultiNodeTeam::SideStream& side = t.side_stream();
  WEFT_CUDA_CHECK(cudaEventRecord(side.fork[0], stream));
  WEFT_CUDA_CHECK(cudaStreamWaitEvent(side.stream, side.fork[0], 0));
  nccl_call(t, "hierarchical_all_gather_matmul: ncclAllGather", [&](nccl::Comm, nccl::Comm all) {
    return nccl::api().AllGather(a_shard, ga, size_t(m) * k, nccl::kBfloat16, all, side.stream);
  });
  WEFT_CUDA_CHECK(cudaEventRecord(side.join[0], side.stream));
  char* o = static_cast<char*>(out);
  // In the node: the gather, then the GEMM (FusedOptions::Mode::kSequential). Not the fused kernel: beside
  // NCCL's kernel on the side stream, a kernel as wide as the SM budget whose blocks wait for peers' blocks
  // could wait for ones that NCCL's keep from being scheduled.
  FusedOptions in_node;
  in_node.mode = FusedOptions::Mode::kSequential;
  all_gather_matmul(t.node_team(), t.node_rank(), a_shard, b, o + first * n * 2, nullptr, node_rows, n, k,
                    b_layout, stream, in_node);
  // The other nodes' rows, once their shards have landed: those before this node's, then those after.
  WEFT_CUDA_CHECK(cudaStreamWaitEvent(stream, side.join[0], 0));
  if (first > 0) gemm(ga, b, o, first, n, k, b_layout, DType::kBF16, stream);
  const int64_t after = int64_t(t.world()) * m - first - node_rows;
  if (after > 0)
    gemm(ga + (first + node_rows) * k * 2, b, o + (first + node_rows) * n * 2, after, n, k, b_layout,
         DType::kBF16, stream);
}

void hierarchical_matmul_reduce_scatter(MultiNodeTeam& t, const void* a, const void* b, void* out, int64_t m,
                                        int64_t n, int64_t k, BLayout b_layout, cudaStream_t stream) {
  check_tp("hierarchical_matmul_reduce_scatter", m, n, k);
  stream = stream_of(t, stream);
  t.check_alive();
  WEFT_CUDA_CHECK(cudaSetDevice(t.node_rank().device()));
  const size_t nodes = t.nodes(), ns = t.node_size(), block = size_t(m) * k * 2;
  // a's row blocks as [nodes][node_size] (block (g, i): rank g x node_size + i's rows), regrouped as
  // [node_size][nodes]: the in-node reduce-scatter then gives the i-th rank the node's sums of every node's
  // i-th rank's rows, [nodes][m][N]; among the i-th ranks, node g keeps its own.
  char* scratch = static_cast<char*>(t.scratch(nodes * ns * block + nodes * size_t(m) * n * 2, stream));
  char *regrouped = scratch, *sums = scratch + nodes * ns * block;
  transpose_blocks(a, regrouped, nodes, ns, block, stream);
  matmul_reduce_scatter(t.node_team(), t.node_rank(), regrouped, b, sums, int64_t(nodes * ns) * m, n, k,
                        b_layout, stream);
  nccl_call(t, "hierarchical_matmul_reduce_scatter: ncclReduceScatter", [&](nccl::Comm across, nccl::Comm) {
    return nccl::api().ReduceScatter(sums, out, size_t(m) * n, nccl::kBfloat16, nccl::kSum, across, stream);
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
