// Timelines: in-kernel timestamps of what each block, warp and role did, per rank (Nsight Systems does not
// run on every machine; %globaltimer does). A rank records only while a buffer is attached
// (Communicator::timeline_start); kernels receive the buffer through the TeamView or their scheduler's
// params, and every mark is one predicated branch when none is (the pointer is null).
//
// An event is one edge of a span: (phase, begin or end, arg) at time t_ns, from block `block`, warp `warp`
// (a span's two edges come from the same thread). Events of one rank share one clock (the GPU's global
// timer, nanoseconds); ranks on different GPUs are aligned only as well as the GPUs' timers agree.
#pragma once
#include <cstdint>

namespace weft {

enum class TimelinePhase : uint8_t {
  kBlock = 0,       // a persistent (LCSC) kernel's block, start to exit; arg: 0 compute, 1 communicator
  kWaitInputs = 1,  // the loader waiting for a work item's inputs (a peer's chunk); arg: the item
  kMainloop = 2,    // a consumer warpgroup's mainloop over one work item (incl. waits for its stages); arg:
                    // the tile (m << 16 | n), attention's item (head << 16 | block), else 0
  kStore = 3,       // a consumer warpgroup's store of one work item (local, peer, or staging); arg: as above
  kCommBegin = 4,   // a communicator block's opening (e.g. meeting its peers' counterparts)
  kCommTask = 5,    // a communicator block's task; arg: the task
  kCollective = 6,  // a collective kernel's block; arg: 1 the fused RS / AR reduce (the pre-staged
                    // reduce-scatter), 3 the one-shot (all-reduce, reduce-scatter, small all-to-all); the
                    // other collective kernels carry no marks (weft/ops/collectives.cuh says why)
  kStreamWait = 7,  // a stream-ordered wait for a peer's flag (copy-engine pipelines); arg: the value
  kMoe = 8,         // a block of one of the MoE dispatch / combine kernels; arg: the step (MoeStep)
  kCommWait = 9,    // inside a communicator block's task, its wait for the task's input (e.g. a counted
                    // half of the fused RS / AR); arg: the task. The summed-in-epilogue RS / AR: the loader's
                    // wait for an own tile's partials (arg: the tile) and a storer's wait for its previous
                    // peer tile's stores before counting it (arg: bit 31 | the tile)
  kDecode = 10,     // a step of a flash_decode block (thread 0's marks); arg: the step (DecodeStep)
  kCount = 11,
};

// TimelinePhase::kMoe's arg: which MoE kernel the block belongs to (src/ops/moe.cu).
enum class MoeStep : uint32_t {
  kCountSlots = 1,      // this rank's slots per expert
  kExchangeCounts = 2,  // the counts to every rank (meet, push, meet)
  kPlaceSlots = 3,      // every slot's row, the group ends, the padding rows marked
  kDispatchTokens = 4,  // the rows pushed to their ranks and expanded there (meet ... meet)
  kCombineTokens = 5,   // each token's weighted sum of its experts' rows
  kCombineBackward = 6,
  kSumStagedSlots = 7,  // the fused down GEMM + combine's sum
  // The low-latency dispatch (one kernel):
  kLowLatencySlots = 8,       // a block's (token, rank) items: the rows' atomics at the rank, the row's store
  kLowLatencyWaitRanks = 10,  // every rank's rows in place here (the grid's release)
  kCombineMeet = 11,          // inside kCombineTokens: the block's meeting with its peers before the pulls
  kZeroPadding = 12,          // this rank's groups' padding rows zeroed (MoeShape::zero_padding)
};

// TimelinePhase::kDecode's arg: the step of a flash_decode block (weft/ops/flash_decode.cuh).
enum class DecodeStep : uint32_t {
  kPartial = 1,       // one item's split-KV partial (its keys' scores, softmax and P V in registers)
  kPush = 2,          // the item's partial rows to the merging ranks (the first push waits for the inbox),
                      // or (several splits) into this rank's inbox
  kWaitPartials = 3,  // a merge item's wait until every rank's partials of its pair have landed
  kMerge = 4,         // the merge of those partials into out and lse
  kMergeSplits = 5,   // several splits: a merge item's wait for its pair's phase-1 items here (and, before
                      // the block's first push, for the merging ranks' release of the inbox), the merge of
                      // this rank's splits and the push of the result to the merging ranks (on a team of
                      // one: the result into out and lse)
  kRelease = 6,       // the block's end: its system fence and, in the last block, the release of the inbox
};

inline const char* timeline_phase_name(TimelinePhase p) {
  switch (p) {
    case TimelinePhase::kBlock:
      return "block";
    case TimelinePhase::kWaitInputs:
      return "wait_inputs";
    case TimelinePhase::kMainloop:
      return "mainloop";
    case TimelinePhase::kStore:
      return "store";
    case TimelinePhase::kCommBegin:
      return "comm_begin";
    case TimelinePhase::kCommTask:
      return "comm_task";
    case TimelinePhase::kCollective:
      return "collective";
    case TimelinePhase::kStreamWait:
      return "stream_wait";
    case TimelinePhase::kMoe:
      return "moe";
    case TimelinePhase::kCommWait:
      return "comm_wait";
    case TimelinePhase::kDecode:
      return "decode";
    default:
      return "?";
  }
}

inline const char* decode_step_name(DecodeStep s) {
  switch (s) {
    case DecodeStep::kPartial:
      return "partial";
    case DecodeStep::kPush:
      return "push";
    case DecodeStep::kWaitPartials:
      return "wait_partials";
    case DecodeStep::kMerge:
      return "merge";
    case DecodeStep::kMergeSplits:
      return "merge_splits";
    case DecodeStep::kRelease:
      return "release";
    default:
      return "?";
  }
}

inline const char* moe_step_name(MoeStep s) {
  switch (s) {
    case MoeStep::kCountSlots:
      return "count_slots";
    case MoeStep::kExchangeCounts:
      return "exchange_counts";
    case MoeStep::kPlaceSlots:
      return "place_slots";
    case MoeStep::kDispatchTokens:
      return "dispatch_tokens";
    case MoeStep::kCombineMeet:
      return "combine_meet";
    case MoeStep::kCombineTokens:
      return "combine_tokens";
    case MoeStep::kCombineBackward:
      return "combine_backward";
    case MoeStep::kSumStagedSlots:
      return "sum_staged_slots";
    case MoeStep::kLowLatencySlots:
      return "low_latency_slots";
    case MoeStep::kLowLatencyWaitRanks:
      return "low_latency_wait_ranks";
    case MoeStep::kZeroPadding:
      return "zero_padding";
    default:
      return "?";
  }
}

struct TimelineEvent {
  uint64_t t_ns;   // %globaltimer
  uint32_t arg;    // per phase (above); work items of GEMM-shaped ops: tile m << 16 | tile n
  uint16_t block;  // blockIdx.x
  uint8_t warp;    // threadIdx.x / 32
  uint8_t edge;    // phase | kTimelineEnd on a span's end
};
static_assert(sizeof(TimelineEvent) == 16, "one 16-byte store per event");
inline constexpr uint8_t kTimelineEnd = 0x80;

// The device buffer: a cursor that every mark bumps, then the events (marks past `capacity` are counted,
// not stored, so the host can say the buffer was too small).
struct TimelineBuffer {
  uint32_t count;
  uint32_t capacity;
  uint64_t reserved;
  TimelineEvent events[1];  // [capacity]
};

// Scheduler parameters P with a timeline buffer. lcsc/kernel.cuh compiles its marks into an op only where
// its scheduler parameters have a `timeline`, so an op that records only on request instantiates its timed
// kernel on Timed<P> beside the plain one on P: the plain kernel carries no mark at all (the attention
// kernels' marks, compiled in and off, cost 5-10% of a causal forward at head dim 128, bench/RESULTS.md).
template <class P>
struct Timed : P {
  TimelineBuffer* timeline = nullptr;
};

}  // namespace weft
