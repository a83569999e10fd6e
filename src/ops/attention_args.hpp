// What the attention launchers share (internal to src/ops): the checks of a call, its error-message prefix
// and the 4-D tensor maps of [batch, seq, heads, dim] tensors.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <string>
#include <type_traits>

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

// Shape checks with clear errors (no device needed). Packed sequences: `segments` (see AttentionSegments).
inline void check_attention_shape(const AttentionShape& s, const AttentionSegments& seg,
                                  const std::string& w) {
  if (seg.packed()) {
    WEFT_CHECK(seg.q_end != nullptr && seg.k_begin != nullptr && seg.k_end != nullptr,
               w + "packed sequences need all four of segments.q_begin, q_end, k_begin and k_end");
    WEFT_CHECK(seg.total_q >= 1 && seg.total_k >= 1 && seg.total_q < (int64_t(1) << 31) &&
                   seg.total_k < (int64_t(1) << 31),
               w +
                   "packed sequences: segments.total_q and total_k (rows of q and of k / v) must be in [1, "
                   "2^31), got " +
                   std::to_string(seg.total_q) + " and " + std::to_string(seg.total_k));
    WEFT_CHECK(s.seq_q <= seg.total_q && s.seq_k <= seg.total_k,
               w + "packed sequences: seq_q / seq_k are the longest sequences and cannot exceed total_q (" +
                   std::to_string(seg.total_q) + ") / total_k (" + std::to_string(seg.total_k) + ")");
  } else {
    WEFT_CHECK(
        seg.q_end == nullptr && seg.k_begin == nullptr && seg.k_end == nullptr,
        w + "segments.q_begin is null but other segment arrays are set: packed sequences need all four");
  }
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
  check_attention_shape(s, o.segments, w);
  WEFT_CHECK(dtype == DType::kBF16 || dtype == DType::kFP16,
             w + "tensors must be bf16 or fp16 (DType::kBF16, kFP16), got " + dtype_name(dtype));
  WEFT_CHECK(!std::isnan(o.softmax_scale) && o.softmax_scale >= 0.f,
             w + "softmax_scale must be positive (or 0 for 1 / sqrt(head_dim))");
  WEFT_CHECK(o.max_blocks >= 0, w + "options.max_blocks must be >= 0");
  WEFT_CHECK(o.timeline == nullptr || dtype == DType::kBF16,
             w + "options.timeline: bf16 calls only (the timed kernels are a measuring tool)");
  const DeviceFacts dev = device_facts();
  WEFT_CHECK(dev.cc == 90, w + "runs on Hopper (sm_90) GPUs; device " + std::to_string(dev.device) +
                               " is sm_" + std::to_string(dev.cc));
  return dev;
}

// The team attention ops (ring, Ulysses, hybrid, context attention) set the per-step options themselves: a
// caller's would be ignored, so they are refused; so is options.timeline (they record into their rank's,
// team_attention_timeline). with_grads:
// accumulate_grads too (the backwards, and the Ulysses / hybrid start shared by both passes; the ring and
// context forwards leave it alone, as training code hands the forward the backward's options).
inline void check_team_attention_options(const AttentionOptions& o, bool with_grads, const std::string& w) {
  if (with_grads)
    WEFT_CHECK(
        !o.segments.packed() && !o.accumulate.enabled() && !o.accumulate_grads.enabled(),
        w + "options.segments / accumulate / accumulate_grads are set by the op itself; leave them empty");
  else
    WEFT_CHECK(!o.segments.packed() && !o.accumulate.enabled(),
               w + "options.segments and options.accumulate are set by the op itself; leave them empty");
  WEFT_CHECK(o.timeline == nullptr,
             w + "options.timeline is for the single-GPU flash attention; the team ops "
                 "record into their rank's timeline (Communicator::timeline_start)");
}

// The timeline a team attention op records into: its rank's (Communicator::timeline_start), for bf16 calls;
// fp16 calls record nothing (the timed kernels, which carry the marks, exist for bf16 alone).
inline TimelineBuffer* team_attention_timeline(const Rank& rank, DType dtype) {
  return dtype == DType::kBF16 ? rank.view().timeline : nullptr;
}

// A team attention kernel's parameters: the timed kernels (Timed scheduler parameters, chosen by
// by_head_dim_and_type) record into the rank's timeline; the others carry none.
template <class Params>
void set_team_timeline(Params& p, const Rank& rank) {
  if constexpr (requires { p.sched.timeline; }) p.sched.timeline = rank.view().timeline;
}

// A team attention op's kernel for its head dim and dtype: run(std::integral_constant<int, D>{}, T{},
// std::bool_constant<timed>{}), timed where team_attention_timeline is set.
template <class Run>
void by_head_dim_and_type(const Rank& rank, int64_t head_dim, DType dtype, Run&& run) {
  using D64 = std::integral_constant<int, 64>;
  using D128 = std::integral_constant<int, 128>;
  if (dtype == DType::kFP16) {
    head_dim == 64 ? run(D64{}, __half{}, std::false_type{}) : run(D128{}, __half{}, std::false_type{});
  } else if (team_attention_timeline(rank, dtype) != nullptr) {
    head_dim == 64 ? run(D64{}, __nv_bfloat16{}, std::true_type{})
                   : run(D128{}, __nv_bfloat16{}, std::true_type{});
  } else {
    head_dim == 64 ? run(D64{}, __nv_bfloat16{}, std::false_type{})
                   : run(D128{}, __nv_bfloat16{}, std::false_type{});
  }
}

inline float attention_scale(const AttentionShape& s, const AttentionOptions& o) {
  return o.softmax_scale > 0.f ? o.softmax_scale : 1.f / std::sqrt(float(s.head_dim));
}

