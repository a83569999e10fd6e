// Single-process mode drives every rank from one host thread. It relies on the host calls an op makes
// returning while a GPU already holds work that waits for a rank the thread has not driven yet (a kernel
// spinning on a peer's flag, or a stream wait on one). A host call that waits for such a GPU never returns:
// session 11 saw a 4-GPU hang inside cublasLtMatmul (cuKernelSetAttribute) in that state.
//
// This test puts a GPU in that state on purpose: a kernel spinning on a host-memory flag (alone, or with a
// cuBLAS GEMM queued behind it), or a stream wait on the flag with a GEMM queued behind it. Then it makes,
// on another stream of the same GPU (and of the next GPU, single-process with two or more), host calls of
// weft's and cuBLAS's. A call that has not returned after kPatience counts as waiting; the flag is then
// released so that the test ends. Every outcome is printed. The calls that weft makes where one thread
// drives several ranks outside a capture must return (weft::gemm, copies, the cuBLAS handle, streams and
// events, the symmetric heap's allocation); the cuBLAS GEMMs are printed only: weft does not call them
// there, because one of them waits (1 x H200, session 12: cublasGemmEx whose kernel is new on the GPU,
// captured or not).
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda.h>
#include <cuda_bf16.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "harness.hpp"
#include "runtime/driver.hpp"
#include "weft/ops/gemm.hpp"

using namespace weft;
using weft::test::TestContext;

namespace {

// Calls that return take at most ~11 ms here (4 x H200, 2 x H200: 0.1-11 ms, the first of a kind the
// slowest); the calls that wait (cuBLAS's, printed only) each cost the whole patience.
constexpr auto kPatience = std::chrono::seconds(1);
constexpr int64_t kDim = 2048;  // the held and the seen GEMM: kDim^3

#define CUBLAS_CALL(expr)                                       \
  do {                                                          \
    const int st_ = int(expr);                                  \
    WEFT_EXPECT(st_ == 0, #expr " failed with status " << st_); \
  } while (0)

// Polls the host flag (mapped pinned memory) until it is set; a bound of ~60 s so that a test that lost
// track of the flag cannot leave a kernel running for ever.
__global__ void spin_until_set(const volatile uint32_t* flag) {
  const long long start = clock64();
  while (*flag == 0 && clock64() - start < (1ll << 37)) __nanosleep(2000);
}

// One GPU's cuBLAS / cublasLt state and GEMM operands (zeros: only the calls matter here).
struct GpuSide {
  int device = 0;
  cudaStream_t held = nullptr, free = nullptr;
  cublasHandle_t blas = nullptr;
  cublasLtHandle_t lt = nullptr;
  void *a = nullptr, *b = nullptr, *c = nullptr, *lt_ws = nullptr;
  std::vector<std::pair<cublasHandle_t, void*>> made;  // handles (and workspaces) the probe created
  std::unique_ptr<Communicator> team;                  // a team of one on this GPU (its heap)
  std::vector<SymmetricBuffer> heap_buffers;
  std::vector<std::pair<cudaStream_t, cudaEvent_t>> streams;  // made by the probe
  static constexpr size_t kLtWorkspace = 32 << 20;

  explicit GpuSide(int dev) : device(dev) {
    WEFT_CUDA_CHECK(cudaSetDevice(device));
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&held, cudaStreamNonBlocking));
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&free, cudaStreamNonBlocking));
    const size_t bytes = 4 * kDim * kDim * 2;  // room for the larger "new shape" GEMMs too
    for (void** p : {&a, &b, &c}) {
      WEFT_CUDA_CHECK(cudaMalloc(p, bytes));
      WEFT_CUDA_CHECK(cudaMemset(*p, 0, bytes));
    }
    WEFT_CUDA_CHECK(cudaMalloc(&lt_ws, kLtWorkspace));
    CUBLAS_CALL(cublasCreate(&blas));
    CUBLAS_CALL(cublasLtCreate(&lt));
    Options o;
    o.devices = {device};
    team = Communicator::create_single_process(o);
  }
  ~GpuSide() {
    cudaSetDevice(device);
    cudaDeviceSynchronize();
    cublasDestroy(blas);
    cublasLtDestroy(lt);
    for (auto& [st, ev] : streams) {
      cudaStreamDestroy(st);
      cudaEventDestroy(ev);
    }
    for (auto& b : heap_buffers) team->free(b);
    team.reset();
    for (auto& [h, ws] : made) {
      cublasDestroy(h);
      cudaFree(ws);
    }
    for (void* p : {a, b, c, lt_ws}) cudaFree(p);
    cudaStreamDestroy(held);
    cudaStreamDestroy(free);
  }
  // Row-major C [m, n] = A [m, k] . B [k, n] with cublasGemmEx, as src/ops/cublas_gemm.cpp calls it.
  void gemm(cudaStream_t s, int64_t m, int64_t n, int64_t k) {
    WEFT_CUDA_CHECK(cudaSetDevice(device));
    CUBLAS_CALL(cublasSetStream(blas, s));
    const float one = 1.f, zero = 0.f;
    CUBLAS_CALL(cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, int(n), int(m), int(k), &one, b, CUDA_R_16BF,
                             int(n), a, CUDA_R_16BF, int(k), &zero, c, CUDA_R_16BF, int(n),
                             CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
  // The same product through cublasLtMatmul (heuristic's first algorithm), as weft did before 3b747b0.
  void lt_gemm(cudaStream_t s, int64_t m, int64_t n, int64_t k) {
    WEFT_CUDA_CHECK(cudaSetDevice(device));
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
    cublasLtMatmulPreference_t pref = nullptr;
    CUBLAS_CALL(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    CUBLAS_CALL(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, uint64_t(n), uint64_t(k), n));
    CUBLAS_CALL(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, uint64_t(k), uint64_t(m), k));
    CUBLAS_CALL(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, uint64_t(n), uint64_t(m), n));
    CUBLAS_CALL(cublasLtMatmulPreferenceCreate(&pref));
    const size_t ws = kLtWorkspace;
    CUBLAS_CALL(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                     sizeof(ws)));
    cublasLtMatmulHeuristicResult_t h{};
    int found = 0;
    CUBLAS_CALL(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, 1, &h, &found));
    WEFT_EXPECT(found == 1, "cublasLt found no algorithm");
    const float one = 1.f, zero = 0.f;
    CUBLAS_CALL(cublasLtMatmul(lt, op, &one, b, la, a, lb, &zero, c, lc, c, lc, &h.algo, lt_ws, ws, s));
    cublasLtMatmulPreferenceDestroy(pref);
    for (auto l : {la, lb, lc}) cublasLtMatrixLayoutDestroy(l);
    cublasLtMatmulDescDestroy(op);
  }
};

