// Element-wise peer access: 16-byte vector loads, stores and reductions on a peer's copy of a symmetric
// buffer, broadcast to every rank, and reduce-from-peers (the unicast replacement for in-switch
// reduction). Pointers are into this rank's heap; the functions translate them to the peer's copy.
// None of these order anything: publish with signal_set (or fence_release + a relaxed signal) after them.
#pragma once
#include "weft/device/numeric.cuh"
#include "weft/device/vec.cuh"
#include "weft/team_view.hpp"

namespace weft {

// 16 bytes of `peer`'s copy of `local`.
template <class T>
__device__ __forceinline__ uint4 peer_load16(const TeamView& team, const T* local, int peer) {
  return ld16(team.peer_ptr(local, peer));
}

template <class T>
__device__ __forceinline__ void peer_store16(const TeamView& team, T* local, int peer, const uint4& v) {
  st16(team.peer_ptr(local, peer), v);
}

// Atomic add of 4 fp32 into `peer`'s copy (one red instruction; relaxed, system scope).
__device__ __forceinline__ void peer_red_add(const TeamView& team, float* local, int peer, const float4& v) {
  asm volatile("red.relaxed.sys.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(team.peer_ptr(local, peer)),
               "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
               : "memory");
}
// Atomic add of 8 bf16 (as 4 bf16x2) into `peer`'s copy. Accumulates in bf16: for sums of many terms
// prefer staging and an fp32 reduce_from_peers.
__device__ __forceinline__ void peer_red_add(const TeamView& team, __nv_bfloat16* local, int peer,
                                             const uint4& v) {
  asm volatile(
      "red.relaxed.sys.global.add.noftz.v4.bf16x2 [%0], {%1, %2, %3, %4};" ::"l"(team.peer_ptr(local, peer)),
      "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
      : "memory");
}

// Stores the same 16 bytes into every rank's copy of `local` (this rank's included).
template <class T>
__device__ __forceinline__ void broadcast16(const TeamView& team, T* local, const uint4& v) {
  for (int p = 0; p < team.world; ++p) st16(team.peer_ptr(local, p), v);
}

// The same 16 bytes read from every rank's copy of `local`, combined in fp32 with R. Loads from all ranks
// are issued before any is used, so the W reads overlap.
template <Elem E, Reduce R, int kMaxRanks = 8>
__device__ __forceinline__ Pack<E> reduce_from_peers16(const TeamView& team,
                                                       const typename Pack<E>::T* local) {
  Pack<E> acc = Pack<E>::load(ld16(local));
  for (int base = 0; base < team.world; base += kMaxRanks) {
    uint4 raw[kMaxRanks];
#pragma unroll
    for (int i = 0; i < kMaxRanks; ++i) {
      const int p = base + i;
      if (p < team.world && p != team.rank) raw[i] = ld16(team.peer_ptr(local, p));
    }
#pragma unroll
    for (int i = 0; i < kMaxRanks; ++i) {
      const int p = base + i;
      if (p < team.world && p != team.rank) acc.template combine_with<R>(Pack<E>::load(raw[i]));
    }
  }
  return acc;
}

}  // namespace weft
