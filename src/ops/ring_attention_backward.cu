// Host side of weft::ring_attention_backward (weft/ops/context_attention.hpp; device code:
// weft/ops/ring_attention_backward.cuh). The communicator's workspace area "ring attention backward"
// (symmetric) holds this rank's fp32 dQ accumulator slots (slot 0: its own rows; with peers on other GPUs
// slot s: the rows of rank r - s), the per-row terms (own and received) and the Q / dO receive slots; the
// caller's workspace holds one tensor map per step (where its dQ parts go), the dQ parts' addresses and the
// pass's table. Order on the stream: zero slot 0, prepare the terms, upload, meet (receive slots free, every
// peer done reading this rank's slots), zero the other GPUs' slots, the persistent kernel, meet (every add
// complete), dQ = scale * the sum of its parts.
#include <algorithm>
#include <bit>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "../runtime/kernels.hpp"
#include "attention_args.hpp"
#include "op_args.hpp"
#include "phase_clock.hpp"
#include "ring_attention_host.hpp"
#include "sequence_parallel.hpp"
#include "weft/lcsc/launch.cuh"
#include "weft/ops/context_attention.hpp"
#include "weft/ops/ring_attention_backward.cuh"
#include "weft/runtime/error.hpp"
#include "weft/runtime/kernel_preload.hpp"