// Kernels that nothing else launches: the first launch of each in the process (CUDA's lazy loading loads a
// kernel then).
template <int kN>
__global__ void never_launched(int* p) {
  if (p) p[threadIdx.x] = kN;
}
template <int... kN>
void launch_never_launched(int i, cudaStream_t s, std::integer_sequence<int, kN...>) {
  using Kernel = void (*)(int*);
  static constexpr Kernel kernels[] = {&never_launched<kN>...};
  WEFT_EXPECT(i < int(sizeof...(kN)), "more scenarios than never-launched kernels");
  kernels[i]<<<1, 32, 0, s>>>(nullptr);
  WEFT_CUDA_CHECK(cudaGetLastError());
}

struct HostCall {
  const char* name;
  bool relied_on;                          // a single-process path of weft makes this call in the held state
  std::function<void(GpuSide&, int)> run;  // int: a number unique to the scenario (for new shapes)
};

void weft_gemm(GpuSide& g, int64_t m, GemmStore store) {
  WEFT_CUDA_CHECK(cudaSetDevice(g.device));
  GemmOptions o;
  o.store = store;
  gemm(g.a, g.b, g.c, m, kDim, kDim, BLayout::kKN, DType::kBF16, g.free, o);
}

void captured(GpuSide& g, const std::function<void()>& enqueue) {
  WEFT_CUDA_CHECK(cudaSetDevice(g.device));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  WEFT_CUDA_CHECK(cudaStreamBeginCapture(g.free, cudaStreamCaptureModeRelaxed));
  enqueue();
  WEFT_CUDA_CHECK(cudaStreamEndCapture(g.free, &graph));
  WEFT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  WEFT_CUDA_CHECK(cudaGraphDestroy(graph));
  WEFT_CUDA_CHECK(cudaGraphLaunch(exec, g.free));
  WEFT_CUDA_CHECK(cudaGraphExecDestroy(exec));
}

