// Host side of the ring attention backward with the keys travelling (device code:
// weft/ops/ring_attention_backward.cuh, RingAttentionBwdKvOp; the choice between it and the queries
// travelling: ring_backward, src/ops/ring_attention_backward.cu). The communicator's workspace area "ring
// attention backward, keys travelling" (symmetric) holds this rank's fp32 dQ accumulator, its rows' terms,
// the K / V receive slots and this rank's dK / dV parts of every step's source; the caller's workspace holds
// the entries' table, the query ranges for the prepare kernel, the landed counts and the parts' addresses.
// Order on the stream: zero the dQ accumulator and prepare the terms, upload, meet (receive slots free; every
// peer has finished reading this rank's parts of the previous call), zero the parts, the persistent kernel,
// meet (every rank's parts complete), dK / dV = the sum of their W parts, dQ = scale * its accumulator.
#include <algorithm>
#include <bit>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "../runtime/kernels.hpp"
#include "attention_args.hpp"
#include "op_args.hpp"
#include "phase_clock.hpp"
#include "ring_backward_host.hpp"
#include "ring_attention_host.hpp"
#include "sequence_parallel.hpp"
#include "weft/lcsc/launch.cuh"
#include "weft/ops/context_attention.hpp"
#include "weft/ops/ring_attention_backward.cuh"
#include "weft/runtime/error.hpp"
#include "weft/runtime/kernel_preload.hpp"

