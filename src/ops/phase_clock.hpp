// A developer's view of where a multi-kernel op's time goes: with WEFT_OP_PHASES=1 a launcher's PhaseClock
// records a CUDA event on its stream and the host's clock at each mark (a phase: "GPU us / host us", the
// GPU's including any wait for the host to issue it); a later call's clock prints the phases of every earlier
// call whose events have completed, one line a call on stderr. It never waits for the GPU (a wait would hang
// a single-process team, whose next rank's work is not issued yet), so the last calls of a process go
// unprinted, and calls captured into a CUDA graph are not timed; for finding the phase to work on, not for
// timings of record. Off (the default), a mark is one branch.
#pragma once
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <list>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace weft::ops {

class PhaseClock {
 public:
  PhaseClock(const std::string& op, cudaStream_t stream) : stream_(stream) {  // (off: no copy of op)
    const char* e = std::getenv("WEFT_OP_PHASES");
    if (e == nullptr || std::strcmp(e, "1") != 0) return;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) (void)cudaGetLastError();
    if (capture != cudaStreamCaptureStatusNone) return;  // (a graph's calls: not timed)
    on_ = true;
    call_.op = op;
    if (cudaGetDevice(&call_.device) != cudaSuccess) (void)cudaGetLastError();
    print_completed(call_.device);
    mark("");
  }
  PhaseClock(const PhaseClock&) = delete;
  PhaseClock& operator=(const PhaseClock&) = delete;
  // The phase since the previous mark ends here.
  void mark(const char* phase) {
    if (!on_) return;
    const auto host = std::chrono::steady_clock::now();  // (before the mark's own API calls)
    cudaEvent_t e = take_event(call_.device);
    if (e == nullptr) return;
    if (cudaEventRecord(e, stream_) != cudaSuccess) {
      (void)cudaGetLastError();  // (ours: the failing call was the last)
      cudaEventDestroy(e);
      return;
    }
    call_.marks.push_back({phase, e, host});
  }
  ~PhaseClock() {
    if (!on_) return;
    const std::lock_guard<std::mutex> lock(state().mutex);
    state().pending.push_back(std::move(call_));
  }

 private:
  struct Mark {
    const char* phase;
    cudaEvent_t event;
    std::chrono::steady_clock::time_point host;
  };
  struct Call {
    std::string op;
    int device = 0;  // where its events are: queried and timed with that device current
    std::vector<Mark> marks;
  };
  struct State {
    std::mutex mutex;
    std::list<Call> pending;
    std::map<int, std::vector<cudaEvent_t>> spare;  // printed calls' events, per device, for reuse
  };
  // An event of `device` (the current one): a printed call's, else a new one (creating one costs more than
  // recording it, and would count in the phases' host time).
  static cudaEvent_t take_event(int device) {
    {
      State& s = state();
      const std::lock_guard<std::mutex> lock(s.mutex);
      std::vector<cudaEvent_t>& spare = s.spare[device];
      if (!spare.empty()) {
        const cudaEvent_t e = spare.back();
        spare.pop_back();
        return e;
      }
    }
    cudaEvent_t e = nullptr;
    if (cudaEventCreate(&e) != cudaSuccess) {
      (void)cudaGetLastError();
      return nullptr;
    }
    return e;
  }
  static State& state() {
    static State s;
    return s;
  }
  // The completed calls of `device` (the current one; a single-process team's ranks each print their own).
  static void print_completed(int device) {
    State& s = state();
    const std::lock_guard<std::mutex> lock(s.mutex);
    for (auto it = s.pending.begin(); it != s.pending.end();) {
      const std::vector<Mark>& m = it->marks;
      if (it->device != device) {
        ++it;
        continue;
      }
      const cudaError_t done = m.empty() ? cudaSuccess : cudaEventQuery(m.back().event);
      if (done != cudaSuccess) {  // not ready (that status, where recorded, cleared), or ours
        if (done != cudaErrorNotReady || cudaPeekAtLastError() == cudaErrorNotReady) (void)cudaGetLastError();
        ++it;
        continue;
      }
      std::string line = "weft phases " + it->op + ":";
      float total = 0;
      for (size_t i = 1; i < m.size(); ++i) {
        float ms = 0;
        if (cudaEventElapsedTime(&ms, m[i - 1].event, m[i].event) != cudaSuccess) (void)cudaGetLastError();
        total += ms;
        const double host = std::chrono::duration<double, std::micro>(m[i].host - m[i - 1].host).count();
        char cell[128];
        std::snprintf(cell, sizeof cell, " %s %.1f / %.1f us,", m[i].phase, ms * 1e3f, host);
        line += cell;
      }
      const double host =
          m.empty() ? 0 : std::chrono::duration<double, std::micro>(m.back().host - m.front().host).count();
      std::fprintf(stderr, "%s total %.1f / %.1f us (GPU / host)\n", line.c_str(), total * 1e3f, host);
      for (const Mark& x : m) s.spare[it->device].push_back(x.event);
      it = s.pending.erase(it);
    }
  }

  cudaStream_t stream_;
  bool on_ = false;
  Call call_;
};

}  // namespace weft::ops