// New shapes differ in M (as the pipelines' row pieces do): kDim + 64 * unique rows.
std::vector<HostCall> host_calls() {
  return {
      {"cublasGemmEx, shape run before", false, [](GpuSide& g, int) { g.gemm(g.free, kDim, kDim, kDim); }},
      {"cublasGemmEx, shape run before, captured + instantiated + launched", false,
       [](GpuSide& g, int) { captured(g, [&] { g.gemm(g.free, kDim, kDim, kDim); }); }},
      {"weft::gemm, shape run before", true, [](GpuSide& g, int) { weft_gemm(g, kDim, GemmStore::kStore); }},
      {"weft::gemm, new shape", true,
       [](GpuSide& g, int u) { weft_gemm(g, kDim + 64 * u, GemmStore::kStore); }},
      {"weft::gemm reduce-add, new shape", true,
       [](GpuSide& g, int u) { weft_gemm(g, kDim + 64 * u, GemmStore::kReduceAdd); }},
      {"cublasCreate with a cudaMalloc'd workspace", true,
       [](GpuSide& g, int) {
         WEFT_CUDA_CHECK(cudaSetDevice(g.device));
         g.made.emplace_back();
         CUBLAS_CALL(cublasCreate(&g.made.back().first));
         WEFT_CUDA_CHECK(cudaMalloc(&g.made.back().second, GpuSide::kLtWorkspace));
         CUBLAS_CALL(cublasSetWorkspace(g.made.back().first, g.made.back().second, GpuSide::kLtWorkspace));
       }},
      {"symmetric heap allocation (a team of one on this GPU)", true,
       [](GpuSide& g, int) { g.heap_buffers.push_back(g.team->alloc(8 << 20)); }},
      {"cudaStreamCreateWithFlags + cudaEventCreateWithFlags (a pipeline's first call)", true,
       [](GpuSide& g, int) {
         WEFT_CUDA_CHECK(cudaSetDevice(g.device));
         g.streams.emplace_back();
         WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&g.streams.back().first, cudaStreamNonBlocking));
         WEFT_CUDA_CHECK(cudaEventCreateWithFlags(&g.streams.back().second, cudaEventDisableTiming));
       }},
      {"cudaMemcpyAsync device to device", true,
       [](GpuSide& g, int) {
         WEFT_CUDA_CHECK(cudaSetDevice(g.device));
         WEFT_CUDA_CHECK(cudaMemcpyAsync(g.c, g.a, 1 << 20, cudaMemcpyDeviceToDevice, g.free));
       }},
      {"cublasGemmEx, new shape", false,
       [](GpuSide& g, int u) { g.gemm(g.free, kDim + 64 * u, kDim, kDim); }},
      {"cublasGemmEx, new shape, captured + instantiated + launched", false,
       [](GpuSide& g, int u) { captured(g, [&] { g.gemm(g.free, kDim + 64 * u, kDim, kDim); }); }},
      {"cublasLtMatmul, shape run before", false,
       [](GpuSide& g, int) { g.lt_gemm(g.free, kDim, kDim, kDim); }},
      {"first launch of a kernel", false,
       [](GpuSide& g, int) {
         static int next = 0;  // one kernel per scenario of this call (3 holds x 2 GPUs at most)
         WEFT_CUDA_CHECK(cudaSetDevice(g.device));
         launch_never_launched(next++, g.free, std::make_integer_sequence<int, 16>{});
       }},
  };
}

// Runs `call` while `flag` is 0; sets the flag after kPatience if the call has not returned by then.
// Returns whether the call returned before that.
bool returns_while_held(volatile uint32_t* flag, const std::function<void()>& call) {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false, released = false;
  std::thread releaser([&] {
    std::unique_lock<std::mutex> lock(mu);
    if (!cv.wait_for(lock, kPatience, [&] { return done; })) {
      released = true;
      *flag = 1;
    }
  });
  std::exception_ptr error;
  try {
    call();
  } catch (...) {
    error = std::current_exception();
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    done = true;
  }
  cv.notify_all();
  releaser.join();
  *flag = 1;
  if (error) std::rethrow_exception(error);
  return !released;
}

}  // namespace