namespace weft {
namespace {

const char* const kArea = "ring attention backward, keys travelling";
const char* const kState = "ring attention backward, keys travelling: call count, finishers";
const char* const kArrived = "ring attention backward, keys travelling: chunk arrivals";
const char* const kMeetings = "ring attention backward, keys travelling: slots free, parts complete";
const ResourceDeclaration kResources[] = {
    ResourceDeclaration{{kState, 2}},
    ResourceDeclaration{{kArrived, ops::kRingChunkFlags}},
    ResourceDeclaration{{kMeetings, 0, 2}},
};

struct Sizes : ops::RingPassSizes {
  int64_t heads = 0, kv_heads = 0, head_dim = 0, term_stride = 0;
  ops::RingQueryRanges queries;  // this rank's query ranges (the terms' layout)
  int64_t longest_keys = 1, key_blocks = 0;
  std::vector<ops::RingKeyEntry> entries;  // step by step, step 0 first (no wait)
  int head_split = 1;
  Sizes(int world, int rank, const std::vector<int64_t>& doc_lengths, ops::Sharding causal, int64_t h,
        int64_t kv, int64_t d, int grain)
      : RingPassSizes(world, rank, doc_lengths, causal, ops::RingTravel::kKeys, grain),
        heads(h),
        kv_heads(kv),
        head_dim(d),
        term_stride(4 * slot_rows),
        queries(L, rank),
        entries(ops::ring_key_entries(L, rank)) {
    for (const ops::RingKeyEntry& e : entries) {
      longest_keys = std::max(longest_keys, e.k_end - e.k_begin);
      key_blocks += (e.k_end - e.k_begin + ops::kAttentionBwdBlockN - 1) / ops::kAttentionBwdBlockN;
    }
  }
  void choose_head_split(int sm_budget) {  // (ring_key_head_split)
    head_split = ops::ring_key_head_split(pass.causal, heads / kv_heads, kv_heads, key_blocks, sm_budget);
  }
  size_t parts_bytes() const { return size_t(L.world * slot_rows * kv_heads * head_dim) * 4; }  // dK or dV
  size_t accum_bytes() const { return size_t(std::max<int64_t>(local, 1) * heads * head_dim) * 4; }
  size_t slot_bytes() const { return size_t(slot_rows * kv_heads * head_dim) * 2; }
  // The table: q_begin, q_end, k_begin, k_end, step per entry; push_begin, push_end per slot.
  size_t table_words() const {
    return 5 * std::max<size_t>(entries.size(), 1) + 2 * std::max(1, L.world - 1);
  }
};

// The area (symmetric: peers push into the slots and read the parts): the dQ accumulator [local][heads][dim]
// fp32; the terms (LSE, D) [2][heads][term_stride] fp32; the K and V slots [W - 1][slot_rows][kv_heads][dim];
// the dK and dV parts [W][slot_rows][kv_heads][dim] fp32. Carved alike on every rank.
struct Area {
  float *accum = nullptr, *terms = nullptr, *dk_parts = nullptr, *dv_parts = nullptr;
  char *slots_k = nullptr, *slots_v = nullptr;
};
Area carve_area(ops::WorkspaceLayout& a, const Sizes& z) {
  Area p;
  p.accum = a.take<float>(z.accum_bytes());
  p.terms = a.take<float>(size_t(2 * z.heads * z.term_stride) * 4);
  const size_t slots = size_t(std::max(1, z.L.world - 1)) * z.slot_bytes();
  p.slots_k = a.take(slots);
  p.slots_v = a.take(slots);
  p.dk_parts = a.take<float>(z.parts_bytes());
  p.dv_parts = a.take<float>(z.parts_bytes());
  return p;
}
size_t area_bytes(const Sizes& z) {
  return ops::bytes_carved_by([&](ops::WorkspaceLayout& a) { carve_area(a, z); });
}

// The caller's workspace: the table, the query ranges (begins, then ends), the landed counts, the dK and dV
// parts' addresses (W each).
struct Own {
  int32_t *table = nullptr, *ranges = nullptr;
  int* landed = nullptr;
  const float** parts = nullptr;
};
Own carve_own(ops::WorkspaceLayout& w, const Sizes& z) {
  Own p;
  p.table = w.take<int32_t>(z.table_words() * 4);
  p.ranges = w.take<int32_t>(z.queries.words_bytes());
  p.landed = w.take<int>(z.landed_bytes());
  p.parts = reinterpret_cast<const float**>(w.take(2 * size_t(z.L.world) * sizeof(float*)));
  return p;
}
size_t own_bytes(const Sizes& z) {
  return ops::bytes_carved_by([&](ops::WorkspaceLayout& w) { carve_own(w, z); });
}

using Buffers = ops::RingBackwardTensors;

// Where the uploaded table's arrays start.
struct Table {
  const int32_t *q_begin, *q_end, *k_begin, *k_end, *step, *push_begin, *push_end;
  Table(const int32_t* words, int64_t entries, int world)
      : q_begin(words),
        q_end(words + entries),
        k_begin(words + 2 * entries),
        k_end(words + 3 * entries),
        step(words + 4 * entries),
        push_begin(words + 5 * entries),
        push_end(push_begin + std::max(1, world - 1)) {}
};

// The table's words (Table's arrays), the query ranges and the parts' addresses (dK: index s of rank r + s,
// then dV alike).
template <int kBN>
void upload(Rank& rank, const Sizes& z, const Own& w, const Area& a, cudaStream_t stream) {
  const int W = z.L.world, r = rank.rank();
  const int64_t E = static_cast<int64_t>(z.entries.size());
  std::vector<int32_t> words(z.table_words(), 0);
  for (int64_t i = 0; i < E; ++i) {
    const ops::RingKeyEntry& e = z.entries[i];
    words[i] = static_cast<int32_t>(e.q_begin);
    words[E + i] = static_cast<int32_t>(e.q_end);
    words[2 * E + i] = static_cast<int32_t>(e.k_begin);
    words[3 * E + i] = static_cast<int32_t>(e.k_end);
    words[4 * E + i] = e.step;
  }
  // This rank's K / V rows each receiver reads, whole key boxes from each part's first row.
  const auto push = ops::ring_key_push_rows(z.L, r, kBN, z.slot_rows);
  const int slots = std::max(1, W - 1);
  for (int s = 0; s < slots; ++s) {
    words[5 * E + s] = static_cast<int32_t>(push[s].first);
    words[5 * E + slots + s] = static_cast<int32_t>(push[s].second);
  }
  ops::upload_words(w.table, words, stream);
  z.queries.upload(w.ranges, stream);
  const size_t part_floats = z.parts_bytes() / 4 / W;
  std::vector<int32_t> part_words(2 * W * sizeof(float*) / 4);
  for (int s = 0; s < W; ++s)
    for (int which = 0; which < 2; ++which) {
      const float* base = which == 0 ? a.dk_parts : a.dv_parts;
      const float* part = rank.peer_ptr(base + s * part_floats, (r + s) % W);
      std::memcpy(part_words.data() + (which * W + s) * sizeof(float*) / 4, &part, sizeof(part));
    }
  ops::upload_words(reinterpret_cast<int32_t*>(w.parts), part_words, stream);
}

// This rank's dQ accumulator zeroed and its rows' terms (LSE, D) written, before the meeting: peers never
// touch either.
template <int kD, class T>
void prepare(const Sizes& z, const Own& w, const Area& a, const Buffers& b, cudaStream_t stream) {
  WEFT_CUDA_CHECK(cudaMemsetAsync(a.accum, 0, z.accum_bytes(), stream));
  z.queries.prepare<kD, T>(w.ranges, z.local, z.heads, z.term_stride, b, a.terms,
                           a.terms + z.heads * z.term_stride, stream);
}

// The kernel's parameters past its scheduler's.
template <class Op, int kD>
void fill_params(Communicator& comm, Rank& rank, const Sizes& z, const Own& w, const Area& a,
                 const Buffers& b, const Table& table, int blocks, const AttentionOptions& options,
                 DType dtype, const std::string& where, cudaStream_t stream, typename Op::Params& p) {
  const int W = z.L.world;
  const int64_t heads = z.heads, local = std::max<int64_t>(z.local, 1), group = heads / z.kv_heads;
  float* dsum = a.terms + heads * z.term_stride;
  // The rows of the entries: queries of this rank, keys of the entry's source (packed-sequence form).
  p.rows = {table.q_begin,
            table.q_end,
            table.k_begin,
            table.k_end,
            static_cast<int>(z.queries.longest),
            static_cast<int>(z.longest_keys),
            static_cast<int>(local)};
  p.entry_step = table.step;
  ops::ring_team_setup<Op>(comm, rank, z, table.push_begin, table.push_end, {kState, kArrived}, blocks,
                           w.landed, stream, p, where);
  p.head_split_log2 = std::countr_zero(static_cast<unsigned>(z.head_split));
  const AttentionShape shape{1, z.max_own, z.max_own, heads, z.kv_heads, kD};
  const float scale = ops::attention_scale(shape, options);
  ops::set_softmax_params(p, heads, group, scale, z.pass.causal);
  // A rank with no rows still needs maps: they point at the area and are never read.
  const auto own = [&](const void* x) { return z.local > 0 ? x : static_cast<const void*>(a.accum); };
  const int64_t slots = std::max(1, W - 1);
  p.q = ops::map_bshd(own(b.q), 1, local, heads, kD, Op::kBM, where + "q", dtype);
  p.dout = ops::map_bshd(own(b.dout), 1, local, heads, kD, Op::kBM, where + "dout", dtype);
  p.k = ops::map_bshd(own(b.k), 1, local, z.kv_heads, kD, Op::kBN, where + "k", dtype);
  p.v = ops::map_bshd(own(b.v), 1, local, z.kv_heads, kD, Op::kBN, where + "v", dtype);
  p.slot_k =
      ops::map_bshd(a.slots_k, slots, z.slot_rows, z.kv_heads, kD, Op::kBN, where + "slots (k)", dtype);
  p.slot_v =
      ops::map_bshd(a.slots_v, slots, z.slot_rows, z.kv_heads, kD, Op::kBN, where + "slots (v)", dtype);
  p.dk_parts = ops::map_bshd(a.dk_parts, W, z.slot_rows, z.kv_heads, kD, Op::kWgRows, where + "dK parts",
                             DType::kFP32);
  p.dv_parts = ops::map_bshd(a.dv_parts, W, z.slot_rows, z.kv_heads, kD, Op::kWgRows, where + "dV parts",
                             DType::kFP32);
  p.dk = p.dk_parts;  // (the base's maps, prefetched; this op stores through the parts)
  p.dv = p.dv_parts;
  p.dq_accum = ops::map_bshd(a.accum, 1, local, heads, kD, Op::kBM, where + "dQ accumulator", DType::kFP32);
  p.lse_map = ops::map_terms(a.terms, z.term_stride, heads, Op::kBM, where + "terms (LSE)");
  p.dsum_map = ops::map_terms(dsum, z.term_stride, heads, Op::kBM, where + "terms (D)");
  p.k_src = static_cast<const uint4*>(own(b.k));
  p.v_src = static_cast<const uint4*>(own(b.v));
  p.slots_k = reinterpret_cast<uint4*>(a.slots_k);
  p.slots_v = reinterpret_cast<uint4*>(a.slots_v);
  p.row_vecs = static_cast<int>(z.kv_heads * kD / 8);
}

// dK / dV = the sums of their W parts (index s of rank r + s), dQ = scale * its accumulator.
template <int kD, class T>
void sum_gradients(const Sizes& z, const Own& w, const Area& a, const Buffers& b,
                   const AttentionOptions& options, cudaStream_t stream) {
  if (z.local == 0) return;
  const int W = z.L.world;
  const int64_t heads = z.heads;
  const float scale =
      ops::attention_scale(AttentionShape{1, z.max_own, z.max_own, heads, z.kv_heads, kD}, options);
  constexpr int kThreads = 256;
  const int64_t kv_elements = z.local * z.kv_heads * kD, q_elements = z.local * heads * kD;
  const auto kv_grid = static_cast<unsigned>((kv_elements / 4 + kThreads - 1) / kThreads);
  detail::preload<&ops::ring_bwd_sum_dq<T>>();
  ops::ring_bwd_sum_dq<T>
      <<<kv_grid, kThreads, 0, stream>>>(w.parts, W, static_cast<T*>(b.dk), kv_elements, 1.f);
  ops::ring_bwd_sum_dq<T>
      <<<kv_grid, kThreads, 0, stream>>>(w.parts + W, W, static_cast<T*>(b.dv), kv_elements, 1.f);
  detail::preload<&ops::attention_bwd_convert_dq<T>>();
  ops::attention_bwd_convert_dq<T>
      <<<static_cast<unsigned>((q_elements / 4 + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
          a.accum, static_cast<T*>(b.dq), q_elements, scale);
  WEFT_CUDA_CHECK(cudaGetLastError());
}

template <int kD, class T, bool kTimed>
void launch(ops::OpCall& call, ops::PhaseClock& clock, const Sizes& z, const Buffers& b, const Own& w,
            const Area& a, const AttentionOptions& options, DType dtype) {
  using Op = ops::RingAttentionBwdKvOp<kD, T, kTimed>;
  Communicator& comm = call.comm;
  Rank& rank = call.rank;
  const cudaStream_t stream = call.stream;
  const std::string& where = call.where;
  const int W = z.L.world;
  const int64_t entries = std::max<int64_t>(static_cast<int64_t>(z.entries.size()), 1);
  const Table table(w.table, entries, W);
  typename Op::Params p{};
  lcsc::AttentionSchedulerParams& sched = p.sched;
  sched.row_begin = table.k_begin;  // each entry's key blocks
  sched.row_end = table.k_end;
  sched.batch = static_cast<int>(z.entries.size());
  sched.heads = static_cast<int>(z.kv_heads * z.head_split);
  sched.q_blocks = static_cast<int>((z.longest_keys + Op::kBN - 1) / Op::kBN);
  sched.block_rows = Op::kBN;
  sched.paired = z.pass.causal && z.head_split == 1;
  sched.section_pairs =
      sched.heads;  // entry after entry: step 0's (no wait) first, as the forward's sections
  const int resident = std::min(lcsc::Launcher<Op>::max_resident_clusters(), rank.sm_budget());
  const int blocks =
      std::max(1, ops::attention_blocks(resident, options, std::max<int64_t>(sched.units(), 1)));
  sched.compute_blocks = blocks;
  if (call.planning()) {
    call.planned_op(
        "ring_attention_backward",
        "ring attention backward, keys travelling: the per-row terms, then one persistent kernel "
        "(K / V pushed around the ring; dQ added here, dK / dV parts in fp32 read by their owners "
        "after it), then dK / dV summed from their parts and dQ converted",
        blocks, static_cast<int>(lcsc::kSmemBytes<Op>));
    return;
  }
  upload<Op::kBN>(rank, z, w, a, stream);
  clock.mark("uploads");
  prepare<kD, T>(z, w, a, b, stream);
  clock.mark("terms");

  fill_params<Op, kD>(comm, rank, z, w, a, b, table, blocks, options, dtype, where, stream, p);
  clock.mark("params");

  const BarrierSlots meetings = comm.resources(rank, kMeetings).slots;
  // Receive slots free; every peer has read this rank's parts of the previous call.
  launch_team_barrier(rank.view(), meetings[0], stream);
  clock.mark("meeting");
  WEFT_CUDA_CHECK(cudaMemsetAsync(a.dk_parts, 0, z.parts_bytes(), stream));
  WEFT_CUDA_CHECK(cudaMemsetAsync(a.dv_parts, 0, z.parts_bytes(), stream));
  clock.mark("zeroing");
  lcsc::Launcher<Op>::launch(p, blocks, stream);
  clock.mark("kernel");
  launch_team_barrier(rank.view(), meetings[1], stream);  // every rank's parts complete
  clock.mark("meeting");
  sum_gradients<kD, T>(z, w, a, b, options, stream);
  clock.mark("dK / dV sums, dQ");
}

}  // namespace

namespace ops {

bool ring_backward_keys_travel(int64_t heads, int64_t kv_heads) {
  const char* e = std::getenv("WEFT_RING_BACKWARD");
  if (e != nullptr && std::string(e) == "queries") return false;
  if (e != nullptr && std::string(e) == "keys") return true;
  return heads >= 2 * kv_heads;  // 12 x kv_heads bytes a row and head dim against 8 x heads
}

size_t ring_backward_keys_workspace_bytes(int world, const std::vector<int64_t>& doc_lengths, bool causal,
                                          int64_t heads, int64_t kv_heads, int64_t head_dim, int grain) {
  return ring_most_bytes(world, causal, [&](int r, Sharding s) {
    return own_bytes(Sizes(world, r, doc_lengths, s, heads, kv_heads, head_dim, grain));
  });
}

void ring_backward_keys(OpCall& call, PhaseClock& clock, const void* q, const void* k, const void* v,
                        const void* out, const void* dout, const float* lse, void* dq, void* dk, void* dv,
                        const std::vector<int64_t>& doc_lengths, int64_t heads, int64_t kv_heads,
                        int64_t head_dim, void* workspace, size_t workspace_bytes, DType dtype,
                        const AttentionOptions& options, int grain, const RingCaller& caller) {
  Rank& rank = call.rank;
  const std::string& where = call.where;
  Sizes z(rank.world(), rank.rank(), doc_lengths, sharding_of(options), heads, kv_heads, head_dim, grain);
  z.choose_head_split(rank.sm_budget());
  WEFT_CHECK(z.slot_rows * std::max(heads, kv_heads) * head_dim < (int64_t(1) << 31) &&
                 z.term_stride * heads < (int64_t(1) << 31) &&
                 int64_t(z.entries.size()) * (heads + 1) < (int64_t(1) << 31),
             where + "sizes past 2^31 are not supported (TMA coordinates and work items are 32-bit)");
  check_workspace(workspace, workspace_bytes, own_bytes(z), caller.sizing, where);
  check_attention_operands(call, {q, k, v, out, lse, dout, dq, dk, dv}, true, z.local, heads, kv_heads,
                           head_dim);
  WorkspaceLayout area_layout(call.workspace(area_bytes(z), kArea));
  const Area area = carve_area(area_layout, z);
  WorkspaceLayout own_layout(workspace);
  const Own own = carve_own(own_layout, z);
  const Buffers b{q, k, v, out, dout, lse, dq, dk, dv};
  clock.mark("checks, sizes, workspace");
  by_head_dim_and_type(rank, head_dim, dtype, [&](auto d, auto t, auto timed) {
    launch<decltype(d)::value, decltype(t), decltype(timed)::value>(call, clock, z, b, own, area, options,
                                                                    dtype);
  });
}

}  // namespace ops
}  // namespace weft