namespace weft {
namespace {

const char* const kArea = "ring attention backward";
const char* const kState = "ring attention backward: call count, finishers";
const char* const kArrived = "ring attention backward: chunk arrivals";
const char* const kMeetings = "ring attention backward: slots free, dQ complete";
const ResourceDeclaration kRingBackwardResources[] = {
    ResourceDeclaration{{kState, 2}},
    ResourceDeclaration{{kArrived, ops::kRingChunkFlags}},
    ResourceDeclaration{{kMeetings, 0, 2}},
};

struct Sizes : ops::RingPassSizes {
  int64_t heads = 0, kv_heads = 0, head_dim = 0, term_stride = 0;
  std::vector<std::pair<int64_t, int64_t>> ranges;  // this rank's query ranges that the peers meet
  int64_t longest_range = 1;
  Sizes(int world, int rank, const std::vector<int64_t>& doc_lengths, ops::Sharding causal, int64_t h,
        int64_t kv, int64_t d, int grain)
      : RingPassSizes(world, rank, doc_lengths, causal, ops::RingTravel::kQueries, grain),
        heads(h),
        kv_heads(kv),
        head_dim(d),
        term_stride(4 * slot_rows),  // a range beginning at row x has its terms from term row 4 x on
        ranges(ops::ring_query_ranges(L, rank)) {
    for (const auto& [b, e] : ranges) longest_range = std::max(longest_range, e - b);
  }
  int accum_slots = 1;  // dQ accumulator slots: 1, or W where some peer is on another GPU (DqRoute)
  // Items per K / V head (RingAttentionBwdOp::Params::head_split): its GQA group's query heads in this many
  // parts, else 1. Causal passes only: their items cost very unequal amounts (a zigzag rank's first chunk of
  // keys meets every later query, its last chunk few), and the smallest split giving three items per SM of
  // the budget evens that out (2k rows a rank, 32 / 8 heads, 2 x H200: the kernel 2.4x faster than with its
  // 128 items on 132 SMs). Non-causal items cost alike: a four-way split of 128 items ran 6% slower. From the
  // longest rank's rows and the SM budget: the same on every rank (the area's size).
  int head_split = 1;
  void choose_head_split(int sm_budget) {
    const int64_t key_blocks = (slot_rows + ops::kAttentionBwdBlockN - 1) / ops::kAttentionBwdBlockN;
    const int64_t group = heads / kv_heads, items = key_blocks * kv_heads;
    if (!pass.causal) return;
    for (int d = 1; d <= group; d *= 2)  // powers of two (AttentionBwdOp::Params::head_split_log2)
      if (group % d == 0) {
        head_split = d;
        if (items * d >= 3 * int64_t(sm_budget)) break;
      }
  }
  size_t dkv_accum_bytes() const {  // each of dK, dV: fp32 [slot_rows][kv_heads][head_dim], if split
    return head_split > 1 ? size_t(slot_rows * kv_heads * head_dim) * 4 : 0;
  }
  size_t accum_slot_bytes() const { return size_t(slot_rows * heads * head_dim) * 4; }
  size_t slot_bytes() const { return size_t(slot_rows * heads * head_dim) * 2; }
};

// The area (symmetric: peers write into its slots): the dQ accumulator slots
// [accum_slots][slot_rows][heads][head_dim] fp32; the terms (LSE, D) [2][W][heads][term_stride] fp32; the Q
// and dO slots [W - 1][slot_rows][heads][head_dim] each. Carved by this one function, with a base or without
// (sizing), alike on every rank.
struct Area {
  float *accum = nullptr, *terms = nullptr;
  char *slots_q = nullptr, *slots_dout = nullptr;
  float *dk_accum = nullptr, *dv_accum = nullptr;  // Sizes::head_split > 1 only
};
Area carve_area(ops::WorkspaceLayout& a, const Sizes& z) {
  Area p;
  p.accum = a.take<float>(size_t(z.accum_slots) * z.accum_slot_bytes());
  p.terms = a.take<float>(size_t(2 * z.L.world * z.heads * z.term_stride) * 4);
  const size_t slots = size_t(std::max(1, z.L.world - 1)) * z.slot_bytes();
  p.slots_q = a.take(slots);
  p.slots_dout = a.take(slots);
  if (z.head_split > 1) {
    p.dk_accum = a.take<float>(z.dkv_accum_bytes());
    p.dv_accum = a.take<float>(z.dkv_accum_bytes());
  }
  return p;
}
size_t area_bytes(const Sizes& z) {
  return ops::bytes_carved_by([&](ops::WorkspaceLayout& a) { carve_area(a, z); });
}

// The caller's workspace: the steps' dQ maps (64-byte aligned) then the dQ parts' addresses (W each); the
// pass's table; the query ranges (begins, then ends) for the prepare kernel; the landed counts.
struct Own {
  char* parts = nullptr;
  int32_t *table = nullptr, *ranges = nullptr;
  int* landed = nullptr;
  const float* const* part_addresses(int world) const {
    return reinterpret_cast<const float* const*>(parts + world * sizeof(CUtensorMap));
  }
};
Own carve_own(ops::WorkspaceLayout& w, const Sizes& z) {
  Own p;
  p.parts = w.take(size_t(z.L.world) * (sizeof(CUtensorMap) + sizeof(float*)));
  p.table = w.take<int32_t>(z.table_bytes());
  p.ranges = w.take<int32_t>((2 * z.ranges.size() + 1) * 4);
  p.landed = w.take<int>(z.landed_bytes());
  return p;
}
size_t own_bytes(const Sizes& z) {
  return ops::bytes_carved_by([&](ops::WorkspaceLayout& w) { carve_own(w, z); });
}

// Where step s's dQ parts go: through this rank's slot s when the rows' owner (rank r - s) is on another GPU
// (adding into the owner's memory would cross the links once per key block), else straight into the owner's
// slot 0. WEFT_RING_DQ_SLOTS=1 takes slots for every peer (tests the multi-GPU route on one GPU).
struct DqRoute {
  std::vector<char> through_slot;  // [W]; step 0 (this rank's rows) never
  bool any = false, always = false;
  DqRoute(const Communicator& comm, const Rank& rank) : through_slot(rank.world(), 0) {
    const char* force = std::getenv("WEFT_RING_DQ_SLOTS");
    always = force != nullptr && std::string(force) == "1";
    for (int s = 1; s < rank.world(); ++s) {
      through_slot[s] = crosses(comm, rank, rank.rank(), s);
      any |= through_slot[s] != 0;
    }
  }
  // Whether rank `holder` (of rank's team) takes a slot for the rows it meets at step s (those of rank
  // holder - s).
  bool crosses(const Communicator& comm, const Rank& rank, int holder, int s) const {
    const int W = rank.world();
    return s > 0 &&
           (always || !comm.same_gpu(rank.team_rank_of(holder), rank.team_rank_of((holder - s + W) % W)));
  }
};

struct Buffers {
  const void *q, *k, *v, *out, *dout;
  const float* lse;
  void *dq, *dk, *dv;
};

// What a call uploads to the workspace before its kernels: each step's dQ map and the dQ parts of this
// rank's rows (read by the final sum), the pass's table, this rank's query ranges.
struct Uploads {
  int parts;  // dQ parts of this rank's rows
  ops::RingTable table;
  const int32_t* range_begin;  // [ranges] begins, then [ranges] ends
  int64_t ranges;
};

template <class Op, int kD>
Uploads upload_tables(Communicator& comm, Rank& rank, const Sizes& z, const DqRoute& route, const Own& w,
                      float* accum, cudaStream_t stream, const std::string& where) {
  const int W = z.L.world;
  const int64_t G = z.segments(), heads = z.heads;
  // Each step's dQ map; the dQ parts of this rank's rows (slot 0, then slot s of rank r + s where that rank
  // took a slot for them: it is on another GPU, the route is the same rule seen from there); the pass's
  // table; this rank's query ranges.
  const int r = rank.rank();
  const size_t slot_floats = z.accum_slot_bytes() / 4;
  std::vector<int32_t> words(size_t(W) * (sizeof(CUtensorMap) + sizeof(float*)) / 4, 0);
  for (int s = 0; s < W; ++s) {
    float* target = route.through_slot[s] ? accum + s * slot_floats : rank.peer_ptr(accum, (r - s + W) % W);
    const CUtensorMap m = ops::map_bshd(target, 1, z.slot_rows, heads, kD, Op::kBM,
                                        where + "dQ parts of step " + std::to_string(s), DType::kFP32);
    std::memcpy(words.data() + s * sizeof(CUtensorMap) / 4, &m, sizeof(CUtensorMap));
  }
  int parts = 0;
  auto* part_at = words.data() + W * sizeof(CUtensorMap) / 4;
  for (int s = 0; s < W; ++s) {
    if (s > 0 && !route.crosses(comm, rank, (r + s) % W, s)) continue;
    const float* part = rank.peer_ptr(accum + s * slot_floats, (r + s) % W);
    std::memcpy(part_at + parts++ * sizeof(part) / 4, &part, sizeof(part));
  }
  ops::upload_words(reinterpret_cast<int32_t*>(w.parts), words, stream);
  ops::upload_words(w.table, ops::ring_table_words(z, Op::kBM), stream);
  const int64_t nr = static_cast<int64_t>(z.ranges.size());
  int32_t* range_begin = w.ranges;
  std::vector<int32_t> range_words(2 * nr);
  for (int64_t i = 0; i < nr; ++i) {
    range_words[i] = static_cast<int32_t>(z.ranges[i].first);
    range_words[nr + i] = static_cast<int32_t>(z.ranges[i].second);
  }
  if (nr > 0) ops::upload_words(range_begin, range_words, stream);
  return {parts, ops::RingTable(w.table, G, W), range_begin, nr};
}

// This rank's own accumulator slot zeroed and its rows' terms written (the base prepare over the query
// ranges as packed sequences: a range beginning at row x gets term rows 4 x on) before the meeting that
// lets the peers in; the other slots, which the peers read after the previous call, after it.
template <int kD, class T>
void prepare_terms(const Sizes& z, const Uploads& u, const Buffers& b, float* accum, float* terms,
                   cudaStream_t stream) {
  const int W = z.L.world;
  const int64_t heads = z.heads, nr = u.ranges;
  const int32_t* range_begin = u.range_begin;
  WEFT_CUDA_CHECK(cudaMemsetAsync(accum, 0, z.accum_slot_bytes(), stream));
  if (nr > 0) {
    const ops::AttentionRows ranges{range_begin,
                                    range_begin + nr,
                                    range_begin,
                                    range_begin + nr,
                                    static_cast<int>(z.longest_range),
                                    static_cast<int>(z.longest_range),
                                    static_cast<int>(z.local)};
    constexpr int kThreads = 256;
    const int64_t grid = (nr * z.longest_range * heads * 32 + kThreads - 1) / kThreads;
    detail::preload<&ops::attention_bwd_prepare<kD, T>>();
    ops::attention_bwd_prepare<kD, T><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
        static_cast<const T*>(b.out), static_cast<const T*>(b.dout), b.lse, terms,
        terms + W * heads * z.term_stride, ranges, static_cast<int>(nr), static_cast<int>(heads),
        static_cast<int>(z.term_stride));
    WEFT_CUDA_CHECK(cudaGetLastError());
  }
}

// The kernel's parameters; returns its grid.
template <class Op, int kD, class T>
int fill_params(Communicator& comm, Rank& rank, const Sizes& z, const Uploads& u, const Buffers& b,
                const Own& w, const Area& a, cudaStream_t stream, const AttentionOptions& options,
                DType dtype, const std::string& where, typename Op::Params& p) {
  const int W = z.L.world;
  const int64_t local = std::max<int64_t>(z.local, 1), heads = z.heads;
  const AttentionShape shape{1, z.max_own, z.max_own, heads, z.kv_heads, kD};
  const float scale = ops::attention_scale(shape, options);
  const ops::RingTable& table = u.table;
  float *accum = a.accum, *terms = a.terms;
  char *slots_q = a.slots_q, *slots_dout = a.slots_dout;
  // A rank with no rows still needs maps: they point at the area and are never read.
  const auto own = [&](const void* q) { return z.local > 0 ? q : static_cast<const void*>(a.accum); };
  // L2 sections: K / V heads whose group's Q, dO (of all W ranks) and dQ parts fit in 2/3 of L2.
  const int64_t group = heads / z.kv_heads;
  const int64_t bytes_per_pair = group * z.slot_rows * W * kD * (2 + 2 + 4);
  const int64_t section = std::max<int64_t>(1, ops::device_facts().l2_bytes * 2 / 3 / bytes_per_pair);
  int* landed = w.landed;
  const int blocks = ops::ring_launch_setup<Op>(
      comm, rank, z, table, {kState, kArrived}, z.kv_heads * z.head_split, Op::kBN, section * z.head_split,
      z.head_split, options, landed, stream, p, where, z.head_split == 1);
  p.head_split_log2 = std::countr_zero(static_cast<unsigned>(z.head_split));

  const int64_t slots = std::max(1, W - 1);
  p.q = ops::map_bshd(own(b.q), 1, local, heads, kD, Op::kBM, where + "q", dtype);
  p.dout = ops::map_bshd(own(b.dout), 1, local, heads, kD, Op::kBM, where + "dout", dtype);
  p.k = ops::map_bshd(own(b.k), 1, local, z.kv_heads, kD, Op::kBN, where + "k", dtype);
  p.v = ops::map_bshd(own(b.v), 1, local, z.kv_heads, kD, Op::kBN, where + "v", dtype);
  if (z.head_split > 1) {  // the items' dK / dV reduce-added into fp32 accumulators, converted after
    p.dk = ops::map_bshd(a.dk_accum, 1, local, z.kv_heads, kD, Op::kWgRows, where + "dK accumulator",
                         DType::kFP32);
    p.dv = ops::map_bshd(a.dv_accum, 1, local, z.kv_heads, kD, Op::kWgRows, where + "dV accumulator",
                         DType::kFP32);
    p.dkv_fp32 = 1;
  } else {
    p.dk = ops::map_bshd(own(b.dk), 1, local, z.kv_heads, kD, Op::Epilogue::kBoxRows, where + "dk", dtype);
    p.dv = ops::map_bshd(own(b.dv), 1, local, z.kv_heads, kD, Op::Epilogue::kBoxRows, where + "dv", dtype);
  }
  p.dq_accum =
      ops::map_bshd(accum, 1, z.slot_rows, heads, kD, Op::kBM, where + "dQ accumulator", DType::kFP32);
  p.dq_maps = reinterpret_cast<const CUtensorMap*>(w.parts);
  p.lse_map = ops::map_terms(terms, z.term_stride, W * heads, Op::kBM, where + "terms (LSE)");
  p.dsum_map = ops::map_terms(terms + W * heads * z.term_stride, z.term_stride, W * heads, Op::kBM,
                              where + "terms (D)");
  p.slot_q = ops::map_bshd(slots_q, slots, z.slot_rows, heads, kD, Op::kBM, where + "slots (q)", dtype);
  p.slot_dout =
      ops::map_bshd(slots_dout, slots, z.slot_rows, heads, kD, Op::kBM, where + "slots (dout)", dtype);
  // Key segments: the store reads each one's rows (the query fields are unused: the ranges are per step).
  p.rows = {table.own_begin,
            table.own_end,
            table.own_begin,
            table.own_end,
            static_cast<int>(z.max_own),
            static_cast<int>(z.max_own),
            static_cast<int>(local)};
  p.dk_out = static_cast<T*>(b.dk);
  p.dv_out = static_cast<T*>(b.dv);
  ops::set_softmax_params(p, heads, group, scale, z.pass.causal);

  p.query_begin = table.met_begin;
  p.query_end = table.met_end;
  p.q_src = static_cast<const uint4*>(own(b.q));
  p.dout_src = static_cast<const uint4*>(own(b.dout));
  p.slots_q = reinterpret_cast<uint4*>(slots_q);
  p.slots_dout = reinterpret_cast<uint4*>(slots_dout);
  p.row_vecs = static_cast<int>(heads * kD / 8);
  p.terms = terms;
  p.term_stride = static_cast<int>(z.term_stride);

  return blocks;
}

template <int kD, class T, bool kTimed>
void launch(ops::OpCall& call, ops::PhaseClock& clock, const Sizes& z, const DqRoute& route, const Buffers& b,
            const Own& w, const Area& a, const AttentionOptions& options, DType dtype) {
  using Op = ops::RingAttentionBwdOp<kD, T, kTimed>;
  Communicator& comm = call.comm;
  Rank& rank = call.rank;
  const cudaStream_t stream = call.stream;
  const std::string& where = call.where;
  const int W = z.L.world;
  const int64_t heads = z.heads;
  if (ops::ring_planned<Op>(
          call, z, ops::RingTable(w.table, z.segments(), W), z.kv_heads * z.head_split, Op::kBN, options,
          "ring_attention_backward",
          std::string("ring attention backward: the per-row terms, then one persistent kernel "
                      "(Q, dO and terms pushed around the ring; dQ parts added into fp32 "
                      "accumulators") +
              (z.head_split > 1 ? ", a K / V head's query heads in " + std::to_string(z.head_split) +
                                      " items, dK / dV added in fp32 and converted after"
                                : "") +
              "), then dQ summed from its parts",
          z.head_split == 1))
    return;
  const float scale =
      ops::attention_scale(AttentionShape{1, z.max_own, z.max_own, heads, z.kv_heads, kD}, options);
  float *accum = a.accum, *terms = a.terms;
  const size_t slot_floats = z.accum_slot_bytes() / 4;
  const Uploads u = upload_tables<Op, kD>(comm, rank, z, route, w, accum, stream, where);
  const int parts = u.parts;
  clock.mark("uploads");
  prepare_terms<kD, T>(z, u, b, accum, terms, stream);
  clock.mark("terms");
  typename Op::Params p{};
  const int blocks = fill_params<Op, kD, T>(comm, rank, z, u, b, w, a, stream, options, dtype, where, p);

  const BarrierSlots meetings = comm.resources(rank, kMeetings).slots;
  clock.mark("params");
  launch_team_barrier(rank.view(), meetings[0], stream);  // receive slots free, peers' reads of ours done
  clock.mark("meeting");
  for (int s = 1; s < W; ++s)
    if (route.through_slot[s])
      WEFT_CUDA_CHECK(cudaMemsetAsync(accum + s * slot_floats, 0, z.accum_slot_bytes(), stream));
  const int64_t dkv_elements = z.local * z.kv_heads * kD;
  if (z.head_split > 1 && z.local > 0) {  // (local: peers never touch these)
    WEFT_CUDA_CHECK(cudaMemsetAsync(a.dk_accum, 0, size_t(dkv_elements) * 4, stream));
    WEFT_CUDA_CHECK(cudaMemsetAsync(a.dv_accum, 0, size_t(dkv_elements) * 4, stream));
  }
  clock.mark("zeroing");
  lcsc::Launcher<Op>::launch(p, blocks, stream);
  clock.mark("kernel");
  if (z.head_split > 1 && z.local > 0) {  // dK (its scale applied in the kernel) and dV
    constexpr int kThreads = 256;
    const auto grid = static_cast<unsigned>((dkv_elements / 4 + kThreads - 1) / kThreads);
    detail::preload<&ops::attention_bwd_convert_dq<T>>();
    ops::attention_bwd_convert_dq<T>
        <<<grid, kThreads, 0, stream>>>(a.dk_accum, static_cast<T*>(b.dk), dkv_elements, 1.f);
    ops::attention_bwd_convert_dq<T>
        <<<grid, kThreads, 0, stream>>>(a.dv_accum, static_cast<T*>(b.dv), dkv_elements, 1.f);
    WEFT_CUDA_CHECK(cudaGetLastError());
  }
  clock.mark("dK / dV convert");
  launch_team_barrier(rank.view(), meetings[1], stream);  // every rank's accumulator slots complete
  clock.mark("meeting");
  if (z.local > 0) {
    constexpr int kThreads = 256;
    const int64_t elements = z.local * heads * kD;
    detail::preload<&ops::ring_bwd_sum_dq<T>>();
    ops::ring_bwd_sum_dq<T>
        <<<static_cast<unsigned>((elements / 4 + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
            w.part_addresses(W), parts, static_cast<T*>(b.dq), elements, scale);
    WEFT_CUDA_CHECK(cudaGetLastError());
  }
  clock.mark("dQ sum");
}

}  // namespace

size_t ring_attention_backward_workspace_bytes(int world, const std::vector<int64_t>& doc_lengths,
                                               bool causal, int64_t heads, int64_t kv_heads,
                                               int64_t head_dim) {
  return ops::ring_backward_workspace_bytes(world, doc_lengths, causal, heads, kv_heads, head_dim, 1);
}

void ring_attention_backward(Communicator& comm, Rank& rank, const void* q, const void* k, const void* v,
                             const void* out, const void* dout, const float* lse, void* dq, void* dk,
                             void* dv, const std::vector<int64_t>& doc_lengths, int64_t heads,
                             int64_t kv_heads, int64_t head_dim, void* workspace, size_t workspace_bytes,
                             DType dtype, cudaStream_t stream, const AttentionOptions& options) {
  ops::ring_backward(comm, rank, q, k, v, out, dout, lse, dq, dk, dv, doc_lengths, heads, kv_heads, head_dim,
                     workspace, workspace_bytes, dtype, stream, options, 1,
                     {"weft::ring_attention_backward", "ring_attention_backward_workspace_bytes()"});
}

Plan ring_attention_backward_plan(Communicator& comm, Rank& rank, const void* q, const void* k, const void* v,
                                  const void* out, const void* dout, const float* lse, void* dq, void* dk,
                                  void* dv, const std::vector<int64_t>& doc_lengths, int64_t heads,
                                  int64_t kv_heads, int64_t head_dim, void* workspace, size_t workspace_bytes,
                                  DType dtype, cudaStream_t stream, const AttentionOptions& options) {
  Plan plan;
  ops::ring_backward(comm, rank, q, k, v, out, dout, lse, dq, dk, dv, doc_lengths, heads, kv_heads, head_dim,
                     workspace, workspace_bytes, dtype, stream, options, 1,
                     {"weft::ring_attention_backward", "ring_attention_backward_workspace_bytes()", &plan});
  return plan;
}

namespace ops {

size_t ring_backward_workspace_bytes(int world, const std::vector<int64_t>& doc_lengths, bool causal,
                                     int64_t heads, int64_t kv_heads, int64_t head_dim, int grain) {
  size_t most = 0;
  for (int r = 0; r < world; ++r)
    for (const Sharding s : Sharding(causal).both())
      most = std::max(most, own_bytes(Sizes(world, r, doc_lengths, s, heads, kv_heads, head_dim, grain)));
  return most;
}

void ring_backward(Communicator& comm, Rank& rank, const void* q, const void* k, const void* v,
                   const void* out, const void* dout, const float* lse, void* dq, void* dk, void* dv,
                   const std::vector<int64_t>& doc_lengths, int64_t heads, int64_t kv_heads, int64_t head_dim,
                   void* workspace, size_t workspace_bytes, DType dtype, cudaStream_t stream,
                   const AttentionOptions& options, int grain, const RingCaller& caller) {
  ops::OpCall call(comm, rank, stream, ops::team_where(caller.op, rank), caller.plan);
  ops::PhaseClock clock(call.where, stream);
  const std::string& where = call.where;
  ops::check_team_attention_options(options, true, where);
  WEFT_CHECK(!options.deterministic,
             where +
                 "options.deterministic is not supported by the ring backward (dQ parts of every rank are "
                 "added in arrival order); use context_attention_backward for bit-reproducible gradients");
  ops::check_attention_call({1, 1, 1, heads, kv_heads, head_dim}, dtype, options, where);
  Sizes z(rank.world(), rank.rank(), doc_lengths, ops::sharding_of(options), heads, kv_heads, head_dim,
          grain);
  const DqRoute route(comm, rank);
  z.accum_slots = route.any ? rank.world() : 1;  // the same on every rank: a team on one GPU or on several
  z.choose_head_split(rank.sm_budget());
  WEFT_CHECK(z.slot_rows * heads * head_dim < (int64_t(1) << 31) &&
                 z.term_stride * heads * rank.world() < (int64_t(1) << 31) &&
                 int64_t(z.ranges.size()) * z.longest_range * heads * 32 < (int64_t(1) << 39) &&
                 z.segments() * rank.world() < (int64_t(1) << 31),
             where + "sizes past 2^31 are not supported (TMA coordinates and work items are 32-bit)");
  const size_t need = own_bytes(z);
  ops::check_workspace(workspace, workspace_bytes, need, caller.sizing, where);
  ops::check_attention_operands(call, {q, k, v, out, lse, dout, dq, dk, dv}, true, z.local, heads, kv_heads,
                                head_dim);
  ops::WorkspaceLayout area_layout(call.workspace(area_bytes(z), kArea));
  const Area area = carve_area(area_layout, z);
  ops::WorkspaceLayout own_layout(workspace);
  const Own own = carve_own(own_layout, z);
  const Buffers b{q, k, v, out, dout, lse, dq, dk, dv};
  clock.mark("checks, sizes, workspace");
  ops::by_head_dim_and_type(rank, head_dim, dtype, [&](auto d, auto t, auto timed) {
    launch<decltype(d)::value, decltype(t), decltype(timed)::value>(call, clock, z, route, b, own, area,
                                                                    options, dtype);
  });
}

}  // namespace ops
}  // namespace weft
