#include "harness.hpp"

#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <numeric>
#include <thread>

namespace weft::test {

std::vector<TestCase>& registry() {
  static std::vector<TestCase> r;
  return r;
}

Communicator& TestContext::comm() {
  if (!shared) shared = make_comm();
  return *shared;
}

std::unique_ptr<Communicator> TestContext::make_comm(std::chrono::milliseconds timeout) {
  Options o = options;
  o.timeout = timeout;
  return make_comm_with(o);
}

std::unique_ptr<Communicator> TestContext::make_comm_with(Options o) {
  return multi_process ? Communicator::create_from_launcher(*o.env, o)
                       : Communicator::create_single_process(o);
}

std::string lcsc_timeline_problem(const TimelineRecord& rec) {
  std::map<int, int> begins, ends;  // per phase
  for (const TimelineEvent& e : rec.events) ++(e.edge & kTimelineEnd ? ends : begins)[e.edge & ~kTimelineEnd];
  const bool closed = begins == ends;
  const int block = begins[int(TimelinePhase::kBlock)], main = begins[int(TimelinePhase::kMainloop)],
            store = begins[int(TimelinePhase::kStore)];
  if (!rec.dropped && closed && block > 0 && main > 0 && store == main) return "";
  return std::to_string(rec.events.size()) + " events (" + std::to_string(rec.dropped) +
         " dropped), blocks " + std::to_string(block) + ", mainloops " + std::to_string(main) + ", stores " +
         std::to_string(store) + (closed ? "" : ", a span not closed");
}

}  // namespace weft::test

namespace {

// Comma-separated substrings; a leading '-' excludes. No positive entry means "all".
bool matches(const std::string& name, const std::string& filter) {
  bool any_positive = false, hit = false;
  size_t start = 0;
  while (start < filter.size()) {
    size_t end = filter.find(',', start);
    if (end == std::string::npos) end = filter.size();
    std::string part = filter.substr(start, end - start);
    start = end + 1;
    if (part.empty()) continue;
    if (part[0] == '-') {
      if (name.find(part.substr(1)) != std::string::npos) return false;
    } else {
      any_positive = true;
      hit |= name.find(part) != std::string::npos;
    }
  }
  return !any_positive || hit;
}

std::mutex step_mu;
std::string step_now;  // note_step's last word in the running test
std::string current_step() {
  std::lock_guard<std::mutex> lock(step_mu);
  return step_now;
}

// Ends the process when one test runs longer than WEFT_TEST_TIMEOUT_S (default 300 s): a host thread
// blocked in a CUDA call (or a stream waiting for a peer: those waits have no timeout) would otherwise hang
// the suite until its outer timeout, with no word of which test. Exit code 124, as timeout(1) uses.
class Watchdog {
 public:
  explicit Watchdog(std::string prefix) : prefix_(std::move(prefix)) {
    const char* v = std::getenv("WEFT_TEST_TIMEOUT_S");
    limit_s_ = v ? std::atoi(v) : 300;
    if (limit_s_ > 0) std::thread([this] { watch(); }).detach();
  }
  void start(const char* test) {
    weft::test::note_step({});
    test_.store(test);
    started_.store(now_s());
  }

