// Device side of timelines (weft/timeline.hpp): one event per call, nothing when no buffer is attached.
#pragma once
#include "weft/device/ptx.cuh"
#include "weft/timeline.hpp"

namespace weft {

__device__ __forceinline__ void timeline_mark(TimelineBuffer* tl, TimelinePhase phase, bool end,
                                              uint32_t arg = 0) {
  if (tl == nullptr) return;
  const uint32_t i = atomicAdd(&tl->count, 1u);
  if (i >= tl->capacity) return;
  TimelineEvent e;
  e.t_ns = ptx::globaltimer_ns();
  e.arg = arg;
  e.block = static_cast<uint16_t>(blockIdx.x);
  e.warp = static_cast<uint8_t>(threadIdx.x / 32);
  e.edge = static_cast<uint8_t>(phase) | (end ? kTimelineEnd : 0);
  tl->events[i] = e;
}

// A span from construction to destruction, marked by the constructing thread.
class TimelineSpan {
 public:
  __device__ TimelineSpan(TimelineBuffer* tl, TimelinePhase phase, uint32_t arg = 0)
      : tl_(tl), phase_(phase), arg_(arg) {
    timeline_mark(tl_, phase_, false, arg_);
  }
  __device__ ~TimelineSpan() { timeline_mark(tl_, phase_, true, arg_); }
  TimelineSpan(const TimelineSpan&) = delete;
  TimelineSpan& operator=(const TimelineSpan&) = delete;

 private:
  TimelineBuffer* tl_;
  TimelinePhase phase_;
  uint32_t arg_;
};

}  // namespace weft
