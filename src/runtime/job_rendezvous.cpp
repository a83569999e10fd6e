#include "weft/runtime/job_rendezvous.hpp"

#include <cstdint>
#include <map>
#include <mutex>
#include <utility>
#include <cstring>

#include "weft/runtime/error.hpp"

namespace weft {

namespace {

// Strings as one string: each as its 8-byte little-endian length, then its bytes.
std::string pack(const std::vector<std::string>& parts) {
  std::string out;
  for (const std::string& p : parts) {
    uint64_t n = p.size();
    for (int b = 0; b < 8; ++b) out.push_back(static_cast<char>((n >> (8 * b)) & 0xff));
    out += p;
  }
  return out;
}

std::vector<std::string> unpack(const std::string& blob, const std::string& what) {
  std::vector<std::string> parts;
  size_t at = 0;
  while (at < blob.size()) {
    WEFT_CHECK(blob.size() - at >= 8, "job rendezvous: " + what + " is truncated");
    uint64_t n = 0;
    for (int b = 0; b < 8; ++b) n |= uint64_t(static_cast<unsigned char>(blob[at + b])) << (8 * b);
    at += 8;
    WEFT_CHECK(blob.size() - at >= n, "job rendezvous: " + what + " is truncated");
    parts.push_back(blob.substr(at, n));
    at += n;
  }
  return parts;
}

// The number of JobRendezvous rank `rank` of job `job` made before in this process (ranks may be threads).
int next_generation(const std::string& job, int rank) {
  static std::mutex lock;
  static std::map<std::pair<std::string, int>, int> made;
  std::lock_guard<std::mutex> hold(lock);
  return made[{job, rank}]++;
}

}  // namespace

RendezvousAddress leaders_address(const EnvGetter& env, Launcher launcher) {
  RendezvousAddress a;
  const auto host = env("MASTER_ADDR");
  WEFT_CHECK(
      host && !host->empty(),
      "weft: a job spanning nodes meets at MASTER_ADDR, which is not set (torchrun sets it; weft-launch "
      "--master HOST:PORT sets it)");
  a.host = *host;
  if (auto p = env("WEFT_RENDEZVOUS_PORT"); p && !p->empty()) {
    a.port = parse_int(*p, "WEFT_RENDEZVOUS_PORT", 1, 65535);
    return a;
  }
  const auto master = env("MASTER_PORT");
  WEFT_CHECK(master && !master->empty(),
             "weft: a job spanning nodes needs WEFT_RENDEZVOUS_PORT or MASTER_PORT, neither is set");
  // torch's store (torchrun's, or init_process_group's env:// one) listens on MASTER_PORT: the nodes meet on
  // the next port, whatever the launcher.
  (void)launcher;
  a.port = parse_int(*master, "MASTER_PORT", 1, 65535) + 1;
  WEFT_CHECK(a.port <= 65535, "weft: MASTER_PORT + 1 is past 65535: set WEFT_RENDEZVOUS_PORT");
  return a;
}

JobRendezvous::JobRendezvous(const LaunchEnv& env, const RendezvousAddress& leaders,
                             std::chrono::milliseconds timeout)
    : rank_(env.rank),
      world_(env.world),
      node_index_(env.node),
      nodes_(env.nodes),
      node_size_(env.node_size) {
  WEFT_CHECK(node_size_ >= 1 && nodes_ * node_size_ == world_,
             "job rendezvous: " + std::to_string(nodes_) + " nodes of " + std::to_string(node_size_) +
                 " ranks do not make a world of " + std::to_string(world_));
  WEFT_CHECK(
      nodes_ == 1 || env.secret.size() >= 16,
      "weft: a job spanning nodes needs WEFT_JOB_SECRET (16 characters or more, the same on every node: "
      "e.g. WEFT_JOB_SECRET=$(openssl rand -hex 16) exported before the launchers start): the nodes "
      "meet over TCP, where the secret is the only admission");
  // The node's channel: named per node, so fake nodes of one host (WEFT_NODE_SIZE) meet apart, and per
  // rendezvous of the rank (every rank makes them in the same order), so a new one stays apart from a
  // previous one that a slow rank may still be leaving.
  const std::string job = env.job_id + ".rdv" + std::to_string(next_generation(env.job_id, rank_)) +
                          (nodes_ == 1 ? std::string() : ".node" + std::to_string(node_index_));
  node_ = std::make_unique<Channel>(job, rank_ - node_index_ * node_size_, node_size_, timeout, env.secret);
  if (nodes_ > 1 && rank_ % node_size_ == 0)
    leaders_ =
        std::make_unique<TcpRendezvous>(leaders.host, leaders.port, node_index_, nodes_, env.secret, timeout);
}

JobRendezvous::~JobRendezvous() = default;

std::vector<std::string> JobRendezvous::allgather(const std::string& mine) {
  Channel::Gathered in_node = node_->allgather(mine);
  if (nodes_ == 1) return std::move(in_node.data);
  // The first rank of each node trades its node's parts with the other nodes', then hands the whole to its
  // node (the others contribute nothing to that second round).
  std::string whole;
  if (leaders_) {
    const std::vector<std::string> per_node = leaders_->allgather(pack(in_node.data));
    std::vector<std::string> all;
    for (int n = 0; n < nodes_; ++n) {
      std::vector<std::string> parts = unpack(per_node[n], "node " + std::to_string(n) + "'s parts");
      WEFT_CHECK(static_cast<int>(parts.size()) == node_size_,
                 "job rendezvous: node " + std::to_string(n) + " has " + std::to_string(parts.size()) +
                     " ranks, node " + std::to_string(node_index_) + " " + std::to_string(node_size_) +
                     ": every node needs the same number of ranks");
      for (std::string& p : parts) all.push_back(std::move(p));
    }
    whole = pack(all);
  }
  Channel::Gathered handed = node_->allgather(whole);
  std::vector<std::string> all = unpack(handed.data[0], "the job's parts");
  WEFT_CHECK(static_cast<int>(all.size()) == world_, "job rendezvous: " + std::to_string(all.size()) +
                                                         " parts for a world of " + std::to_string(world_));
  return all;
}

}  // namespace weft
