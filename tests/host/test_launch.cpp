// weft-launch, run as a real program: environment of the ranks, exit status, grace kill, usage errors, and
// an end-to-end job in which this test binary itself is each rank.
#include <fcntl.h>
#include <sys/stat.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <future>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "test_util.hpp"
#include "weft/runtime/channel.hpp"
#include "weft/runtime/env.hpp"
#include "weft/runtime/job_rendezvous.hpp"

#ifndef WEFT_LAUNCH_PATH
#error "WEFT_LAUNCH_PATH must name the weft-launch binary"
#endif

using weft_test::Clock;
using weft_test::milliseconds;
using weft_test::ms_since;

namespace {

// ---- this binary as a rank under weft-launch -----------------------------------------------------------
// When WEFT_HOST_TEST_CHILD is set, the process is a rank started by weft-launch: it runs the named scenario
// before gtest starts and exits with its verdict (0 = as expected).
// A rank of a job of several nodes (one launcher each): every rank gets every rank's bytes, twice.
int job_rendezvous_rank(const weft::LaunchEnv& env) {
  weft::JobRendezvous job(env, weft::leaders_address(weft::process_env(), env.launcher),
                          std::chrono::milliseconds(10000));
  for (int round = 0; round < 2; ++round) {
    const auto all = job.allgather("rank " + std::to_string(env.rank) + " node " + std::to_string(env.node) +
                                   " round " + std::to_string(round));
    if (static_cast<int>(all.size()) != env.world) return 97;
    for (int r = 0; r < env.world; ++r)
      if (all[r] != "rank " + std::to_string(r) + " node " + std::to_string(r / env.node_size) + " round " +
                        std::to_string(round)) {
        weft_test::child_note("rank " + std::to_string(env.rank) + " got '" + all[r] + "' for rank " +
                              std::to_string(r));
        return 98;
      }
  }
  return env.nodes == 2 ? 0 : 99;
}

int launched_rank(const std::string& mode) {
  const auto env = weft::parse_launch_env(weft::process_env(), static_cast<long>(::getppid()));
  if (!env || env->launcher != weft::Launcher::kWeft) return 90;
  if (mode == "job_rendezvous") return job_rendezvous_rank(*env);
  weft::Channel ch(env->job_id, env->rank, env->world, std::chrono::milliseconds(5000));
  ch.set_op_timeout(std::chrono::milliseconds(10000));
  if (mode == "allgather") {
    const auto g = ch.allgather("hello from " + std::to_string(env->rank));
    for (int r = 0; r < env->world; ++r)
      if (g.data[r] != "hello from " + std::to_string(r)) return 91;
    ch.barrier();
    return 0;
  }
  if (mode == "die") {  // rank 1 crashes; the others must notice on their own, well before the grace kill
    ch.barrier();
    if (env->rank == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      ::_exit(3);
    }
    try {
      ch.allgather("never completes");
    } catch (const weft::Error& e) {
      const std::string msg = e.what();
      if (msg.find("rank 1") == std::string::npos) {
        weft_test::child_note("rank " + std::to_string(env->rank) + ": " + msg);
        return 92;
      }
      return 0;
    }
    return 93;
  }
  return 94;
}

const bool kLaunchedRankHook = [] {
  if (const char* mode = std::getenv("WEFT_HOST_TEST_CHILD")) {
    int rc = 95;
    try {
      rc = launched_rank(mode);
    } catch (const std::exception& e) {
      weft_test::child_note(std::string("launched rank failed: ") + e.what());
      rc = 96;
    }
    ::_exit(rc);
  }
  return true;
}();

// ---- running weft-launch -------------------------------------------------------------------------------

struct Result {
  int code = -1;       // weft-launch's exit status
  std::string output;  // its stdout and stderr, and the ranks'
  long long ms = 0;    // how long it ran
};

std::string temp_path(const std::string& tag) {
  static std::atomic<int> n{0};  // launches may run side by side (several nodes' launchers)
  return "/tmp/weft-host-test-" + std::to_string(::getpid()) + "-" + tag + "-" + std::to_string(n++);
}

Result launch(const std::vector<std::string>& args, const std::map<std::string, std::string>& env = {},
              milliseconds limit = milliseconds(10000)) {
  const std::string out_path = temp_path("out");
  std::vector<std::string> argv_s = {WEFT_LAUNCH_PATH};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  const auto t0 = Clock::now();
  const pid_t pid = weft_test::fork_child(
      [&] {
        for (auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
        const int fd = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (fd < 0) return 120;
        ::dup2(fd, 1);
        ::dup2(fd, 2);
        ::close(fd);
        std::vector<char*> argv;
        for (auto& a : argv_s) argv.push_back(const_cast<char*>(a.c_str()));
        argv.push_back(nullptr);
        ::alarm(0);  // weft-launch has its own limits; wait_child enforces ours
        ::execv(argv[0], argv.data());
        return 121;
      },
      0);
  Result r;
  r.code = weft_test::wait_child(pid, limit);
  r.ms = ms_since(t0);
  std::ifstream f(out_path);
  std::stringstream ss;
  ss << f.rdbuf();
  r.output = ss.str();
  ::unlink(out_path.c_str());
  return r;
}

std::string self_exe() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace

TEST(Launch, EveryRankSeesTheLaunchEnvironment) {
  const std::string dir = temp_path("env");
  ASSERT_EQ(::mkdir(dir.c_str(), 0700), 0);
  const Result r = launch({"-n", "3", "sh", "-c",
                           "echo \"$RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE $WEFT_JOB_ID "
                           "$WEFT_JOB_SECRET\" > \"$0/rank$RANK\"",
                           dir});
  EXPECT_EQ(r.code, 0) << r.output;
  std::string job, secret;
  for (int rank = 0; rank < 3; ++rank) {
    const std::string path = dir + "/rank" + std::to_string(rank);
    std::istringstream line(slurp(path));
    int rk = -1, lr = -1, ws = -1, lws = -1;
    std::string id, sec;
    line >> rk >> lr >> ws >> lws >> id >> sec;
    EXPECT_EQ(sec.size(), 32u) << "a job secret of 128 random bits, in hex: '" << sec << "'";
    if (rank == 0) secret = sec;
    EXPECT_EQ(sec, secret) << "all ranks of one launch share the job secret";
    EXPECT_EQ(rk, rank);
    EXPECT_EQ(lr, rank);
    EXPECT_EQ(ws, 3);
    EXPECT_EQ(lws, 3);
    EXPECT_FALSE(id.empty());
    if (rank == 0) job = id;
    EXPECT_EQ(id, job) << "all ranks of one launch share the job id";
    ::unlink(path.c_str());
  }
  ::rmdir(dir.c_str());
  // The ranks' environment is what parse_launch_env expects from weft-launch.
  std::map<std::string, std::string> vars = {{"RANK", "2"},        {"LOCAL_RANK", "2"},
                                             {"WORLD_SIZE", "3"},  {"LOCAL_WORLD_SIZE", "3"},
                                             {"WEFT_JOB_ID", job}, {"WEFT_JOB_SECRET", secret}};
  const auto e = weft::parse_launch_env(
      [&](const std::string& k) -> std::optional<std::string> {
        auto it = vars.find(k);
        return it == vars.end() ? std::nullopt : std::optional<std::string>(it->second);
      },
      1);
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->launcher, weft::Launcher::kWeft);
  EXPECT_EQ(e->job_id, job);
  EXPECT_EQ(e->secret, secret);
  vars["WEFT_JOB_SECRET"] = "short";  // a secret one could guess is refused by name
  std::string err;
  try {
    weft::parse_launch_env(
        [&](const std::string& k) -> std::optional<std::string> {
          auto it = vars.find(k);
          return it == vars.end() ? std::nullopt : std::optional<std::string>(it->second);
        },
        1);
  } catch (const weft::Error& x) {
    err = x.what();
  }
  EXPECT_NE(err.find("WEFT_JOB_SECRET must hold at least 16 characters"), std::string::npos) << err;
}

TEST(Launch, EachLaunchGetsItsOwnJobId) {
  const Result a = launch({"-n", "1", "sh", "-c", "echo \"id=$WEFT_JOB_ID secret=$WEFT_JOB_SECRET\""});
  const Result b = launch({"-n", "1", "sh", "-c", "echo \"id=$WEFT_JOB_ID secret=$WEFT_JOB_SECRET\""});
  EXPECT_EQ(a.code, 0);
  EXPECT_EQ(b.code, 0);
  EXPECT_HAS(a.output, "id=");
  EXPECT_NE(a.output, b.output);
}

TEST(Launch, AllRanksSucceeding) {
  const Result r = launch({"-n", "4", "--", "sh", "-c", "test \"$WORLD_SIZE\" = 4 && test \"$RANK\" -lt 4"});
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_LT(r.ms, 5000);
}

TEST(Launch, FailingRankExitStatusPropagates) {
  const Result r = launch({"-n", "3", "sh", "-c", "if [ \"$RANK\" = 1 ]; then exit 5; fi; exit 0"});
  EXPECT_EQ(r.code, 5) << r.output;
  EXPECT_HAS(r.output, "rank 1 exited with code 5");
}

TEST(Launch, AllRanksSkippedGives77) {
  const Result r = launch({"-n", "3", "sh", "-c", "exit 77"});
  EXPECT_EQ(r.code, 77) << r.output;
}

TEST(Launch, FailureWinsOverSkip) {
  // Rank 0 skips at once; rank 1 fails a little later: the job failed.
  const Result r =
      launch({"-n", "2", "sh", "-c", "if [ \"$RANK\" = 0 ]; then exit 77; fi; sleep 0.2; exit 3"});
  EXPECT_EQ(r.code, 3) << r.output;
  // And the other way round.
  const Result s =
      launch({"-n", "2", "sh", "-c", "if [ \"$RANK\" = 0 ]; then exit 3; fi; sleep 0.2; exit 77"});
  EXPECT_EQ(s.code, 3) << s.output;
}

TEST(Launch, HungRankIsKilledAfterGrace) {
  const Result r =
      launch({"-n", "3", "--grace", "1", "sh", "-c", "if [ \"$RANK\" = 0 ]; then exit 4; fi; exec sleep 30"},
             {}, milliseconds(8000));
  EXPECT_EQ(r.code, 4) << r.output;  // the first failure, not the kill of the hung ranks
  EXPECT_GE(r.ms, 900);
  EXPECT_LT(r.ms, 5000);
  EXPECT_HAS(r.output, "killing ranks still running 1 s after a rank failed");
}

TEST(Launch, RankKilledBySignalIsReported) {
  const Result r =
      launch({"-n", "2", "--grace", "5", "sh", "-c", "if [ \"$RANK\" = 1 ]; then kill -9 $$; fi"});
  EXPECT_EQ(r.code, 128 + 9) << r.output;
  EXPECT_HAS(r.output, "rank 1 killed by signal 9");
}

TEST(Launch, MissingProgramIs127) {
  const Result r = launch({"-n", "2", "/nonexistent/weft-test-program"});
  EXPECT_EQ(r.code, 127) << r.output;
  EXPECT_HAS(r.output, "cannot run /nonexistent/weft-test-program");
}

TEST(Launch, UsageErrors) {
  Result r = launch({});
  EXPECT_EQ(r.code, 2);
  EXPECT_HAS(r.output, "usage: weft-launch -n NPROC");
  r = launch({"sh", "-c", "exit 0"});  // no -n
  EXPECT_EQ(r.code, 2);
  EXPECT_HAS(r.output, "usage");
  r = launch({"-n", "2"});  // no program
  EXPECT_EQ(r.code, 2);
  EXPECT_HAS(r.output, "usage");
  r = launch({"-n", "0", "true"});
  EXPECT_EQ(r.code, 2);
  EXPECT_HAS(r.output, "-n='0' is not an integer in [1, ");
  r = launch({"-n", "two", "true"});
  EXPECT_EQ(r.code, 2);
  EXPECT_HAS(r.output, "-n='two'");
  r = launch({"-n", "2", "--grace", "-1", "true"});
  EXPECT_EQ(r.code, 2);
  EXPECT_HAS(r.output, "--grace='-1'");
  r = launch({"--frobnicate", "-n", "2", "true"});
  EXPECT_EQ(r.code, 2);
  EXPECT_HAS(r.output, "unknown option --frobnicate");
  r = launch({"-h"});
  EXPECT_EQ(r.code, 0);
  EXPECT_HAS(r.output, "usage");
}

TEST(Launch, EndToEndRanksRendezvous) {
  const std::string exe = self_exe();
  ASSERT_FALSE(exe.empty());
  const Result r = launch({"-n", "3", "--grace", "10", exe}, {{"WEFT_HOST_TEST_CHILD", "allgather"}});
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_LT(r.ms, 5000);
}

// Two launchers on one host as the two nodes of one job (--nnodes 2, each its --node-rank, one --master): the
// ranks meet through JobRendezvous (each node's Channel, the nodes' first ranks over TCP).
TEST(Launch, TwoLaunchersMakeOneJobOfTwoNodes) {
  const std::string exe = self_exe();
  ASSERT_FALSE(exe.empty());
  const std::string master = "127.0.0.1:" + std::to_string(weft_test::free_tcp_port());
  const std::map<std::string, std::string> env = {{"WEFT_HOST_TEST_CHILD", "job_rendezvous"},
                                                  {"WEFT_JOB_SECRET", "two-launchers-one-secret"}};
  auto node = [&](int index) {
    return std::async(std::launch::async, [&, index] {
      return launch({"-n", "2", "--nnodes", "2", "--node-rank", std::to_string(index), "--master", master,
                     "--grace", "10", exe},
                    env, milliseconds(20000));
    });
  };
  auto first = node(0), second = node(1);
  const Result a = first.get(), b = second.get();
  EXPECT_EQ(a.code, 0) << a.output;
  EXPECT_EQ(b.code, 0) << b.output;
}

TEST(Launch, SeveralNodesNeedAMasterAndOneSecret) {
  if (std::getenv("WEFT_JOB_SECRET") || std::getenv("MASTER_ADDR"))
    GTEST_SKIP() << "WEFT_JOB_SECRET or MASTER_ADDR is set in this test's environment";
  Result r = launch({"-n", "1", "--nnodes", "2", "--node-rank", "0", "--master", "127.0.0.1:1", "true"});
  EXPECT_EQ(r.code, 2);
  EXPECT_HAS(r.output, "needs WEFT_JOB_SECRET");
  r = launch({"-n", "1", "--nnodes", "2", "--node-rank", "0", "true"}, {{"WEFT_JOB_SECRET", "s"}});
  EXPECT_EQ(r.code, 2);
  EXPECT_HAS(r.output, "needs --master HOST:PORT");
  r = launch({"-n", "1", "--nnodes", "2", "--node-rank", "2", "--master", "h:1", "true"});
  EXPECT_EQ(r.code, 2);
  EXPECT_HAS(r.output, "is not a node of --nnodes 2");
  r = launch({"-n", "1", "--master", "nohost", "true"});
  EXPECT_EQ(r.code, 2);
  EXPECT_HAS(r.output, "--master wants HOST:PORT");
}

TEST(Launch, EndToEndCrashIsNoticedByTheOtherRanks) {
  const std::string exe = self_exe();
  ASSERT_FALSE(exe.empty());
  const Result r = launch({"-n", "3", "--grace", "20", exe}, {{"WEFT_HOST_TEST_CHILD", "die"}});
  EXPECT_EQ(r.code, 3) << r.output;
  EXPECT_HAS(r.output, "rank 1 exited with code 3");
  // The survivors failed their collective and exited by themselves (code 0 = with the expected message).
  EXPECT_LACKS(r.output, "killing");
  EXPECT_LACKS(r.output, "rank 0 exited");
  EXPECT_LACKS(r.output, "rank 2 exited");
  EXPECT_LT(r.ms, 5000);
}
