// The device view of a team: what a kernel needs to reach every rank's symmetric heap and signal pad.
//
// It is small and passed by value as a kernel argument. Per-peer data (the heap base of each peer as this
// rank sees it) lives in device memory inside the signal pad, so the view does not grow with the world size.
#pragma once
#include <cstddef>
#include <cstdint>

#include "weft/host_device.hpp"

namespace weft {

struct TimelineBuffer;  // weft/timeline.hpp

// The signal pad's room: flag words and barrier slots, granted to ops by name. Each split of the team into
// sub-teams (Communicator::subteam) is granted its own runs of what its ops use (a ring attention pass about
// 1k flags, flash_decode ~13k, the rooted collectives 2k, the collectives' per-block meetings 256 slots), so
// there is room for several splits beside the team's own grants (~24k flags): 1 MiB of flags and 4 MiB of
// inboxes per rank.
inline constexpr int kMaxWorld = 128;      // ranks in one team (an NVL72 fits)
inline constexpr int kFlagWords = 131072;  // 64-bit flag words
inline constexpr int kBarrierSlots =
    4096;  // independent team barriers (one block per rank at a time in each)

// Typed handles to signal-pad resources. The communicator grants them by name (weft/runtime/resources.hpp:
// every rank gets the same run for the same name), and kernels take them as parameters: no op carves the
// pad by arithmetic of its own.
struct Flags {  // a run of flag words: zero at team creation, never reset by weft (counters and epochs)
  int32_t first = 0, count = 0;
};
struct BarrierSlots {  // a run of barrier slots (barrier_block): slot i of the run is first + i
  int32_t first = 0, count = 0;
  WEFT_HD int operator[](int i) const { return first + i; }
};

// Why a device-side wait gave up. Written once per rank (first error wins) into the rank's signal pad; the
// wait returns false, the kernel winds down, and the host reads the record after synchronizing.
enum class DeviceErrorCode : uint32_t {
  kNone = 0,
  kTimeout = 1,     // a wait exceeded the team's timeout
  kAborted = 2,     // the host raised the abort flag (a peer process died) or another wait already failed
  kBadCounts = 3,   // all_to_all_v refused its counts (block: the offending rank; thread: which check;
                    // expected: the limit; observed: what the counts need)
  kPeerFailed = 4,  // a wait of rank `rank` failed (the rest of the record is its own) and work it feeds into
                    // this rank's call went on past it (stream_wait_kernel): this rank's results are invalid
  kBadInput = 5,  // flash_decode refused device-side input (block: the sequence; thread: ops::DecodeBadInput;
                  // expected: the limit; observed: the value)
};

struct DeviceError {
  uint32_t code;    // DeviceErrorCode
  int32_t rank;     // rank that waited (its rank in the whole team, also for a sub-team's wait)
  uint32_t block;   // linear block index
  uint32_t thread;  // linear thread index in the block
  uint64_t
      flag_offset;  // the flag's byte offset in the heap (the host names it: user flag i, barrier slot s ...)
  uint64_t expected;   // the value waited for (>=)
  uint64_t observed;   // the last value seen
  uint64_t waited_ns;  // how long it waited
  uint32_t cause;      // kPeerFailed: the failed rank's own code
  uint32_t complete;   // set (after a fence) once the fields above are written: a copier waits for it
};
static_assert(sizeof(DeviceError) <= 64, "the signal pad keeps 64 bytes for the error record");

// Layout of the signal pad: one symmetric allocation made at team creation, zeroed, never reset. All flags
// are 64-bit and monotonic (counters / epochs), so no kernel ever needs to clear them.
struct SignalPadLayout {
  static constexpr size_t kFlagsOffset = 0;  // flag words (Flags runs index them)
  static constexpr size_t kBarrierInboxOffset = kFlagsOffset + sizeof(uint64_t) * kFlagWords;
  // inbox[slot][src]: the last barrier epoch rank `src` announced to this rank on `slot`.
  static constexpr size_t kBarrierEpochOffset =
      kBarrierInboxOffset + sizeof(uint64_t) * kBarrierSlots * kMaxWorld;
  // epoch[slot]: the last barrier epoch this rank completed on `slot` (local state).
  static constexpr size_t kGridArriveOffset = kBarrierEpochOffset + sizeof(uint64_t) * kBarrierSlots;
  // arrive[slot], generation[slot]: the in-kernel grid barrier that precedes a cross-rank barrier.
  static constexpr size_t kGridGenerationOffset = kGridArriveOffset + sizeof(uint64_t) * kBarrierSlots;
  // peer_base[r]: rank r's heap as mapped in this rank's address space (read by this rank only).
  static constexpr size_t kPeerTableOffset = kGridGenerationOffset + sizeof(uint64_t) * kBarrierSlots;
  // The first device wait failure of this rank (DeviceError).
  static constexpr size_t kErrorOffset = kPeerTableOffset + sizeof(uint64_t) * kMaxWorld;
  static constexpr size_t kBytes = kErrorOffset + 64;
};

struct TeamView {
  int32_t rank = 0;
  int32_t world = 0;
  char* local_base = nullptr;               // this rank's heap
  uint64_t pad_offset = 0;                  // the signal pad's offset in every heap
  uint64_t timeout_ns = 0;                  // how long a wait may spin before it reports kTimeout
  DeviceError* error = nullptr;             // this rank's error record (in its signal pad)
  const volatile int32_t* abort = nullptr;  // host-mapped; non-zero once the host saw a peer die
  // A sub-team (Communicator::subteam) sees its member r at team rank peer_first + r * peer_stride; a team
  // itself at r (0, 1). Only the peer table is indexed by team ranks: flags and barrier slots are the
  // sub-team's own grants, indexed by its ranks.
  int32_t peer_first = 0, peer_stride = 1;
  // Where this rank's kernels record their timeline (weft/timeline.hpp); null (the default): not recording.
  TimelineBuffer* timeline = nullptr;

