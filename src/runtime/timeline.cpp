// Communicator::timeline_start / timeline_take (weft/timeline.hpp): a device buffer per recording rank,
// handed to kernels through the rank's TeamView.
#include <algorithm>
#include <cstddef>

#include "weft/runtime/communicator.hpp"
#include "weft/runtime/current_device.hpp"

namespace weft {

void Communicator::set_timeline(Rank& rank, TimelineBuffer* buffer) {
  rank.view_.timeline = buffer;
  for (auto& [key, sub] : subteams_)
    if (std::get<0>(key) == &rank) sub->view_.timeline = buffer;
}

void Communicator::timeline_start(Rank& rank, uint32_t max_events) {
  WEFT_CHECK(&rank.team_rank() == &rank,
             "weft: timeline_start of a sub-team's rank: start the team's own rank");
  WEFT_CHECK(max_events >= 1, "weft: timeline_start needs room for at least one event");
  WEFT_CHECK(!timelines_.count(&rank),
             "weft: rank " + std::to_string(rank.rank()) + " is already recording a timeline");
  const detail::CurrentDeviceGuard keep_device;
  WEFT_CUDA_CHECK(cudaSetDevice(rank.device()));
  const size_t bytes = offsetof(TimelineBuffer, events) + sizeof(TimelineEvent) * size_t(max_events);
  void* p = nullptr;
  WEFT_CUDA_CHECK(cudaMalloc(&p, bytes));
  const TimelineBuffer header{0, max_events, 0, {}};
  WEFT_CUDA_CHECK(cudaMemcpy(p, &header, offsetof(TimelineBuffer, events), cudaMemcpyHostToDevice));
  timelines_[&rank] = static_cast<TimelineBuffer*>(p);
  set_timeline(rank, static_cast<TimelineBuffer*>(p));
}

TimelineRecord read_timeline(const TimelineBuffer* buffer, int rank) {
  TimelineBuffer header{};
  WEFT_CUDA_CHECK(cudaMemcpy(&header, buffer, offsetof(TimelineBuffer, events), cudaMemcpyDeviceToHost));
  TimelineRecord rec;
  rec.rank = rank;
  const uint32_t stored = std::min(header.count, header.capacity);
  rec.dropped = header.count - stored;
  rec.events.resize(stored);
  if (stored)
    WEFT_CUDA_CHECK(cudaMemcpy(rec.events.data(), buffer->events, sizeof(TimelineEvent) * stored,
                               cudaMemcpyDeviceToHost));
  std::stable_sort(rec.events.begin(), rec.events.end(),
                   [](const TimelineEvent& a, const TimelineEvent& b) { return a.t_ns < b.t_ns; });
  return rec;
}

TimelineRecord Communicator::timeline_take(Rank& rank) {
  auto it = timelines_.find(&rank);
  WEFT_CHECK(it != timelines_.end(),
             "weft: timeline_take: rank " + std::to_string(rank.rank()) + " is not recording a timeline");
  TimelineBuffer* buf = it->second;
  const detail::CurrentDeviceGuard keep_device;
  WEFT_CUDA_CHECK(cudaSetDevice(rank.device()));
  WEFT_CUDA_CHECK(cudaStreamSynchronize(rank.stream()));
  WEFT_CUDA_CHECK(cudaDeviceSynchronize());  // kernels of the rank on other streams (pipelines) too
  TimelineRecord rec = read_timeline(buf, rank.rank());
  set_timeline(rank, nullptr);
  timelines_.erase(it);
  WEFT_CUDA_CHECK(cudaFree(buf));
  return rec;
}

}  // namespace weft
