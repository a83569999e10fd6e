// JobRendezvous (weft/runtime/job_rendezvous.hpp): ranks in threads of this process as the nodes of one job
// (each node's Channel, the nodes' first ranks over TCP on 127.0.0.1). Every rank gets every rank's bytes in
// rank order whatever the split into nodes; a job spanning nodes without a secret is refused before anything
// listens; the nodes' meeting address comes from the environment as documented.
#include <gtest/gtest.h>

#include <future>
#include <map>
#include <string>
#include <vector>

#include "test_util.hpp"
#include "weft/runtime/job_rendezvous.hpp"

using weft::JobRendezvous;
using weft::LaunchEnv;
using namespace std::chrono_literals;

namespace {

LaunchEnv rank_env(const std::string& job, int rank, int nodes, int node_size, const std::string& secret) {
  LaunchEnv e;
  e.launcher = weft::Launcher::kWeft;
  e.rank = rank;
  e.world = nodes * node_size;
  e.local_world = node_size;
  e.local_rank = rank % node_size;
  e.node = rank / node_size;
  e.nodes = nodes;
  e.node_size = node_size;
  e.job_id = job;
  e.secret = secret;
  return e;
}

// Every rank of a job of `nodes` x `node_size` ranks, each in a thread: three allgathers of "r<rank>c<call>".
std::vector<std::vector<std::string>> run_job(int nodes, int node_size) {
  const std::string job = weft_test::unique_job("jobrdv");
  const weft::RendezvousAddress at{"127.0.0.1", weft_test::free_tcp_port()};
  std::vector<std::future<std::vector<std::string>>> ranks;
  for (int r = 0; r < nodes * node_size; ++r)
    ranks.push_back(std::async(std::launch::async, [=] {
      JobRendezvous j(rank_env(job, r, nodes, node_size, "0123456789abcdef-job"), at, 5000ms);
      std::vector<std::string> got;
      for (int c = 0; c < 3; ++c)
        for (const std::string& s : j.allgather("r" + std::to_string(r) + "c" + std::to_string(c)))
          got.push_back(s);
      return got;
    }));
  std::vector<std::vector<std::string>> out;
  for (auto& f : ranks) out.push_back(f.get());
  return out;
}

}  // namespace

TEST(JobRendezvous, EveryRankGetsEveryRanksBytesAcrossNodes) {
  for (auto [nodes, node_size] : {std::pair{1, 3}, {2, 2}, {3, 1}, {2, 3}}) {
    const int world = nodes * node_size;
    std::vector<std::string> want;
    for (int c = 0; c < 3; ++c)
      for (int r = 0; r < world; ++r) want.push_back("r" + std::to_string(r) + "c" + std::to_string(c));
    for (const auto& got : run_job(nodes, node_size)) EXPECT_EQ(got, want) << nodes << " x " << node_size;
  }
}

TEST(JobRendezvous, SeveralNodesNeedTheJobSecret) {
  const std::string msg = weft_test::error_of([] {
    JobRendezvous j(rank_env("nosecret", 0, 2, 1, ""), weft::RendezvousAddress{"127.0.0.1", 1}, 100ms);
  });
  EXPECT_HAS(msg, "needs WEFT_JOB_SECRET");
}

TEST(JobRendezvous, LeadersAddressFromTheEnvironment) {
  auto getter = [](std::map<std::string, std::string> vars) -> weft::EnvGetter {
    return [vars](const std::string& k) -> std::optional<std::string> {
      auto it = vars.find(k);
      if (it == vars.end()) return std::nullopt;
      return it->second;
    };
  };
  using weft::Launcher;
  auto a =
      weft::leaders_address(getter({{"MASTER_ADDR", "n0"}, {"MASTER_PORT", "29500"}}), Launcher::kTorchrun);
  EXPECT_EQ(a.host, "n0");
  EXPECT_EQ(a.port, 29501);  // torch's store holds MASTER_PORT itself
  a = weft::leaders_address(getter({{"MASTER_ADDR", "n0"}, {"MASTER_PORT", "29500"}}), Launcher::kMpi);
  EXPECT_EQ(a.port, 29501);
  a = weft::leaders_address(
      getter({{"MASTER_ADDR", "n0"}, {"MASTER_PORT", "29500"}, {"WEFT_RENDEZVOUS_PORT", "40000"}}),
      Launcher::kTorchrun);
  EXPECT_EQ(a.port, 40000);
  EXPECT_HAS(weft_test::error_of([&] { weft::leaders_address(getter({}), Launcher::kTorchrun); }),
             "MASTER_ADDR");
  EXPECT_HAS(weft_test::error_of([&] {
               weft::leaders_address(getter({{"MASTER_ADDR", "n0"}}), Launcher::kMpi);
             }),
             "MASTER_PORT");
}
