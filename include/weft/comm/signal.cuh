// Signal / wait: the one cross-GPU synchronization mechanism every other primitive builds on.
//
// A flag is a 64-bit word at the same offset in every rank's symmetric heap. Flags only grow (counters and
// epochs), so nothing ever resets them and a late reader can never miss a value.
//   signal_set / signal_add  write into a peer's flag with release semantics at system scope: everything the
//                            calling thread wrote before (and its block, after a __syncthreads) is visible
//                            to the peer once it sees the new value.
//   fence_release + signal_set<Order::kRelaxed>
//                            the same guarantee with the fence hoisted: a sys-scope release costs ~0.6 us on
//                            Hopper (a MEMBAR.SYS), so issue fence_release() as soon as the data to publish
//                            is written, do other work (typically: wait for the peer), then signal relaxed.
//                            The signal covers everything written before the fence, nothing after it. A
//                            relaxed signal with no fence before it publishes nothing (a bare notification).
//   acquire_for_tma          after a successful wait: makes what the signal published visible to this
//                            thread's later TMA (async-proxy) reads too; a wait acquires for generic loads
//                            only. Likewise before a TMA store into memory a peer handed over by a signal.
//   release_after_tma        after this thread's TMA stores completed (bulk wait): orders them before its
//                            later signals, which otherwise publish generic writes only.
//   wait_ge                  spins on this rank's own flag with acquire loads at system scope (flags written
//                            by peers); wait_ge_local at GPU scope (flags written by this GPU's own blocks);
//                            wait_ge_napping polls every 20 us (long waits beside compute warps);
//                            wait_ge_local_progressing times out only when the flag stops moving.
//                            It never hangs: after the team's timeout, or once the host raises the abort
//                            flag, it records who waited for what and returns false.
#pragma once
#include "weft/device/ptx.cuh"
#include "weft/team_view.hpp"

