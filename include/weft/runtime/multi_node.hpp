// A team spanning nodes (issue 58): weft's team of this node's ranks (its NVLink kernels and symmetric heap:
// peer mappings exist only inside the node, so nothing can address a rank of another node) plus NCCL
// communicators for the legs between nodes, made through the job's rendezvous (JobRendezvous). NCCL is
// loaded at run time, here only. The hierarchical collectives over it are in weft/ops/hierarchical.hpp.
//
// Ranks: rank = node x node_size + i (i: the rank inside its node, the launcher's contiguous blocks). The
// node team's rank is i; `across` holds the i-th rank of every node (its rank: the node).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "weft/runtime/communicator.hpp"
#include "weft/runtime/env.hpp"

namespace weft {

class JobRendezvous;

class MultiNodeTeam {
 public:
  // One rank per process under a launcher (torchrun, mpirun, weft-launch; WEFT_NODE_SIZE splits one host into
  // fake nodes for tests). Every rank of the job calls it; throws weft::Error with the reason (no NCCL, no
  // WEFT_JOB_SECRET across nodes, a rank missing at the timeout). A job of one node is a team of one node.
  static std::unique_ptr<MultiNodeTeam> create_from_launcher(const LaunchEnv& env, Options opts = {});
  static std::unique_ptr<MultiNodeTeam> create(Options opts = {});  // the process environment
  ~MultiNodeTeam();
  MultiNodeTeam(const MultiNodeTeam&) = delete;
  MultiNodeTeam& operator=(const MultiNodeTeam&) = delete;

  Communicator& node_team() { return *node_; }
  Rank& node_rank() { return node_->local(0); }
  int rank() const { return rank_; }
  int world() const { return world_; }
  int node() const { return node_index_; }
  int nodes() const { return nodes_; }
  int node_size() const { return node_size_; }
  // The NCCL communicators (ncclComm_t): `across` the i-th rank of every node; `all` every rank (NCCL's own
  // algorithms over the whole job: the baseline the hierarchical ops are measured against). Read them under
  // nccl_lock() and check_alive() before enqueueing: a failure takes them away (under the lock) and aborts
  // them from the watchdog's thread. Null once aborted. Call synchronize on the team's streams before the
  // team ends: its teardown aborts the communicators (destroying would wait for ever on a dead peer).
  void* nccl_across() const { return across_; }
  void* nccl_all() const { return all_; }
  std::mutex& nccl_lock() { return nccl_lock_; }
  // Throws the failure that ended the team (an NCCL error between nodes, a rank of this node lost), if any.
  void check_alive() const;
  // A device buffer of at least `bytes` on this rank's GPU, grown on demand (outside a graph capture; an
  // outgrown one is kept until the team ends). One buffer for the team's calls: they run one at a time,
  // on one stream or ordered between streams, as the team's collectives do.
  void* scratch(size_t bytes, cudaStream_t stream);
  // A second stream of this rank's GPU for a leg that overlaps the caller's stream (the NCCL leg beside
  // weft's in-node kernels), with events to fork and join it (one pair per piece of a pipelined call).
  // Created on first use (outside a capture); the team's calls use it one at a time, as the scratch.
  static constexpr int kSidePieces = 8;
  struct SideStream {
    cudaStream_t stream = nullptr;
    cudaEvent_t fork[kSidePieces] = {}, join[kSidePieces] = {};
  };
  const SideStream& side_stream();

 private:
  MultiNodeTeam() = default;
  int rank_ = 0, world_ = 1, node_index_ = 0, nodes_ = 1, node_size_ = 1;
  std::unique_ptr<JobRendezvous> job_;
  std::unique_ptr<Communicator> node_;
  void* across_ = nullptr;
  void* all_ = nullptr;
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
  std::vector<void*> retired_;  // outgrown scratch buffers, freed with the team
  SideStream side_;
  // The watchdog: every 20 ms, NCCL's asynchronous errors of both communicators, the node team's abort flag
  // and its device error records (a device wait that failed inside the node). On any, once: the NCCL
  // communicators are aborted (their kernels return; a rank that died on another node fails this one instead
  // of leaving it waiting in NCCL) and the node team too (its device waits fail), with the reason.
  void watch();
  void fail(const std::string& why);
  mutable std::mutex nccl_lock_;
  std::string failure_;  // under nccl_lock_
  std::atomic<bool> stop_{false};
  std::thread watchdog_;
};

}  // namespace weft
