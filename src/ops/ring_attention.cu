// Host side of weft::ring_attention_forward (weft/ops/context_attention.hpp; device code:
// weft/ops/ring_attention.cuh): the pass's segments and key ranges (ring_pass_of) uploaded into the caller's
// workspace, the receive slots in the communicator's workspace area "ring attention" (symmetric), a meeting,
// then the one persistent kernel.
#include <algorithm>
#include <string>
#include <vector>

#include "../runtime/kernels.hpp"
#include "attention_args.hpp"
#include "ring_attention_host.hpp"
#include "op_args.hpp"
#include "phase_clock.hpp"
#include "sequence_parallel.hpp"
#include "weft/lcsc/launch.cuh"
#include "weft/ops/context_attention.hpp"
#include "weft/ops/ring_attention.cuh"
#include "weft/runtime/error.hpp"

namespace weft {
namespace {

const char* const kArea = "ring attention";
const char* const kState = "ring attention: call count, finishers";
const char* const kArrived = "ring attention: chunk arrivals";
const char* const kMeeting = "ring attention: slots free";
const ResourceDeclaration kRingResources[] = {
    ResourceDeclaration{{kState, 2}},
    ResourceDeclaration{{kArrived, ops::kRingChunkFlags}},
    ResourceDeclaration{{kMeeting, 0, 1}},
};

struct Sizes : ops::RingPassSizes {
  int64_t kv_heads = 0, head_dim = 0;
  Sizes(int world, int rank, const std::vector<int64_t>& doc_lengths, ops::Sharding causal, int64_t kv,
        int64_t d, int grain)
      : RingPassSizes(world, rank, doc_lengths, causal, ops::RingTravel::kKeys, grain),
        kv_heads(kv),
        head_dim(d) {}
  size_t slot_bytes() const { return size_t(slot_rows * kv_heads * head_dim) * 2; }
};

// The area (symmetric: peers push into its slots): the K and V receive slots, [W - 1][slot_rows][kv_heads]
// [head_dim] each; the caller's workspace: the pass's table, then the landed counts. Each carved by one
// function, with a base or without (sizing).
struct Area {
  char *slots_k = nullptr, *slots_v = nullptr;
};
Area carve_area(ops::WorkspaceLayout& a, const Sizes& z) {
  const size_t slots = size_t(std::max(1, z.L.world - 1)) * z.slot_bytes();
  Area p;
  p.slots_k = a.take(slots);
  p.slots_v = a.take(slots);
  return p;
}
struct Own {
  int32_t* table = nullptr;
  int* landed = nullptr;
};
Own carve_own(ops::WorkspaceLayout& w, const Sizes& z) {
  Own p;
  p.table = w.take<int32_t>(z.table_bytes());
  p.landed = w.take<int>(z.landed_bytes());
  return p;
}
size_t area_bytes(const Sizes& z) {
  return ops::bytes_carved_by([&](ops::WorkspaceLayout& a) { carve_area(a, z); });
}
size_t own_bytes(const Sizes& z) {
  return ops::bytes_carved_by([&](ops::WorkspaceLayout& w) { carve_own(w, z); });
}

template <int kD, class T, bool kTimed>
void launch(ops::OpCall& call, ops::PhaseClock& clock, const Sizes& z, const void* q, const void* k,
            const void* v, void* out, float* lse, int64_t heads, const Own& w, const Area& a,
            const AttentionOptions& options, DType dtype) {
  using Op = ops::RingAttentionFwdOp<kD, T, kTimed>;
  Communicator& comm = call.comm;
  Rank& rank = call.rank;
  const cudaStream_t stream = call.stream;
  const std::string& where = call.where;
  const int W = z.L.world;
  const int64_t G = z.segments(), local = std::max<int64_t>(z.local, 1);
  const ops::RingTable table(w.table, G, W);
  if (ops::ring_planned<Op>(call, z, table, heads, Op::kBM, options, "ring_attention_forward",
                            "ring attention: one persistent kernel, K / V pushed around the ring beside the "
                            "attention of the rows already landed"))
    return;
  typename Op::Params p{};
  ops::upload_words(w.table, ops::ring_table_words(z, Op::kBN), stream);
  clock.mark("table");
  // L2 sections: query heads whose K / V (of all W ranks) fit in 2/3 of L2, whole GQA groups.
  const int64_t group = heads / z.kv_heads;
  const int64_t kv_bytes_per_group = 2 * z.slot_rows * W * kD * 2;
  const int64_t section =
      std::max<int64_t>(1, ops::device_facts().l2_bytes * 2 / 3 / kv_bytes_per_group) * group;
  int* landed = w.landed;
  const int blocks = ops::ring_launch_setup<Op>(comm, rank, z, table, {kState, kArrived}, heads, Op::kBM,
                                                section, group, options, landed, stream, p, where);
  clock.mark("schedule, sync, landed counts zeroed");

  // A rank with no rows still needs maps: they point at the slots and are never read.
  char *slots_k = a.slots_k, *slots_v = a.slots_v;
  const void* qs = z.local > 0 ? q : slots_k;
  const void* ks = z.local > 0 ? k : slots_k;
  const void* vs = z.local > 0 ? v : slots_k;
  void* os = z.local > 0 ? out : slots_k;
  const int64_t slots = std::max(1, W - 1);
  p.q = ops::map_bshd(qs, 1, local, heads, kD, Op::kBM, where + "q", dtype);
  p.k = ops::map_bshd(ks, 1, local, z.kv_heads, kD, Op::kBN, where + "k", dtype);
  p.v = ops::map_bshd(vs, 1, local, z.kv_heads, kD, Op::kBN, where + "v", dtype);
  p.o = ops::map_bshd(os, 1, local, heads, kD, Op::Epilogue::kBoxRows, where + "out", dtype);
  p.slot_k = ops::map_bshd(slots_k, slots, z.slot_rows, z.kv_heads, kD, Op::kBN, where + "slots", dtype);
  p.slot_v = ops::map_bshd(slots_v, slots, z.slot_rows, z.kv_heads, kD, Op::kBN, where + "slots", dtype);
  // The store reads each segment's query range; its key fields are unused (the key ranges are per step).
  p.rows = {
      table.own_begin,        table.own_end, table.met_begin, table.met_end, static_cast<int>(z.max_own), 0,
      static_cast<int>(local)};
  p.lse = lse;
  p.out = static_cast<T*>(out);
  const AttentionShape shape{1, z.max_own, z.max_own, heads, z.kv_heads, kD};
  const float scale = ops::attention_scale(shape, options);
  ops::set_softmax_params(p, heads, group, scale, z.pass.causal);

  p.key_begin = table.met_begin;
  p.key_end = table.met_end;
  p.k_src = static_cast<const uint4*>(ks);
  p.v_src = static_cast<const uint4*>(vs);
  p.slots_k = reinterpret_cast<uint4*>(slots_k);
  p.slots_v = reinterpret_cast<uint4*>(slots_v);
  p.row_vecs = static_cast<int>(z.kv_heads * kD / 8);

  clock.mark("tensor maps, params");
  launch_team_barrier(rank.view(), comm.resources(rank, kMeeting).slots[0], stream);  // slots free
  clock.mark("meeting");
  lcsc::Launcher<Op>::launch(p, blocks, stream);
  clock.mark("kernel");
}

}  // namespace

size_t ring_attention_workspace_bytes(int world, const std::vector<int64_t>& doc_lengths, bool causal,
                                      int64_t kv_heads, int64_t head_dim) {
  return ops::ring_forward_workspace_bytes(world, doc_lengths, causal, kv_heads, head_dim, 1);
}

void ring_attention_forward(Communicator& comm, Rank& rank, const void* q, const void* k, const void* v,
                            void* out, float* lse, const std::vector<int64_t>& doc_lengths, int64_t heads,
                            int64_t kv_heads, int64_t head_dim, void* workspace, size_t workspace_bytes,
                            DType dtype, cudaStream_t stream, const AttentionOptions& options) {
  ops::ring_forward(comm, rank, q, k, v, out, lse, doc_lengths, heads, kv_heads, head_dim, workspace,
                    workspace_bytes, dtype, stream, options, 1,
                    {"weft::ring_attention_forward", "ring_attention_workspace_bytes()"});
}

Plan ring_attention_forward_plan(Communicator& comm, Rank& rank, const void* q, const void* k, const void* v,
                                 void* out, float* lse, const std::vector<int64_t>& doc_lengths,
                                 int64_t heads, int64_t kv_heads, int64_t head_dim, void* workspace,
                                 size_t workspace_bytes, DType dtype, cudaStream_t stream,
                                 const AttentionOptions& options) {
  Plan plan;
  ops::ring_forward(comm, rank, q, k, v, out, lse, doc_lengths, heads, kv_heads, head_dim, workspace,
                    workspace_bytes, dtype, stream, options, 1,
                    {"weft::ring_attention_forward", "ring_attention_workspace_bytes()", &plan});
  return plan;
}

namespace ops {

size_t ring_forward_workspace_bytes(int world, const std::vector<int64_t>& doc_lengths, bool causal,
                                    int64_t kv_heads, int64_t head_dim, int grain) {
  size_t most = 0;
  for (int r = 0; r < world; ++r)
    for (const ops::Sharding s : ops::Sharding(causal).both())
      most = std::max(most, own_bytes(Sizes(world, r, doc_lengths, s, kv_heads, head_dim, grain)));
  return most;
}

void ring_forward(Communicator& comm, Rank& rank, const void* q, const void* k, const void* v, void* out,
                  float* lse, const std::vector<int64_t>& doc_lengths, int64_t heads, int64_t kv_heads,
                  int64_t head_dim, void* workspace, size_t workspace_bytes, DType dtype, cudaStream_t stream,
                  const AttentionOptions& options, int grain, const RingCaller& caller) {
  ops::OpCall call(comm, rank, stream, ops::team_where(caller.op, rank), caller.plan);
  ops::PhaseClock clock(call.where, stream);
  const std::string& where = call.where;
  ops::check_team_attention_options(options, false, where);
  // The attention core's checks (head_dim, dtype, heads vs kv_heads, scale, Hopper) on one segment's shape.
  ops::check_attention_call({1, 1, 1, heads, kv_heads, head_dim}, dtype, options, where);
  const Sizes z(rank.world(), rank.rank(), doc_lengths, ops::sharding_of(options), kv_heads, head_dim, grain);
  WEFT_CHECK(z.slot_rows * std::max(heads, kv_heads) < (int64_t(1) << 31) &&
                 z.segments() * rank.world() < (int64_t(1) << 31),
             where + "sizes past 2^31 are not supported (TMA coordinates and work items are 32-bit)");
  const size_t need = own_bytes(z);
  ops::check_workspace(workspace, workspace_bytes, need, caller.sizing, where);
  ops::check_attention_operands(call, {q, k, v, out, lse}, false, z.local, heads, kv_heads, head_dim);
  ops::WorkspaceLayout area_layout(call.workspace(area_bytes(z), kArea));
  const Area area = carve_area(area_layout, z);
  ops::WorkspaceLayout own_layout(workspace);
  const Own own = carve_own(own_layout, z);
  clock.mark("checks, sizes, workspace");
  ops::by_head_dim_and_type(rank, head_dim, dtype, [&](auto d, auto t, auto timed) {
    launch<decltype(d)::value, decltype(t), decltype(timed)::value>(call, clock, z, q, k, v, out, lse, heads,
                                                                    own, area, options, dtype);
  });
}

}  // namespace ops
}  // namespace weft
