// weft-launch: starts one process per GPU on this node, the way torchrun would, with no Python needed.
//   weft-launch -n 4 ./my_program args...
//   weft-launch -n 8 --nnodes 2 --node-rank 0 --master node0:29500 ./my_program   (on each node, its rank)
// Each child gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, a job-unique WEFT_JOB_ID and the job's
// WEFT_JOB_SECRET (random, or the one the caller set; see weft::LaunchEnv::secret). When a child
// fails, the others are expected to notice within seconds (weft's runtime does); any still running after a
// grace period are killed, so the launcher never hangs.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "weft/runtime/env.hpp"
#include "weft/runtime/error.hpp"
#include "weft/team_view.hpp"

namespace {
volatile sig_atomic_t g_forward_signal = 0;
void on_signal(int sig) {
  g_forward_signal = sig;
}

int usage() {
  std::fprintf(stderr,
               "usage: weft-launch -n NPROC [--nnodes N --node-rank I --master HOST:PORT] [--grace SECONDS]\n"
               "                   [--] PROGRAM [ARGS...]\n"
               "Starts NPROC copies of PROGRAM, one rank each, on this node. A job of N nodes runs one\n"
               "launcher per node, each with its --node-rank (ranks I x NPROC ..), the same --master (an\n"
               "address of node 0 every node reaches) and the same WEFT_JOB_SECRET in the environment.\n");
  return 2;
}
// The job's secret (weft::LaunchEnv::secret): 128 random bits unless the caller chose one. Only processes
// that know it join the ranks' rendezvous; it reaches the ranks through their environment only. Empty if
// no random bits could be read.
std::string job_secret() {
  if (const char* given = std::getenv("WEFT_JOB_SECRET"); given != nullptr && *given != '\0') return given;
  unsigned char bytes[16];
  std::FILE* f = std::fopen("/dev/urandom", "rb");
  const bool read = f != nullptr && std::fread(bytes, 1, sizeof bytes, f) == sizeof bytes;
  if (f != nullptr) std::fclose(f);
  if (!read) return {};
  std::string secret;
  for (unsigned char b : bytes) {
    char hex[3];
    std::snprintf(hex, sizeof hex, "%02x", b);
    secret += hex;
  }
  return secret;
}

// This launcher's place in a job of several nodes (one launcher per node).
struct Nodes {
  int count = 1, index = 0;
  std::string master_host;  // --master HOST:PORT: the nodes' meeting address (node 0's), empty: none given
  int master_port = 0;
};

// Starts local rank r = 0 .. nproc - 1 of program argv[0] (each leading its own process group); empty if a
// fork failed.
std::vector<pid_t> start_ranks(int nproc, const Nodes& nodes, char** argv, const std::string& job,
                               const std::string& secret) {
  std::vector<pid_t> kids;
  for (int r = 0; r < nproc; ++r) {
    pid_t pid = ::fork();
    if (pid < 0) {
      std::perror("weft-launch: fork");
      for (pid_t k : kids) ::kill(-k, SIGTERM);  // the ranks started so far would wait for the rest
      for (pid_t k : kids) ::waitpid(k, nullptr, 0);
      return {};
    }
    if (pid == 0) {
      ::setpgid(0, 0);  // each rank leads its own process group: the launcher can stop what it starts
      ::setenv("RANK", std::to_string(nodes.index * nproc + r).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(nodes.count * nproc).c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", std::to_string(nproc).c_str(), 1);
      if (!nodes.master_host.empty()) {
        ::setenv("MASTER_ADDR", nodes.master_host.c_str(), 1);
        ::setenv("MASTER_PORT", std::to_string(nodes.master_port).c_str(), 1);  // weft's nodes meet on + 1
      }
      ::setenv("WEFT_JOB_ID", job.c_str(), 1);
      ::setenv("WEFT_JOB_SECRET", secret.c_str(), 1);
      ::execvp(argv[0], argv);
      std::fprintf(stderr, "weft-launch: cannot run %s\n", argv[0]);
      std::_Exit(127);
    }
    ::setpgid(pid, pid);
    kids.push_back(pid);
  }
  return kids;
}

// Waits for every rank; forwards SIGINT / SIGTERM to them, kills those still running grace_s seconds after
// one failed. Returns the first failure's code, else 77 ("skipped") if a rank skipped, else 0.
int wait_ranks(std::vector<pid_t> kids, int grace_s) {
  const int nproc = static_cast<int>(kids.size());
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  auto signal_all = [&](int sig) {
    for (pid_t k : kids)
      if (k > 0) ::kill(-k, sig);
  };
  int status_out = 0, alive = nproc;
  std::chrono::steady_clock::time_point kill_at{};
  bool failing = false;
  while (alive > 0) {
    if (g_forward_signal != 0) {  // Ctrl-C / termination of the launcher reaches every rank
      signal_all(g_forward_signal);
      g_forward_signal = 0;
    }
    int st = 0;
    pid_t pid = ::waitpid(-1, &st, WNOHANG);
    if (pid == 0) {
      if (failing && std::chrono::steady_clock::now() >= kill_at) {
        std::fprintf(stderr, "weft-launch: killing ranks still running %d s after a rank failed\n", grace_s);
        signal_all(SIGKILL);
        kill_at = std::chrono::steady_clock::time_point::max();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
    if (pid < 0) {
      if (errno == EINTR) continue;
      break;
    }
    --alive;
    int rank = -1;
    for (int r = 0; r < nproc; ++r)
      if (kids[r] == pid) {
        rank = r;
        kids[r] = -1;
      }
    int code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    if (code == 77 && !failing) {  // the program's "skipped" exit code (no GPU): not a failure
      if (status_out == 0) status_out = 77;
      continue;
    }
    if (code != 0) {
      if (WIFSIGNALED(st))
        std::fprintf(stderr, "weft-launch: rank %d killed by signal %d\n", rank, WTERMSIG(st));
      else
        std::fprintf(stderr, "weft-launch: rank %d exited with code %d\n", rank, code);
      if (status_out == 0 || status_out == 77) status_out = code;
      if (!failing) {
        failing = true;
        kill_at = std::chrono::steady_clock::now() + std::chrono::seconds(grace_s);
      }
    }
  }
  return status_out;
}

// HOST:PORT of --master into n; throws naming the malformed part.
void parse_master(const std::string& text, Nodes& n) {
  const size_t colon = text.rfind(':');
  if (colon == std::string::npos || colon == 0)
    weft::throw_error("weft-launch: --master wants HOST:PORT, got '" + text + "'");
  n.master_host = text.substr(0, colon);
  n.master_port = weft::parse_int(text.substr(colon + 1), "--master's port", 1, 65535);
}
}  // namespace

int main(int argc, char** argv) {
  int nproc = 0, grace_s = 30, i = 1;
  Nodes nodes;
  try {
    for (; i < argc; ++i) {
      std::string a = argv[i];
      if ((a == "-n" || a == "--nproc") && i + 1 < argc)
        nproc = weft::parse_int(argv[++i], "-n", 1, weft::kMaxWorld);
      else if (a == "--nnodes" && i + 1 < argc)
        nodes.count = weft::parse_int(argv[++i], "--nnodes", 1, weft::kMaxWorld);
      else if (a == "--node-rank" && i + 1 < argc)
        nodes.index = weft::parse_int(argv[++i], "--node-rank", 0, weft::kMaxWorld);
      else if (a == "--master" && i + 1 < argc)
        parse_master(argv[++i], nodes);
      else if (a == "--grace" && i + 1 < argc)
        grace_s = weft::parse_int(argv[++i], "--grace", 0, 86400);
      else if (a == "--") {
        ++i;
        break;
      } else if (a == "-h" || a == "--help")
        return usage(), 0;
      else if (!a.empty() && a[0] == '-') {
        std::fprintf(stderr, "weft-launch: unknown option %s\n", a.c_str());
        return usage();
      } else
        break;
    }
    if (nodes.index >= nodes.count)
      weft::throw_error("weft-launch: --node-rank " + std::to_string(nodes.index) +
                        " is not a node of --nnodes " + std::to_string(nodes.count));
    if (nodes.count > 1 && nodes.master_host.empty() && !std::getenv("MASTER_ADDR"))
      weft::throw_error("weft-launch: a job of several nodes needs --master HOST:PORT (node 0's address)");
    if (const char* s = std::getenv("WEFT_JOB_SECRET"); nodes.count > 1 && (s == nullptr || *s == '\0'))
      weft::throw_error(
          "weft-launch: a job of several nodes needs WEFT_JOB_SECRET in the environment, the same on every "
          "node (e.g. export WEFT_JOB_SECRET=$(openssl rand -hex 16) where every launcher reads it): each "
          "launcher would draw a different one");
  } catch (const weft::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
  if (nproc <= 0 || i >= argc) return usage();
  const std::string secret = job_secret();
  if (secret.empty()) {
    std::fprintf(stderr, "weft-launch: cannot read /dev/urandom for the job's secret\n");
    return 1;
  }
  const std::vector<pid_t> kids =
      start_ranks(nproc, nodes, argv + i, "launch-" + std::to_string(::getpid()), secret);
  if (kids.empty()) return 1;
  return wait_ranks(kids, grace_s);
}