namespace weft {

enum class Order {
  kRelease,  // the signal itself orders the caller's earlier writes before it (fused fence)
  kRelaxed,  // no fence: pair with an earlier fence_release(), or publish nothing
};

// Orders this thread's earlier writes (and its block's, after a __syncthreads) before its later
// relaxed signals, system-wide.
__device__ __forceinline__ void fence_release() {
  ptx::fence_acq_rel_sys();
}

// See the header: the proxy fence that lets TMA see (or overwrite) what a wait acquired.
__device__ __forceinline__ void acquire_for_tma() {
  ptx::fence_proxy_async_global();
}
__device__ __forceinline__ void release_after_tma() {
  ptx::fence_proxy_async_global();
}

template <Order O = Order::kRelease>
__device__ __forceinline__ void signal_set(const TeamView& team, uint64_t* flag, int peer, uint64_t value) {
  if constexpr (O == Order::kRelease)
    ptx::st_release_sys(team.peer_ptr(flag, peer), value);
  else
    ptx::st_relaxed_sys(team.peer_ptr(flag, peer), value);
}

template <Order O = Order::kRelease>
__device__ __forceinline__ void signal_add(const TeamView& team, uint64_t* flag, int peer, uint64_t delta) {
  if constexpr (O == Order::kRelease)
    ptx::red_release_sys_add(team.peer_ptr(flag, peer), delta);
  else
    ptx::red_relaxed_sys_add(team.peer_ptr(flag, peer), delta);
}

namespace detail {
__device__ __forceinline__ uint32_t linear_block() {
  return blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
}
__device__ __forceinline__ uint32_t linear_thread() {
  return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}

// Writes this rank's error record if it is the first (first error wins: the record names what started the
// chain) and returns whether it was: the code by a system-scope CAS (peers copy into records too,
// report_failure_to_peers), the fields, a fence, then the `complete` mark a copier waits for. `rank` is the
// rank in the whole team (a sub-team's view maps its own).
// record_error is the body, inlined where a call may not be (see wait_ge_inlined); report_error the call.
__device__ __forceinline__ bool record_error(const TeamView& team, DeviceErrorCode code, uint32_t block,
                                             uint32_t thread, uint64_t flag_offset, uint64_t expected,
                                             uint64_t observed, uint64_t waited_ns) {
  DeviceError* e = team.error;
  if (atomicCAS_system(reinterpret_cast<unsigned int*>(&e->code), 0u, static_cast<unsigned int>(code)) != 0u)
    return false;
  e->rank = team.peer_first + team.rank * team.peer_stride;
  e->block = block;
  e->thread = thread;
  e->flag_offset = flag_offset;
  e->expected = expected;
  e->observed = observed;
  e->waited_ns = waited_ns;
  __threadfence_system();
  *reinterpret_cast<volatile uint32_t*>(&e->complete) = 1u;
  return true;
}
inline __device__ __noinline__ bool report_error(const TeamView& team, DeviceErrorCode code, uint32_t block,
                                                 uint32_t thread, uint64_t flag_offset, uint64_t expected,
                                                 uint64_t observed, uint64_t waited_ns) {
  return record_error(team, code, block, thread, flag_offset, expected, observed, waited_ns);
}

// A wait's failure: who waited (block, thread), for which flag, for what.
inline __device__ __noinline__ void report_wait_failure(const TeamView& team, DeviceErrorCode code,
                                                        const uint64_t* flag, uint64_t expected,
                                                        uint64_t observed, uint64_t waited_ns) {
  (void)report_error(team, code, linear_block(), linear_thread(),
                     static_cast<uint64_t>(reinterpret_cast<const char*>(flag) - team.local_base), expected,
                     observed, waited_ns);
}

// Copies this rank's failure record into every peer's (code kPeerFailed; first error wins there as well).
// For waits whose stream goes on after a failure: the work enqueued behind a failed stream wait still runs
// and its arrival writes can satisfy peers' waits with data computed from a partial that never came, so the
// peers must learn that the call failed even where none of their own waits did.
// The record copied is complete: the thread that won this rank's record (maybe another wait's, or a peer's
// copy) may still be writing it, so this waits for its `complete` mark (at most 1 ms; then it copies what is
// there). A refusal of bad counts is not copied: every rank refuses that call itself.
inline __device__ __noinline__ void report_failure_to_peers(const TeamView& team) {
  const volatile DeviceError* mine = team.error;
  const uint64_t start = ptx::globaltimer_ns();
  while (mine->complete == 0u && ptx::globaltimer_ns() - start < 1000000) {
  }
  __threadfence_system();
  if (mine->code == static_cast<uint32_t>(DeviceErrorCode::kBadCounts)) return;
  for (int r = 0; r < team.world; ++r) {
    if (r == team.rank) continue;
    DeviceError* e = team.peer_ptr(team.error, r);
    if (atomicCAS_system(reinterpret_cast<unsigned int*>(&e->code), 0u,
                         static_cast<unsigned int>(DeviceErrorCode::kPeerFailed)) != 0u)
      continue;
    e->rank = mine->rank;
    e->block = mine->block;
    e->thread = mine->thread;
    e->flag_offset = mine->flag_offset;
    e->expected = mine->expected;
    e->observed = mine->observed;
    e->waited_ns = mine->waited_ns;
    e->cause = mine->code == static_cast<uint32_t>(DeviceErrorCode::kPeerFailed) ? mine->cause : mine->code;
    __threadfence_system();
    *reinterpret_cast<volatile uint32_t*>(&e->complete) = 1u;
  }
  __threadfence_system();  // before the stream's next work (its pushes) starts
}

template <bool kSys>
__device__ __forceinline__ uint64_t ld_acquire(const uint64_t* flag) {
  return kSys ? ptx::ld_acquire_sys(flag) : ptx::ld_acquire_gpu(flag);
}

// What a poll ended with: done, or the failure to report (aborted or timed out, the last value seen, how
// long).
struct PollOutcome {
  bool done;
  DeviceErrorCode code;
  uint64_t seen, waited_ns;
};

// Slow path of every wait: polls `done(load(flag))` with the clock running. Every 20 us it looks at this
// rank's error record (another wait already failed) and the timeout; every 1 ms at the host's abort flag.
// The abort flag is host memory: 100+ blocks reading it every few microseconds queue up on PCIe and slow
// every wait.
template <bool kSys, int kNapNs, class Done>
__device__ __forceinline__ PollOutcome poll_until(const TeamView& team, const uint64_t* flag, Done done) {
  const uint64_t start = ptx::globaltimer_ns();
  uint64_t last_check = start, last_abort_check = start;
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      if (done(ld_acquire<kSys>(flag))) return {true, DeviceErrorCode::kNone, 0, 0};
      // Many blocks polling one local flag flood its L2 slice and slow the very writes they wait for.
      if constexpr (kNapNs > 0) __nanosleep(kNapNs);
    }
    const uint64_t now = ptx::globaltimer_ns();
    if (now - last_check < 20000) continue;
    last_check = now;
    const uint64_t seen = ld_acquire<kSys>(flag);
    if (done(seen)) return {true, DeviceErrorCode::kNone, 0, 0};
    bool abort = *reinterpret_cast<volatile uint32_t*>(&team.error->code) != 0;
    if (now - last_abort_check >= 1000000) {
      last_abort_check = now;
      abort |= *team.abort != 0;
    }
    if (abort) return {false, DeviceErrorCode::kAborted, seen, now - start};
    if (now - start > team.timeout_ns) return {false, DeviceErrorCode::kTimeout, seen, now - start};
  }
}

