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

template <int kD>
Plan run(const Call& c, cudaStream_t stream, bool launch) {
  using Op = ops::AttentionFwdOp<kD>;
  using Launcher = lcsc::Launcher<Op>;
  const AttentionShape& sh = c.shape;
  typename Op::Params p{};
  p.sched.batch = static_cast<int>(sh.batch);
  p.sched.heads = static_cast<int>(sh.heads);
  p.sched.q_blocks = static_cast<int>((sh.seq_q + Op::kBM - 1) / Op::kBM);
  p.sched.paired = c.options.causal;
  const int blocks = ops::attention_blocks(Launcher::max_resident_clusters(), c.options, p.sched.units());
  p.sched.compute_blocks = blocks;
  // L2 sections: as many (batch, head) pairs as have their K and V in 2/3 of L2 (the rest holds Q, O and
  // other traffic), whole GQA groups.
  const int64_t group = sh.heads / sh.kv_heads;
  const int64_t kv_bytes_per_group = 2 * sh.seq_k * kD * 2;
  int64_t section = std::max<int64_t>(1, ops::device_facts().l2_bytes * 2 / 3 / kv_bytes_per_group) * group;
  p.sched.section_pairs = static_cast<int>(std::min<int64_t>(section, sh.batch * sh.heads));

  Plan plan;
  plan.op = "flash_attention_forward";
  plan.path = c.options.causal ? "persistent attention, causal" : "persistent attention";
  plan.blocks = blocks;
  plan.cluster = 1;
  plan.smem_bytes = static_cast<int>(lcsc::kSmemBytes<Op>);
  plan.tiles = {Op::kBM, Op::kBN, kD, Op::kStages, 0, p.sched.units()};
  if (!launch) return plan;

  p.q = ops::map_bshd(c.q, sh.batch, sh.seq_q, sh.heads, kD, Op::kBM, c.where + "q");
  p.k = ops::map_bshd(c.k, sh.batch, sh.seq_k, sh.kv_heads, kD, Op::kBN, c.where + "k");
  p.v = ops::map_bshd(c.v, sh.batch, sh.seq_k, sh.kv_heads, kD, Op::kBN, c.where + "v");
  p.o = ops::map_bshd(c.out, sh.batch, sh.seq_q, sh.heads, kD, Op::Epilogue::kBoxRows, c.where + "out");
  p.lse = c.lse;
  p.seq_q = static_cast<int>(sh.seq_q);
  p.seq_k = static_cast<int>(sh.seq_k);
  p.heads = static_cast<int>(sh.heads);
  p.group = static_cast<int>(sh.heads / sh.kv_heads);
  const float scale = ops::attention_scale(sh, c.options);
  p.scale = scale;
  p.scale_log2 = scale * 1.4426950408889634f;
  p.causal = c.options.causal ? 1 : 0;
  Launcher::launch(p, blocks, stream);
  return plan;
}

Plan dispatch(const Call& c, DType dtype, cudaStream_t stream, bool launch) {
  const ops::DeviceFacts dev = ops::check_attention_call(c.shape, dtype, c.options, c.where);
  if (launch) {
    for (auto [p, name] :
         {std::pair<const void*, const char*>{c.q, "q"}, {c.k, "k"}, {c.v, "v"}, {c.out, "out"}}) {
      ops::check_pointer_alignment(p, name, 16, c.where);
      ops::check_device_memory(p, name, dev.device, c.where);
    }
    if (c.lse) ops::check_pointer_alignment(c.lse, "lse", 4, c.where);
  }
  return c.shape.head_dim == 64 ? run<64>(c, stream, launch) : run<128>(c, stream, launch);
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
