// TMA tensor maps (the tensor form of the bulk-copy engine): 2-D tiles between global memory (local or a
// peer's, through the symmetric heap) and 128-byte-swizzled shared memory.
//
// Host: make_map_2d() encodes a CUtensorMap with cuTensorMapEncodeTiled, resolved at run time through the
// runtime's entry-point query (weft never links libcuda). Device: loads complete on an mbarrier (transaction
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
#include <string>

#include "weft/device/bulk_copy.cuh"
#include "weft/runtime/error.hpp"

namespace weft::tma {

// ---- host ------------------------------------------------------------------------------------
// A row-major 2-D tensor in global memory: `rows` rows of `cols` elements, rows `row_stride_bytes` apart.
struct Tensor2d {
  const void* base = nullptr;
  CUtensorMapDataType dtype = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  uint32_t elem_bytes = 2;
  uint64_t rows = 0, cols = 0;
  uint64_t row_stride_bytes = 0;
};

inline decltype(&::cuTensorMapEncodeTiled) encode_tiled_fn() {
  static const auto fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult status{};
    const cudaError_t e =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &status);
    if (e != cudaSuccess || status != cudaDriverEntryPointSuccess || p == nullptr)
      throw_error(std::string("weft: the CUDA driver does not provide cuTensorMapEncodeTiled (") +
                  cudaGetErrorString(e) + "); TMA needs an NVIDIA driver for CUDA 12 or newer");
    return reinterpret_cast<decltype(&::cuTensorMapEncodeTiled)>(p);
  }();
  return fn;
}

// Encodes a tensor map whose box is box_rows x box_cols elements. `what` names the tensor in errors.
// With the 128-byte swizzle a box row must be at most 128 bytes (tile/layout.cuh's Sw128Tile blocks are
// exactly 128).
inline CUtensorMap make_map_2d(const Tensor2d& t, uint32_t box_rows, uint32_t box_cols,
                               const std::string& what,
                               CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_128B,
                               CUtensorMapL2promotion l2 = CU_TENSOR_MAP_L2_PROMOTION_L2_256B) {
  const auto addr = reinterpret_cast<uintptr_t>(t.base);
  WEFT_CHECK(t.base != nullptr, what + ": null pointer");
  WEFT_CHECK(addr % 16 == 0,
             what + ": TMA needs a 16-byte aligned base address, got " + std::to_string(addr));
  WEFT_CHECK(t.rows >= 1 && t.cols >= 1 && t.rows <= (1ull << 32) && t.cols <= (1ull << 32),
             what + ": each dimension must be in [1, 2^32], got " + std::to_string(t.rows) + " x " +
                 std::to_string(t.cols));
  WEFT_CHECK(t.row_stride_bytes % 16 == 0 && t.row_stride_bytes < (1ull << 40),
             what + ": TMA needs a row stride that is a multiple of 16 bytes (and < 2^40), got " +
                 std::to_string(t.row_stride_bytes) + " bytes");
  WEFT_CHECK(t.row_stride_bytes >= t.cols * t.elem_bytes,
             what + ": the row stride is shorter than a row (" + std::to_string(t.row_stride_bytes) + " < " +
                 std::to_string(t.cols * t.elem_bytes) + " bytes)");
  WEFT_CHECK(box_rows >= 1 && box_rows <= 256 && box_cols >= 1 && box_cols <= 256 &&
                 (box_cols * t.elem_bytes) % 16 == 0,
             what + ": bad TMA box");
  WEFT_CHECK(swizzle != CU_TENSOR_MAP_SWIZZLE_128B || box_cols * t.elem_bytes <= 128,
             what + ": a 128-byte swizzled box row is at most 128 bytes");
  CUtensorMap map;
  const cuuint64_t dims[2] = {t.cols, t.rows};
  const cuuint64_t strides[1] = {t.row_stride_bytes};
  const cuuint32_t box[2] = {box_cols, box_rows};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r =
      encode_tiled_fn()(&map, t.dtype, 2, const_cast<void*>(t.base), dims, strides, box, elem_strides,
                        CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, l2, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw_error("weft: cuTensorMapEncodeTiled failed for " + what + ": " + driver_error_text(int(r)) + " (" +
                std::to_string(t.rows) + " x " + std::to_string(t.cols) + ", row stride " +
                std::to_string(t.row_stride_bytes) + " B, box " + std::to_string(box_rows) + " x " +
                std::to_string(box_cols) + ")");
  return map;
}

// ---- device ----------------------------------------------------------------------------------
// `map` is the generic address of a tensor map in kernel parameters (__grid_constant__), constant or
// global memory. Maps written by the host before the launch need no fence.
__device__ __forceinline__ void prefetch_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
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

}  // namespace weft::tma
