// Host side of weft::flash_attention_backward: validation, the workspace layout, and the three launches
// (prepare, the LCSC op, convert; device code: weft/ops/attention_backward.cuh).
#include <algorithm>
#include <bit>
#include <string>
#include <utility>

#include "attention_args.hpp"
#include "weft/lcsc/launch.cuh"
#include "weft/ops/attention_backward.cuh"

namespace weft {
namespace {

struct Call {
  const void *q = nullptr, *k = nullptr, *v = nullptr, *out = nullptr, *dout = nullptr;
  const float* lse = nullptr;
  void *dq = nullptr, *dk = nullptr, *dv = nullptr, *workspace = nullptr;
  size_t workspace_bytes = 0;
  AttentionShape shape;
  AttentionOptions options;
  std::string where;
};

// Query rows per step of the kernel (AttentionBwdOp's kBlockM): 128 at D = 64 from 4096 queries on
// (1.03-1.09x the 64-row kernel's speed there; 0.88-0.92x at 1024 queries, where an item has only a few
// steps), else 64; deterministic calls alike (each warpgroup's dQ part is then 64 of the block's rows).
int block_rows(const AttentionShape& s) {
  return s.head_dim == 64 && s.seq_q >= 4096 ? 128 : 64;
}

// The workspace: the fp32 dQ accumulator (q's layout), then LSE * log2(e) and D per query row, [heads,
// term_stride] each (attention_term_rows, and a box of slack).
// Deterministic calls add a counter per (sequence, head, query block) for the turns of the dQ additions, and
// the kernel's unit claims counter after them.
// Where the items are fewer than the SMs (a small batch x sequence with few K / V heads: Ulysses' core at 2k
// tokens a GPU ran 64 items on 132 SMs), a K / V head's GQA query heads are split over head_split items
// (AttentionBwdOp::Params::head_split_log2), the largest power of two that still fits one wave; their dK /
// dV are reduce-added into fp32 accumulators after the above (or into accumulate_grads'), converted after
// the kernel. Not for deterministic calls (the adds' order varies).
struct Workspace {
  int64_t rows = 0, term_stride = 0, dq_blocks = 0, key_rows = 0;
  size_t accum_bytes = 0, row_bytes = 0, order_bytes = 0, dkv_bytes = 0;
  int head_split = 1;
  bool dkv_accum = false;  // split items add dK / dV into the workspace's fp32 accumulators (converted after)
  Workspace(const AttentionShape& s, const AttentionOptions& o) {
    const AttentionSegments& seg = o.segments;
    rows = ops::query_rows(s, seg);
    term_stride = (ops::attention_term_rows(seg.packed(), seg.total_q, s.batch, s.seq_q) + 127) / 64 * 64;
    accum_bytes = (size_t(rows * s.heads * s.head_dim) * 4 + 255) / 256 * 256;
    row_bytes = size_t(s.heads * term_stride) * 4;  // a multiple of 256
    const int64_t block_m = block_rows(s);
    dq_blocks = (s.seq_q + block_m - 1) / block_m;
    if (o.deterministic) order_bytes = size_t(s.batch * s.heads * dq_blocks) * 8 + 8;
    // The size reserves for the most splitting the shape allows (causal's paired units, every SM): the
    // sizing calls know neither causal nor max_blocks, and either only lowers the split.
    const int sms = ops::device_facts().sms;  // one persistent block an SM (the kernel's shared memory)
    head_split =
        o.deterministic ? 1 : split_for(s, o.causal, o.max_blocks > 0 ? std::min(sms, o.max_blocks) : sms);
    const int most = o.deterministic ? 1 : split_for(s, true, sms);
    key_rows = seg.packed() ? seg.total_k : s.batch * s.seq_k;
    if (most > 1 && !o.accumulate_grads.enabled())
      dkv_bytes = (size_t(key_rows * s.kv_heads * s.head_dim) * 4 + 255) / 256 * 256;
    dkv_accum = head_split > 1 && !o.accumulate_grads.enabled();  // (dkv_bytes > 0 then)
  }
  size_t bytes() const { return accum_bytes + 2 * row_bytes + order_bytes + 2 * dkv_bytes; }
  // The largest power-of-two split of the group (AttentionBwdOp::Params::head_split_log2) whose items still
  // fit one wave of `wave` blocks.
  static int split_for(const AttentionShape& s, bool causal, int64_t wave) {
    const int64_t group = s.heads / s.kv_heads, key_blocks = (s.seq_k + 127) / 128;  // (kBN = 128)
    const int64_t units = s.batch * s.kv_heads * (causal ? (key_blocks + 1) / 2 : key_blocks);
    int split = 1;
    for (int64_t d = 2; d <= group; d *= 2)
      if (group % d == 0 && units * d <= wave) split = static_cast<int>(d);
    return split;
  }
};

// The kernel's TMA maps: the operands, dK / dV (or the fp32 accumulators they are added into), and the
// workspace's dQ accumulator and per-row terms.
template <class Op>
void map_operands(typename Op::Params& p, const Call& c, DType dtype, const Workspace& ws, float* accum,
                  float* lse_log2, float* dsum, float* dk_accum, float* dv_accum) {
  const AttentionShape& sh = c.shape;
  const AttentionSegments& seg = c.options.segments;
  p.q = ops::map_rows(c.q, sh, seg, false, sh.heads, Op::kBM, c.where + "q", dtype);
  p.dout = ops::map_rows(c.dout, sh, seg, false, sh.heads, Op::kBM, c.where + "dout", dtype);
  p.k = ops::map_rows(c.k, sh, seg, true, sh.kv_heads, Op::kBN, c.where + "k", dtype);
  p.v = ops::map_rows(c.v, sh, seg, true, sh.kv_heads, Op::kBN, c.where + "v", dtype);
  const AttentionGradAccumulate& grads = c.options.accumulate_grads;
  if (ws.dkv_accum) {  // split items: the workspace's fp32 accumulators, converted
    p.dk = ops::map_rows(dk_accum, sh, seg, true, sh.kv_heads, Op::kWgRows, c.where + "workspace (dK)",
                         DType::kFP32);
    p.dv = ops::map_rows(dv_accum, sh, seg, true, sh.kv_heads, Op::kWgRows, c.where + "workspace (dV)",
                         DType::kFP32);
    p.dkv_fp32 = 1;
  } else if (grads.enabled()) {  // fp32 maps of the accumulators: dK / dV reduce-added
    p.dk = ops::map_rows(grads.dk, sh, seg, true, sh.kv_heads, Op::kWgRows, c.where + "accumulate_grads.dk",
                         DType::kFP32);
    p.dv = ops::map_rows(grads.dv, sh, seg, true, sh.kv_heads, Op::kWgRows, c.where + "accumulate_grads.dv",
                         DType::kFP32);
    p.dkv_fp32 = 1;
  } else {
    p.dk = ops::map_rows(c.dk, sh, seg, true, sh.kv_heads, Op::Epilogue::kBoxRows, c.where + "dk", dtype);
    p.dv = ops::map_rows(c.dv, sh, seg, true, sh.kv_heads, Op::Epilogue::kBoxRows, c.where + "dv", dtype);
  }
  p.dq_accum =
      ops::map_rows(accum, sh, seg, false, sh.heads, Op::kWgRows, c.where + "workspace (dQ)", DType::kFP32);
  // The per-row terms: 2-D {term rows, heads} maps, boxes of a query block's rows.
  p.lse_map = ops::map_terms(lse_log2, ws.term_stride, sh.heads, Op::kBM, c.where + "workspace (LSE)");
  p.dsum_map = ops::map_terms(dsum, ws.term_stride, sh.heads, Op::kBM, c.where + "workspace (D)");
}

// The split items' dK / dV (fp32 accumulators) into the caller's tensors, over the sequences' key rows only.
template <class T>
void convert_key_rows(const Call& c, const Workspace& ws, int64_t head_dim, const float* dk_accum,
                      const float* dv_accum, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const AttentionShape& sh = c.shape;
  const AttentionSegments& seg = c.options.segments;
  const int64_t row_elements = sh.kv_heads * head_dim;
  const int64_t range_rows = seg.packed() ? sh.seq_k : ws.key_rows;  // the longest range
  const dim3 grid(static_cast<unsigned>(
                      std::min<int64_t>((range_rows * row_elements / 4 + kThreads - 1) / kThreads, 4096)),
                  seg.packed() ? static_cast<unsigned>(sh.batch) : 1u);
  detail::preload<&ops::attention_bwd_convert_key_rows<T>>();
  for (const auto& [from, to] : {std::pair{dk_accum, c.dk}, std::pair{dv_accum, c.dv}})
    ops::attention_bwd_convert_key_rows<T><<<grid, kThreads, 0, stream>>>(
        from, static_cast<T*>(to), ws.key_rows, row_elements, seg.packed() ? seg.k_begin : nullptr,
        seg.packed() ? seg.k_end : nullptr);
  WEFT_CUDA_CHECK(cudaGetLastError());
}

template <int kD, class T, bool kDeterministic, int kBM = 64, bool kTimed = false>
Plan run(const Call& c, DType dtype, cudaStream_t stream, bool launch) {
  using Op = ops::AttentionBwdOp<kD, T, kDeterministic, kBM, kTimed>;
  using Launcher = lcsc::Launcher<Op>;
  const AttentionShape& sh = c.shape;
  const AttentionSegments& seg = c.options.segments;
  const Workspace ws(sh, c.options);
  typename Op::Params p{};
  p.sched.batch = static_cast<int>(sh.batch);
  p.sched.heads = static_cast<int>(sh.kv_heads * ws.head_split);
  p.head_split_log2 = std::countr_zero(static_cast<unsigned>(ws.head_split));
  p.sched.q_blocks = static_cast<int>((sh.seq_k + Op::kBN - 1) / Op::kBN);  // key blocks
  // Causal key blocks cost less the later they are: paired units even that out, except for deterministic
  // calls, whose dQ turns (descending) need the key blocks handed out last first.
  p.sched.paired = c.options.causal && !kDeterministic;
  p.sched.reversed = kDeterministic;
  p.sched.row_begin = seg.k_begin;
  p.sched.row_end = seg.k_end;
  p.sched.block_rows = Op::kBN;
  const int blocks = ops::attention_blocks(Launcher::max_resident_clusters(), c.options, p.sched.units());
  p.sched.compute_blocks = blocks;
  if constexpr (kTimed) p.sched.timeline = c.options.timeline;
  // L2 sections (lcsc/attention_scheduler.cuh): K / V heads whose group's Q, dO and dQ accumulator fit in
  // 2/3 of L2.
  const int64_t group = sh.heads / sh.kv_heads;
  const int64_t bytes_per_pair = group * sh.seq_q * kD * (2 + 2 + 4);
  int64_t section = std::max<int64_t>(1, ops::device_facts().l2_bytes * 2 / 3 / bytes_per_pair);
  p.sched.section_pairs = static_cast<int>(  // (a split pair holds 1 / head_split of the group)
      std::min<int64_t>(section * ws.head_split, sh.batch * sh.kv_heads * ws.head_split));

  Plan plan;
  plan.op = "flash_attention_backward";
  plan.path = std::string(c.options.causal ? "prepare, persistent attention backward (causal), convert dQ"
                                           : "prepare, persistent attention backward, convert dQ") +
              (seg.packed() ? ", packed sequences" : "") +
              (c.options.deterministic ? ", deterministic dQ" : "") +
              (ws.head_split > 1 ? ", a K / V head's query heads over " + std::to_string(ws.head_split) +
                                       " items (dK / dV added in fp32, converted after)"
                                 : "");
  plan.blocks = blocks;
  plan.cluster = 1;
  plan.smem_bytes = static_cast<int>(lcsc::kSmemBytes<Op>);
  plan.tiles = {Op::kBM, Op::kBN, kD, Op::kStages, 0, p.sched.units()};
  if (!launch) return plan;

  auto* accum = static_cast<float*>(c.workspace);
  auto* lse_log2 = reinterpret_cast<float*>(static_cast<char*>(c.workspace) + ws.accum_bytes);
  auto* dsum = reinterpret_cast<float*>(static_cast<char*>(c.workspace) + ws.accum_bytes + ws.row_bytes);
  auto* dq_order =
      reinterpret_cast<uint64_t*>(static_cast<char*>(c.workspace) + ws.accum_bytes + 2 * ws.row_bytes);
  char* const dkv = static_cast<char*>(c.workspace) + ws.accum_bytes + 2 * ws.row_bytes + ws.order_bytes;
  auto *dk_accum = reinterpret_cast<float*>(dkv), *dv_accum = reinterpret_cast<float*>(dkv + ws.dkv_bytes);
  WEFT_CUDA_CHECK(cudaMemsetAsync(accum, 0, ws.accum_bytes, stream));
  if (ws.dkv_accum) WEFT_CUDA_CHECK(cudaMemsetAsync(dkv, 0, 2 * ws.dkv_bytes, stream));
  if (ws.order_bytes) WEFT_CUDA_CHECK(cudaMemsetAsync(dq_order, 0, ws.order_bytes, stream));
  p.rows = ops::attention_rows(sh, seg);
  {
    constexpr int kThreads = 256;
    const int64_t grid = (sh.batch * sh.seq_q * sh.heads * 32 + kThreads - 1) / kThreads;
    detail::preload<&ops::attention_bwd_prepare<kD, T>>();
    ops::attention_bwd_prepare<kD, T><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
        static_cast<const T*>(c.out), static_cast<const T*>(c.dout), c.lse, lse_log2, dsum, p.rows,
        static_cast<int>(sh.batch), static_cast<int>(sh.heads), static_cast<int>(ws.term_stride));
    WEFT_CUDA_CHECK(cudaGetLastError());
  }