// The slow path as a call (one copy of the loop per kernel, not per wait); `want` and `observe(value)` only
// feed the failure report.
template <bool kSys, int kNapNs = kSys ? 0 : 64, class Done, class Observe>
inline __device__ __noinline__ bool wait_slow(const TeamView& team, const uint64_t* flag, uint64_t want,
                                              Done done, Observe observe) {
  const PollOutcome w = poll_until<kSys, kNapNs>(team, flag, done);
  if (!w.done) report_wait_failure(team, w.code, flag, want, observe(w.seen), w.waited_ns);
  return w.done;
}

struct AtLeast {
  uint64_t want;
  __device__ bool operator()(uint64_t x) const { return x >= want; }
};
struct Identity {
  __device__ uint64_t operator()(uint64_t x) const { return x; }
};
}  // namespace detail

// Waits until this rank's `flag` (a pointer into its own heap) is >= `want`. Returns false (and records why)
// on timeout or abort; the caller should then stop its work and return.
[[nodiscard]] __device__ __forceinline__ bool wait_ge(const TeamView& team, const uint64_t* flag,
                                                      uint64_t want) {
  // Short waits (a signal already in flight) finish here, without the slow path's call and clock reads.
#pragma unroll 1
  for (int i = 0; i < 16; ++i)
    if (ptx::ld_acquire_sys(flag) >= want) return true;
  return detail::wait_slow<true>(team, flag, want, detail::AtLeast{want}, detail::Identity{});
}

// wait_ge with no function call in it, for warps whose registers setmaxnreg cut (a GEMM's loader waiting for
// its inputs): a call there makes ptxas ignore every setmaxnreg of the kernel, and the consumers then keep
// the launch's 168 registers instead of 232 and spill.
[[nodiscard]] __device__ __forceinline__ bool wait_ge_inlined(const TeamView& team, const uint64_t* flag,
                                                              uint64_t want) {
  const detail::PollOutcome w = detail::poll_until<true, 0>(team, flag, detail::AtLeast{want});
  if (!w.done)
    (void)detail::record_error(team, w.code, detail::linear_block(), detail::linear_thread(),
                               static_cast<uint64_t>(reinterpret_cast<const char*>(flag) - team.local_base),
                               want, w.seen, w.waited_ns);
  return w.done;
}

// The same for a wait expected to last (a peer's compute, a phase of the kernel): a poll every 20 us.
// Hundreds of warps polling a rank's few flag lines every microsecond flood their L2 slice, and every load
// of the compute beside them that maps to that slice waits (Ulysses' pulls: a third slower attention).
[[nodiscard]] __device__ __forceinline__ bool wait_ge_napping(const TeamView& team, const uint64_t* flag,
                                                              uint64_t want) {
  if (ptx::ld_acquire_sys(flag) >= want) return true;
  return detail::wait_slow<true, 20000>(team, flag, want, detail::AtLeast{want}, detail::Identity{});
}

// The same for a flag that only threads of this GPU write (e.g. blocks of one kernel meeting).
[[nodiscard]] __device__ __forceinline__ bool wait_ge_local(const TeamView& team, const uint64_t* flag,
                                                            uint64_t want) {
  if (ptx::ld_acquire_gpu(flag) >= want) return true;
  return detail::wait_slow<false>(team, flag, want, detail::AtLeast{want}, detail::Identity{});
}

// wait_ge_local for a count that many finishers raise over a long time (e.g. a kernel's whole run): the
// team's timeout bounds a stall, not the wait, and restarts whenever the count moves.
[[nodiscard]] __device__ inline bool wait_ge_local_progressing(const TeamView& team, const uint64_t* flag,
                                                               uint64_t want) {
  struct AtLeastOrMoved {
    uint64_t want, from;
    __device__ bool operator()(uint64_t x) const { return x >= want || x != from; }
  };
  for (uint64_t seen = ptx::ld_acquire_gpu(flag); seen < want; seen = ptx::ld_acquire_gpu(flag)) {
    const detail::PollOutcome w = detail::poll_until<false, 64>(team, flag, AtLeastOrMoved{want, seen});
    if (!w.done) {
      detail::report_wait_failure(team, w.code, flag, want, w.seen, w.waited_ns);
      return false;
    }
  }
  return true;
}

// Waits until `done(*flag)` holds for a condition other than ">=" (e.g. a word whose upper half carries a
// call epoch); `want` and `observe(value)` describe it in a failure report.
template <class Done, class Observe>
[[nodiscard]] __device__ __forceinline__ bool wait_until(const TeamView& team, const uint64_t* flag,
                                                         uint64_t want, Done done, Observe observe) {
  if (done(ptx::ld_acquire_sys(flag))) return true;
  return detail::wait_slow<true>(team, flag, want, done, observe);
}

}  // namespace weft
