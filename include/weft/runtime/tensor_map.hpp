// Host side of TMA: make_map() encodes a CUtensorMap (a strided tensor of rank 2..5, its box and swizzle)
// with cuTensorMapEncodeTiled, resolved at run time through the runtime's entry-point query (weft never
// links libcuda), and checks what TMA requires with errors naming the tensor; make_map_2d() is its
// row-major 2-D form. The device side that uses the maps is weft/tile/tma.cuh.
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

// A strided tensor in global memory, dimensions innermost first (TMA's order): dims[0] elements are
// contiguous; dimension i > 0 steps by strides_bytes[i] bytes (strides_bytes[0] is unused).
struct TensorNd {
  const void* base = nullptr;
  CUtensorMapDataType dtype = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  uint32_t elem_bytes = 2;
  int rank = 2;
  uint64_t dims[5] = {};
  uint64_t strides_bytes[5] = {};
};

// Encodes a tensor map whose box is box[0] x box[1] x ... elements (innermost first). `what` names the
// tensor in errors. With the 128-byte swizzle a box row (box[0] elements) must be at most 128 bytes
// (tile/layout.cuh's Sw128Tile blocks are exactly 128); the box lands in shared memory densely, innermost
// first.
inline CUtensorMap make_map(const TensorNd& t, const uint32_t* box, const std::string& what,
                            CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_128B,
                            CUtensorMapL2promotion l2 = CU_TENSOR_MAP_L2_PROMOTION_L2_256B) {
  const auto addr = reinterpret_cast<uintptr_t>(t.base);
  WEFT_CHECK(t.rank >= 2 && t.rank <= 5, what + ": tensor maps here have rank 2 to 5");
  WEFT_CHECK(t.base != nullptr, what + ": null pointer");
  WEFT_CHECK(addr % 16 == 0,
             what + ": TMA needs a 16-byte aligned base address, got " + std::to_string(addr));
  cuuint64_t dims[5], strides[4];
  cuuint32_t boxes[5], elem_strides[5];
  for (int i = 0; i < t.rank; ++i) {
    WEFT_CHECK(t.dims[i] >= 1 && t.dims[i] <= (1ull << 32), what + ": dimension " + std::to_string(i) +
                                                                " must be in [1, 2^32], got " +
                                                                std::to_string(t.dims[i]));
    WEFT_CHECK(box[i] >= 1 && box[i] <= 256, what + ": bad TMA box (each side 1..256)");
    dims[i] = t.dims[i];
    boxes[i] = box[i];
    elem_strides[i] = 1;
    if (i == 0) continue;
    const uint64_t st = t.strides_bytes[i];
    WEFT_CHECK(st % 16 == 0 && st < (1ull << 40),
               what + ": TMA needs strides that are multiples of 16 bytes (and < 2^40), got " +
                   std::to_string(st) + " bytes for dimension " + std::to_string(i));
    strides[i - 1] = st;
  }
  WEFT_CHECK(t.strides_bytes[1] >= t.dims[0] * t.elem_bytes,
             what + ": the row stride is shorter than a row (" + std::to_string(t.strides_bytes[1]) + " < " +
                 std::to_string(t.dims[0] * t.elem_bytes) + " bytes)");
  WEFT_CHECK((box[0] * t.elem_bytes) % 16 == 0, what + ": a TMA box row must be a multiple of 16 bytes");
  WEFT_CHECK(swizzle != CU_TENSOR_MAP_SWIZZLE_128B || box[0] * t.elem_bytes <= 128,
             what + ": a 128-byte swizzled box row is at most 128 bytes");
  CUtensorMap map;
  const CUresult r = encode_tiled_fn()(
      &map, t.dtype, static_cast<cuuint32_t>(t.rank), const_cast<void*>(t.base), dims, strides, boxes,
      elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, l2, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::string shape, box_text;
    for (int i = t.rank - 1; i >= 0; --i) {
      shape += std::to_string(t.dims[i]) + (i ? " x " : "");
      box_text += std::to_string(box[i]) + (i ? " x " : "");
    }
    throw_error("weft: cuTensorMapEncodeTiled failed for " + what + ": " + driver_error_text(int(r)) + " (" +
                shape + ", row stride " + std::to_string(t.strides_bytes[1]) + " B, box " + box_text + ")");
  }
  return map;
}

// A row-major 2-D tensor: `rows` rows of `cols` elements, rows `row_stride_bytes` apart; box box_rows x
// box_cols elements.
inline CUtensorMap make_map_2d(const Tensor2d& t, uint32_t box_rows, uint32_t box_cols,
                               const std::string& what,
                               CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_128B,
                               CUtensorMapL2promotion l2 = CU_TENSOR_MAP_L2_PROMOTION_L2_256B) {
  TensorNd n;
  n.base = t.base;
  n.dtype = t.dtype;
  n.elem_bytes = t.elem_bytes;
  n.rank = 2;
  n.dims[0] = t.cols;
  n.dims[1] = t.rows;
  n.strides_bytes[1] = t.row_stride_bytes;
  const uint32_t box[2] = {box_cols, box_rows};
  return make_map(n, box, what, swizzle, l2);
}

}  // namespace weft::tma
