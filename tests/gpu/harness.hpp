// A minimal test harness for the GPU suite. It has no dependencies (the GPU machines have no GoogleTest)
// and knows about ranks: in one-process-per-GPU mode every rank runs every test and reports its own result.
//
//   WEFT_GPU_TEST(name) { ... WEFT_EXPECT(cond, "what") ... }   // the body sees `ctx` (TestContext&)
//
// Exit codes: 0 all passed, 1 some failed, 77 skipped (no usable GPU), which ctest shows as skipped.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "weft/ops/plan.hpp"
#include "weft/runtime/communicator.hpp"

namespace weft::test {

struct TestContext {
  Options options;  // how to make a communicator in this mode (devices, env)
  bool multi_process = false;
  int process_rank = 0;  // 0 in single-process mode
  int world = 0;         // team size the tests run at
  int gpus = 1;          // single-process: GPUs the team spans (world / options.ranks_per_gpu)
  bool quick = false;    // --quick: fewer rounds (for compute-sanitizer runs)
  // The shared communicator for tests that don't need their own.
  Communicator& comm();
  std::unique_ptr<Communicator> make_comm(std::chrono::milliseconds timeout = std::chrono::milliseconds(0));
  // A communicator of this mode with other options (o.env and o.devices as in `options`).
  std::unique_ptr<Communicator> make_comm_with(Options o);
  std::unique_ptr<Communicator> shared;
};

// The step a test is in (set by the test, e.g. before waiting on one kernel): a test that hangs is reported
// with its last step, so a hang names the kernel it waited on. Cleared when the next test starts.
void note_step(std::string what);

struct Failure {
  std::string what;
};
struct Skip {
  std::string why;
};

using TestFn = void (*)(TestContext&);
struct TestCase {
  const char* name;
  TestFn fn;
  int min_world;   // ranks the test needs (1: runs on a single-GPU machine too)
  bool any_world;  // min_world 1 and a test of teams too: --team-only keeps it
};
std::vector<TestCase>& registry();
struct Registrar {
  Registrar(const char* name, TestFn fn, int min_world, bool any_world) {
    registry().push_back({name, fn, min_world, any_world});
  }
};

// Per-local-rank device buffers of one size: in the symmetric heap, or ordinary cudaMalloc memory on each
// rank's GPU. ptr[i] belongs to comm.local(i).
struct RankBuffers {
  Communicator& comm;
  bool symmetric;
  std::vector<char*> ptr;
  SymmetricBuffer sym;
  RankBuffers(Communicator& c, uint64_t bytes, bool in_heap) : comm(c), symmetric(in_heap) {
    if (symmetric) {
      sym = c.alloc(bytes);
      ptr = sym.local;
      return;
    }
    for (int i = 0; i < c.num_local(); ++i) {
      char* p = nullptr;
      WEFT_CUDA_CHECK(cudaSetDevice(c.local(i).device()));
      WEFT_CUDA_CHECK(cudaMalloc(&p, bytes));
      ptr.push_back(p);
    }
  }
  ~RankBuffers() {
    if (symmetric) {
      comm.free(sym);
      return;
    }
    for (int i = 0; i < comm.num_local(); ++i) {
      cudaSetDevice(comm.local(i).device());
      cudaFree(ptr[i]);
    }
  }
  RankBuffers(const RankBuffers&) = delete;
  RankBuffers& operator=(const RankBuffers&) = delete;
};

// Runs f(begin, end) over [0, n) split into contiguous parts of at least `min_part` items on the host's cores
// (host references of large teams: a W-rank reference costs W times a 1-rank one; attention references have
// few but long rows: min_part 1).
template <class F>
void parallel_for(size_t n, F&& f, size_t min_part = 4096) {
  const size_t parts =
      std::max<size_t>(1, std::min<size_t>(std::thread::hardware_concurrency(), n / min_part));
  if (parts == 1) return f(size_t(0), n);
  std::vector<std::thread> pool;
  for (size_t p = 0; p < parts; ++p) pool.emplace_back([&, p] { f(n * p / parts, n * (p + 1) / parts); });
  for (auto& t : pool) t.join();
}

// What an LCSC kernel's timeline (weft/timeline.hpp) holds that it should not, or lacks: marks dropped, a
// span not closed, no block span, no work item's mainloop, a mainloop without its store; "" when it is whole.
std::string lcsc_timeline_problem(const TimelineRecord& rec);

// An environment variable set to `value` while the object lives, the process's earlier value (or none) back
// after, also when a check throws: for the developer switches the ops read at each call.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* v = std::getenv(name);
    had_ = v != nullptr;
    if (had_) before_ = v;
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (had_)
      setenv(name_.c_str(), before_.c_str(), 1);
    else
      unsetenv(name_.c_str());
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_, before_;
  bool had_ = false;
};

// cudaMalloc'd memory on the current GPU for one test's scope.
// The message of the weft::Error that f throws; "" when it returns normally.
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return {};
}

