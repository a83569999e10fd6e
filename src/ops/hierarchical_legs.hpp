// What the collectives across nodes share (internal to src/ops: hierarchical.cpp, hierarchical_moe.cu): the
// stream a call runs on, NCCL calls that respect the team's failure, and the block exchange among the i-th
// ranks of the nodes.
#pragma once
#include <cuda_runtime.h>

#include <mutex>
#include <string>

#include "../runtime/nccl_api.hpp"
#include "weft/ops/collectives.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/multi_node.hpp"

namespace weft::ops {

inline nccl::RedOp red_op(ReduceOp op) {
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

inline cudaStream_t stream_of(MultiNodeTeam& t, cudaStream_t s) {
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

// Among the i-th ranks of the nodes: block m of `send` (send_bytes each, `send_stride` apart: 0 sends the
// one block to every node) to node m, and node m's block for this node into block m of `recv` (recv_bytes
// each, back to back); one NCCL group of sends and receives (bytes as 8-bit words).
inline void exchange_across(MultiNodeTeam& t, const std::string& op, const void* send, size_t send_stride,
                            size_t send_bytes, void* recv, size_t recv_bytes, cudaStream_t stream) {
  const auto& n = nccl::api();
  nccl_call(t, op + ": ncclSend / ncclRecv", [&](nccl::Comm across, nccl::Comm) {
    int rc = n.GroupStart();
    for (int m = 0; m < t.nodes() && rc == 0; ++m) {
      rc = n.Send(static_cast<const char*>(send) + m * send_stride, send_bytes, nccl::kUint8, m, across,
                  stream);
      if (rc == 0)
        rc = n.Recv(static_cast<char*>(recv) + m * recv_bytes, recv_bytes, nccl::kUint8, m, across, stream);
    }
    const int end = n.GroupEnd();
    return rc != 0 ? rc : end;
  });
}

}  // namespace weft::ops
