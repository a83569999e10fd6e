// Host side of TMA: make_map_2d() encodes a CUtensorMap (a row-major 2-D tensor, its box and swizzle) with
// cuTensorMapEncodeTiled, resolved at run time through the runtime's entry-point query (weft never links
// libcuda), and checks what TMA requires with errors naming the tensor. The device side that uses the maps
// is weft/tile/tma.cuh.
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "weft/runtime/error.hpp"

namespace weft::tma {

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

}  // namespace weft::tma
