// Warp specialization building blocks: which warpgroup a thread is in, register reallocation between
// warpgroups (setmaxnreg), named barriers over one warpgroup, and a bounded wait for pipeline mbarriers.
//
// A block of W warpgroups launches with the same register count R for every thread (ptxas takes it from
// __launch_bounds__(128 * W, 1): R = 65536 / (128 * W), rounded down to a multiple of 8). setmaxnreg then
// moves registers between warpgroups: a producer warpgroup gives some back (dec), the consumers take them
// (inc). The sum must stay within the block's allocation: 128 * (dec + (W - 1) * inc) <= 128 * W * R.
#pragma once
#include <cstdint>

#include "weft/device/bulk_copy.cuh"
#include "weft/device/ptx.cuh"

namespace weft::tile {

inline constexpr int kWarpSize = 32;
inline constexpr int kWarpgroupThreads = 128;

// Warp-uniform by construction (broadcast from lane 0), so branches on it never diverge inside a warp.
__device__ __forceinline__ int warpgroup_index() {
  return __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / kWarpgroupThreads, 0);
}
__device__ __forceinline__ int warp_in_warpgroup() {
  return __shfl_sync(0xffffffffu, (static_cast<int>(threadIdx.x) / kWarpSize) % 4, 0);
}
__device__ __forceinline__ int thread_in_warpgroup() {
  return static_cast<int>(threadIdx.x) % kWarpgroupThreads;
}
__device__ __forceinline__ int lane_id() {
  return static_cast<int>(threadIdx.x) % kWarpSize;
}

// Register reallocation. Every warp of the warpgroup must execute the same call.
template <uint32_t kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  static_assert(kRegs >= 24 && kRegs <= 256 && kRegs % 8 == 0, "setmaxnreg: 24..256, multiple of 8");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <uint32_t kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  static_assert(kRegs >= 24 && kRegs <= 256 && kRegs % 8 == 0, "setmaxnreg: 24..256, multiple of 8");
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}

// Named barriers: id 0 is __syncthreads; ids 1..15 are free. `threads` is a multiple of 32.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  ptx::bar_sync(id, threads);
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  ptx::bar_arrive(id, threads);
}

// Waits for an mbarrier phase like weft::mbarrier_wait, but gives up after kHangNs with a trap: inside one
// block (or cluster) a pipeline wait that takes that long is a bug (a wrong byte count, a bad tensor map),
// and a trap turns a silent hang into a launch error the host sees.
inline constexpr uint64_t kHangNs = 20ull * 1000 * 1000 * 1000;
// The loop is PTX, not C++: a C++ loop around the try-wait (with its trap path) in a consumer warpgroup
// changed ptxas' register allocation of the whole consumer (spills, and wgmma serialised for lack of
// registers); as one asm statement it is opaque straight-line code to the allocator.
__device__ __forceinline__ void mbarrier_wait_bounded(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      " .reg .pred done, late;\n"
      " .reg .u64 t0, t;\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @done bra DONE;\n"
      " mov.u64 t0, %%globaltimer;\n"
      "WAIT:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @done bra DONE;\n"
      " mov.u64 t, %%globaltimer;\n"
      " sub.u64 t, t, t0;\n"
      " setp.gt.u64 late, t, %2;\n"
      " @late trap;\n"
      " bra WAIT;\n"
      "DONE:\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity), "l"(kHangNs)
      : "memory");
}

// Spins until *counter >= want (a gpu-scope acquire load), and like mbarrier_wait_bounded traps after
// kHangNs. One asm block: a loop the compiler sees inside a kernel that holds wgmma accumulators made ptxas
// spill them and serialise the kernel's wgmma.
__device__ __forceinline__ void wait_ge_bounded(const uint64_t* counter, uint64_t want) {
  asm volatile(
      "{\n"
      " .reg .pred done, late;\n"
      " .reg .u64 v, t0, t;\n"
      " ld.acquire.gpu.global.u64 v, [%0];\n"
      " setp.ge.u64 done, v, %1;\n"
      " @done bra DONE;\n"
      " mov.u64 t0, %%globaltimer;\n"
      "WAIT:\n"
      " nanosleep.u32 64;\n"
      " ld.acquire.gpu.global.u64 v, [%0];\n"
      " setp.ge.u64 done, v, %1;\n"
      " @done bra DONE;\n"
      " mov.u64 t, %%globaltimer;\n"
      " sub.u64 t, t, t0;\n"
      " setp.gt.u64 late, t, %2;\n"
      " @late trap;\n"
      " bra WAIT;\n"
      "DONE:\n"
      "}\n" ::"l"(counter),
      "l"(want), "l"(kHangNs)
      : "memory");
}

}  // namespace weft::tile
