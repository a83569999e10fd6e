// Tile transfers by the bulk-copy engine (TMA), between this block's shared memory and any rank's copy of
// a symmetric buffer: put (shared -> peer), put-reduce (shared += into peer, in the copy engine), get
// (peer -> shared). A tile is `rows` rows of `row_bytes` contiguous bytes, `stride` bytes apart in global
// memory and packed in shared memory; row_bytes, stride and addresses must be multiples of 16.
// One thread issues (the copy engine does the work). Puts complete with the issuing thread's bulk groups
// (bulk_commit, then bulk_wait / bulk_wait_read); gets complete on an mbarrier as `rows * row_bytes`
// transaction bytes (arm it with mbarrier_arrive_expect_tx first).
#pragma once
#include "weft/device/bulk_copy.cuh"
#include "weft/device/numeric.cuh"
#include "weft/team_view.hpp"

namespace weft {

struct TileShape {
  uint32_t rows;
  uint32_t row_bytes;
  uint64_t stride;  // bytes between rows in global memory
};

template <class T>
__device__ __forceinline__ void tile_put(const TeamView& team, T* local_dst, int peer, const void* smem_src,
                                         TileShape t) {
  char* dst = reinterpret_cast<char*>(team.peer_ptr(local_dst, peer));
  const char* src = static_cast<const char*>(smem_src);
  for (uint32_t r = 0; r < t.rows; ++r) bulk_store(dst + r * t.stride, src + r * t.row_bytes, t.row_bytes);
}

template <class T>
__device__ __forceinline__ void tile_get(const TeamView& team, const T* local_src, int peer, void* smem_dst,
                                         TileShape t, uint64_t* bar) {
  const char* src = reinterpret_cast<const char*>(team.peer_ptr(local_src, peer));
  char* dst = static_cast<char*>(smem_dst);
  for (uint32_t r = 0; r < t.rows; ++r)
    bulk_load(dst + r * t.row_bytes, src + r * t.stride, t.row_bytes, bar);
}

namespace detail {
template <Elem E>
__device__ __forceinline__ void bulk_reduce_add(void* gmem_dst, const void* smem_src, uint32_t bytes) {
  if constexpr (E == Elem::kFP32)
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(gmem_dst),
                 "r"(smem_addr(smem_src)), "r"(bytes)
                 : "memory");
  else if constexpr (E == Elem::kBF16)
    asm volatile(
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.noftz.bf16 [%0], [%1], %2;" ::"l"(gmem_dst),
        "r"(smem_addr(smem_src)), "r"(bytes)
        : "memory");
  else
    asm volatile(
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.noftz.f16 [%0], [%1], %2;" ::"l"(gmem_dst),
        "r"(smem_addr(smem_src)), "r"(bytes)
        : "memory");
}
}  // namespace detail

// peer[tile] += smem tile, element type E, done by the copy engine (each element atomically).
template <Elem E, class T>
__device__ __forceinline__ void tile_put_reduce_add(const TeamView& team, T* local_dst, int peer,
                                                    const void* smem_src, TileShape t) {
  char* dst = reinterpret_cast<char*>(team.peer_ptr(local_dst, peer));
  const char* src = static_cast<const char*>(smem_src);
  for (uint32_t r = 0; r < t.rows; ++r)
    detail::bulk_reduce_add<E>(dst + r * t.stride, src + r * t.row_bytes, t.row_bytes);
}

// Waits until this thread's committed puts (and put-reduces) have landed, and orders them before its
// later ordinary writes, such as the signal that tells the peer: the copy engine writes through the async
// proxy, so completion alone does not order it with the generic proxy.
__device__ __forceinline__ void tile_puts_complete() {
  bulk_wait<0>();
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// The same tile put to every rank (this rank's copy included): unicast fan-out, no multicast.
template <class T>
__device__ __forceinline__ void tile_broadcast(const TeamView& team, T* local_dst, const void* smem_src,
                                               TileShape t) {
  for (int p = 0; p < team.world; ++p) tile_put(team, local_dst, (team.rank + p) % team.world, smem_src, t);
}

}  // namespace weft