 private:
  static int64_t now_s() {
    return std::chrono::duration_cast<std::chrono::seconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  [[noreturn]] void watch() {
    for (;;) {
      std::this_thread::sleep_for(std::chrono::seconds(1));
      const char* test = test_.load();
      if (test && now_s() - started_.load() > limit_s_) {
        const std::string step = current_step();
        std::printf("%s[  HUNG    ] %s: still running after %d s (WEFT_TEST_TIMEOUT_S)%s%s; exiting\n",
                    prefix_.c_str(), test, limit_s_, step.empty() ? "" : ", in step: ", step.c_str());
        std::fflush(stdout);
        std::_Exit(124);
      }
    }
  }
  std::string prefix_;
  int limit_s_ = 0;
  std::atomic<const char*> test_{nullptr};
  std::atomic<int64_t> started_{0};
};

}  // namespace

void weft::test::note_step(std::string what) {
  std::lock_guard<std::mutex> lock(step_mu);
  step_now = std::move(what);
}

// User + system CPU time of every thread of this process so far.
static double host_cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return double(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         1e-6 * double(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

int main(int argc, char** argv) {
  using namespace weft::test;
  TestContext ctx;
  std::string filter;
  int gpus = 0, ranks = 0;
  bool team_only = false;  // leave out the one-GPU tests (they run in the plain one-GPU step)
  auto count_arg = [&](int& i, const char* name) {
    const int v = i + 1 < argc ? std::atoi(argv[++i]) : 0;
    if (v < 1) {
      std::fprintf(stderr, "weft-gpu-tests: %s takes a positive integer\n", name);
      std::exit(2);
    }
    return v;
  };
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--filter" && i + 1 < argc)
      filter = argv[++i];
    else if (a == "--gpus")
      gpus = count_arg(i, "--gpus");
    else if (a == "--ranks")
      ranks = count_arg(i, "--ranks");
    else if (a == "--sm-budget")
      ctx.options.sm_budget = count_arg(i, "--sm-budget");
    else if (a == "--team-only")
      team_only = true;
    else if (a == "--quick")
      ctx.quick = true;
    else if (a == "--list") {
      for (auto& t : registry()) std::printf("%s\n", t.name);
      return 0;
    } else {
      const bool help = a == "--help" || a == "-h";
      if (!help) std::fprintf(stderr, "weft-gpu-tests: unknown option or missing value: '%s'\n", a.c_str());
      std::fprintf(
          help ? stdout : stderr,
          "usage: weft-gpu-tests [--gpus G] [--ranks W] [--sm-budget B] [--filter a,b,-c] [--quick] "
          "[--team-only] [--list] [--help]\n"
          "  single-process over G GPUs (default: all) with one rank each; --ranks W: a team of W\n"
          "  virtual ranks over G GPUs (default G: the largest that divides W), W / G per GPU;\n"
          "  --sm-budget B: SMs per rank (Options::sm_budget); --team-only: only tests of teams (2+ ranks, "
          "or any);\n"
          "  --filter: tests whose name contains one of the comma-separated words, none of the -words.\n"
          "  One rank per process under weft-launch/torchrun/mpirun.\n"
          "  WEFT_TEST_TIMEOUT_S=n: exit (124) when one test runs longer (default 300, 0: never)\n");
      return help ? 0 : 2;
    }
  }
  std::setvbuf(stdout, nullptr, _IOLBF, 0);

  // Virtual ranks need the most hardware work queues (weft::Communicator says why), read when CUDA starts:
  // set before the first CUDA call, and only for them (real GPUs keep the driver's default).
  if (ranks > 0) setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  if (const std::string why = weft::cuda_unavailable_reason(); !why.empty()) {
    std::printf("SKIPPED: weft-gpu-tests: %s; the GPU suite did not run\n", why.c_str());
    return 77;
  }
  int ndev = 0;
  WEFT_CUDA_CHECK(cudaGetDeviceCount(&ndev));
  std::optional<weft::LaunchEnv> env;
  try {
    env = weft::parse_launch_env(weft::process_env(), static_cast<long>(::getppid()));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
  // More ranks on this node than GPUs, with no per-rank CUDA_VISIBLE_DEVICES: ranks would share a GPU, which
  // weft refuses. A single-GPU machine running the suite's 2-rank entry skips it, visibly.
  if (env && ndev < env->local_world && !std::getenv("CUDA_VISIBLE_DEVICES")) {
    std::printf(
        "SKIPPED: weft-gpu-tests: %d ranks on this node but %d GPU%s visible (one GPU per rank); the "
        "multi-process tests did not run\n",
        env->local_world, ndev, ndev == 1 ? "" : "s");
    return 77;
  }
  std::string prefix;
  if (env) {
    ctx.multi_process = true;
    ctx.process_rank = env->rank;
    ctx.world = env->world;
    ctx.options.env = env;
    prefix = "[rank " + std::to_string(env->rank) + "] ";
  } else {
    if (ranks > 0 && gpus == 0) gpus = std::gcd(ranks, ndev);
    if (gpus == 0) gpus = ndev;
    if (gpus > ndev) {
      std::printf("SKIPPED: weft-gpu-tests: %d GPUs requested, %d visible\n", gpus, ndev);
      return 77;
    }
    if (ranks == 0) ranks = gpus;
    if (ranks % gpus != 0) {
      std::fprintf(stderr, "weft-gpu-tests: --ranks %d is not a multiple of --gpus %d\n", ranks, gpus);
      return 2;
    }
    ctx.world = ranks;
    ctx.gpus = gpus;
    ctx.options.ranks_per_gpu = ranks / gpus;
    for (int d = 0; d < gpus; ++d) ctx.options.devices.push_back(d);
  }
  bool any_runnable = false;
  auto selected = [&](const TestCase& t) {
    return matches(t.name, filter) && !(team_only && t.min_world < 2 && !t.any_world);
  };
  for (auto& t : registry()) any_runnable |= selected(t) && t.min_world <= ctx.world;
  if (!any_runnable) {
    std::printf(
        "SKIPPED: weft-gpu-tests: no selected test runs at world size %d (team tests need 2 ranks: 2 GPUs, "
        "or --ranks 2 for virtual ranks on one)\n",
        ctx.world);
    return 77;
  }
  std::string mode = env ? weft::launcher_name(env->launcher) : "single-process";
  if (!env && ctx.options.ranks_per_gpu > 1)
    mode += ", virtual ranks: " + std::to_string(ctx.options.ranks_per_gpu) + " per GPU on " +
            std::to_string(ctx.gpus) + " GPU" + (ctx.gpus > 1 ? "s" : "");
  if (ctx.options.sm_budget > 0) mode += ", SM budget " + std::to_string(ctx.options.sm_budget);
  std::printf("%sweft-gpu-tests: %s, world size %d%s, %u host threads\n", prefix.c_str(), mode.c_str(),
              ctx.world, ctx.quick ? " (quick)" : "", std::thread::hardware_concurrency());

  int passed = 0, failed = 0, skipped = 0;
  static Watchdog watchdog(prefix);  // static: its detached thread may outlive main's frame
  for (auto& t : registry()) {
    if (!selected(t)) continue;
    if (t.min_world > ctx.world) {
      ++skipped;
      std::printf("%s[  SKIPPED ] %s: needs %d ranks, world size is %d\n", prefix.c_str(), t.name,
                  t.min_world, ctx.world);
      continue;
    }
    std::printf("%s[ RUN      ] %s\n", prefix.c_str(), t.name);
    watchdog.start(t.name);
    const auto t0 = std::chrono::steady_clock::now();
    const double cpu0 = host_cpu_seconds();
    std::string err;
    bool skip = false;
    try {
      t.fn(ctx);
    } catch (const Failure& f) {
      err = f.what;
    } catch (const Skip& s) {
      skip = true;
      err = s.why;
    } catch (const std::exception& e) {
      err = std::string("exception: ") + e.what();
    }
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (skip) {
      ++skipped;
      std::printf("%s[  SKIPPED ] %s: %s\n", prefix.c_str(), t.name, err.c_str());
    } else if (err.empty()) {
      ++passed;
      // The process's CPU time beside the wall time: far above it, the test waited on host references
      // spread over cores; near it, on one core or on the GPU (a synchronize may spin).
      std::printf("%s[       OK ] %s (%.0f ms, host CPU %.1f s)\n", prefix.c_str(), t.name, ms,
                  host_cpu_seconds() - cpu0);
    } else {
      ++failed;
      std::printf("%s[  FAILED  ] %s (%.0f ms): %s\n", prefix.c_str(), t.name, ms, err.c_str());
      ctx.shared.reset();            // a failed test may leave the team unusable
      if (ctx.multi_process) break;  // peers cannot know; stop here (they fail fast on our exit)
    }
  }
  std::printf("%ssummary: %d passed, %d failed, %d skipped\n", prefix.c_str(), passed, failed, skipped);
  std::fflush(stdout);
  watchdog.start("(communicator teardown)");
  ctx.shared.reset();
  return failed ? 1 : 0;
}