WEFT_GPU_TEST_ONE_GPU(host_calls_return_while_gpu_waits) {
  std::vector<int> devices;
  if (ctx.multi_process) {
    devices.push_back(ctx.comm().local(0).device());
  } else {
    for (int d = 0; d < std::min(ctx.gpus, 2); ++d) devices.push_back(d);
  }
  std::vector<std::unique_ptr<GpuSide>> gpus;
  for (int d : devices) gpus.push_back(std::make_unique<GpuSide>(d));
  for (auto& g : gpus) {  // every call once, unheld: modules loaded, handles and plans made
    g->gemm(g->free, kDim, kDim, kDim);
    g->lt_gemm(g->free, kDim, kDim, kDim);
    WEFT_CUDA_CHECK(cudaSetDevice(g->device));
    gemm(g->a, g->b, g->c, kDim, kDim, kDim, BLayout::kKN, DType::kBF16, g->free);
    WEFT_CUDA_CHECK(cudaStreamSynchronize(g->free));
  }
  uint32_t* flag = nullptr;
  WEFT_CUDA_CHECK(cudaHostAlloc(&flag, sizeof(uint32_t), cudaHostAllocMapped | cudaHostAllocPortable));
  uint32_t* flag_dev = nullptr;
  WEFT_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&flag_dev), flag, 0));
  std::vector<std::string> waited_relied;
  int unique = 1, rows = 0;
  // The hold on GPU 0: a kernel spinning on the flag, alone or with a GEMM queued behind it, or a stream wait
  // on the flag with a GEMM queued behind it.
  enum class Hold { kSpin, kSpinThenGemm, kStreamWaitThenGemm };
  for (Hold hold : {Hold::kSpin, Hold::kSpinThenGemm, Hold::kStreamWaitThenGemm}) {
    const char* hold_name = hold == Hold::kSpin           ? "kernel spinning on a flag"
                            : hold == Hold::kSpinThenGemm ? "kernel spinning on a flag, GEMM queued behind it"
                                                          : "stream wait on a flag, GEMM queued behind it";
    for (const HostCall& call : host_calls()) {
      for (size_t target = 0; target < gpus.size(); ++target) {
        GpuSide& held = *gpus[0];
        GpuSide& caller = *gpus[target];
        *flag = 0;
        WEFT_CUDA_CHECK(cudaSetDevice(held.device));
        if (hold == Hold::kStreamWaitThenGemm) {  // 32-bit stream memory operations: always supported
          WEFT_CU_CHECK(driver().cuStreamWaitValue32(held.held, reinterpret_cast<CUdeviceptr>(flag_dev), 1,
                                                     CU_STREAM_WAIT_VALUE_GEQ));
        } else {
          spin_until_set<<<1, 32, 0, held.held>>>(flag_dev);
          WEFT_CUDA_CHECK(cudaGetLastError());
        }
        if (hold != Hold::kSpin) held.gemm(held.held, kDim, kDim, kDim);
        const auto t0 = std::chrono::steady_clock::now();
        WEFT_EXPECT(kDim + 64 * unique <= 4 * kDim, "new shapes outgrew the operands");
        const bool returned = returns_while_held(flag, [&] { call.run(caller, unique++); });
        const double ms =
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        for (auto& g : gpus) {
          WEFT_CUDA_CHECK(cudaSetDevice(g->device));
          WEFT_CUDA_CHECK(cudaDeviceSynchronize());
        }
        const std::string where = std::string(hold_name) + " on GPU " + std::to_string(held.device) +
                                  "; host call on GPU " + std::to_string(caller.device) + ": " + call.name;
        std::printf("    host_calls: %-150s %s (%.1f ms)\n", where.c_str(),
                    returned ? "returned" : "WAITED (flag released)", ms);
        ++rows;
        if (!returned && call.relied_on) waited_relied.push_back(where);
      }
    }
  }
  WEFT_CUDA_CHECK(cudaFreeHost(flag));
  std::string list;
  for (auto& w : waited_relied) list += "\n      " + w;
  WEFT_EXPECT(rows > 0, "no scenario ran");
  WEFT_EXPECT(waited_relied.empty(),
              "host calls that single-process mode relies on waited for a held GPU:" << list);
}
