// Host side of weft::ulysses_attention_forward / _backward (weft/ops/context_attention.hpp). Every rank
// attends its share of the heads over the whole sequence, out of natural-order buffers in the communicator's
// workspace area "ulysses attention" (symmetric), over whole documents.
//   forward   three passes (push, one packed attention call, pull), or with WEFT_ULYSSES_FORWARD=pipelined
//             one persistent kernel (weft/ops/ulysses_attention.cuh): the shares travel in head chunks into
//             head-major buffers while earlier chunks are attended, and each rank pulls its rows of the
//             finished chunks back while later ones are.
//   backward  every rank pushes each rank's head share of its rows (q, k, v, out, dout, LSE) into that
//             rank's row-major buffers, the attention backward runs in one packed call, and each rank pulls
//             its rows of dQ, dK and dV (dK / dV summed in fp32 over the ranks sharing a K / V head).
#include <algorithm>
#include <array>
#include <cstdlib>
#include <string>
#include <vector>

#include "../runtime/kernels.hpp"
#include "attention_args.hpp"
#include "op_args.hpp"
#include "sequence_parallel.hpp"
#include "weft/lcsc/launch.cuh"
#include "weft/ops/context_attention.hpp"
#include "weft/ops/ulysses_attention.cuh"
#include "weft/runtime/error.hpp"

