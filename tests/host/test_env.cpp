#include <gtest/gtest.h>
#include <stdlib.h>

#include <map>
#include <optional>
#include <string>

#include "test_util.hpp"
#include "weft/runtime/env.hpp"
#include "weft/team_view.hpp"

using weft::LaunchEnv;
using weft::Launcher;
using weft_test::error_of;

namespace {

using Vars = std::map<std::string, std::string>;

weft::EnvGetter fake(const Vars& vars) {
  return [vars](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

Vars torch(int rank, int world) {
  const std::string r = std::to_string(rank), w = std::to_string(world);
  return {{"RANK", r}, {"WORLD_SIZE", w}, {"LOCAL_RANK", r}, {"LOCAL_WORLD_SIZE", w}};
}

Vars ompi(int rank, int world) {
  const std::string r = std::to_string(rank), w = std::to_string(world);
  return {{"OMPI_COMM_WORLD_RANK", r},
          {"OMPI_COMM_WORLD_SIZE", w},
          {"OMPI_COMM_WORLD_LOCAL_RANK", r},
          {"OMPI_COMM_WORLD_LOCAL_SIZE", w}};
}

Vars with(Vars v, const Vars& extra) {
  for (auto& [k, x] : extra) v[k] = x;
  return v;
}

Vars without(Vars v, const std::string& name) {
  v.erase(name);
  return v;
}

LaunchEnv parse_ok(const Vars& v, long ppid = 4242) {
  std::optional<LaunchEnv> e;
  const std::string err = error_of([&] { e = weft::parse_launch_env(fake(v), ppid); });
  EXPECT_EQ(err, "<no exception>");
  EXPECT_TRUE(e.has_value());
  return e.value_or(LaunchEnv{});
}

std::string parse_err(const Vars& v) {
  return error_of([&] { weft::parse_launch_env(fake(v), 4242); });
}

}  // namespace

TEST(Env, NoLauncherVariablesMeansSingleProcess) {
  EXPECT_FALSE(weft::parse_launch_env(fake({}), 1).has_value());
  // Variables that only accompany a launcher do not make one.
  EXPECT_FALSE(weft::parse_launch_env(fake({{"MASTER_PORT", "29500"},
                                            {"TORCHELASTIC_RUN_ID", "abc"},
                                            {"PMIX_NAMESPACE", "ns"},
                                            {"OMPI_MCA_ess_base_jobid", "7"},
                                            {"WEFT_JOB_ID", "lonely"},
                                            {"CUDA_VISIBLE_DEVICES", "0"}}),
                                      1)
                   .has_value());
}

TEST(Env, TorchrunEnvironment) {
  const LaunchEnv e =
      parse_ok(with(torch(2, 4), {{"TORCHELASTIC_RUN_ID", "run42"}, {"MASTER_PORT", "29511"}}), 999);
  EXPECT_EQ(e.launcher, Launcher::kTorchrun);
  EXPECT_EQ(e.rank, 2);
  EXPECT_EQ(e.world, 4);
  EXPECT_EQ(e.local_rank, 2);
  EXPECT_EQ(e.local_world, 4);
  EXPECT_HAS(e.job_id, "run42");
  EXPECT_HAS(e.job_id, "29511");
  EXPECT_LACKS(e.job_id, "999");  // the launcher's own id wins over the parent pid
  EXPECT_STREQ(weft::launcher_name(e.launcher), "torchrun");
}

TEST(Env, TorchrunJobIdSeparatesJobsAndRestarts) {
  // Two torchrun jobs on one node, both with the default run id, differ by their master port.
  const Vars base = with(torch(0, 2), {{"TORCHELASTIC_RUN_ID", "none"}});
  const std::string a = parse_ok(with(base, {{"MASTER_PORT", "29500"}})).job_id;
  const std::string b = parse_ok(with(base, {{"MASTER_PORT", "29501"}})).job_id;
  EXPECT_NE(a, b);
  // An elastic restart of the same job must not meet the sockets of the previous attempt.
  const std::string c =
      parse_ok(with(base, {{"MASTER_PORT", "29500"}, {"TORCHELASTIC_RESTART_COUNT", "1"}})).job_id;
  EXPECT_NE(a, c);
  // The same variables give the same id in every rank.
  EXPECT_EQ(a,
            parse_ok(with(with(torch(1, 2), {{"TORCHELASTIC_RUN_ID", "none"}}), {{"MASTER_PORT", "29500"}}))
                .job_id);
}

TEST(Env, WeftJobIdMeansWeftLaunch) {
  const LaunchEnv e =
      parse_ok(with(torch(1, 3), {{"WEFT_JOB_ID", "launch-777"}, {"TORCHELASTIC_RUN_ID", "x"}}));
  EXPECT_EQ(e.launcher, Launcher::kWeft);
  EXPECT_EQ(e.job_id, "launch-777");
  EXPECT_EQ(e.rank, 1);
  EXPECT_EQ(e.world, 3);
  EXPECT_STREQ(weft::launcher_name(e.launcher), "weft-launch");
}

TEST(Env, OpenMpiEnvironment) {
  const LaunchEnv e = parse_ok(with(ompi(3, 4), {{"PMIX_NAMESPACE", "prterun-host-1234@1"}}));
  EXPECT_EQ(e.launcher, Launcher::kMpi);
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world, 4);
  EXPECT_EQ(e.local_rank, 3);
  EXPECT_EQ(e.local_world, 4);
  EXPECT_HAS(e.job_id, "prterun-host-1234@1");
  EXPECT_STREQ(weft::launcher_name(e.launcher), "mpirun");

  const LaunchEnv old = parse_ok(with(ompi(0, 2), {{"OMPI_MCA_ess_base_jobid", "3142320129"}}));
  EXPECT_EQ(old.launcher, Launcher::kMpi);
  EXPECT_HAS(old.job_id, "3142320129");

  // PMIx namespace and the ess job id name the same job: either is fine, but all ranks must agree.
  const Vars both = {{"PMIX_NAMESPACE", "ns9"}, {"OMPI_MCA_ess_base_jobid", "55"}};
  EXPECT_EQ(parse_ok(with(ompi(0, 2), both)).job_id, parse_ok(with(ompi(1, 2), both)).job_id);
  // WEFT_JOB_ID overrides the launcher's id.
  EXPECT_EQ(parse_ok(with(ompi(0, 2), {{"WEFT_JOB_ID", "mine"}, {"PMIX_NAMESPACE", "ns"}})).job_id, "mine");
}

TEST(Env, JobIdFallsBackToParentPid) {
  const LaunchEnv t = parse_ok(torch(0, 2), 31337);
  EXPECT_EQ(t.launcher, Launcher::kTorchrun);
  EXPECT_HAS(t.job_id, "31337");
  const LaunchEnv m = parse_ok(ompi(1, 2), 31338);
  EXPECT_HAS(m.job_id, "31338");
  // An empty WEFT_JOB_ID is no id at all.
  const LaunchEnv w = parse_ok(with(torch(0, 2), {{"WEFT_JOB_ID", ""}}), 31339);
  EXPECT_HAS(w.job_id, "31339");
  EXPECT_NE(parse_ok(torch(0, 2), 1).job_id, parse_ok(torch(0, 2), 2).job_id);
}

TEST(Env, IncompleteTorchrunEnvironmentNamesMissingVariables) {
  const std::string msg = parse_err({{"RANK", "0"}, {"WORLD_SIZE", "2"}});
  EXPECT_HAS(msg, "incomplete");
  EXPECT_HAS(msg, "LOCAL_RANK, LOCAL_WORLD_SIZE not set");
  EXPECT_LACKS(msg, "WORLD_SIZE, LOCAL_RANK, LOCAL");  // the present ones are not listed as missing

  const std::string only_local = parse_err({{"LOCAL_WORLD_SIZE", "2"}});
  EXPECT_HAS(only_local, "RANK, WORLD_SIZE, LOCAL_RANK not set");

  EXPECT_HAS(parse_err(without(torch(0, 2), "LOCAL_WORLD_SIZE")), "LOCAL_WORLD_SIZE not set");
}

TEST(Env, IncompleteMpiEnvironmentNamesMissingVariables) {
  const std::string msg = parse_err({{"OMPI_COMM_WORLD_RANK", "1"}});
  EXPECT_HAS(msg, "incomplete mpirun environment");
  EXPECT_HAS(msg, "OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_SIZE not set");
}

TEST(Env, MalformedValuesNameTheVariable) {
  struct Case {
    std::string var, value;
  };
  for (const Case& c : {Case{"RANK", "abc"}, Case{"RANK", "1.0"}, Case{"WORLD_SIZE", "4x"},
                        Case{"WORLD_SIZE", ""}, Case{"LOCAL_RANK", "-"}, Case{"LOCAL_WORLD_SIZE", "0x4"},
                        Case{"WORLD_SIZE", "99999999999999999999999"}}) {
    const std::string msg = parse_err(with(torch(1, 4), {{c.var, c.value}}));
    EXPECT_HAS(msg, c.var + "='" + c.value + "'");
    EXPECT_HAS(msg, "is not an integer in");
  }
  const std::string mpi = parse_err(with(ompi(0, 2), {{"OMPI_COMM_WORLD_SIZE", "two"}}));
  EXPECT_HAS(mpi, "OMPI_COMM_WORLD_SIZE='two'");
}

TEST(Env, OutOfRangeValuesNameTheVariableAndRange) {
  EXPECT_HAS(parse_err(with(torch(0, 1), {{"WORLD_SIZE", "0"}})), "WORLD_SIZE='0' is not an integer in [1, ");
  const std::string big = std::to_string(weft::kMaxWorld + 1);
  EXPECT_HAS(parse_err(torch(0, weft::kMaxWorld + 1)), "WORLD_SIZE='" + big + "'");
  EXPECT_HAS(parse_err(with(torch(0, 2), {{"RANK", "-1"}})), "RANK='-1' is not an integer in [0, 1]");
  EXPECT_HAS(parse_err(with(torch(0, 2), {{"LOCAL_WORLD_SIZE", "-3"}})), "LOCAL_WORLD_SIZE='-3'");
  // The largest world is accepted.
  EXPECT_EQ(parse_ok(torch(weft::kMaxWorld - 1, weft::kMaxWorld)).world, weft::kMaxWorld);
}

TEST(Env, RankMustBeBelowWorldSize) {
  const std::string msg = parse_err(with(torch(0, 4), {{"RANK", "4"}, {"LOCAL_RANK", "4"}}));
  EXPECT_HAS(msg, "RANK='4' is not an integer in [0, 3]");
  EXPECT_HAS(parse_err(with(torch(0, 4), {{"LOCAL_RANK", "7"}})),
             "LOCAL_RANK='7' is not an integer in [0, 3]");
  EXPECT_HAS(parse_err(with(ompi(0, 2), {{"OMPI_COMM_WORLD_RANK", "2"}})), "OMPI_COMM_WORLD_RANK='2'");
}

// Multi-node layouts parse (the communicator refuses them, not built yet): ranks in contiguous blocks per
// node; anything else is named. WEFT_NODE_SIZE splits one host into fake nodes.
TEST(Env, NodesOfAMultiNodeJob) {
  const LaunchEnv e =
      parse_ok({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"}});
  EXPECT_EQ(e.node, 1);
  EXPECT_EQ(e.nodes, 2);
  EXPECT_EQ(e.node_size, 4);
  const LaunchEnv m =
      parse_ok(with(ompi(3, 8), {{"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}}));
  EXPECT_EQ(m.node, 1);
  EXPECT_EQ(m.nodes, 4);
  const LaunchEnv one = parse_ok(torch(2, 4));
  EXPECT_EQ(one.nodes, 1);
  EXPECT_EQ(one.node_size, 4);
  const std::string uneven =
      parse_err({{"RANK", "5"}, {"WORLD_SIZE", "6"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"}});
  EXPECT_HAS(uneven, "same number of ranks on every node");
  const std::string scattered =
      parse_err({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "4"}});
  EXPECT_HAS(scattered, "contiguous blocks");
}

TEST(Env, FakeNodesSplitOneHost) {
  const LaunchEnv e = parse_ok(with(torch(3, 4), {{"WEFT_NODE_SIZE", "2"}}));
  EXPECT_EQ(e.node, 1);
  EXPECT_EQ(e.nodes, 2);
  EXPECT_EQ(e.node_size, 2);
  EXPECT_HAS(parse_err(with(torch(0, 4), {{"WEFT_NODE_SIZE", "3"}})), "does not divide");
  EXPECT_HAS(parse_err(with(torch(0, 4), {{"WEFT_NODE_SIZE", "8"}})), "WEFT_NODE_SIZE='8'");
}

TEST(Env, RankAndLocalRankMustAgreeOnOneNode) {
  const std::string msg = parse_err(with(torch(1, 4), {{"LOCAL_RANK", "2"}}));
  EXPECT_HAS(msg, "RANK=1");
  EXPECT_HAS(msg, "LOCAL_RANK=2");
}

TEST(Env, JobIdIsSanitized) {
  const std::string a = parse_ok(with(torch(0, 2), {{"WEFT_JOB_ID", "a/b c/d"}})).job_id;
  EXPECT_EQ(a, "a_b_c_d");
  const std::string t =
      parse_ok(with(torch(0, 2), {{"TORCHELASTIC_RUN_ID", "x/y"}, {"MASTER_PORT", "1"}})).job_id;
  EXPECT_LACKS(t, "/");
  EXPECT_HAS(t, "x_y");
  const std::string ns = parse_ok(with(ompi(0, 2), {{"PMIX_NAMESPACE", "/tmp/ns 1"}})).job_id;
  EXPECT_LACKS(ns, "/");
  EXPECT_LACKS(ns, " ");
  // Long ids are cut to fit a socket name, keeping the (distinguishing) end.
  const std::string long_id = std::string(200, 'j') + "-tail-1";
  const std::string cut = parse_ok(with(torch(0, 2), {{"WEFT_JOB_ID", long_id}})).job_id;
  EXPECT_EQ(cut.size(), 64u);
  EXPECT_EQ(cut, long_id.substr(long_id.size() - 64));
}

TEST(Env, ParseIntEdgeCases) {
  EXPECT_EQ(weft::parse_int("0", "x", 0, 5), 0);
  EXPECT_EQ(weft::parse_int("5", "x", 0, 5), 5);
  EXPECT_EQ(weft::parse_int("-3", "x", -5, 5), -3);
  EXPECT_EQ(weft::parse_int("007", "x", 0, 10), 7);  // decimal, not octal
  EXPECT_EQ(weft::parse_int("2147483647", "x", 0, 2147483647), 2147483647);
  for (const char* bad : {"", "6", "-1", "abc", "1e3", "3 ", "0x3", "+", "-", "4.", "99999999999999999999",
                          "-99999999999999999999", "2147483648", "4294967297"}) {
    const std::string msg = error_of([&] { weft::parse_int(bad, "--thing", 0, 5); });
    EXPECT_HAS(msg, std::string("--thing='") + bad + "' is not an integer in [0, 5]");
  }
}

TEST(Env, ProcessEnvReadsTheRealEnvironment) {
  const std::string name = "WEFT_HOST_TEST_VAR_" + std::to_string(::getpid());
  const weft::EnvGetter env = weft::process_env();
  EXPECT_FALSE(env(name).has_value());
  ASSERT_EQ(::setenv(name.c_str(), "", 1), 0);
  EXPECT_EQ(env(name), std::optional<std::string>(""));  // set but empty is still set
  ASSERT_EQ(::setenv(name.c_str(), "v a/l", 1), 0);
  EXPECT_EQ(env(name), std::optional<std::string>("v a/l"));
  ::unsetenv(name.c_str());
  EXPECT_FALSE(env(name).has_value());
}

TEST(Env, LauncherNames) {
  EXPECT_STREQ(weft::launcher_name(Launcher::kNone), "single-process");
  EXPECT_STREQ(weft::launcher_name(Launcher::kTorchrun), "torchrun");
  EXPECT_STREQ(weft::launcher_name(Launcher::kMpi), "mpirun");
  EXPECT_STREQ(weft::launcher_name(Launcher::kWeft), "weft-launch");
}
