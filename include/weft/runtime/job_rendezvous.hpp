// The rendezvous of a job whose ranks may span nodes (issue 58): the ranks of a node meet on the node-local
// Channel (the peers' uid and the job secret checked; descriptors, the heap handles, travel there only), and
// the nodes meet through their first ranks over TcpRendezvous (the job secret, required across nodes, is the
// only admission there). allgather() hands every rank every rank's bytes, whichever node they are on: what a
// team spanning nodes exchanges once (host names, the NCCL unique id). On one node it is the Channel alone.
//
// Where the first ranks meet (leaders_address): MASTER_ADDR, port WEFT_RENDEZVOUS_PORT, else MASTER_PORT + 1
// (torch's store, torchrun's or init_process_group's, listens on MASTER_PORT itself). The listener is closed
// once every node is in.
#pragma once
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "weft/runtime/channel.hpp"
#include "weft/runtime/env.hpp"
#include "weft/runtime/tcp_rendezvous.hpp"

namespace weft {

struct RendezvousAddress {
  std::string host;
  int port = 0;
};

// The nodes' meeting address from the environment (see the header); throws naming what is missing. Not
// needed (and not read) on a job of one node.
RendezvousAddress leaders_address(const EnvGetter& env, Launcher launcher);

class JobRendezvous {
 public:
  // Blocks until every rank of the job has joined (its node's Channel, then its node's first rank the
  // other nodes'), or throws after `timeout` naming who is missing. A job spanning nodes needs env.secret
  // (WEFT_JOB_SECRET, the same on every node).
  JobRendezvous(const LaunchEnv& env, const RendezvousAddress& leaders, std::chrono::milliseconds timeout);
  ~JobRendezvous();
  JobRendezvous(const JobRendezvous&) = delete;
  JobRendezvous& operator=(const JobRendezvous&) = delete;

  // Every rank's `mine`, by global rank. Collective over the whole job: every rank calls it, the same number
  // of times. Throws if a node reports another rank count than this one's.
  std::vector<std::string> allgather(const std::string& mine);

  Channel& node_channel() { return *node_; }  // this node's ranks (Channel rank = rank - node x node_size)
  int rank() const { return rank_; }
  int world() const { return world_; }
  int node() const { return node_index_; }
  int nodes() const { return nodes_; }

 private:
  int rank_, world_, node_index_, nodes_, node_size_;
  std::unique_ptr<Channel> node_;
  std::unique_ptr<TcpRendezvous> leaders_;  // the node's first rank only, on a job of several nodes
};

}  // namespace weft