  map_operands<Op>(p, c, dtype, ws, accum, lse_log2, dsum, dk_accum, dv_accum);
  p.dq_order = dq_order;
  p.dq_blocks = static_cast<int>(ws.dq_blocks);
  if constexpr (kDeterministic) {  // (zeroed with the turn counters above)
    p.claims = reinterpret_cast<int*>(dq_order + ws.order_bytes / 8 - 1);
    WEFT_CHECK(!p.sched.paired, c.where + "internal: claimed units of a paired schedule");
  }
  p.dk_out = static_cast<T*>(c.dk);
  p.dv_out = static_cast<T*>(c.dv);
  const float scale = ops::attention_scale(sh, c.options);
  ops::set_softmax_params(p, sh.heads, group, scale, c.options.causal);
  Launcher::launch(p, blocks, stream);

  {
    constexpr int kThreads = 256;
    const int64_t elements = ws.rows * sh.heads * kD;
    detail::preload<&ops::attention_bwd_convert_dq<T>>();
    ops::attention_bwd_convert_dq<T>
        <<<static_cast<unsigned>((elements / 4 + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
            accum, static_cast<T*>(c.dq), elements, scale);
    WEFT_CUDA_CHECK(cudaGetLastError());
    if (ws.dkv_accum)
      convert_key_rows<T>(c, ws, kD, dk_accum, dv_accum, stream);  // dK (scaled in the kernel), dV
  }
  return plan;
}

template <class T, bool kDeterministic, bool kTimed = false>
Plan by_shape(const Call& c, DType dtype, cudaStream_t stream, bool launch) {
  if (c.shape.head_dim == 128) return run<128, T, kDeterministic, 64, kTimed>(c, dtype, stream, launch);
  if (block_rows(c.shape) == 128) return run<64, T, kDeterministic, 128, kTimed>(c, dtype, stream, launch);
  return run<64, T, kDeterministic, 64, kTimed>(c, dtype, stream, launch);
}
template <bool kDeterministic>
Plan by_type(const Call& c, DType dtype, cudaStream_t stream, bool launch) {
  if (c.options.timeline != nullptr)  // the timed kernels (bf16: check_attention_call)
    return by_shape<__nv_bfloat16, kDeterministic, true>(c, dtype, stream, launch);
  return dtype == DType::kFP16 ? by_shape<__half, kDeterministic>(c, dtype, stream, launch)
                               : by_shape<__nv_bfloat16, kDeterministic>(c, dtype, stream, launch);
}

Plan dispatch(const Call& c, DType dtype, cudaStream_t stream, bool launch) {
  const ops::DeviceFacts dev = ops::check_attention_call(c.shape, dtype, c.options, c.where);
  if (launch) {
    const AttentionGradAccumulate& grads = c.options.accumulate_grads;
    WEFT_CHECK(grads.enabled() == (grads.dv != nullptr),
               c.where + "options.accumulate_grads needs both dk and dv (fp32 accumulators)");
    const void* dk = grads.enabled() ? static_cast<const void*>(grads.dk) : c.dk;
    const void* dv = grads.enabled() ? static_cast<const void*>(grads.dv) : c.dv;
    for (auto [p, name] : {std::pair<const void*, const char*>{c.q, "q"},
                           {c.k, "k"},
                           {c.v, "v"},
                           {c.out, "out"},
                           {c.dout, "dout"},
                           {c.dq, "dq"},
                           {dk, grads.enabled() ? "accumulate_grads.dk" : "dk"},
                           {dv, grads.enabled() ? "accumulate_grads.dv" : "dv"}}) {
      ops::check_pointer_alignment(p, name, 16, c.where);
      ops::check_device_memory(p, name, dev.device, c.where);
    }
    WEFT_CHECK(c.lse != nullptr, c.where + "lse (the forward's log-sum-exp) is required");
    ops::check_pointer_alignment(c.lse, "lse", 4, c.where);
    ops::check_device_memory(c.lse, "lse", dev.device, c.where);
    WEFT_CHECK(
        !c.options.accumulate.enabled(),
        c.where + "options.accumulate is for the forward; the backward takes the forward's out and lse");
    ops::check_segment_arrays(c.options.segments, dev.device, c.where);
    const size_t need = Workspace(c.shape, c.options).bytes();
    ops::check_workspace(c.workspace, c.workspace_bytes, need,
                         "flash_attention_backward_workspace_bytes(shape, options)", c.where);
    ops::check_device_memory(c.workspace, "workspace", dev.device, c.where);
  }
  return c.options.deterministic ? by_type<true>(c, dtype, stream, launch)
                                 : by_type<false>(c, dtype, stream, launch);
}

std::string where(const AttentionShape& s) {
  return ops::attention_where("weft::flash_attention_backward", s);
}

}  // namespace

size_t flash_attention_backward_workspace_bytes(const AttentionShape& shape,
                                                const AttentionOptions& options) {
  ops::check_attention_shape(shape, options.segments, where(shape));
  return Workspace(shape, options).bytes();
}

void flash_attention_backward(const void* q, const void* k, const void* v, const void* out, const void* dout,
                              const float* lse, void* dq, void* dk, void* dv, void* workspace,
                              size_t workspace_bytes, const AttentionShape& shape, DType dtype,
                              cudaStream_t stream, const AttentionOptions& options) {
  Call c{q, k, v, out, dout, lse, dq, dk, dv, workspace, workspace_bytes, shape, options, where(shape)};
  dispatch(c, dtype, stream, true);
}

Plan flash_attention_backward_plan(const AttentionShape& shape, DType dtype,
                                   const AttentionOptions& options) {
  Call c;
  c.shape = shape;
  c.options = options;
  c.where = where(shape);
  return dispatch(c, dtype, nullptr, false);
}

}  // namespace weft
