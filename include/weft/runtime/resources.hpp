// Resources an op needs from its team besides its operands: flag words and barrier slots of the signal pad,
// and a workspace area of its own. An op asks for them by name; the communicator grants each name once, the
// same run on every rank, and hands out typed handles (weft::Flags, weft::BarrierSlots) for kernel
// parameters. The runtime knows no op: it only keeps the names for error messages ("flag 3 of
// 'all_gather_matmul: chunk arrivals'").
//
// Two ways to ask:
//   declared  a static ResourceDeclaration in the op's source file (weft's own ops do this). The communicator
//             grants every declaration when it is created, sorted by name, so every process of a team grants
//             the same runs whatever order its ops later run in, and an area declared with a size is made
//             then (never during a CUDA graph capture).
//   at run time  Communicator::resources(request): granted on first request, in request order, so every rank
//             must ask in the same order (as for Communicator::alloc).
// Two ops that name the same owner share its resources (the counts must agree): the collectives and the fused
// kernels share their per-block meeting slots, since their kernels run one after another on a stream.
#pragma once
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

#include "weft/team_view.hpp"

namespace weft {

struct ResourceRequest {
  std::string owner;      // who uses them: an op name, or a name ops share to share the resources
  int flags = 0;          // flag words (zero at team creation; weft never resets them)
  int barrier_slots = 0;  // team barrier slots
  // A workspace area of its own (Communicator::workspace(bytes, capturing, owner)) of area_bytes(world)
  // bytes, made at team creation (declared requests only; nullptr: none).
  uint64_t (*area_bytes)(int world) = nullptr;
  // Called for every rank when a single-process team of several ranks is created, on the rank's device,
  // before any kernel runs (declared requests only; nullptr: none). For a library whose first use in a
  // process waits for the GPU's running work (cuBLAS's first handle): one host thread drives every rank, so
  // inside an op that wait could be for a kernel waiting on a rank the thread has not launched yet.
  void (*ready_rank)(int rank) = nullptr;
};

struct ResourceGrant {
  std::string owner;
  Flags flags;
  BarrierSlots slots;
};

// The grants of one team (host only; every rank of the team keeps the same table).
class ResourceRegistry {
 public:
  ResourceRegistry(int flag_words, int barrier_slots) : flag_words_(flag_words), slots_(barrier_slots) {}
  // The grant of r.owner: made now if there is none (throws weft::Error when the pad is full), else the
  // existing one (throws when the counts differ: two ops use one name for different things).
  const ResourceGrant& grant(const ResourceRequest& r);
  // The grant of `owner`, or nullptr.
  const ResourceGrant* find(const std::string& owner) const;
  // Names a flag word or barrier slot for error messages: "flag 3 of 'x'", "slot 0 of 'y'", or "not granted".
  std::string describe_flag(int word) const;
  std::string describe_slot(int slot) const;
  int flags_granted() const { return next_flag_; }
  int slots_granted() const { return next_slot_; }

 private:
  mutable std::mutex mu_;
  int flag_words_, slots_;
  int next_flag_ = 0, next_slot_ = 0;
  std::deque<ResourceGrant> grants_;  // stable addresses
};

// The declarations made so far (by ResourceDeclaration objects, at static initialization).
const std::vector<ResourceRequest>& declared_resources();

// Declares an op's resources at static initialization: `static const ResourceDeclaration kMine{{...}};` in
// the op's source file. Declarations of one owner must agree.
struct ResourceDeclaration {
  explicit ResourceDeclaration(ResourceRequest r);
};

}  // namespace weft