// The softmax fields every attention kernel's parameters carry: the query heads, the query heads per K / V
// head, the scale (and the same in log2 units: the kernels exponentiate with exp2), causal masking.
template <class Params>
void set_softmax_params(Params& p, int64_t heads, int64_t group, float scale, bool causal) {
  constexpr float kLog2e = 1.4426950408889634f;
  p.heads = static_cast<int>(heads);
  p.group = static_cast<int>(group);
  p.scale = scale;
  p.scale_log2 = scale * kLog2e;
  p.causal = causal ? 1 : 0;
}

// A [batch, seq, heads, dim] bf16 / fp16 tensor as a 4-D map {dim, head, seq, batch} with box {64, 1, rows,
// 1}: boxes clip at each sequence's end (loads past it read zeros, stores past it write nothing). fp32
// tensors: box {32, 1, rows, 1}, 128 bytes across as well.
inline CUtensorMap map_bshd(const void* base, int64_t batch, int64_t seq, int64_t heads, int64_t dim,
                            uint32_t rows, const std::string& what, DType dtype) {
  const bool f32 = dtype == DType::kFP32;
  tma::TensorNd t;
  t.base = base;
  t.dtype = f32                     ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
            : dtype == DType::kFP16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                    : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  t.elem_bytes = f32 ? 4 : 2;
  t.rank = 4;
  t.dims[0] = uint64_t(dim);
  t.dims[1] = uint64_t(heads);
  t.dims[2] = uint64_t(seq);
  t.dims[3] = uint64_t(batch);
  t.strides_bytes[1] = uint64_t(dim) * t.elem_bytes;
  t.strides_bytes[2] = uint64_t(heads * dim) * t.elem_bytes;
  t.strides_bytes[3] = uint64_t(seq * heads * dim) * t.elem_bytes;
  const uint32_t box[4] = {f32 ? 32u : 64u, 1, rows, 1};
  return tma::make_map(t, box, what);
}

// A head-major [heads, rows, dim] bf16 / fp16 tensor seen as map_bshd's [1, rows, heads, dim] (the same 4-D
// map {dim, head, row, batch} and box; only the strides differ): the attention reads and writes it as a
// packed tensor.
inline CUtensorMap map_heads_rows(const void* base, int64_t heads, int64_t rows, int64_t dim,
                                  uint32_t box_rows, const std::string& what, DType dtype) {
  tma::TensorNd t;
  t.base = base;
  t.dtype = dtype == DType::kFP16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  t.elem_bytes = 2;
  t.rank = 4;
  t.dims[0] = uint64_t(dim);
  t.dims[1] = uint64_t(heads);
  t.dims[2] = uint64_t(rows);
  t.dims[3] = 1;
  t.strides_bytes[1] = uint64_t(rows * dim) * 2;
  t.strides_bytes[2] = uint64_t(dim) * 2;
  t.strides_bytes[3] = uint64_t(heads * rows * dim) * 2;
  const uint32_t box[4] = {64u, 1, box_rows, 1};
  return tma::make_map(t, box, what);
}

// The attention backward's per-row terms (LSE * log2(e), D): [heads][term_stride] fp32 rows viewed as a 2-D
// map {term_stride, heads} with boxes of `rows` floats of one head.
inline CUtensorMap map_terms(const float* base, int64_t term_stride, int64_t heads, uint32_t rows,
                             const std::string& what) {
  tma::TensorNd t;
  t.base = base;
  t.dtype = CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
  t.elem_bytes = 4;
  t.rank = 2;
  t.dims[0] = uint64_t(term_stride);
  t.dims[1] = uint64_t(heads);
  t.strides_bytes[1] = uint64_t(term_stride) * 4;
  const uint32_t box[2] = {rows, 1};
  return tma::make_map(t, box, what, CU_TENSOR_MAP_SWIZZLE_NONE);
}

// Packed sequences' arrays: device memory on `device`, int32-aligned.
inline void check_segment_arrays(const AttentionSegments& seg, int device, const std::string& w) {
  if (!seg.packed()) return;
  for (auto [p, name] : {std::pair<const void*, const char*>{seg.q_begin, "segments.q_begin"},
                         {seg.q_end, "segments.q_end"},
                         {seg.k_begin, "segments.k_begin"},
                         {seg.k_end, "segments.k_end"}}) {
    check_pointer_alignment(p, name, 4, w);
    check_device_memory(p, name, device, w);
  }
}

// The map of q-like (rows = seq_q or total_q) or k-like tensors, dense or packed (one sequence of `total`
// rows).
inline CUtensorMap map_rows(const void* base, const AttentionShape& s, const AttentionSegments& seg,
                            bool keys, int64_t heads, uint32_t box_rows, const std::string& what,
                            DType dtype) {
  if (seg.packed())
    return map_bshd(base, 1, keys ? seg.total_k : seg.total_q, heads, s.head_dim, box_rows, what, dtype);
  return map_bshd(base, s.batch, keys ? s.seq_k : s.seq_q, heads, s.head_dim, box_rows, what, dtype);
}
// Rows of q's layout seen as [rows, heads, dim].
inline int64_t query_rows(const AttentionShape& s, const AttentionSegments& seg) {
  return seg.packed() ? seg.total_q : s.batch * s.seq_q;
}

// Persistent blocks of an attention kernel: one per resident slot, capped by the SM budget and the items.
inline int attention_blocks(int resident, const AttentionOptions& o, int64_t units) {
  int blocks = resident;
  if (o.max_blocks > 0) blocks = std::min(blocks, o.max_blocks);
  return static_cast<int>(std::min<int64_t>(blocks, units));
}

}  // namespace weft::ops
