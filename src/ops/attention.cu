// Host side of weft::flash_attention_forward: validation with clear errors, 4-D tensor maps, the work
// schedule and launch (device code: weft/ops/attention.cuh).
#include <algorithm>
#include <string>

#include "attention_args.hpp"
#include "weft/lcsc/launch.cuh"
#include "weft/ops/attention.cuh"

namespace weft {
namespace {

struct Call {
  const void *q = nullptr, *k = nullptr, *v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;
  AttentionShape shape;
  AttentionOptions options;
  std::string where;
};

template <int kD, class T, int kWarpgroups = ops::attention_warpgroups(kD), bool kTimed = false>
Plan run(const Call& c, DType dtype, cudaStream_t stream, bool launch) {
  using Op = ops::ChainedAttentionFwdOp<kD, T, kWarpgroups, kTimed>;
  using Launcher = lcsc::Launcher<Op>;
  const AttentionShape& sh = c.shape;
  typename Op::Params p{};
  p.sched.batch = static_cast<int>(sh.batch);
  p.sched.heads = static_cast<int>(sh.heads);
  p.sched.q_blocks = static_cast<int>((sh.seq_q + Op::kBM - 1) / Op::kBM);
  p.sched.paired = c.options.causal;
  p.sched.row_begin = c.options.segments.q_begin;
  p.sched.row_end = c.options.segments.q_end;
  p.sched.block_rows = Op::kBM;
  const int blocks = ops::attention_blocks(Launcher::max_resident_clusters(), c.options, p.sched.units());
  p.sched.compute_blocks = blocks;
  if constexpr (kTimed) p.sched.timeline = c.options.timeline;
  // L2 sections: as many (batch, head) pairs as have their K and V in 2/3 of L2 (the rest holds Q, O and
  // other traffic), whole GQA groups.
  const int64_t group = sh.heads / sh.kv_heads;
  const int64_t kv_bytes_per_group = 2 * sh.seq_k * kD * 2;
  int64_t section = std::max<int64_t>(1, ops::device_facts().l2_bytes * 2 / 3 / kv_bytes_per_group) * group;
  p.sched.section_pairs = static_cast<int>(std::min<int64_t>(section, sh.batch * sh.heads));

  Plan plan;
  plan.op = "flash_attention_forward";
  plan.path = std::string(c.options.causal ? "persistent attention, causal" : "persistent attention") +
              (c.options.segments.packed() ? ", packed sequences" : "") +
              (c.options.accumulate.enabled() ? ", accumulating in fp32" : "");
  plan.blocks = blocks;
  plan.cluster = 1;
  plan.smem_bytes = static_cast<int>(lcsc::kSmemBytes<Op>);
  plan.tiles = {Op::kBM, Op::kBN, kD, Op::kStages, 0, p.sched.units()};
  if (!launch) return plan;

  const AttentionSegments& seg = c.options.segments;
  const AttentionAccumulate& acc = c.options.accumulate;
  p.q = ops::map_rows(c.q, sh, seg, false, sh.heads, Op::kBM, c.where + "q", dtype);
  p.k = ops::map_rows(c.k, sh, seg, true, sh.kv_heads, Op::kBN, c.where + "k", dtype);
  p.v = ops::map_rows(c.v, sh, seg, true, sh.kv_heads, Op::kBN, c.where + "v", dtype);
  if (!acc.enabled())
    p.o = ops::map_rows(c.out, sh, seg, false, sh.heads, Op::Epilogue::kBoxRows, c.where + "out", dtype);
  p.rows = ops::attention_rows(sh, seg);
  p.lse = c.lse;
  p.out = static_cast<T*>(c.out);
  p.acc_o = acc.o;
  p.acc_lse = acc.lse;
  const float scale = ops::attention_scale(sh, c.options);
  ops::set_softmax_params(p, sh.heads, sh.heads / sh.kv_heads, scale, c.options.causal);
  Launcher::launch(p, blocks, stream);
  return plan;
}

template <class T, bool kTimed = false>
Plan by_shape(const Call& c, bool rows_128, DType dtype, cudaStream_t stream, bool launch) {
  if (c.shape.head_dim == 128)
    return run<128, T, ops::attention_warpgroups(128), kTimed>(c, dtype, stream, launch);
  return rows_128 ? run<64, T, 2, kTimed>(c, dtype, stream, launch)
                  : run<64, T, ops::attention_warpgroups(64), kTimed>(c, dtype, stream, launch);
}

Plan dispatch(const Call& c, DType dtype, cudaStream_t stream, bool launch) {
  const ops::DeviceFacts dev = ops::check_attention_call(c.shape, dtype, c.options, c.where);
  const AttentionAccumulate& acc = c.options.accumulate;
  WEFT_CHECK(acc.enabled() == (acc.lse != nullptr),
             c.where + "options.accumulate needs both o and lse (the running fp32 output and LSE)");
  const int forced = c.options.query_rows;
  WEFT_CHECK(forced == 0 || forced == 128 || (forced == 192 && c.shape.head_dim == 64),
             c.where + "options.query_rows must be 0 (chosen), 128, or 192 at head dim 64; got " +
                 std::to_string(forced));
  if (launch) {
    for (auto [p, name] : {std::pair<const void*, const char*>{c.q, "q"}, {c.k, "k"}, {c.v, "v"}}) {
      ops::check_pointer_alignment(p, name, 16, c.where);
      ops::check_device_memory(p, name, dev.device, c.where);
    }
    if (c.out != nullptr || !acc.enabled()) {
      ops::check_pointer_alignment(c.out, "out", 16, c.where);
      ops::check_device_memory(c.out, "out", dev.device, c.where);
    }
    if (c.lse) ops::check_pointer_alignment(c.lse, "lse", 4, c.where);
    if (acc.enabled()) {
      WEFT_CHECK(c.lse == nullptr,
                 c.where + "accumulating: pass lse = null (the running LSE is accumulate.lse)");
      ops::check_pointer_alignment(acc.o, "accumulate.o", 16, c.where);
      ops::check_device_memory(acc.o, "accumulate.o", dev.device, c.where);
      ops::check_pointer_alignment(acc.lse, "accumulate.lse", 4, c.where);
      ops::check_device_memory(acc.lse, "accumulate.lse", dev.device, c.where);
    }
    ops::check_segment_arrays(c.options.segments, dev.device, c.where);
  }
  // D = 64: 128-row query blocks (2 warpgroups) for a causal mask up to 2048 query rows, where a 192-row
  // block's diagonal work is the larger share and the last, heaviest block of 1024 rows is a third full;
  // 192 rows otherwise, faster even where they pad 1024 rows to 1152 (bench/RESULTS.md, attention).
  const bool rows_128 = forced ? forced == 128 : c.options.causal && c.shape.seq_q <= 2048;
  if (c.options.timeline != nullptr)  // the timed kernels (bf16: check_attention_call)
    return by_shape<__nv_bfloat16, true>(c, rows_128, dtype, stream, launch);
  return dtype == DType::kFP16 ? by_shape<__half>(c, rows_128, dtype, stream, launch)
                               : by_shape<__nv_bfloat16>(c, rows_128, dtype, stream, launch);
}

std::string where(const AttentionShape& s) {
  return ops::attention_where("weft::flash_attention_forward", s);
}

}  // namespace

void flash_attention_forward(const void* q, const void* k, const void* v, void* out, float* lse,
                             const AttentionShape& shape, DType dtype, cudaStream_t stream,
                             const AttentionOptions& options) {
  dispatch(Call{q, k, v, out, lse, shape, options, where(shape)}, dtype, stream, true);
}

Plan flash_attention_forward_plan(const AttentionShape& shape, DType dtype, const AttentionOptions& options) {
  return dispatch(Call{nullptr, nullptr, nullptr, nullptr, nullptr, shape, options, where(shape)}, dtype,
                  nullptr, false);
}

}  // namespace weft
