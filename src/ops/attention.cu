// Host side of weft::flash_attention_forward: validation with clear errors, 4-D tensor maps, the work
// schedule and launch (device code: weft/ops/attention.cuh).
#include <algorithm>
#include <cmath>
#include <string>

#include "op_args.hpp"
#include "weft/lcsc/launch.cuh"
#include "weft/ops/attention.cuh"
#include "weft/ops/attention.hpp"
#include "weft/runtime/current_device.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/tensor_map.hpp"

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

// A [batch, seq, heads, dim] bf16 tensor as a 4-D map {dim, head, seq, batch} with box {64, 1, rows, 1}.
CUtensorMap map_bshd(const void* base, int64_t batch, int64_t seq, int64_t heads, int64_t dim, uint32_t rows,
                     const std::string& what) {
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

template <int kD>
Plan run(const Call& c, cudaStream_t stream, bool launch) {
  using Op = ops::AttentionFwdOp<kD>;
  using Launcher = lcsc::Launcher<Op>;
  const AttentionShape& sh = c.shape;
  typename Op::Params p{};
  p.sched.batch = static_cast<int>(sh.batch);
  p.sched.heads = static_cast<int>(sh.heads);
  p.sched.q_blocks = static_cast<int>((sh.seq_q + Op::kBM - 1) / Op::kBM);
  p.sched.heavy_first = c.options.causal;
  // A persistent grid: one block per resident slot (one per SM), capped by the SM budget and the item count.
  int blocks = Launcher::max_resident_clusters();
  if (c.options.max_blocks > 0) blocks = std::min(blocks, c.options.max_blocks);
  blocks = static_cast<int>(std::min<int64_t>(blocks, p.sched.units()));
  p.sched.compute_blocks = blocks;
  // L2 sections: as many (batch, head) pairs as have their K and V in 2/3 of L2 (the rest holds Q, O and
  // other traffic), whole GQA groups; causal, at least 16 runs of the grid per section (the scheduler's
  // balance needs them).
  const int64_t group = sh.heads / sh.kv_heads;
  const int64_t kv_bytes_per_group = 2 * sh.seq_k * kD * 2;
  int64_t section = std::max<int64_t>(1, ops::device_facts().l2_bytes * 2 / 3 / kv_bytes_per_group) * group;
  if (c.options.causal)
    section = std::max<int64_t>(section, (16 * int64_t(blocks) + p.sched.q_blocks - 1) / p.sched.q_blocks);
  p.sched.section_pairs = static_cast<int>(std::min<int64_t>(section, sh.batch * sh.heads));

  Plan plan;
  plan.op = "flash_attention_forward";
  plan.path = c.options.causal ? "persistent attention, causal" : "persistent attention";
  plan.blocks = blocks;
  plan.cluster = 1;
  plan.smem_bytes = static_cast<int>(lcsc::kSmemBytes<Op>);
  plan.tiles = {Op::kBM, Op::kBN, kD, Op::kStages, 0, p.sched.units()};
  if (!launch) return plan;

  p.q = map_bshd(c.q, sh.batch, sh.seq_q, sh.heads, kD, Op::kBM, c.where + "q");
  p.k = map_bshd(c.k, sh.batch, sh.seq_k, sh.kv_heads, kD, Op::kBN, c.where + "k");
  p.v = map_bshd(c.v, sh.batch, sh.seq_k, sh.kv_heads, kD, Op::kBN, c.where + "v");
  p.o = map_bshd(c.out, sh.batch, sh.seq_q, sh.heads, kD, Op::Epilogue::kBoxRows, c.where + "out");
  p.lse = c.lse;
  p.seq_q = static_cast<int>(sh.seq_q);
  p.seq_k = static_cast<int>(sh.seq_k);
  p.heads = static_cast<int>(sh.heads);
  p.group = static_cast<int>(sh.heads / sh.kv_heads);
  const float scale = c.options.softmax_scale > 0.f ? c.options.softmax_scale : 1.f / std::sqrt(float(kD));
  p.scale = scale;
  p.scale_log2 = scale * 1.4426950408889634f;
  p.causal = c.options.causal ? 1 : 0;
  Launcher::launch(p, blocks, stream);
  return plan;
}

Plan dispatch(const Call& c, DType dtype, cudaStream_t stream, bool launch) {
  const AttentionShape& s = c.shape;
  const std::string& w = c.where;
  WEFT_CHECK(s.batch >= 1 && s.seq_q >= 1 && s.seq_k >= 1 && s.heads >= 1 && s.kv_heads >= 1,
             w + "batch, seq_q, seq_k, heads and kv_heads must be at least 1");
  WEFT_CHECK(s.heads % s.kv_heads == 0, w + "heads (" + std::to_string(s.heads) +
                                            ") must be a multiple of kv_heads (" +
                                            std::to_string(s.kv_heads) + ")");
  WEFT_CHECK(s.head_dim == 64 || s.head_dim == 128,
             w + "head_dim must be 64 or 128, got " + std::to_string(s.head_dim));
  WEFT_CHECK(dtype == DType::kBF16,
             w + "q, k, v and out must be bf16 (DType::kBF16), got " + dtype_name(dtype));
  WEFT_CHECK(s.seq_q < (int64_t(1) << 31) && s.seq_k < (int64_t(1) << 31) && s.heads < (1 << 24) &&
                 s.batch * s.heads * ((s.seq_q + 127) / 128) < (int64_t(1) << 31),
             w + "sizes past 2^31 are not supported (TMA coordinates and work items are 32-bit)");
  WEFT_CHECK(!std::isnan(c.options.softmax_scale) && c.options.softmax_scale >= 0.f,
             w + "softmax_scale must be positive (or 0 for 1 / sqrt(head_dim))");
  WEFT_CHECK(c.options.max_blocks >= 0, w + "options.max_blocks must be >= 0");
  const ops::DeviceFacts dev = ops::device_facts();
  WEFT_CHECK(dev.cc == 90, w + "runs on Hopper (sm_90) GPUs; device " + std::to_string(dev.device) +
                               " is sm_" + std::to_string(dev.cc));
  if (launch) {
    for (auto [p, name] :
         {std::pair<const void*, const char*>{c.q, "q"}, {c.k, "k"}, {c.v, "v"}, {c.out, "out"}}) {
      ops::check_pointer_alignment(p, name, 16, w);
      ops::check_device_memory(p, name, dev.device, w);
    }
    if (c.lse) ops::check_pointer_alignment(c.lse, "lse", 4, w);
  }
  return s.head_dim == 64 ? run<64>(c, stream, launch) : run<128>(c, stream, launch);
}

std::string where_of(const AttentionShape& s) {
  return "weft::flash_attention_forward(batch=" + std::to_string(s.batch) +
         ", seq_q=" + std::to_string(s.seq_q) + ", seq_k=" + std::to_string(s.seq_k) +
         ", heads=" + std::to_string(s.heads) + ", kv_heads=" + std::to_string(s.kv_heads) +
         ", head_dim=" + std::to_string(s.head_dim) + "): ";
}

}  // namespace

void flash_attention_forward(const void* q, const void* k, const void* v, void* out, float* lse,
                             const AttentionShape& shape, DType dtype, cudaStream_t stream,
                             const AttentionOptions& options) {
  dispatch(Call{q, k, v, out, lse, shape, options, where_of(shape)}, dtype, stream, true);
}

Plan flash_attention_forward_plan(const AttentionShape& shape, DType dtype, const AttentionOptions& options) {
  return dispatch(Call{nullptr, nullptr, nullptr, nullptr, nullptr, shape, options, where_of(shape)}, dtype,
                  nullptr, false);
}

}  // namespace weft