struct DeviceBuffer {
  void* p = nullptr;
  size_t bytes = 0;
  explicit DeviceBuffer(size_t b) : bytes(b) { WEFT_CUDA_CHECK(cudaMalloc(&p, b ? b : 16)); }
  ~DeviceBuffer() { cudaFree(p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

// Host <-> device copies and poisoning on local rank i's GPU.
// cudaMemcpy runs on the legacy stream, which neither waits for the rank's non-blocking stream nor is waited
// for by it: wait for the rank's stream first (a poison queued there must not land on the data uploaded after
// it, as it would for an in-place op's input inside a poisoned output), and for the copy's DMA after it
// (from pageable memory cudaMemcpy may return before it lands).
inline void upload(Communicator& c, int i, void* dst, const void* src, size_t bytes) {
  WEFT_CUDA_CHECK(cudaSetDevice(c.local(i).device()));
  WEFT_CUDA_CHECK(cudaStreamSynchronize(c.local(i).stream()));
  WEFT_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  WEFT_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
}
inline void download(Communicator& c, int i, void* dst, const void* src, size_t bytes) {
  WEFT_CUDA_CHECK(cudaSetDevice(c.local(i).device()));
  WEFT_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}
// On the rank's stream, where the ops run by default: a plain cudaMemset runs on the legacy stream, which a
// non-blocking rank stream does not wait for (a poison landing after the op's output would read as a
// failure).
inline void poison(Communicator& c, int i, void* dst, size_t bytes) {
  WEFT_CUDA_CHECK(cudaSetDevice(c.local(i).device()));
  WEFT_CUDA_CHECK(cudaMemsetAsync(dst, 0xff, bytes, c.local(i).stream()));  // NaN in every float type
}

// Op plans (weft/ops/plan.hpp) against their calls: the sizes of the workspace areas a plan names (and of
// the shared area) before a call, then check_call_kept_plan after it: "" when no area grew past what the
// plan named (a grown area is the asked size rounded up to the heap granularity), else what grew.
using WorkspaceSizes = std::map<std::string, uint64_t>;
inline WorkspaceSizes workspace_sizes(const Communicator& c, const Plan& plan) {
  WorkspaceSizes sizes{{"", 0}};
  for (const auto& [area, bytes] : plan.workspace) sizes[area] = 0;
  for (auto& [area, bytes] : sizes)
    if (const SymmetricBuffer* ws = c.current_workspace(area)) bytes = ws->bytes;
  return sizes;
}
inline std::string check_call_kept_plan(const Communicator& c, const Plan& plan,
                                        const WorkspaceSizes& before) {
  const uint64_t g = c.heap_granularity();
  for (const auto& [area, now] : workspace_sizes(c, plan)) {
    const uint64_t planned = (plan.workspace_bytes(area) + g - 1) / g * g;
    const uint64_t was = before.count(area) ? before.at(area) : 0;
    if (now > std::max(was, planned))
      return "workspace '" + area + "' grew to " + std::to_string(now) + " bytes, the plan (" +
             describe(plan) + ") named " + std::to_string(plan.workspace_bytes(area));
  }
  return {};
}

}  // namespace weft::test

#define WEFT_GPU_TEST_REGISTERED(name, min_world, any_world)                                      \
  static void weft_test_##name(::weft::test::TestContext& ctx);                                   \
  static ::weft::test::Registrar weft_reg_##name(#name, &weft_test_##name, min_world, any_world); \
  static void weft_test_##name([[maybe_unused]] ::weft::test::TestContext& ctx)
#define WEFT_GPU_TEST_WORLD(name, min_world) WEFT_GPU_TEST_REGISTERED(name, min_world, false)
// A test of the team: needs at least 2 ranks.
#define WEFT_GPU_TEST(name) WEFT_GPU_TEST_WORLD(name, 2)
// A test of one GPU's kernels (it uses rank 0 only): also runs on single-GPU machines.
#define WEFT_GPU_TEST_ONE_GPU(name) WEFT_GPU_TEST_WORLD(name, 1)
// A test of an op at every world size, a team of one included: runs on single-GPU machines and in the
// team steps (--team-only) alike.
#define WEFT_GPU_TEST_ANY_WORLD(name) WEFT_GPU_TEST_REGISTERED(name, 1, true)

#define WEFT_EXPECT(cond, msg)                                                    \
  do {                                                                            \
    if (!(cond)) {                                                                \
      std::ostringstream weft_os_;                                                \
      weft_os_ << __FILE__ << ":" << __LINE__ << ": expected " #cond ": " << msg; \
      throw ::weft::test::Failure{weft_os_.str()};                                \
    }                                                                             \
  } while (0)

// `statement` must throw weft::Error with `part` in its message.
#define WEFT_EXPECT_ERROR(statement, part)                                                 \
  do {                                                                                     \
    std::string weft_msg_;                                                                 \
    try {                                                                                  \
      statement;                                                                           \
    } catch (const ::weft::Error& weft_e_) {                                               \
      weft_msg_ = weft_e_.what();                                                          \
    }                                                                                      \
    WEFT_EXPECT(weft_msg_.find(part) != std::string::npos,                                 \
                "expected an error naming '" << (part) << "', got '" << weft_msg_ << "'"); \
  } while (0)

// A call after its plan (weft/ops/plan.hpp): the call must keep to the plan's workspace, and the plan must
// name its path and (on a team) a grid; returns the plan.
namespace weft::test {
template <class Call>
Plan keeping_plan(Communicator& c, const Plan& plan, Call&& call) {
  const WorkspaceSizes before = workspace_sizes(c, plan);
  call();
  const std::string kept = check_call_kept_plan(c, plan, before);
  WEFT_EXPECT(kept.empty(), kept);
  WEFT_EXPECT(!plan.path.empty() && (plan.blocks > 0 || c.world() == 1), describe(plan));
  return plan;
}
}  // namespace weft::test

#define WEFT_SKIP(msg)       \
  throw ::weft::test::Skip { \
    msg                      \
  }

#define WEFT_CUDA_OK(expr) WEFT_CUDA_CHECK(expr)
