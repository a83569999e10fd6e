// A developer's view of where a multi-kernel op's GPU time goes: with WEFT_OP_PHASES=1 a launcher's
// PhaseClock records a CUDA event on its stream at each mark and, when it goes out of scope, synchronizes the
// stream and prints each phase's time on stderr (one line a call). The call then blocks the host: for
// finding the phase to work on, not for timings of record. Off (the default), a mark is one branch.
#pragma once
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace weft::ops {

class PhaseClock {
 public:
  PhaseClock(std::string op, cudaStream_t stream) : op_(std::move(op)), stream_(stream) {
    const char* e = std::getenv("WEFT_OP_PHASES");
    if (e == nullptr || std::strcmp(e, "1") != 0) return;
    on_ = true;
    mark("");
  }
  PhaseClock(const PhaseClock&) = delete;
  PhaseClock& operator=(const PhaseClock&) = delete;
  // The phase since the previous mark ends here.
  void mark(const char* phase) {
    if (!on_) return;
    cudaEvent_t e;
    if (cudaEventCreate(&e) != cudaSuccess || cudaEventRecord(e, stream_) != cudaSuccess) return;
    marks_.push_back({phase, e});
  }
  ~PhaseClock() {
    if (!on_) return;
    std::string line = "weft phases " + op_ + ":";
    float total = 0;
    if (cudaStreamSynchronize(stream_) == cudaSuccess)
      for (size_t i = 1; i < marks_.size(); ++i) {
        float ms = 0;
        cudaEventElapsedTime(&ms, marks_[i - 1].event, marks_[i].event);
        total += ms;
        char cell[96];
        std::snprintf(cell, sizeof cell, " %s %.1f us,", marks_[i].phase, ms * 1e3f);
        line += cell;
      }
    for (const Mark& m : marks_) cudaEventDestroy(m.event);
    std::fprintf(stderr, "%s total %.1f us\n", line.c_str(), total * 1e3f);
  }

 private:
  struct Mark {
    const char* phase;
    cudaEvent_t event;
  };
  std::string op_;
  cudaStream_t stream_;
  bool on_ = false;
  std::vector<Mark> marks_;
};

}  // namespace weft::ops
