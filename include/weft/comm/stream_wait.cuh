// Stream-ordered waits on a flag that never hang.
//
// cuStreamWaitValue32 blocks a stream until a word holds a value, with no timeout: a peer that died or
// stalls blocks the stream, and every later call of the rank, for ever. stream_wait_kernel is the same wait
// as a one-warp kernel on the stream: one thread spins on this rank's flag with the team's timeout and abort
// flag (wait_until), so the wait fails with a device error record (which Communicator::synchronize reports:
// who waited, for which flag, for what value) instead, on this rank and, copied there, on every peer. The
// kernel acquires at system scope, and the stream's later work is ordered after the kernel, so what the
// flag's writer published before it is visible there.
//
// The flags are 64-bit words whose writers (cuStreamWriteValue32, host-enqueued) store small counts into the
// low half; the waits compare the whole word.
#pragma once
#include <cstdint>

#include "weft/comm/signal.cuh"
#include "weft/device/timeline.cuh"

namespace weft {

enum class StreamWait : uint32_t {
  kEqual,    // until *flag == value
  kAtLeast,  // until *flag >= value
};

template <StreamWait kHow>
__global__ void __launch_bounds__(32)
    stream_wait_kernel(TeamView team, const uint64_t* flag, uint64_t value) {
  if (threadIdx.x != 0) return;
  const TimelineSpan span(team.timeline, TimelinePhase::kStreamWait, uint32_t(value));
  const bool ok = wait_until(
      team, flag, value, [value](uint64_t x) { return kHow == StreamWait::kEqual ? x == value : x >= value; },
      [](uint64_t x) { return x; });  // a failure is recorded; the host's synchronize() reports it
  // The stream goes on past a failed wait (copies, arrival writes for peers): every peer's synchronize must
  // report the call as failed too, also where the garbage that follows satisfied all of its waits.
  if (!ok) detail::report_failure_to_peers(team);
}

}  // namespace weft
