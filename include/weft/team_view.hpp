// The device view of a team: what a kernel needs to reach every rank's symmetric heap and signal pad.
//
// It is small and passed by value as a kernel argument. Per-peer data (the heap base of each peer as this
// rank sees it) lives in device memory inside the signal pad, so the view does not grow with the world size.
#pragma once
#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define WEFT_HD __host__ __device__ __forceinline__
#else
#define WEFT_HD inline
#endif

namespace weft {

inline constexpr int kMaxWorld = 128;          // ranks in one team (an NVL72 fits)
inline constexpr int kUserFlags = 4096;        // signal flags free for ops and users
inline constexpr int kBarrierSlots = 512;      // independent barriers (one block at a time per slot)
inline constexpr int kUserBarrierSlots = 256;  // [0, 256) free for ops and users; the runtime uses the
                                               // rest (the collectives take one slot per block)
inline constexpr int kRuntimeBarrierSlot = kUserBarrierSlots;      // used by Communicator::device_barrier
inline constexpr int kCollectiveSlotBase = kUserBarrierSlots + 1;  // collectives: slot base + block index
inline constexpr int kCollectiveMaxBlocks = kBarrierSlots - kCollectiveSlotBase;

// Why a device-side wait gave up. Written once per rank (first error wins) into the rank's signal pad; the
// wait returns false, the kernel winds down, and the host reads the record after synchronizing.
enum class DeviceErrorCode : uint32_t {
  kNone = 0,
  kTimeout = 1,  // a wait exceeded the team's timeout
  kAborted = 2,  // the host raised the abort flag (a peer process died) or another wait already failed
};

struct DeviceError {
  uint32_t code;    // DeviceErrorCode
  int32_t rank;     // rank that waited
  uint32_t block;   // linear block index
  uint32_t thread;  // linear thread index in the block
  uint64_t
      flag_offset;  // the flag's byte offset in the heap (the host names it: user flag i, barrier slot s ...)
  uint64_t expected;   // the value waited for (>=)
  uint64_t observed;   // the last value seen
  uint64_t waited_ns;  // how long it waited
};

// Layout of the signal pad: one symmetric allocation made at team creation, zeroed, never reset. All flags
// are 64-bit and monotonic (counters / epochs), so no kernel ever needs to clear them.
struct SignalPadLayout {
  static constexpr size_t kUserFlagsOffset = 0;
  static constexpr size_t kBarrierInboxOffset = kUserFlagsOffset + sizeof(uint64_t) * kUserFlags;
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
  // one_shot_calls[block]: the LL one-shot calls block `block` of this rank has completed (local state).
  static constexpr size_t kOneShotCallsOffset = kErrorOffset + 64;
  static constexpr size_t kBytes = kOneShotCallsOffset + sizeof(uint64_t) * kBarrierSlots;
};

struct TeamView {
  int32_t rank = 0;
  int32_t world = 0;
  char* local_base = nullptr;               // this rank's heap
  uint64_t pad_offset = 0;                  // the signal pad's offset in every heap
  uint64_t timeout_ns = 0;                  // how long a wait may spin before it reports kTimeout
  DeviceError* error = nullptr;             // this rank's error record (in its signal pad)
  const volatile int32_t* abort = nullptr;  // host-mapped; non-zero once the host saw a peer die

  WEFT_HD char* pad() const { return local_base + pad_offset; }
  WEFT_HD char* const* peer_bases() const {
    return reinterpret_cast<char* const*>(pad() + SignalPadLayout::kPeerTableOffset);
  }
  // The address of `local` (a pointer into this rank's heap) in rank r's heap.
  template <class T>
  WEFT_HD T* peer_ptr(T* local, int r) const {
    return reinterpret_cast<T*>(peer_bases()[r] + (reinterpret_cast<const char*>(local) - local_base));
  }
  WEFT_HD uint64_t* user_flag(int i) const {
    return reinterpret_cast<uint64_t*>(pad() + SignalPadLayout::kUserFlagsOffset) + i;
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
  WEFT_HD uint64_t* one_shot_calls(int block) const {
    return reinterpret_cast<uint64_t*>(pad() + SignalPadLayout::kOneShotCallsOffset) + block;
  }
  WEFT_HD uint64_t* grid_generation(int slot) const {
    return reinterpret_cast<uint64_t*>(pad() + SignalPadLayout::kGridGenerationOffset) + slot;
  }
};

}  // namespace weft
