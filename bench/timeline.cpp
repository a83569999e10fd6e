// record_timeline (bench.hpp): one call's in-kernel timeline per rank (weft/timeline.hpp), as a CSV of spans
// and a table of phases.
#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <map>
#include <tuple>

#include "bench.hpp"
#include "weft/timeline.hpp"

namespace weft::bench {
namespace {

struct Span {
  int rank, block, warp;
  TimelinePhase phase;
  uint64_t begin, end;
  uint32_t arg;
};

// Pairs each end edge with the latest open begin of the same (block, warp, phase).
std::vector<Span> spans_of(const TimelineRecord& rec) {
  std::vector<Span> out;
  std::map<std::tuple<int, int, int>, std::vector<const TimelineEvent*>> open;
  for (const TimelineEvent& e : rec.events) {
    const int phase = e.edge & ~kTimelineEnd;
    auto& stack = open[{e.block, e.warp, phase}];
    if (!(e.edge & kTimelineEnd)) {
      stack.push_back(&e);
    } else if (!stack.empty()) {
      const TimelineEvent* b = stack.back();
      stack.pop_back();
      out.push_back({rec.rank, e.block, e.warp, TimelinePhase(phase), b->t_ns, e.t_ns, b->arg});
    }
  }
  return out;
}

std::string with_rank(const std::string& path, int rank) {
  const size_t slash = path.find_last_of('/'), dot = path.find_last_of('.');
  const bool has_ext = dot != std::string::npos && (slash == std::string::npos || dot > slash);
  return has_ext ? path.substr(0, dot) + ".rank" + std::to_string(rank) + path.substr(dot)
                 : path + ".rank" + std::to_string(rank);
}

}  // namespace

Table record_timeline(Communicator& comm, const std::vector<cudaStream_t>& streams,
                      const std::function<void()>& enqueue, const std::string& label, std::string path) {
  const int L = comm.num_local();
  for (int i = 0; i < L; ++i) comm.timeline_start(comm.local(i));
  std::vector<cudaGraphExec_t> exec = capture_graphs(comm, streams, enqueue);
  for (int replay = 0; replay < 2; ++replay) {  // the first replay warms up; its events are dropped
    for (int i = 0; i < L; ++i) {
      WEFT_CUDA_CHECK(cudaSetDevice(comm.local(i).device()));
      if (replay == 1)  // the buffer's cursor (TimelineBuffer::count) back to 0
        WEFT_CUDA_CHECK(cudaMemsetAsync(comm.local(i).view().timeline, 0, sizeof(uint32_t), streams[i]));
      WEFT_CUDA_CHECK(cudaGraphLaunch(exec[i], streams[i]));
    }
    for (int i = 0; i < L; ++i) {
      WEFT_CUDA_CHECK(cudaSetDevice(comm.local(i).device()));
      WEFT_CUDA_CHECK(cudaStreamSynchronize(streams[i]));
    }
    comm.check_device_errors();
  }
  for (auto& e : exec) cudaGraphExecDestroy(e);
  std::vector<TimelineRecord> records;
  for (int i = 0; i < L; ++i) records.push_back(comm.timeline_take(comm.local(i)));
  if (!comm.is_single_process()) path = with_rank(path, comm.local(0).rank());
  return timeline_table(records, label, path);
}

Table record_timeline_one_gpu(const std::function<void(TimelineBuffer*)>& call, cudaStream_t stream,
                              const std::string& label, const std::string& path) {
  constexpr uint32_t kMaxEvents = 1u << 20;
  const size_t bytes = offsetof(TimelineBuffer, events) + sizeof(TimelineEvent) * size_t(kMaxEvents);
  DeviceBuffer buffer(bytes);
  auto* tl = static_cast<TimelineBuffer*>(buffer.p);
  const TimelineBuffer header{0, kMaxEvents, 0, {}};
  for (int run = 0; run < 2; ++run) {  // the first run warms up; its events are dropped
    WEFT_CUDA_CHECK(
        cudaMemcpyAsync(tl, &header, offsetof(TimelineBuffer, events), cudaMemcpyHostToDevice, stream));
    call(tl);
    WEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  return timeline_table({read_timeline(tl)}, label, path);
}

Table timeline_table(const std::vector<TimelineRecord>& records, const std::string& label,
                     const std::string& path) {
  std::vector<Span> spans;
  uint64_t dropped = 0;
  for (const TimelineRecord& rec : records) {
    dropped += rec.dropped;
    const std::vector<Span> s = spans_of(rec);
    spans.insert(spans.end(), s.begin(), s.end());
  }
  // Per rank, times from that rank's first event (GPUs' timers agree only roughly); the CSV keeps one origin
  // for the process (the earliest event) so that ranks of one GPU line up.
  std::map<int, uint64_t> t0;
  uint64_t origin = UINT64_MAX;
  for (const Span& s : spans) {
    auto [it, fresh] = t0.try_emplace(s.rank, s.begin);
    it->second = std::min(it->second, s.begin);
    origin = std::min(origin, s.begin);
  }
  if (std::FILE* f = std::fopen(path.c_str(), "w")) {
    std::fprintf(f, "rank,block,warp,phase,begin_us,end_us,arg\n");
    for (const Span& s : spans)
      std::fprintf(f, "%d,%d,%d,%s,%.3f,%.3f,%u\n", s.rank, s.block, s.warp, timeline_phase_name(s.phase),
                   (s.begin - origin) / 1e3, (s.end - origin) / 1e3, s.arg);
    std::fclose(f);
  } else {
    std::fprintf(stderr, "weft-bench: cannot write the timeline to %s\n", path.c_str());
  }
  Table t("timeline: " + label,
          {"rank", "phase", "spans", "lanes", "first start us", "last end us", "mean span us", "max span us",
           "busy per lane us"},
          "One call (the second of two runs), in-kernel %globaltimer marks (weft/timeline.hpp). Times "
          "from the rank's first mark; a lane is one (block, warp) that marks the phase; busy per lane = the "
          "phase's summed spans / lanes. Spans: " +
              path + (dropped ? fmt(" (%llu marks dropped: buffer full)", (unsigned long long)dropped) : ""));
  // Rows per rank and phase; the phases whose arg is a step (MoE, flash_decode) per step.
  const auto stepped = [](TimelinePhase p) {
    return p == TimelinePhase::kMoe || p == TimelinePhase::kDecode;
  };
  std::map<std::tuple<int, int, uint32_t>, std::vector<const Span*>> by;
  for (const Span& s : spans) by[{s.rank, int(s.phase), stepped(s.phase) ? s.arg : 0}].push_back(&s);
  for (auto& [key, v] : by) {
    const auto [rank, phase, step] = key;
    const uint64_t origin_r = t0[rank];
    uint64_t first = UINT64_MAX, last = 0, total = 0, longest = 0;
    std::map<std::pair<int, int>, int> lanes;
    for (const Span* s : v) {
      first = std::min(first, s->begin);
      last = std::max(last, s->end);
      total += s->end - s->begin;
      longest = std::max(longest, s->end - s->begin);
      lanes[{s->block, s->warp}] = 1;
    }
    std::string name = timeline_phase_name(TimelinePhase(phase));
    if (TimelinePhase(phase) == TimelinePhase::kMoe) name += ":" + std::string(moe_step_name(MoeStep(step)));
    if (TimelinePhase(phase) == TimelinePhase::kDecode)
      name += ":" + std::string(decode_step_name(DecodeStep(step)));
    t.add({std::to_string(rank), name, std::to_string(v.size()), std::to_string(lanes.size()),
           fmt("%.1f", (first - origin_r) / 1e3), fmt("%.1f", (last - origin_r) / 1e3),
           fmt("%.2f", total / 1e3 / v.size()), fmt("%.1f", longest / 1e3),
           fmt("%.1f", total / 1e3 / lanes.size())});
  }
  return t;
}

}  // namespace weft::bench