  WEFT_HD char* pad() const { return local_base + pad_offset; }
  WEFT_HD char* const* peer_bases() const {
    return reinterpret_cast<char* const*>(pad() + SignalPadLayout::kPeerTableOffset);
  }
  // The address of `local` (a pointer into this rank's heap) in rank r's heap.
  template <class T>
  WEFT_HD T* peer_ptr(T* local, int r) const {
    return reinterpret_cast<T*>(peer_bases()[peer_first + r * peer_stride] +
                                (reinterpret_cast<const char*>(local) - local_base));
  }
  // Flag i of a granted run (this rank's copy; peer_ptr reaches a peer's).
  WEFT_HD uint64_t* flag(Flags run, int i) const { return flag_word(run.first + i); }
  WEFT_HD uint64_t* flag_word(int word) const {
    return reinterpret_cast<uint64_t*>(pad() + SignalPadLayout::kFlagsOffset) + word;
  }
  WEFT_HD uint64_t* barrier_inbox(int slot, int src) const {
    return reinterpret_cast<uint64_t*>(pad() + SignalPadLayout::kBarrierInboxOffset) + slot * kMaxWorld + src;
  }
  WEFT_HD uint64_t* barrier_epoch(int slot) const {
    return reinterpret_cast<uint64_t*>(pad() + SignalPadLayout::kBarrierEpochOffset) + slot;
  }
  WEFT_HD uint64_t* grid_arrive(int slot) const {
    return reinterpret_cast<uint64_t*>(pad() + SignalPadLayout::kGridArriveOffset) + slot;
  }
  WEFT_HD uint64_t* grid_generation(int slot) const {
    return reinterpret_cast<uint64_t*>(pad() + SignalPadLayout::kGridGenerationOffset) + slot;
  }
};

}  // namespace weft