namespace weft {
namespace {

const char* const kArea = "ulysses attention";
const char* const kState = "ulysses attention: call count, finishers";
const char* const kArrived = "ulysses attention: chunk arrivals";
const char* const kFinished = "ulysses attention: chunks finished";
const char* const kMeeting = "ulysses attention: buffers free";
const ResourceDeclaration kUlyssesResources[] = {
    ResourceDeclaration{{kState, 2}},
    ResourceDeclaration{{kArrived, ops::kUlyssesArrivalFlags}},
    ResourceDeclaration{{kFinished, ops::kUlyssesDoneFlags}},
    ResourceDeclaration{{kMeeting, 0, 1}},
};

// The sizes of a call, the symmetric area's carving (natural order, this rank's heads: q, out, dout, dq,
// k, v, LSE, fp32 dK, dV) and the caller's workspace (local -> natural rows, document offsets, the
// attention backward's own).
struct Sizes {
  ops::RingLayout L;
  int world = 0;
  int64_t max_local = 0, total = 0, local = 0, docs = 0, heads = 0, kv_heads = 0, head_dim = 0;
  ops::HeadShare q_share, kv_share;
  Sizes(int w, int rank, const std::vector<int64_t>& doc_lengths, ops::Sharding sharding, int64_t h,
        int64_t kv, int64_t d)
      : L(ops::ring_layout(doc_lengths, w, sharding.causal, 1, sharding.zigzag)),
        world(w),
        heads(h),
        kv_heads(kv),
        head_dim(d),
        q_share(ops::HeadShare::split(h, w)),
        kv_share(ops::HeadShare::split(kv, w)) {
    max_local = ops::max_local_rows(L);
    for (int64_t n : doc_lengths) total += n;
    local = L.local_rows(rank);
    docs = static_cast<int64_t>(doc_lengths.size());
  }
  size_t q_elements() const { return size_t(total * q_share.width * head_dim); }
  size_t kv_elements() const { return size_t(total * kv_share.width * head_dim); }
  // The forward's copy segments of rank r's rows (UlyssesSegments): its runs of rows, cut into pieces.
  std::vector<std::array<int32_t, 3>> segments_of(int r) const {
    std::vector<std::array<int32_t, 3>> out;
    for (const ops::RowRun& run : ops::ring_runs(L)) {
      if (run.rank != r) continue;
      for (int64_t at = 0; at < run.length; at += ops::kUlyssesSegmentRows)
        out.push_back({static_cast<int32_t>(run.local + at), static_cast<int32_t>(run.natural + at),
                       static_cast<int32_t>(std::min<int64_t>(ops::kUlyssesSegmentRows, run.length - at))});
    }
    return out;
  }
  // Room for any rank's segments: a run of rows (at most two per document and rank) leaves at most one short
  // segment, the rest are whole. A bound, so that sizing the workspace walks no rank's runs.
  size_t segment_words() const {
    const int64_t most = (max_local + ops::kUlyssesSegmentRows - 1) / ops::kUlyssesSegmentRows + 2 * docs;
    return size_t(3 * most);
  }
  AttentionShape shape() const {
    int64_t longest = 1;
    for (int64_t n : L.doc_length) longest = std::max(longest, n);
    return {docs, longest, longest, q_share.width, kv_share.width, head_dim};
  }
  AttentionSegments segments(const int32_t* cu) const {
    return varlen_segments(cu, cu, std::max<int64_t>(total, 1), std::max<int64_t>(total, 1));
  }
  size_t attention_backward(const AttentionOptions& options) const {
    static const int32_t kAny[2] = {};  // the size does not read the ranges
    AttentionOptions o = options;
    o.segments = segments(kAny);
    return flash_attention_backward_workspace_bytes(shape(), o);
  }
};

// The symmetric area (natural order, this rank's heads), carved by this one function, with a base or
// without (sizing), alike on every rank.
struct Area {
  char *q, *out, *dout, *dq, *k, *v;
  float *lse, *dk32, *dv32;
};
Area carve_area(ops::WorkspaceLayout& a, const Sizes& z) {
  Area r{};
  for (char** p : {&r.q, &r.out, &r.dout, &r.dq}) *p = a.take(z.q_elements() * 2);
  for (char** p : {&r.k, &r.v}) *p = a.take(z.kv_elements() * 2);
  r.lse = a.take<float>(size_t(z.total * z.q_share.width) * 4);
  r.dk32 = a.take<float>(z.kv_elements() * 4);
  r.dv32 = a.take<float>(z.kv_elements() * 4);
  return r;
}

// The caller's workspace: this rank's local -> natural rows and the document offsets; then the forward's
// copy segments and counters (the loaders' landed chunks, then tasks done per (chunk, peer) and items per
// chunk: `pushed`), or the attention backward's own (attention_bytes > 0).
struct Own {
  int32_t *local_nat = nullptr, *offsets = nullptr, *segments = nullptr;
  int* landed = nullptr;
  uint64_t* pushed = nullptr;
  char* counters_end = nullptr;
  char* attention = nullptr;
};
Own carve_own(ops::WorkspaceLayout& w, const Sizes& z, size_t attention_bytes) {
  Own p;
  p.local_nat = w.take<int32_t>(size_t(std::max<int64_t>(z.max_local, 1)) * 4);
  p.offsets = w.take<int32_t>(size_t(z.docs + 1) * 4);
  if (attention_bytes > 0) {
    p.attention = w.take(attention_bytes);
    return p;
  }
  p.segments = w.take<int32_t>(z.segment_words() * 4);
  p.landed = w.take<int>(size_t(ops::kUlyssesMaxBlocks) * 4);
  p.pushed = w.take<uint64_t>(size_t(ops::ulysses_chunk_flags(z.world)) * (z.world + 1) * 8);
  p.counters_end = w.take(0);
  return p;
}
size_t own_bytes(const Sizes& z, size_t attention_bytes) {
  return ops::bytes_carved_by([&](ops::WorkspaceLayout& w) { carve_own(w, z, attention_bytes); });
}
size_t area_bytes(const Sizes& z) {
  return ops::bytes_carved_by([&](ops::WorkspaceLayout& a) { carve_area(a, z); });
}

// Checks; then the area and the caller's workspace carved, the document offsets uploaded.
struct Started {
  Area area;
  Own own;
};
// Checks and the workspace carved; then (not when planning) the documents' offsets uploaded.
Started start(ops::OpCall& call, const Sizes& z, const AttentionOptions& options, void* workspace,
              size_t workspace_bytes, size_t attention_bytes, DType dtype) {
  Rank& rank = call.rank;
  const std::string& where = call.where;
  const size_t need = own_bytes(z, attention_bytes);
  WEFT_CHECK(z.world == rank.world(), where + "the layout's world size differs from the team's");
  WEFT_CHECK(z.heads > 0 && z.heads % z.world == 0, where + "heads (" + std::to_string(z.heads) +
                                                        ") must be a multiple of the world size (" +
                                                        std::to_string(z.world) + ")");
  WEFT_CHECK(z.kv_heads > 0 && z.heads % z.kv_heads == 0, where + "heads must be a multiple of kv_heads");
  WEFT_CHECK(z.kv_heads % z.world == 0 || z.world % z.kv_heads == 0,
             where + "kv_heads (" + std::to_string(z.kv_heads) + ") and the world size (" +
                 std::to_string(z.world) + ") must divide one another");
  WEFT_CHECK(z.head_dim == 64 || z.head_dim == 128, where + "head_dim must be 64 or 128");
  WEFT_CHECK(dtype == DType::kBF16 || dtype == DType::kFP16, where + "tensors must be bf16 or fp16");
  ops::check_team_attention_options(options, true, where);
  ops::check_workspace(workspace, workspace_bytes, need, "the op's workspace_bytes()", where);
  Started s;
  ops::WorkspaceLayout area(call.workspace(area_bytes(z), kArea));
  s.area = carve_area(area, z);
  ops::WorkspaceLayout own(workspace);
  s.own = carve_own(own, z, attention_bytes);
  if (call.planning()) return s;
  std::vector<int32_t> cu(1, 0);
  for (int64_t n : z.L.doc_length) cu.push_back(static_cast<int32_t>(cu.back() + n));
  ops::upload_words(s.own.offsets, cu, call.stream);
  return s;
}

// The forward's kernel: the attention of this rank's heads over its head-major natural buffers, the pushes
// and pulls of the shares (UlyssesAttentionFwdOp), after a meeting (every peer is done with its previous
// call's buffers).
template <int kD, class T, bool kTimed>
void launch_forward(Communicator& comm, Rank& rank, const Sizes& z, const void* q, const void* k,
                    const void* v, void* out, float* lse, const Area& a, const Own& w, cudaStream_t stream,
                    const AttentionOptions& options, DType dtype, const std::string& where) {
  using Op = ops::UlyssesAttentionFwdOp<kD, T, kTimed>;
  const int W = z.world;
  const int64_t qw = z.q_share.width, kvw = z.kv_share.width;
  const int32_t* offsets = w.offsets;
  int32_t* seg_words = w.segments;
  const std::vector<std::array<int32_t, 3>> segs = z.segments_of(rank.rank());
  WEFT_CHECK(3 * segs.size() <= z.segment_words(),
             where + "internal: more copy segments than the room for them");
  std::vector<int32_t> words(3 * segs.size());
  for (size_t i = 0; i < segs.size(); ++i)
    for (int f = 0; f < 3; ++f) words[f * segs.size() + i] = segs[i][f];
  if (!words.empty()) ops::upload_words(seg_words, words, stream);
  // The counters are neighbours: one memset clears them all.
  WEFT_CUDA_CHECK(cudaMemsetAsync(w.landed, 0, w.counters_end - reinterpret_cast<char*>(w.landed), stream));

  typename Op::Params p{};
  const AttentionShape shape = z.shape();
  lcsc::AttentionSchedulerParams& sched = p.sched;
  sched.batch = static_cast<int>(z.docs);
  sched.heads = static_cast<int>(qw);
  sched.q_blocks = static_cast<int>((shape.seq_q + Op::kBM - 1) / Op::kBM);
  sched.paired = options.causal;
  sched.row_begin = offsets;
  sched.row_end = offsets + 1;
  sched.block_rows = Op::kBM;
  sched.heads_outer = true;
  sched.section_pairs = sched.batch;  // a head per L2 section: the heads run in the order they arrive
  ops::set_team_timeline(p, rank);
  const int resident = std::min(lcsc::Launcher<Op>::max_resident_clusters(), rank.sm_budget());
  const int blocks = std::max(1, ops::attention_blocks(resident, options, sched.units()));
  WEFT_CHECK(blocks <= ops::kUlyssesMaxBlocks, where + "more compute blocks than the landed counts hold");
  sched.compute_blocks = blocks;

  const AttentionSegments seg = z.segments(offsets);
  p.q = ops::map_heads_rows(a.q, qw, z.total, kD, Op::kBM, where + "q", dtype);
  p.k = ops::map_heads_rows(a.k, kvw, z.total, kD, Op::kBN, where + "k", dtype);
  p.v = ops::map_heads_rows(a.v, kvw, z.total, kD, Op::kBN, where + "v", dtype);
  p.o = ops::map_heads_rows(a.out, qw, z.total, kD, Op::Epilogue::kBoxRows, where + "out", dtype);
  p.rows = ops::attention_rows(shape, seg);
  p.lse = lse != nullptr ? a.lse : nullptr;
  p.out = reinterpret_cast<T*>(a.out);
  p.out_heads_first = z.total;
  const float scale = ops::attention_scale(shape, options);
  ops::set_softmax_params(p, qw, qw / kvw, scale, options.causal);

  const int flags = ops::ulysses_chunk_flags(W);
  p.sync = {rank.view(), comm.resources(rank, kState).flags, comm.resources(rank, kArrived).flags,
            blocks * (Op::kConsumerWarpgroups + lcsc::kHelperWarps)};
  p.finished_flags = comm.resources(rank, kFinished).flags;
  p.chunk = {static_cast<int>(std::min<int64_t>(qw, flags)), static_cast<int>(qw)};
  p.flags_per_source = flags;
  const int n = static_cast<int>(segs.size());
  p.seg = {seg_words, seg_words + n, seg_words + 2 * n, n};
  p.total = static_cast<int>(z.total);
  p.heads_all = static_cast<int>(z.heads);
  p.kv_heads_all = static_cast<int>(z.kv_heads);
  p.kv_share = static_cast<int>(kvw);
  int64_t item_blocks = 0;
  for (int64_t len : z.L.doc_length) item_blocks += (len + Op::kBM - 1) / Op::kBM;
  p.item_blocks = static_cast<int>(item_blocks);
  p.q_src = static_cast<const uint8_t*>(q);
  p.k_src = static_cast<const uint8_t*>(k);
  p.v_src = static_cast<const uint8_t*>(v);
  p.q_nat = reinterpret_cast<uint8_t*>(a.q);
  p.k_nat = reinterpret_cast<uint8_t*>(a.k);
  p.v_nat = reinterpret_cast<uint8_t*>(a.v);
  p.o_nat = reinterpret_cast<uint8_t*>(a.out);
  p.lse_nat = a.lse;
  p.out_rows = static_cast<uint8_t*>(out);
  p.lse_rows = lse;
  p.local_rows = static_cast<int>(z.local);
  p.landed = w.landed;
  p.pushed = w.pushed;
  p.ended = p.pushed + size_t(flags) * W;

  launch_team_barrier(rank.view(), comm.resources(rank, kMeeting).slots[0], stream);  // buffers free
  lcsc::Launcher<Op>::launch(p, blocks, stream);
}

// The forward in three passes (the default): the shares pushed into the row-major natural buffers, one packed
// attention call, the output pulled back; no overlap. WEFT_ULYSSES_FORWARD=pipelined takes the one-kernel
// forward instead (launch_forward): on virtual ranks of one GPU it is the faster at W = 2 and the slower at
// W = 8 (bench/RESULTS.md), where its first chunk's pushes and last chunk's pulls stay exposed and the
// copies it hides cost only HBM time; NVLink, where it should pay, has not measured it yet.
void forward_in_passes(Communicator& comm, Rank& rank, const Sizes& z, const void* q, const void* k,
                       const void* v, void* out, float* lse, const Area& a, const Own& w, cudaStream_t stream,
                       const AttentionOptions& options, DType dtype) {
  int32_t* local_nat = w.local_nat;
  ops::write_local_to_natural(z.L, rank.rank(), local_nat, stream);
  const int32_t* offsets = w.offsets;
  ops::push_rows(comm, rank, q, z.local, a.q, local_nat, z.q_share, z.head_dim, z.max_local, stream);
  ops::push_rows(comm, rank, k, z.local, a.k, local_nat, z.kv_share, z.head_dim, z.max_local, stream);
  ops::push_rows(comm, rank, v, z.local, a.v, local_nat, z.kv_share, z.head_dim, z.max_local, stream);
  AttentionOptions o = options;
  o.segments = z.segments(offsets);
  o.timeline = ops::team_attention_timeline(rank, dtype);
  flash_attention_forward(a.q, a.k, a.v, a.out, a.lse, z.shape(), dtype, stream, o);
  ops::pull_rows(comm, rank, a.out, false, out, z.local, local_nat, z.q_share, z.head_dim, z.max_local, dtype,
                 stream);
  if (lse != nullptr) ops::pull_lse(rank, a.lse, lse, z.local, local_nat, z.heads, z.total, stream);
}

bool pipelined_forward_chosen() {
  const char* e = std::getenv("WEFT_ULYSSES_FORWARD");
  return e != nullptr && std::string(e) == "pipelined";
}

}  // namespace

size_t ulysses_attention_workspace_bytes(int world, const std::vector<int64_t>& doc_lengths, bool causal,
                                         int64_t heads, int64_t kv_heads, int64_t head_dim) {
  size_t most = 0;
  for (const ops::Sharding s : ops::Sharding(causal).both())
    most = std::max(most, own_bytes(Sizes(world, 0, doc_lengths, s, heads, kv_heads, head_dim), 0));
  return most;
}

size_t ulysses_attention_backward_workspace_bytes(int world, const std::vector<int64_t>& doc_lengths,
                                                  bool causal, int64_t heads, int64_t kv_heads,
                                                  int64_t head_dim) {
  AttentionOptions o;
  o.causal = causal;
  size_t most = 0;
  for (const ops::Sharding s : ops::Sharding(causal).both()) {
    const Sizes z(world, 0, doc_lengths, s, heads, kv_heads, head_dim);
    most = std::max(most, own_bytes(z, z.attention_backward(o)));
  }
  return most;
}

namespace {

void forward(Communicator& comm, Rank& rank, const void* q, const void* k, const void* v, void* out,
             float* lse, const std::vector<int64_t>& doc_lengths, int64_t heads, int64_t kv_heads,
             int64_t head_dim, void* workspace, size_t workspace_bytes, DType dtype, cudaStream_t stream,
             const AttentionOptions& options, Plan* plan) {
  ops::OpCall call(comm, rank, stream, ops::team_where("weft::ulysses_attention_forward", rank), plan);
  const std::string& where = call.where;
  const Sizes z(rank.world(), rank.rank(), doc_lengths, ops::sharding_of(options), heads, kv_heads, head_dim);
  WEFT_CHECK(ops::ulysses_chunk_flags(z.world) >= 1,
             where + "world sizes up to " + std::to_string(ops::kUlyssesDoneFlags) + " are supported");
  const Started st = start(call, z, options, workspace, workspace_bytes, 0, dtype);
  const Area& a = st.area;
  ops::check_attention_call({1, 1, 1, heads, kv_heads, head_dim}, dtype, options, where);
  WEFT_CHECK(z.total * std::max(z.q_share.width, z.kv_share.width) < (int64_t(1) << 31),
             where + "sizes past 2^31 are not supported (TMA coordinates and work items are 32-bit)");
  ops::check_attention_operands(call, {q, k, v, out, lse}, false, z.local, heads, kv_heads, head_dim);
  if (call.planning()) {
    AttentionOptions o = options;
    o.segments = z.segments(st.own.offsets);
    o.timeline = ops::team_attention_timeline(rank, dtype);
    const Plan core = z.total > 0 ? flash_attention_forward_plan(z.shape(), dtype, o) : Plan{};
    call.planned_op(
        "ulysses_attention_forward",
        pipelined_forward_chosen()
            ? "one kernel: heads moved in chunks beside the attention of earlier ones"
            : "heads pushed (all-to-all), flash attention over the whole sequence, outputs pulled back",
        core.blocks, core.smem_bytes);
    return;
  }
  if (z.total == 0) return;
  if (!pipelined_forward_chosen())
    return forward_in_passes(comm, rank, z, q, k, v, out, lse, a, st.own, call.stream, options, dtype);
  ops::by_head_dim_and_type(rank, head_dim, dtype, [&](auto d, auto t, auto timed) {
    launch_forward<decltype(d)::value, decltype(t), decltype(timed)::value>(
        comm, rank, z, q, k, v, out, lse, a, st.own, call.stream, options, dtype, where);
  });
}

void backward(Communicator& comm, Rank& rank, const void* q, const void* k, const void* v, const void* out,
              const void* dout, const float* lse, void* dq, void* dk, void* dv,
              const std::vector<int64_t>& doc_lengths, int64_t heads, int64_t kv_heads, int64_t head_dim,
              void* workspace, size_t workspace_bytes, DType dtype, cudaStream_t stream,
              const AttentionOptions& options, Plan* plan) {
  ops::OpCall call(comm, rank, stream, ops::team_where("weft::ulysses_attention_backward", rank), plan);
  stream = call.stream;
  const Sizes z(rank.world(), rank.rank(), doc_lengths, ops::sharding_of(options), heads, kv_heads, head_dim);
  const size_t attention_bytes = z.attention_backward(options);
  ops::check_attention_operands(call, {q, k, v, out, lse, dout, dq, dk, dv}, true, z.local, heads, kv_heads,
                                head_dim);
  const Started st = start(call, z, options, workspace, workspace_bytes, attention_bytes, dtype);
  const Area& a = st.area;
  AttentionOptions o = options;
  o.segments = z.segments(st.own.offsets);
  o.accumulate_grads = {a.dk32, a.dv32};
  o.timeline = ops::team_attention_timeline(rank, dtype);
  if (call.planning()) {
    const Plan core = z.total > 0 ? flash_attention_backward_plan(z.shape(), dtype, o) : Plan{};
    call.planned_op(
        "ulysses_attention_backward",
        "q, k, v, out, dout and LSE pushed (all-to-all), flash attention backward into fp32 dK / dV sums, "
        "dq, dk, dv pulled back",
        core.blocks, core.smem_bytes);
    return;
  }
  if (z.total == 0) return;
  int32_t* local_nat = st.own.local_nat;
  ops::write_local_to_natural(z.L, rank.rank(), local_nat, stream);
  ops::push_rows(comm, rank, q, z.local, a.q, local_nat, z.q_share, head_dim, z.max_local, stream);
  // After the first push's meeting: every peer is done with its previous call's LSE and dK / dV sums.
  ops::push_lse(rank, lse, z.local, a.lse, local_nat, heads, z.total, stream);
  // dK and dV are neighbours in the area: one memset clears both.
  WEFT_CUDA_CHECK(cudaMemsetAsync(
      a.dk32, 0, reinterpret_cast<char*>(a.dv32 + z.kv_elements()) - reinterpret_cast<char*>(a.dk32),
      stream));
  ops::push_rows(comm, rank, k, z.local, a.k, local_nat, z.kv_share, head_dim, z.max_local, stream);
  ops::push_rows(comm, rank, v, z.local, a.v, local_nat, z.kv_share, head_dim, z.max_local, stream);
  ops::push_rows(comm, rank, out, z.local, a.out, local_nat, z.q_share, head_dim, z.max_local, stream);
  ops::push_rows(comm, rank, dout, z.local, a.dout, local_nat, z.q_share, head_dim, z.max_local, stream);
  flash_attention_backward(a.q, a.k, a.v, a.out, a.dout, a.lse, a.dq, nullptr, nullptr, st.own.attention,
                           attention_bytes, z.shape(), dtype, stream, o);
  ops::pull_rows(comm, rank, a.dq, false, dq, z.local, local_nat, z.q_share, head_dim, z.max_local, dtype,
                 stream);
  ops::pull_rows(comm, rank, a.dk32, true, dk, z.local, local_nat, z.kv_share, head_dim, z.max_local, dtype,
                 stream);
  ops::pull_rows(comm, rank, a.dv32, true, dv, z.local, local_nat, z.kv_share, head_dim, z.max_local, dtype,
                 stream);
}

}  // namespace

void ulysses_attention_forward(Communicator& comm, Rank& rank, const void* q, const void* k, const void* v,
                               void* out, float* lse, const std::vector<int64_t>& doc_lengths, int64_t heads,
                               int64_t kv_heads, int64_t head_dim, void* workspace, size_t workspace_bytes,
                               DType dtype, cudaStream_t stream, const AttentionOptions& options) {
  forward(comm, rank, q, k, v, out, lse, doc_lengths, heads, kv_heads, head_dim, workspace, workspace_bytes,
          dtype, stream, options, nullptr);
}

Plan ulysses_attention_forward_plan(Communicator& comm, Rank& rank, const void* q, const void* k,
                                    const void* v, void* out, float* lse,
                                    const std::vector<int64_t>& doc_lengths, int64_t heads, int64_t kv_heads,
                                    int64_t head_dim, void* workspace, size_t workspace_bytes, DType dtype,
                                    cudaStream_t stream, const AttentionOptions& options) {
  Plan plan;
  forward(comm, rank, q, k, v, out, lse, doc_lengths, heads, kv_heads, head_dim, workspace, workspace_bytes,
          dtype, stream, options, &plan);
  return plan;
}

void ulysses_attention_backward(Communicator& comm, Rank& rank, const void* q, const void* k, const void* v,
                                const void* out, const void* dout, const float* lse, void* dq, void* dk,
                                void* dv, const std::vector<int64_t>& doc_lengths, int64_t heads,
                                int64_t kv_heads, int64_t head_dim, void* workspace, size_t workspace_bytes,
                                DType dtype, cudaStream_t stream, const AttentionOptions& options) {
  backward(comm, rank, q, k, v, out, dout, lse, dq, dk, dv, doc_lengths, heads, kv_heads, head_dim, workspace,
           workspace_bytes, dtype, stream, options, nullptr);
}

Plan ulysses_attention_backward_plan(Communicator& comm, Rank& rank, const void* q, const void* k,
                                     const void* v, const void* out, const void* dout, const float* lse,
                                     void* dq, void* dk, void* dv, const std::vector<int64_t>& doc_lengths,
                                     int64_t heads, int64_t kv_heads, int64_t head_dim, void* workspace,
                                     size_t workspace_bytes, DType dtype, cudaStream_t stream,
                                     const AttentionOptions& options) {
  Plan plan;
  backward(comm, rank, q, k, v, out, dout, lse, dq, dk, dv, doc_lengths, heads, kv_heads, head_dim, workspace,
           workspace_bytes, dtype, stream, options, &plan);
  return plan;
}

}  // namespace weft
