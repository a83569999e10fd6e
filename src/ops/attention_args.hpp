// What the attention launchers share (internal to src/ops): the checks of a call, its error-message prefix
// and the 4-D tensor maps of [batch, seq, heads, dim] tensors.
#pragma once
#include <cmath>
#include <string>

#include "op_args.hpp"
#include "weft/ops/attention.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/tensor_map.hpp"

namespace weft::ops {

inline std::string attention_where(const char* op, const AttentionShape& s) {
  return std::string(op) + "(batch=" + std::to_string(s.batch) + ", seq_q=" + std::to_string(s.seq_q) +
         ", seq_k=" + std::to_string(s.seq_k) + ", heads=" + std::to_string(s.heads) +
         ", kv_heads=" + std::to_string(s.kv_heads) + ", head_dim=" + std::to_string(s.head_dim) + "): ";
}

// Shape checks with clear errors (no device needed).
inline void check_attention_shape(const AttentionShape& s, const std::string& w) {
  WEFT_CHECK(s.batch >= 1 && s.seq_q >= 1 && s.seq_k >= 1 && s.heads >= 1 && s.kv_heads >= 1,
             w + "batch, seq_q, seq_k, heads and kv_heads must be at least 1");
  WEFT_CHECK(s.heads % s.kv_heads == 0, w + "heads (" + std::to_string(s.heads) +
                                            ") must be a multiple of kv_heads (" +
                                            std::to_string(s.kv_heads) + ")");
  WEFT_CHECK(s.head_dim == 64 || s.head_dim == 128,
             w + "head_dim must be 64 or 128, got " + std::to_string(s.head_dim));
  const int64_t longest = s.seq_q > s.seq_k ? s.seq_q : s.seq_k;
  WEFT_CHECK(s.seq_q < (int64_t(1) << 31) && s.seq_k < (int64_t(1) << 31) && s.heads < (1 << 24) &&
                 s.batch * s.heads * ((longest + 63) / 64) < (int64_t(1) << 31),
             w + "sizes past 2^31 are not supported (TMA coordinates and work items are 32-bit)");
}

// Shape, dtype, options and device checks with clear errors; returns the current device's facts.
inline DeviceFacts check_attention_call(const AttentionShape& s, DType dtype, const AttentionOptions& o,
                                        const std::string& w) {
  check_attention_shape(s, w);
  WEFT_CHECK(dtype == DType::kBF16, w + "tensors must be bf16 (DType::kBF16), got " + dtype_name(dtype));
  WEFT_CHECK(!std::isnan(o.softmax_scale) && o.softmax_scale >= 0.f,
             w + "softmax_scale must be positive (or 0 for 1 / sqrt(head_dim))");
  WEFT_CHECK(o.max_blocks >= 0, w + "options.max_blocks must be >= 0");
  const DeviceFacts dev = device_facts();
  WEFT_CHECK(dev.cc == 90, w + "runs on Hopper (sm_90) GPUs; device " + std::to_string(dev.device) +
                               " is sm_" + std::to_string(dev.cc));
  return dev;
}

inline float attention_scale(const AttentionShape& s, const AttentionOptions& o) {
  return o.softmax_scale > 0.f ? o.softmax_scale : 1.f / std::sqrt(float(s.head_dim));
}

// A [batch, seq, heads, dim] bf16 tensor as a 4-D map {dim, head, seq, batch} with box {64, 1, rows, 1}:
// boxes clip at each sequence's end (loads past it read zeros, stores past it write nothing).
inline CUtensorMap map_bshd(const void* base, int64_t batch, int64_t seq, int64_t heads, int64_t dim,
                            uint32_t rows, const std::string& what) {
  tma::TensorNd t;
  t.base = base;
  t.dtype = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  t.elem_bytes = 2;
  t.rank = 4;
  t.dims[0] = uint64_t(dim);
  t.dims[1] = uint64_t(heads);
  t.dims[2] = uint64_t(seq);
  t.dims[3] = uint64_t(batch);
  t.strides_bytes[1] = uint64_t(dim) * 2;
  t.strides_bytes[2] = uint64_t(heads * dim) * 2;
  t.strides_bytes[3] = uint64_t(seq * heads * dim) * 2;
  const uint32_t box[4] = {64, 1, rows, 1};
  return tma::make_map(t, box, what);
}

// Persistent blocks of an attention kernel: one per resident slot, capped by the SM budget and the items.
inline int attention_blocks(int resident, const AttentionOptions& o, int64_t units) {
  int blocks = resident;
  if (o.max_blocks > 0) blocks = std::min(blocks, o.max_blocks);
  return static_cast<int>(std::min<int64_t>(blocks, units));
}

}  // namespace weft::ops
