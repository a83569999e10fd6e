// TMA tensor maps (the tensor form of the bulk-copy engine): 2-D tiles between global memory (local or a
// peer's, through the symmetric heap) and 128-byte-swizzled shared memory.
//
// The maps are encoded on the host (weft/runtime/tensor_map.hpp) and passed as __grid_constant__ kernel
// parameters. Device: loads complete on an mbarrier (transaction
// bytes, as in bulk_copy.cuh), optionally multicast to every CTA of a thread-block cluster (SM-to-SM, inside
// one GPU); stores and reduce-adds complete with the issuing thread's bulk groups (bulk_commit / bulk_wait
// from bulk_copy.cuh).
//
// Coordinates are {column, row}: the contiguous dimension first, as TMA counts them. Boxes that reach past
// the tensor's edge are clipped: loads fill the outside with zeros (and still count the whole box in the
// transaction bytes), stores and reduce-adds write nothing outside.
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "weft/device/bulk_copy.cuh"

namespace weft::tma {

// ---- device ----------------------------------------------------------------------------------
// `map` is the generic address of a tensor map in kernel parameters (__grid_constant__), constant or
// global memory. Maps written by the host before the launch need no fence.
__device__ __forceinline__ void prefetch_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
// A map in global memory written through the generic proxy (by an earlier kernel, e.g. an upload): made
// visible to this thread's tensor-map reads before its first TMA operation with it.
__device__ __forceinline__ void acquire_global_map(const CUtensorMap* map) {
  asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;" ::"l"(reinterpret_cast<uint64_t>(map))
               : "memory");
}

// global -> this CTA's shared memory; the box's bytes complete as transactions on `bar`.
__device__ __forceinline__ void load_2d(void* smem_dst, const CUtensorMap* map, int32_t col, int32_t row,
                                        uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];" ::"r"(smem_addr(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(col), "r"(row), "r"(smem_addr(bar))
      : "memory");
}

// global -> the same shared-memory offset in every CTA of the cluster named in `cta_mask` (bit i: CTA
// rank i); each destination's mbarrier at `bar`'s offset receives the box's bytes.
__device__ __forceinline__ void load_2d_multicast(void* smem_dst, const CUtensorMap* map, int32_t col,
                                                  int32_t row, uint64_t* bar, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(smem_addr(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(col), "r"(row), "r"(smem_addr(bar)), "h"(cta_mask)
      : "memory");
}

// shared -> global (local or peer). Make the tile's ordinary shared-memory writes visible first
// (fence_proxy_async_smem by every writer, then a barrier); completes with the thread's bulk groups.
__device__ __forceinline__ void store_2d(const CUtensorMap* map, int32_t col, int32_t row,
                                         const void* smem_src) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [%0, {%1, %2}], [%3];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(col), "r"(row), "r"(smem_addr(smem_src))
               : "memory");
}

// global[box] += shared, element-wise in the map's type (f32, f16, bf16), each element a relaxed gpu-scope
// reduction; local or peer memory.
__device__ __forceinline__ void reduce_add_2d(const CUtensorMap* map, int32_t col, int32_t row,
                                              const void* smem_src) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2}], [%3];" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(col), "r"(row), "r"(smem_addr(smem_src))
      : "memory");
}

// ---- rank 4 (e.g. [batch, seq, heads, dim] tensors: coordinates {dim, head, seq, batch}) ----------
__device__ __forceinline__ void load_4d(void* smem_dst, const CUtensorMap* map, int32_t c0, int32_t c1,
                                        int32_t c2, int32_t c3, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];" ::"r"(smem_addr(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_addr(bar))
      : "memory");
}
__device__ __forceinline__ void store_4d(const CUtensorMap* map, int32_t c0, int32_t c1, int32_t c2,
                                         int32_t c3, const void* smem_src) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_addr(smem_src))
      : "memory");
}

__device__ __forceinline__ void reduce_add_4d(const CUtensorMap* map, int32_t c0, int32_t c1, int32_t c2,
                                              int32_t c3, const void* smem_src) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];" ::
          "l"(reinterpret_cast<uint64_t>(map)),
      "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_addr(smem_src))
      : "memory");
}

}  // namespace weft::tma
