// Host side of the fused tensor-parallel ops: argument checks, the choice of path (fused kernel, copy-engine
// pipeline or sequential), workspace layout, tensor maps and launch (device code: weft/ops/fused.cuh).
#include <algorithm>
#include <climits>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "../runtime/driver.hpp"
#include "../runtime/kernels.hpp"
#include "cublas_gemm.hpp"
#include "fused_rules.hpp"
#include "op_args.hpp"
#include "ring_schedule.hpp"
#include "weft/runtime/current_device.hpp"
#include "weft/runtime/kernel_preload.hpp"
#include "weft/comm/stream_wait.cuh"
#include "weft/lcsc/launch.cuh"
#include "weft/ops/fused.cuh"
#include "weft/ops/fused.hpp"
#include "weft/ops/gemm_fp8.cuh"
#include "weft/runtime/tensor_map.hpp"

namespace weft {

const char* fused_path_name(FusedPath p) {
  return p == FusedPath::kFused ? "fused" : p == FusedPath::kPipelined ? "pipelined" : "sequential";
}

namespace {

// Signal-pad resources (weft/runtime/resources.hpp): the fused kernels' call state, RS's ready flag, AG's
// chunk flags, each copy-engine pipeline's used / arrived flags (pipelines also name a workspace area of the
// same name). The block-meeting slots they share with the collectives are declared in collectives.cu (which
// every fused op links: its sequential paths call the collectives).
const char* const kFusedState = "fused kernels: call count, finishers";
const char* const kRsReady = "matmul_reduce_scatter / all_reduce kernel: staging ready";
const char* const kAgChunks = "all_gather_matmul kernel: chunk arrivals";
const char* const kAgPipeline = "all_gather_matmul pipeline";
const char* const kRsPipeline = "matmul_reduce_scatter / all_reduce pipeline";
// Workspace area: this rank's rows' sum, where the fused kernel's partials are added at the owner; signal-pad
// flags: the counts of its halves and the counts they reached (ops/fused.cuh, RsGemmOp).
const char* const kRsSum = "matmul_reduce_scatter / all_reduce kernel: the owner's sum";
const char* const kRsHalves = "matmul_reduce_scatter / all_reduce kernel: adds per half at the owner";
// Signal-pad flags of Partials::kSummedInEpilogue: the partials landed per tile at the owner, and the counts
// they reached (ops/fused.cuh, EpilogueSummedC).
const char* const kRsTiles = "matmul_reduce_scatter / all_reduce kernel: partials per tile at the owner";
// Partials::kSplitK (ops::SplitKAllReduceOp): workspace areas of its own (peers write the slots ahead of this
// rank's call), and its flags.
const char* const kSplitKSlots = "matmul_all_reduce at decode sizes: partials at the owner";
const char* const kSplitKResult = "matmul_all_reduce at decode sizes: the summed bands";
const char* const kSplitKLanded = "matmul_all_reduce at decode sizes: partials landed at the owner";
const char* const kSplitKSummed = "matmul_all_reduce at decode sizes: summed bands landed";
constexpr int kPipelineFlags = 2 * kMaxWorld;  // used(r), then arrived(r)
const ResourceDeclaration kFusedResources[] = {
    ResourceDeclaration{{kFusedState, 2}},
    ResourceDeclaration{{kRsReady, 1}},
    ResourceDeclaration{{kAgChunks, ops::kFusedChunkFlags}},
    ResourceDeclaration{{kAgPipeline, kPipelineFlags}},
    ResourceDeclaration{{kRsPipeline, kPipelineFlags}},
    ResourceDeclaration{{kRsHalves, 2 * ops::kRsHalfFlags}},
    ResourceDeclaration{{kRsTiles, 2 * ops::kRsTileFlags}},
    ResourceDeclaration{{kSplitKLanded, ops::kSplitKSlotFlags}},
    ResourceDeclaration{{kSplitKSummed, ops::kSplitKBandFlags}},
};

struct Call : ops::OpCall {
  // `splits_m`: the op hands each rank M / W rows (all_gather_matmul's shards, matmul_reduce_scatter's
  // slices); matmul_all_reduce does not, and takes any M.
  Call(Communicator& c, Rank& r, cudaStream_t s, const char* op, int64_t m, int64_t n, int64_t k,
       bool splits_m, Plan* into = nullptr)
      : OpCall(c, r, s,
               std::string("weft::") + op + "(M=" + std::to_string(m) + ", N=" + std::to_string(n) +
                   ", K=" + std::to_string(k) + "): ",
               into) {
    if (into) into->op = op;
    WEFT_CHECK(m > 0 && n > 0 && k > 0, where + "M, N and K must be at least 1");
    WEFT_CHECK(!splits_m || m % r.world() == 0,
               where + "M must be divisible by the world size " + std::to_string(r.world()));
    WEFT_CHECK(k % 8 == 0 && n % 8 == 0,
               where + "K and N must be multiples of 8 (bf16 rows of 16-byte multiples, which TMA requires)");
  }
  // The operands every fused op has: A (`a_rows` x K, named `a_name`), B (K x N either way), out
  // (`out_rows` x N), all bf16; then the GEMM's own shape, layout and device checks, with gemm's messages.
  void check_operands(const void* a, const char* a_name, int64_t a_rows, const void* b, const void* out,
                      int64_t out_rows, int64_t m, int64_t n, int64_t k, BLayout layout) const {
    check_buffer(a, a_name, a_rows * k * 2);
    check_buffer(b, "b", n * k * 2);
    check_buffer(out, "out", out_rows * n * 2);
    gemm_plan(m, n, k, layout, DType::kBF16);
  }
  // What a fused kernel synchronizes with; `done_target` finishers per call.
  ops::FusedSync sync(int done_target) const {
    return ops::FusedSync{rank.view(),
                          comm.resources(rank, kFusedState).flags,
                          comm.resources(rank, kRsReady).flags,
                          comm.resources(rank, kAgChunks).flags,
                          ops::meeting_slots(comm, rank),
                          done_target};
  }
  // The path to run. `why_not_fused` is empty when the fused kernel can run, else the reason it cannot;
  // kAuto takes the path of the measured rule (auto_path) where it can.
  FusedPath path(const FusedOptions& o, int64_t m, const std::string& why_not_fused, FusedPath rule) const {
    using Mode = FusedOptions::Mode;
    WEFT_CHECK(o.pipeline_pieces >= 0, where + "options.pipeline_pieces must be 0 (auto) or more, got " +
                                           std::to_string(o.pipeline_pieces));
    using Partials = FusedOptions::Partials;
    WEFT_CHECK(o.partials == Partials::kAuto || o.partials == Partials::kStaged ||
                   o.partials == Partials::kAddedAtOwner || o.partials == Partials::kStagedProgressive ||
                   o.partials == Partials::kSummedInEpilogue || o.partials == Partials::kSplitK,
               where + "unknown options.partials");
    WEFT_CHECK(
        o.mode != Mode::kFused || why_not_fused.empty(),
        where + "the fused kernel cannot run here: " + why_not_fused + " (use Mode::kAuto to fall back)");
    // Virtual ranks: the pipeline's stream waits, replayed from CUDA graphs of ranks sharing a GPU, can block
    // one another in the GPU's shared work queues (weft-bench fused hung there: 2 ranks on one H100, 10 calls
    // per graph at M = 2048; eager calls and the suite's one-call graphs passed). Not captured there.
    const bool pipeline_ok = !(capturing && comm.ranks_per_gpu() > 1);
    WEFT_CHECK(o.mode != Mode::kPipelined || m % rank.world() == 0,
               where + "the copy-engine pipeline splits M over the ranks: M = " + std::to_string(m) +
                   " is not divisible by the world size " + std::to_string(rank.world()) +
                   " (use Mode::kAuto or kSequential)");
    WEFT_CHECK(
        o.mode != Mode::kPipelined || pipeline_ok,
        where +
            "the copy-engine pipeline is not captured into CUDA graphs on virtual ranks (ranks sharing "
            "a GPU: their replayed stream waits can block one another); run it outside the capture, or "
            "use Mode::kAuto, kFused or kSequential");
    switch (o.mode) {
      case Mode::kFused:
        return FusedPath::kFused;
      case Mode::kPipelined:
        return FusedPath::kPipelined;
      case Mode::kSequential:
        return FusedPath::kSequential;
      case Mode::kAuto:
        break;
    }
    if (rank.world() == 1 || m < o.min_fused_m) return FusedPath::kSequential;
    if (rule == FusedPath::kFused && !why_not_fused.empty()) return FusedPath::kSequential;
    if (rule == FusedPath::kPipelined && m % rank.world() != 0) return FusedPath::kSequential;
    // Virtual ranks: never the pipeline, captured or not, so that every rank decides alike whichever of
    // them a graph captures.
    if (rule == FusedPath::kPipelined && comm.ranks_per_gpu() > 1)
      return why_not_fused.empty() ? FusedPath::kFused : FusedPath::kSequential;
    return rule;
  }
  // The GEMM of the sequential and pipelined paths: out = a . b (with `accumulate`: out += a . b). cuBLAS
  // (never slower than the cuBLAS + NCCL baseline) where it is safe, else weft::gemm (the store, or a
  // reduce-add into out), which also takes what cuBLAS cannot (a dimension above 2^31 - 1).
  // Not safe: one host thread driving several local ranks outside a capture. Then a GPU may already hold
  // work that waits for a rank this thread drives later (this op's earlier ranks, or this rank's previous
  // op), and cuBLAS's first use of one of its kernels on a GPU waits until that GPU's queued and running
  // work is done: for ever. Seen at 4 GPUs (session 11, in cuKernelSetAttribute) and on one GPU with a
  // held stream (tests/gpu/test_host_calls.cu: cublasGemmEx of a shape not run before waited, captured or
  // not, with eager module loading too; weft::gemm, whose kernels are loaded with the communicator, never).
  void gemm_into(const void* a, const void* b, void* out, int64_t m, int64_t n, int64_t k, BLayout layout,
                 bool accumulate = false) const {
    if (planning()) return;
    const bool cublas_safe = comm.num_local() == 1 || capturing;
    if (cublas_safe &&
        ops::cublas_gemm_bf16(a, b, out, m, n, k, layout, stream, rank.rank(), capturing, where, accumulate))
      return;
    if (!cublas_safe)
      ops::cublas_gemm_ready(rank.rank(), where);  // for a later capture (made with the communicator)
    weft_gemm_into(a, b, out, m, n, k, layout, accumulate);
  }
  // The same on weft::gemm always (its tile width by how well the tiles fill the SMs' waves).
  void weft_gemm_into(const void* a, const void* b, void* out, int64_t m, int64_t n, int64_t k,
                      BLayout layout, bool accumulate = false) const {
    if (planning()) return;
    GemmOptions o;
    o.store = accumulate ? GemmStore::kReduceAdd : GemmStore::kStore;
    o.max_blocks = rank.sm_budget();
    o.timeline = rank.view().timeline;
    gemm(a, b, out, m, n, k, layout, DType::kBF16, stream, o);
  }
  // Before an LCSC op's launch with `comm_blocks` communicator blocks: planning, records the fused kernel's
  // grid and tiles and returns true (launch nothing); else false.
  template <class Op>
  bool planned_kernel(const lcsc::SchedulerParams& s, int comm_blocks) const {
    if (!planning()) return false;
    plan->path = fused_path_name(FusedPath::kFused);
    plan->blocks = s.compute_blocks + comm_blocks;
    plan->comm_blocks = comm_blocks;
    plan->cluster = Op::kClusterSize;
    plan->smem_bytes = static_cast<int>(lcsc::kSmemBytes<Op>);
    plan->tiles = {Op::kBM, Op::kBN, Op::kBK, Op::kStages, s.group_m, int64_t(s.tiles_m) * s.tiles_n};
    return true;
  }
  // Planning a sequential path: takes in the plan of the collective it runs (its path and workspace).
  void plan_sequential(const Plan& collective) const {
    plan->path = fused_path_name(FusedPath::kSequential) + std::string(" (") + collective.op + ": " +
                 collective.path + ")";
    take_workspace(collective);
  }
  // Planning a kernel followed by a collective: its path after the kernel's, and its workspace.
  void plan_more(const Plan& collective) const {
    plan->path += std::string(" + ") + collective.op + ": " + collective.path;
    take_workspace(collective);
  }
  void take_workspace(const Plan& collective) const {
    for (const auto& [area, bytes] : collective.workspace)
      plan->workspace[area] = std::max(plan->workspace[area], bytes);
  }
  // Clusters of an LCSC op's grid that the rank's SM budget allows: its share of what the GPU holds.
  template <class Op>
  int budget_clusters() const {
    return static_cast<int>(int64_t(lcsc::Launcher<Op>::max_resident_clusters()) *
                            std::min(rank.sm_budget(), rank.device_sms()) / rank.device_sms());
  }
  // Why an LCSC op with `comm` communicator blocks cannot run within the SM budget ("" when it can).
  template <class Op>
  std::string why_not_in_budget(int comm_blocks) const {
    if (budget_clusters<Op>() - comm_blocks / Op::kClusterSize >= 1) return {};
    return "rank " + std::to_string(rank.rank()) + "'s SM budget of " + std::to_string(rank.sm_budget()) +
           " SMs leaves no SMs for the GEMM next to " + std::to_string(comm_blocks) +
           " communicator blocks (Options::sm_budget, FusedOptions::comm_blocks)";
  }
  // Grid of an LCSC op with `comm` communicator blocks: compute clusters fill the rest of the budget.
  template <class Op>
  int compute_blocks(int comm_blocks, int units, const FusedOptions& o) const {
    int clusters = budget_clusters<Op>() - comm_blocks / Op::kClusterSize;
    if (o.max_compute_blocks > 0)
      clusters = std::min(clusters, std::max(1, o.max_compute_blocks / Op::kClusterSize));
    const std::string why = why_not_in_budget<Op>(comm_blocks);
    WEFT_CHECK(why.empty(), where + why);
    return std::min(clusters, units) * Op::kClusterSize;
  }
};

// ---- copy-engine pipeline (FusedPath::kPipelined) -------------------------------------------------------
// The GEMM runs as row pieces of cuBLAS (every SM) on the caller's stream while the copy engines move
// finished pieces (RS / AR) or A shards (AG) between GPUs on a side stream: no SM spends time on
// communication. Stream writes and timed waits on signal-pad flags (Pipeline::used / arrived) order the
// GPUs' streams; the pipeline's buffers are a workspace area of their own, since peers write into them
// ahead of this rank's call. A rank's first push into rank r in a call waits for r to clear this rank's used
// flag (r consumed the previous call's pushes), so no rank runs more than one call ahead.

struct PipeStreams {
  cudaStream_t side = nullptr;   // the copies
  cudaStream_t waits = nullptr;  // the waits for peers' arrivals
  cudaEvent_t fork = nullptr, join = nullptr, gemm_done = nullptr, arrived = nullptr;
};

// Per GPU and rank (virtual ranks share a GPU), created on the first pipelined call (not under capture),
// never destroyed (as the cuBLAS handles). One pipelined call at a time per rank of a GPU.
PipeStreams& pipe_streams(int device, int rank, bool capturing, const std::string& where) {
  static std::mutex mu;
  static std::map<std::pair<int, int>, PipeStreams> all;
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = all.find({device, rank}); it != all.end()) return it->second;
  WEFT_CHECK(!capturing, where +
                             "the first pipelined call on a GPU creates its copy stream, which a CUDA graph "
                             "capture does not allow: make one call before capturing");
  PipeStreams p;
  for (cudaStream_t* st : {&p.side, &p.waits})
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(st, cudaStreamNonBlocking));
  for (cudaEvent_t* e : {&p.fork, &p.join, &p.gemm_done, &p.arrived})
    WEFT_CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
  return all.emplace(std::pair{device, rank}, p).first->second;
}

struct Copy {  // bytes from src to dst, both on this GPU
  void* dst = nullptr;
  const void* src = nullptr;
  uint64_t bytes = 0;
};

class CopyPipeline {
 public:
  // Forks the side streams off the caller's (everything before this call is ordered before their work).
  // `owner` names the pipeline's flags (granted at team creation) and its workspace area.
  CopyPipeline(Call& c, const char* owner)
      : c_(c),
        flags_(c.comm.resources(c.rank, owner).flags),
        me_(c.rank.rank()),
        claimed_(c.rank.world()),
        s_(pipe_streams(c.rank.device(), c.rank.rank(), c.capturing, c.where)) {
    WEFT_CUDA_CHECK(cudaEventRecord(s_.fork, c_.stream));
    WEFT_CUDA_CHECK(cudaStreamWaitEvent(s_.side, s_.fork));
    WEFT_CUDA_CHECK(cudaStreamWaitEvent(s_.waits, s_.fork));
  }
  // Caller's stream to side stream: the side stream's next work waits for the caller's work so far.
  void side_waits() const {
    WEFT_CUDA_CHECK(cudaEventRecord(s_.gemm_done, c_.stream));
    WEFT_CUDA_CHECK(cudaStreamWaitEvent(s_.side, s_.gemm_done));
  }
  // Side stream: copy `bytes` from `src` (this GPU) to rank `to`'s copy of `dst` (a pointer into a symmetric
  // buffer of this rank), then set `to`'s arrival count for this rank to `count` (the pieces pushed to `to`
  // so far in this call). The first push to a peer in a call waits until it has consumed the previous call's.
  void push(int to, char* dst, const void* src, uint64_t bytes, uint32_t count = 1) {
    if (!claimed_[to]) {
      wait(s_.side, used(to), StreamWait::kEqual, 0);
      write(s_.side, used(to), 1);
      claimed_[to] = true;
    }
    WEFT_CUDA_CHECK(
        cudaMemcpyAsync(c_.rank.peer_ptr(dst, to), src, bytes, cudaMemcpyDeviceToDevice, s_.side));
    write(s_.side, c_.rank.peer_ptr(arrived(me_), to), count);
  }
  // Caller's stream: what comes next waits until `from` has pushed `count` pieces here in this call (and
  // `then` copied what it names on this GPU). The wait itself runs on a stream of its own, during the
  // caller's current GEMM, and the caller's stream only takes an event edge: a stream wait between two
  // GEMMs cost ~10 us each (2 x H200).
  void wait_arrivals(int from, uint32_t count = 1, Copy then = {}) const {
    wait(s_.waits, arrived(from), StreamWait::kAtLeast, count);
    if (then.bytes)
      WEFT_CUDA_CHECK(cudaMemcpyAsync(then.dst, then.src, then.bytes, cudaMemcpyDeviceToDevice, s_.waits));
    WEFT_CUDA_CHECK(cudaEventRecord(s_.arrived, s_.waits));
    WEFT_CUDA_CHECK(cudaStreamWaitEvent(c_.stream, s_.arrived));
  }
  // This rank's arrival counts as a run of flags (flag s: source s's pushes here in this call), for a kernel
  // that waits on them itself.
  Flags arrival_flags() const { return Flags{flags_.first + kMaxWorld, kMaxWorld}; }
  // Side stream, in order with the pushes: a copy on this GPU.
  void local_copy(void* dst, const void* src, uint64_t bytes) const {
    WEFT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s_.side));
  }
  // Caller's stream, after everything pushed here was consumed: clear the arrival counts, free every peer to
  // push again; then join the side streams back.
  void finish() const {
    for (int r = 0; r < c_.rank.world(); ++r)
      if (r != me_) {
        write(c_.stream, arrived(r), 0);
        write(c_.stream, c_.rank.peer_ptr(used(me_), r), 0);
      }
    for (cudaStream_t st : {s_.side, s_.waits}) {
      WEFT_CUDA_CHECK(cudaEventRecord(s_.join, st));
      WEFT_CUDA_CHECK(cudaStreamWaitEvent(c_.stream, s_.join));
    }
  }

 private:
  // This rank's flags: used(r), set here before this rank's first push into r in a call and cleared by r
  // once it consumed the call's pushes; arrived(r), the count of pieces r has pushed here in this call,
  // cleared here at the end of the call. Unlike other flags these restart from 0 in every call: the host
  // enqueues them as stream writes and waits, whose values are fixed when enqueued (or captured into a
  // graph), so they cannot carry a per-call epoch.
  uint64_t* used(int r) const { return c_.rank.view().flag(flags_, r); }
  uint64_t* arrived(int r) const { return c_.rank.view().flag(flags_, kMaxWorld + r); }
  // A wait on this rank's flag that fails with a device error after the team's timeout (a dead or stuck
  // peer) instead of blocking the stream for ever (weft/comm/stream_wait.cuh).
  void wait(cudaStream_t s, const uint64_t* f, StreamWait how, uint32_t v) const {
    if (how == StreamWait::kEqual) {
      detail::preload<&stream_wait_kernel<StreamWait::kEqual>>();
      stream_wait_kernel<StreamWait::kEqual><<<1, 32, 0, s>>>(c_.rank.view(), f, v);
    } else {
      detail::preload<&stream_wait_kernel<StreamWait::kAtLeast>>();
      stream_wait_kernel<StreamWait::kAtLeast><<<1, 32, 0, s>>>(c_.rank.view(), f, v);
    }
    WEFT_CUDA_CHECK(cudaGetLastError());
  }
  // The flags are 64-bit words holding small counts: 32-bit stream writes into their low half.
  static void write(cudaStream_t s, uint64_t* f, uint32_t v) {  // ordered after the stream's earlier work
    WEFT_CU_CHECK(
        driver().cuStreamWriteValue32(s, reinterpret_cast<CUdeviceptr>(f), v, CU_STREAM_WRITE_VALUE_DEFAULT));
  }
  Call& c_;
  Flags flags_;
  int me_;
  std::vector<bool> claimed_;  // peers pushed to in this call
  PipeStreams& s_;
};

// all_gather_matmul: this rank's shard goes to every peer's area (slot of this rank) by copy engine; the
// GEMM runs on this rank's own rows first, then on each peer's rows as they land (rank - 1 first).
void pipelined_ag(Call& c, const void* a_shard, const void* b, void* out, void* gathered_a, int64_t m,
                  int64_t n, int64_t k, BLayout layout) {
  const int W = c.rank.world(), me = c.rank.rank();
  const int64_t rows = m / W;
  const uint64_t shard = rows * k * 2;
  char* g = c.workspace(m * k * 2, kAgPipeline);
  if (c.planned(fused_path_name(FusedPath::kPipelined))) return;
  auto a_of = [&](int r) { return r == me ? static_cast<const char*>(a_shard) : g + r * shard; };
  auto out_of = [&](int r) { return static_cast<char*>(out) + r * rows * n * 2; };
  CopyPipeline p(c, kAgPipeline);
  for (int s = 1; s < W; ++s) p.push((me + s) % W, g + me * shard, a_shard, shard);
  for (int s = 0; s < W; ++s) {
    const int r = (me - s + W) % W;
    if (r != me) p.wait_arrivals(r);
    // weft::gemm: a shard's rows are a fraction of M, where cuBLAS's 128 x 256 tiles fill the waves poorly
    // (1024 x 14336: 3.4 waves of 132 SMs, the 4th a third full) and weft's rule takes 128 x 128 (6.8).
    c.weft_gemm_into(a_of(r), b, out_of(r), rows, n, k, layout);
  }
  if (gathered_a)
    for (int r = 0; r < W; ++r)
      WEFT_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(gathered_a) + r * shard, a_of(r), shard,
                                      cudaMemcpyDeviceToDevice, c.stream));
  p.finish();
}

// matmul_reduce_scatter / matmul_all_reduce: a ring reduce-scatter whose additions run in the GEMM's
// epilogue (gemm_into with accumulate: out = a . b + out, the partial in out). At step s = 0..W-1 rank r
// computes the rows of rank (r - s - 1) mod W (its own last), adding from step 1 on the partial sum of those
// rows that rank r - 1 made at its step s - 1 and pushed into this rank's inbox (in place there; the last
// step copies it into out first, while the GEMM before runs); below the last step it pushes its sum on to
// rank r + 1. Steps run in row pieces in ring_schedule's order, each pushed as soon as it is computed, so no
// step waits for a whole push and no reduce pass remains (2 GPUs: the peer's rows, then this rank's own plus
// the peer's partial). All-reduce: each final piece also goes to every peer's out (through the workspace when
// out is not symmetric: copied into out at the end).
void pipelined_rs(Call& c, const void* a, const void* b, void* out, int64_t m, int64_t n, int64_t k,
                  BLayout layout, bool all_reduce, int pieces_wanted) {
  const int W = c.rank.world(), me = c.rank.rank(), next = (me + 1) % W, prev = (me + W - 1) % W;
  if (W == 1 && c.planned(fused_path_name(FusedPath::kPipelined))) return;
  if (W == 1) return c.gemm_into(a, b, out, m, n, k, layout);
  const int64_t rows = m / W;
  const uint64_t row_bytes = n * 2, slice = rows * row_bytes;
  // Two pieces per step measured best (2 x H200, bench/RESULTS.md: each more costs ~5-9 us of stream
  // memops and GEMM ramps, and one stalls every step for a whole push); the all-reduce's last step halves its
  // last piece down to ~4 MiB or an eighth of the rows, for a short fan-out after the last GEMM.
  const int64_t tail_rows =
      std::max<int64_t>(64, std::min<int64_t>(rows / 8, (4 << 20) / row_bytes) / 64 * 64);
  const ops::RingSchedule plan = ops::ring_schedule(W, rows, pieces_wanted > 0 ? pieces_wanted : 2,
                                                    all_reduce ? tail_rows : 0, all_reduce);
  const bool sym_out = all_reduce && c.comm.in_heap(c.rank, out, m * n * 2);
  char* gather = all_reduce && !sym_out ? c.workspace(m * n * 2) : nullptr;  // grown before anything waits
  // Inbox slice s - 1 takes rank r - 1's step s - 1 (for this rank's step s); step 0 is made in `staging`.
  char* inbox = c.workspace(W * slice, kRsPipeline);
  if (c.planned(fused_path_name(FusedPath::kPipelined))) return;
  char* staging = inbox + (W - 1) * slice;
  char* my_rows = static_cast<char*>(out) + (all_reduce ? me * slice : 0);
  auto a_at = [&](int s, int64_t row) {  // A's rows computed at step s, from `row` of that chunk on
    return static_cast<const char*>(a) + (((me + W - s - 1) % W) * rows + row) * k * 2;
  };
  auto partial_at = [&](int s, int64_t row) -> char* {
    return s == 0 ? nullptr : inbox + (s - 1) * slice + row * row_bytes;
  };
  auto dst_at = [&](int s, int64_t row) {
    return s == 0 ? staging + row * row_bytes : s < W - 1 ? partial_at(s, row) : my_rows + row * row_bytes;
  };
  CopyPipeline p(c, kRsPipeline);
  for (size_t i = 0; i < plan.order.size(); ++i) {
    const int s = plan.order[i].step;
    const int64_t r0 = plan.first_row(i), nr = plan.row_count(i);
    if (s > 0) {  // the previous rank's piece of step s - 1 holding this one's rows has landed
      const bool in_place = dst_at(s, r0) == partial_at(s, r0);
      p.wait_arrivals(prev, plan.needs[i],
                      in_place ? Copy{} : Copy{dst_at(s, r0), partial_at(s, r0), uint64_t(nr) * row_bytes});
    }
    // out = a . b (+ the partial there from step 1 on: in place in the inbox, the last step's copied into
    // out)
    c.gemm_into(a_at(s, r0), b, dst_at(s, r0), nr, n, k, layout, s > 0);
    if (s < W - 1) {
      p.side_waits();
      p.push(next, partial_at(s + 1, r0), dst_at(s, r0), nr * row_bytes, plan.pushed_to_next[i]);
    } else if (all_reduce) {
      p.side_waits();
      for (int t = 1; t < W; ++t) {
        const int to = (me + t) % W;
        p.push(to, (sym_out ? my_rows : gather + me * slice) + r0 * row_bytes, dst_at(s, r0), nr * row_bytes,
               to == next ? plan.pushed_to_next[i] : plan.finals[i]);
      }
    }
  }
  if (all_reduce)
    for (int q = 0; q < W; ++q) {
      if (q == me) continue;
      p.wait_arrivals(q, q == prev ? plan.pushed_to_next.back() : plan.finals.back());
      if (gather)
        WEFT_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(out) + q * slice, gather + q * slice, slice,
                                        cudaMemcpyDeviceToDevice, c.stream));
    }
  p.finish();
}

// The fused RS / AR kernels' end: every rank's partial of this rank's rows (slice bytes each) sits in this
// rank's `inbox`, slot by source rank (stored by the kernel before its exit meeting); the reduce-scatter
// kernel sums them into `out` — or, for all-reduce, into every rank's copy of out, through `gather`
// (workspace) when out is not symmetric.
void reduce_staged(Call& c, char* inbox, uint64_t slice, void* out, char* gather, bool all_reduce) {
  const int me = c.rank.rank();
  coll::ReduceScatter x{};
  x.team = c.rank.view();
  x.slots = ops::meeting_slots(c.comm, c.rank);
  x.staging = coll::Rows{inbox, 0};
  x.staging_step = slice;
  x.rows = 1;
  x.row_bytes = slice;
  x.fanout = all_reduce;
  x.out = coll::Rows{
      (all_reduce ? (gather ? gather : static_cast<char*>(out)) + me * slice : static_cast<char*>(out)), 0};
  x.final_dst = gather ? static_cast<char*>(out) : nullptr;
  x.final_src = gather;
  const int blocks = ops::collective_blocks(c.rank, slice);
  constexpr auto kernel = &coll::reduce_scatter_kernel<Elem::kBF16, Reduce::kSum, true>;
  detail::preload<kernel>();
  kernel<<<blocks, 512, 0, c.stream>>>(x);
  WEFT_CUDA_CHECK(cudaGetLastError());
}

template <class Op, bool kKMajor>
void set_gemm_maps(typename Op::Params& p, const void* a, const void* b, int64_t m, int64_t n, int64_t k,
                   const void* c, CUtensorMapDataType c_type, uint32_t c_bytes, int64_t c_rows) {
  using Mainloop = typename Op::Mainloop;
  p.a = tma::make_map_2d({a, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, uint64_t(m), uint64_t(k), uint64_t(k) * 2},
                         Mainloop::kABoxRows, Mainloop::kABoxCols, "fused op: A");
  const uint64_t b_rows = kKMajor ? n : k, b_cols = kKMajor ? k : n;
  p.b = tma::make_map_2d({b, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, b_rows, b_cols, b_cols * 2},
                         Mainloop::kBBoxRows, Mainloop::kBBoxCols, "fused op: B");
  p.c = tma::make_map_2d({c, c_type, c_bytes, uint64_t(c_rows), uint64_t(n), uint64_t(n) * c_bytes},
                         Op::Epilogue::kBoxRows, Op::Epilogue::kBoxCols, "fused op: C");
  p.k_blocks = static_cast<int>((k + Op::kBK - 1) / Op::kBK);
  p.store_mode = lcsc::StoreMode::kStore;
}

template <class Op>
void set_schedule(lcsc::SchedulerParams& s, int64_t m, int64_t n) {
  s.tiles_m = static_cast<int>((m + Op::kBM - 1) / Op::kBM);
  s.tiles_n = static_cast<int>((n + Op::kBN - 1) / Op::kBN);
  s.cluster_m = Op::kClusterSize;
  s.group_m = 16;
}

enum class FusedOp { kAllGatherMatmul, kMatmulReduceScatter, kMatmulAllReduce };
// What choose() (below) decides for a call.
struct Choice {
  FusedPath path = FusedPath::kSequential;
  std::string why_not_fused;
  int comm_blocks = 0;
  int64_t chunk_rows = 0, chunks = 0;
  bool copy_engine = false;  // AG: FusedOptions::Gather resolved (comm_blocks 0 then)
  FusedOptions::Partials partials = FusedOptions::Partials::kStaged;  // RS / AR: options.partials resolved
};

// all_gather_matmul's communicator blocks, an even count: as asked, else the measured rule
// (ops::auto_ag_comm_blocks).
int ag_comm_blocks(const Rank& rank, int64_t n_per_rank, const FusedOptions& o, bool fp8 = false) {
  if (o.comm_blocks > 0) return (o.comm_blocks + 1) / 2 * 2;
  return ops::auto_ag_comm_blocks(rank.sm_budget(), n_per_rank, fp8);
}

// The counted RS / AR kernel's communicator blocks (ops/fused.cuh), at most one per half: the all-reduce
// pushes every half to W - 1 peers while the GEMM runs, and staged slots are read W times (W x the rows'
// bytes from HBM during the GEMM: at 4 GPUs and 8192^2 ~350 GB/s, ~50 GB/s a block with 8 units in flight
// per thread): a sixteenth of the SM budget (8 on a whole H100 / H200); the added reduce-scatter only copies
// its halves locally, 1 or 2.
int rs_counting_blocks(const Rank& rank, bool all_reduce, bool staged_slots, int64_t halves,
                       const FusedOptions& o) {
  const int blocks = o.comm_blocks > 0            ? o.comm_blocks
                     : all_reduce || staged_slots ? std::clamp(rank.sm_budget() / 16, 1, 8)
                                                  : std::clamp(rank.sm_budget() / 64, 1, 2);
  return static_cast<int>(std::clamp<int64_t>(halves, 1, blocks));
}

// The all-gather half of an AllGatherA op's params: the schedule's start (local rows first: the band of tile
// rows holding this rank's shard; then rank + 1's, which rank + 1 pushes here right after its own copy, and
// so on), its grid and sync, the shard's map and the chunks. A's elements `elem` bytes (`type` for TMA).
template <class Op>
void set_all_gather(Call& c, typename Op::Params& p, const void* a_shard, char* gathered, int64_t m,
                    int64_t k, CUtensorMapDataType type, uint32_t elem, const Choice& plan,
                    const FusedOptions& o, bool copy_self, Flags arrivals) {
  const int W = c.rank.world(), comm_blocks = plan.comm_blocks;
  const int band_units = p.sched.group_m / Op::kClusterSize;
  const int first_unit_row = static_cast<int>(c.rank.rank() * (m / W) / Op::kBM) / Op::kClusterSize;
  p.sched.start_unit = first_unit_row / band_units * band_units * p.sched.tiles_n;
  // The copy engine's gather leaves one SM to the side stream's waits (its first push to a peer waits for
  // the peer's previous call): a GEMM on every SM could hold them back behind its own waits for the pushes.
  p.sched.compute_blocks =
      c.compute_blocks<Op>(plan.copy_engine ? Op::kClusterSize : comm_blocks, p.sched.units(), o);
  p.sched.timeline = c.rank.view().timeline;
  p.sync = c.sync(p.sched.compute_blocks * Op::kConsumerWarpgroups + comm_blocks);
  p.a_local = tma::make_map_2d({a_shard, type, elem, uint64_t(m / W), uint64_t(k), uint64_t(k) * elem},
                               Op::Mainloop::kABoxRows, Op::Mainloop::kABoxCols, "all-gather: A shard");
  p.a_shard = static_cast<const char*>(a_shard);
  p.gathered = gathered;
  p.shard_rows = m / W;
  p.row_bytes = k * elem;
  p.chunk_rows = static_cast<int>(plan.chunk_rows);
  p.chunks = static_cast<int>(plan.chunks);
  p.copy_self = copy_self || (m / W) % Op::kBM != 0;
  p.arrivals = arrivals;
}

template <bool kKMajor, int kTileN>
void launch_ag_as(Call& c, const void* a_shard, const void* b, void* out, char* gathered, int64_t m,
                  int64_t n, int64_t k, const Choice& plan, const FusedOptions& o, bool copy_self,
                  Flags arrivals) {
  using Op = ops::AgGemmOp<kKMajor, 1, kTileN>;
  typename Op::Params p{};
  set_schedule<Op>(p.sched, m, n);
  set_gemm_maps<Op, kKMajor>(p, gathered, b, m, n, k, out, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, m);
  set_all_gather<Op>(c, p, a_shard, gathered, m, k, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, plan, o, copy_self,
                     arrivals);
  if (c.planned_kernel<Op>(p.sched, plan.comm_blocks)) return;
  lcsc::Launcher<Op>::launch(p, p.sched.compute_blocks + plan.comm_blocks, c.stream);
  WEFT_CUDA_CHECK(cudaGetLastError());
}

// 128 x 256 tiles unless options.tile_n says 128. Not weft::gemm's rule (the narrow tile where it fills the
// blocks' waves better): the fused kernel's tiles wait for their A chunks and a narrow tile reads each
// chunk twice as often; its rule picked 128 at 8192 x 8192 x 8192 on 4 x H100 and ran 573 us against the
// wide tile's 495 (bench/RESULTS.md, "all_gather_matmul's tile width").
template <bool kKMajor>
void launch_ag(Call& c, const void* a_shard, const void* b, void* out, char* gathered, int64_t m, int64_t n,
               int64_t k, const Choice& plan, const FusedOptions& o, bool copy_self, Flags arrivals) {
  // choose() checked the budget with the wide op, and its count of blocks serves both widths: one block an
  // SM at the same shared memory.
  static_assert(
      lcsc::kSmemBytes<ops::AgGemmOp<kKMajor, 1, 128>> == lcsc::kSmemBytes<ops::AgGemmOp<kKMajor, 1>>,
      "the two tile widths' kernels must need the same shared memory");
  if (o.tile_n == 128)
    launch_ag_as<kKMajor, 128>(c, a_shard, b, out, gathered, m, n, k, plan, o, copy_self, arrivals);
  else
    launch_ag_as<kKMajor, 256>(c, a_shard, b, out, gathered, m, n, k, plan, o, copy_self, arrivals);
}

// The RS GEMM, each tile into its owner's inbox (workspace, slot of this rank), then reduce_staged. The
// all-reduce's non-symmetric out gathers in the workspace after the inbox.
// Partials::kAddedAtOwner: each tile reduce-added into its owner's sum, zeroed before the kernel (the storers
// wait for the kernel's start meeting, which every rank reaches after its zeroing). Counted (launch_rs
// says where): the kernel's communicator blocks finish the op (ops/fused.cuh). Otherwise the all-reduce
// all-gathers the sums after the kernel (its entry meeting: every rank's adds have landed); the
// reduce-scatter meets and copies. Partials::kStagedProgressive, counted: staged as kStaged, and the
// communicator blocks sum each half's slots during the GEMM; no reduce kernel after it.
// The bf16 GEMM's operand maps for launch_rs_as.
template <bool kKMajor>
struct Bf16Maps {
  const void *a, *b;
  int64_t m, n, k;
  template <class Op>
  void set(typename Op::Params& p, const void* c, int64_t c_rows) const {
    set_gemm_maps<Op, kKMajor>(p, a, b, m, n, k, c, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, c_rows);
  }
};

// matmul_all_reduce with Partials::kSplitK (M <= ops::kSplitKMaxRows, any M): ops::SplitKAllReduceOp. As
// many K slices as fill the SM budget with items (at most kSplitKMaxSlices, W x S <= 32: a warp lane per
// slot flag; none empty); every rank derives the same from the shape, W and the budget.
template <bool kKMajor, int kTileN>
void launch_split_k_ar(Call& c, const void* a, const void* b, void* out, int64_t m, int64_t n, int64_t k,
                       const FusedOptions& o) {
  using Op = ops::SplitKAllReduceOp<kKMajor, kTileN>;
  typename Op::Params p{};
  const int W = c.rank.world();
  WEFT_CHECK(m <= ops::kSplitKMaxRows && W <= 32, c.where + "Partials::kSplitK takes M up to " +
                                                      std::to_string(ops::kSplitKMaxRows) +
                                                      " on up to 32 ranks");
  p.sched.tiles_m = static_cast<int>((m + Op::kBM - 1) / Op::kBM);
  p.sched.tiles_n = static_cast<int>((n + Op::kBN - 1) / Op::kBN);
  const int k_blocks = static_cast<int>((k + Op::kBK - 1) / Op::kBK);
  const int tiles = p.sched.tiles_m * p.sched.tiles_n;
  const int budget = c.compute_blocks<Op>(0, INT_MAX, o);
  const int slices = std::clamp(budget / tiles, 1, std::min({ops::kSplitKMaxSlices, 32 / W, k_blocks}));
  p.slice_blocks = (k_blocks + slices - 1) / slices;
  p.slices = (k_blocks + p.slice_blocks - 1) / p.slice_blocks;
  p.sched.slices = p.slices;
  const int64_t own_tiles = int64_t(p.sched.tiles_m) * ((p.sched.tiles_n + W - 1) / W);
  WEFT_CHECK(
      own_tiles * ops::kSplitKBands * W * p.slices <= ops::kSplitKSlotFlags &&
          int64_t(tiles) * ops::kSplitKBands * Op::kColumnParts <= ops::kSplitKBandFlags,
      c.where + "Partials::kSplitK: N = " + std::to_string(n) + " has more column tiles than its flags");
  p.sched.compute_blocks = std::min(budget, tiles * p.slices);
  p.sched.timeline = c.rank.view().timeline;
  set_gemm_maps<Op, kKMajor>(p, a, b, m, n, k, out, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, m);
  p.sync = c.sync(p.sched.compute_blocks * Op::kConsumerWarpgroups);
  p.m = static_cast<int>(m);
  p.n = static_cast<int>(n);
  p.slots = reinterpret_cast<float*>(c.workspace(
      uint64_t(own_tiles) * ops::kSplitKBands * W * p.slices * Op::kSlotFloats * 4, kSplitKSlots));
  p.result = reinterpret_cast<__nv_bfloat16*>(c.workspace(uint64_t(m) * n * 2, kSplitKResult));
  p.out = static_cast<__nv_bfloat16*>(out);
  p.slot_flags = c.comm.resources(c.rank, kSplitKLanded).flags;
  p.band_flags = c.comm.resources(c.rank, kSplitKSummed).flags;
  if (c.planning()) {
    c.plan->path = fused_path_name(FusedPath::kFused) + std::string(" (split-K, ") +
                   std::to_string(p.slices) + " slices of 128 x " + std::to_string(Op::kBN) +
                   " tiles, partials summed at the column tiles' owners)";
    c.plan->blocks = p.sched.compute_blocks;
    c.plan->cluster = 1;
    c.plan->smem_bytes = static_cast<int>(lcsc::kSmemBytes<Op>);
    c.plan->tiles = {Op::kBM, Op::kBN, Op::kBK, Op::kStages, 1, int64_t(tiles) * p.slices};
    return;
  }
  lcsc::Launcher<Op>::launch(p, p.sched.compute_blocks, c.stream);
  WEFT_CUDA_CHECK(cudaGetLastError());
}

// Op: an ops::ReduceScatterC; set_maps.set<Op>(p, c, c_rows) sets its GEMM's operand maps and fields (C's map
// at c, c_rows rows).
template <class Op, class SetMaps>
void launch_rs_as(Call& c, const SetMaps& set_maps, void* out, int64_t m, int64_t n, const FusedOptions& o,
                  bool all_reduce) {
  constexpr bool kCounted = Op::kCountedHalves;
  typename Op::Params p{};
  const int W = c.rank.world(), me = c.rank.rank();
  const int64_t rows = m / W;
  const uint64_t slice = uint64_t(rows) * n * 2;
  const bool added = o.partials == FusedOptions::Partials::kAddedAtOwner, counted = kCounted;
  const int comm_blocks = counted ? rs_counting_blocks(c.rank, all_reduce, !added, rows / 64, o)
                                  : Op::kClusterSize;  // block 0 meets
  const bool gathers = all_reduce && !added && !c.comm.in_heap(c.rank, out, m * n * 2);
  char* const out_bytes = static_cast<char*>(out);
  // Where this rank's tiles go at owner r (as seen here): its slot of r's inbox (staged), r's sum (added:
  // the counted all-reduce's sum is r's slice of out, else a workspace area of its own).
  char* inbox = nullptr;
  if (!added)
    inbox = c.workspace(W * slice + (gathers ? m * n * 2 : 0));
  else if (!(counted && all_reduce))
    inbox = c.workspace(slice, kRsSum);
  const auto owner_view = [&](int r) -> char* {
    if (!added) return c.rank.peer_ptr(inbox + me * slice, r);
    return counted && all_reduce ? c.rank.peer_ptr(out_bytes + r * slice, r) : c.rank.peer_ptr(inbox, r);
  };
  char* sum = added ? (counted && all_reduce ? out_bytes + me * slice : inbox) : nullptr;
  set_schedule<Op>(p.sched, m, n);
  set_maps.template set<Op>(p, owner_view(me), rows);
  for (int r = 0; r < W; ++r)
    p.owner[r] = tma::make_map_2d(
        {owner_view(r), CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, uint64_t(rows), uint64_t(n), uint64_t(n) * 2},
        Op::Epilogue::kBoxRows, Op::Epilogue::kBoxCols, "matmul_reduce_scatter: owner");
  if (added) p.store_mode = lcsc::StoreMode::kReduceAdd;
  // Every band of tiles spans all owners' rows where the rows split evenly and W is a power of two (each
  // rank then sends to every owner at once: up to 6% faster, session 7, bench/RESULTS.md). Uncounted, ranks
  // also start at different points of the tile sequence (rank r at (r + 1) / W of it: without the
  // interleave, the start of rank r + 1's rows); counted, all walk it in one order, so that each half is
  // complete soon after every rank has passed it, not only at the end.
  if ((W & (W - 1)) == 0 && p.sched.units_m() % W == 0) p.sched.parts_log2 = __builtin_ctz(unsigned(W));
  p.sched.start_unit = counted ? 0 : static_cast<int>(int64_t((me + 1) % W) * p.sched.units() / W);
  p.sched.compute_blocks = c.compute_blocks<Op>(comm_blocks, p.sched.units(), o);
  p.sched.timeline = c.rank.view().timeline;
  p.sync = c.sync(p.sched.compute_blocks * Op::kConsumerWarpgroups + comm_blocks);
  p.shard_rows = static_cast<int>(rows);
  p.fan_out = counted && all_reduce;
  if (counted) p.halves = c.comm.resources(c.rank, kRsHalves).flags;
  p.tiles_n = p.sched.tiles_n;
  p.n = n;
  p.sum = reinterpret_cast<__nv_bfloat16*>(sum);
  p.out = static_cast<__nv_bfloat16*>(out);
  p.staged_slots = counted && !added;
  p.staging = reinterpret_cast<const __nv_bfloat16*>(inbox);
  const Shape2D my_rows{size_t(rows), size_t(n)};
  if (c.planned_kernel<Op>(p.sched, comm_blocks)) {
    if (added && all_reduce && !counted)
      c.plan_more(all_gather_plan(c.comm, c.rank, inbox, out, my_rows, 0, DType::kBF16, c.stream));
    return;
  }
  if (added) WEFT_CUDA_CHECK(cudaMemsetAsync(sum, 0, slice, c.stream));
  lcsc::Launcher<Op>::launch(p, p.sched.compute_blocks + comm_blocks, c.stream);
  WEFT_CUDA_CHECK(cudaGetLastError());
  if (counted) return;
  if (!added) return reduce_staged(c, inbox, slice, out, gathers ? inbox + W * slice : nullptr, all_reduce);
  if (all_reduce) return all_gather(c.comm, c.rank, inbox, out, my_rows, 0, DType::kBF16, c.stream);
  launch_team_barrier(c.rank.view(), ops::meeting_slots(c.comm, c.rank)[0], c.stream);
  WEFT_CUDA_CHECK(cudaMemcpyAsync(out, inbox, slice, cudaMemcpyDeviceToDevice, c.stream));
}

// Where Partials::kSummedInEpilogue's kernel runs: shards of whole 128-row tiles (a tile has one owner), the
// tiles within their flags and, for the all-reduce, a symmetric out (its slice stored into every rank's).
bool summed_runs(const Call& c, const void* out, int64_t m, int64_t n, const FusedOptions& o,
                 bool all_reduce) {
  const int64_t rows = m / c.rank.world(), tile_n = o.tile_n == 128 ? 128 : 256;
  return m % c.rank.world() == 0 && rows % 128 == 0 &&
         rows / 128 * ((n + tile_n - 1) / tile_n) <= ops::kRsTileFlags &&
         (!all_reduce || c.comm.in_heap(c.rank, out, m * n * 2));
}

// Partials::kSummedInEpilogue (ops::EpilogueSummedC): every tile computed by every rank in the owners'
// rounds (lcsc::OwnerRoundsScheduler), a peer's stored into this rank's slot of its inbox (workspace, as
// kStaged's) and counted there, an own tile summed with the peers' partials in its epilogue and stored into
// out, or (all-reduce, symmetric out) into this rank's slice of every rank's out; no kernel after it.
// launch_rs checks what it needs: shards of whole 128-row tiles, the tiles within their flags.
template <bool kKMajor, int kTileN>
void launch_rs_summed(Call& c, const Bf16Maps<kKMajor>& maps, void* out, int64_t m, int64_t n,
                      const FusedOptions& o, bool all_reduce) {
  using Op = ops::RsSummedGemmOp<kKMajor, kTileN>;
  // rs_why_not and choose() checked the SM budget with the staged op: one block an SM at the same shared
  // memory.
  static_assert(lcsc::kSmemBytes<Op> == lcsc::kSmemBytes<ops::RsGemmOp<kKMajor, 1>>,
                "the summed and the staged kernels must need the same shared memory");
  typename Op::Params p{};
  const int W = c.rank.world(), me = c.rank.rank();
  const int64_t rows = m / W;
  const uint64_t slice = uint64_t(rows) * n * 2;
  constexpr int comm_blocks = 1;  // block 0 meets (the all-reduce's: at the end too)
  char* const inbox = c.workspace(W * slice);
  char* const my_slot = inbox + me * slice;
  const auto map_rows = [&](void* at, const char* what) {  // [rows, n] bf16 at `at`, the epilogue's box
    return tma::make_map_2d(
        {at, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, uint64_t(rows), uint64_t(n), uint64_t(n) * 2},
        Op::Epilogue::kBoxRows, Op::Epilogue::kBoxCols, what);
  };
  set_schedule<Op>(p.sched, m, n);
  maps.template set<Op>(p, my_slot, rows);  // (the GEMM's own C map goes unused)
  for (int r = 0; r < W; ++r)
    p.owner[r] = map_rows(c.rank.peer_ptr(my_slot, r), "matmul_reduce_scatter: owner");
  p.dests = all_reduce ? W : 1;
  for (int i = 0; i < p.dests; ++i)
    p.dest[i] =
        map_rows(all_reduce ? c.rank.peer_ptr(static_cast<char*>(out) + me * slice, (me + 1 + i) % W) : out,
                 "matmul_reduce_scatter: out");
  p.sched.world = W;
  p.sched.rank = me;
  p.sched.shard_tiles_m = static_cast<int>(rows / Op::kBM);
  // Bands of a shard's tile rows: every round spans the W owners' rows, so W x group_m A row blocks in
  // flight, as the GEMM's 16.
  p.sched.group_m = std::max(1, 16 / W);
  p.sched.compute_blocks = c.compute_blocks<Op>(comm_blocks, p.sched.units(), o);
  // The own tiles two waves of compute blocks (2 C positions, W a round) after the peers' partials of them.
  p.sched.delay = (2 * p.sched.compute_blocks + W - 1) / W;
  p.sched.timeline = c.rank.view().timeline;
  p.sync = c.sync(p.sched.compute_blocks * Op::kConsumerWarpgroups + comm_blocks);
  p.shard_rows = static_cast<int>(rows);
  p.tiles = c.comm.resources(c.rank, kRsTiles).flags;
  p.inbox = tma::make_map_2d(
      {inbox, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, uint64_t(W * rows), uint64_t(n), uint64_t(n) * 2},
      Op::Epilogue::kBoxRows, Op::Epilogue::kBoxCols, "matmul_reduce_scatter: inbox");
  p.fan_out = all_reduce;
  if (c.planned_kernel<Op>(p.sched, comm_blocks)) return;
  lcsc::Launcher<Op>::launch(p, p.sched.compute_blocks + comm_blocks, c.stream);
  WEFT_CUDA_CHECK(cudaGetLastError());
}

// Counted where the halves fit their flags and, for the all-reduce, out is symmetric (its slice is the sum;
// as every op's symmetric buffers, out must then be symmetric on every rank, at one offset). check_operands
// has required 16-byte alignment. Partials::kSummedInEpilogue where its shards are whole 128-row tiles, its
// tiles fit their flags and (all-reduce) out is symmetric; elsewhere it, as the counted ways, falls back
// to kStaged.
template <bool kKMajor>
void launch_rs(Call& c, const void* a, const void* b, void* out, int64_t m, int64_t n, int64_t k,
               const FusedOptions& o, bool all_reduce) {
  using Partials = FusedOptions::Partials;
  const int64_t rows = m / c.rank.world();
  const bool sym_ok = !all_reduce || c.comm.in_heap(c.rank, out, m * n * 2);
  const Bf16Maps<kKMajor> maps{a, b, m, n, k};
  if (o.partials == Partials::kSummedInEpilogue && summed_runs(c, out, m, n, o, all_reduce))
    return o.tile_n == 128 ? launch_rs_summed<kKMajor, 128>(c, maps, out, m, n, o, all_reduce)
                           : launch_rs_summed<kKMajor, 256>(c, maps, out, m, n, o, all_reduce);
  const bool counted =
      (o.partials == Partials::kAddedAtOwner || o.partials == Partials::kStagedProgressive) &&
      rows / 64 <= ops::kRsHalfFlags && sym_ok;
  static_assert(ops::RsGemmOp<kKMajor, 1, true>::staged_sum_fits(ops::kFusedMaxWorld),
                "the staged sums' buffers must fit a communicator block's shared memory");
  if (counted)
    launch_rs_as<ops::RsGemmOp<kKMajor, 1, true>>(c, maps, out, m, n, o, all_reduce);
  else if (o.store_ring == 5)
    launch_rs_as<ops::RsGemmOp<kKMajor, 1, false, true>>(c, maps, out, m, n, o, all_reduce);
  else
    launch_rs_as<ops::RsGemmOp<kKMajor, 1, false>>(c, maps, out, m, n, o, all_reduce);
}

// The storer writes whole 64-row halves of a tile into one owner's slot: shards of whole halves only.
// Op: the kernel's op (its grid under the SM budget).
template <class Op = ops::RsGemmOp<true, 1>>
std::string rs_why_not(const Call& c, int64_t m) {
  const int64_t rows = m / c.rank.world();
  if (c.rank.world() > ops::kFusedMaxWorld) return "world size above " + std::to_string(ops::kFusedMaxWorld);
  if (m % c.rank.world() != 0)
    return "M = " + std::to_string(m) + " is not divisible by the world size " +
           std::to_string(c.rank.world());
  if (rows % 64 != 0) return "M / world size = " + std::to_string(rows) + " is not a multiple of 64";
  if (rows > INT32_MAX) return "M / world size above 2^31";
  return c.why_not_in_budget<Op>(Op::kClusterSize);
}

// all_gather_matmul's A chunks: whole 128-row blocks, at least min_rows rows, at most kFusedChunkFlags flags
// in all.
void ag_chunks(int world, int64_t rows, int64_t min_rows, int64_t& chunk_rows, int64_t& chunks) {
  const int64_t blocks = (rows + 127) / 128, per_shard = std::max<int64_t>(1, ops::kFusedChunkFlags / world);
  chunk_rows = 128 * std::max((blocks + per_shard - 1) / per_shard, (min_rows + 127) / 128);
  chunks = (rows + chunk_rows - 1) / chunk_rows;
}

// Every choice a call makes before it launches anything, in one place: the path, why the fused kernel
// cannot run here ("" when it can), the fused kernel's communicator blocks and A chunks, and RS / AR's way of
// summing the partials. out: RS / AR's (Partials::kAuto's choice looks at whether it is symmetric).
// The options' values every path reads (the split-K path, which makes no choice, as well).
void check_options(const Call& c, const FusedOptions& o) {
  WEFT_CHECK(o.comm_blocks >= 0 && o.comm_blocks <= 32, c.where + "options.comm_blocks must be 0..32");
  WEFT_CHECK(o.tile_n == 0 || o.tile_n == 128 || o.tile_n == 256,
             c.where + "options.tile_n must be 0 (auto), 128 or 256, not " + std::to_string(o.tile_n));
  WEFT_CHECK(o.store_ring == 0 || o.store_ring == 2 || o.store_ring == 5,
             c.where + "options.store_ring must be 0 (auto), 2 or 5, not " + std::to_string(o.store_ring));
}

Choice choose(const Call& c, FusedOp op, int64_t m, int64_t n, int64_t k, const FusedOptions& o,
              const void* out = nullptr) {
  check_options(c, o);
  const int W = c.rank.world();
  Choice plan;
  bool gather_auto = false;  // AG: kAuto's rule took the copy engine's gather (and so the fused kernel)
  if (op == FusedOp::kAllGatherMatmul) {
    // The copy engine's gather where asked, or kAuto's measured rows (ops::kCopyEngineGatherRules) take it,
    // and it runs; its chunks of at least 4 MiB (a push costs a copy and a stream write).
    const bool runs = c.comm.ranks_per_gpu() == 1 && (m / W) % 128 == 0;
    gather_auto = runs && o.gather == FusedOptions::Gather::kAuto && ops::auto_gathers_by_copy_engine(W, m);
    plan.copy_engine = runs && (o.gather == FusedOptions::Gather::kCopyEngine || gather_auto);
    ag_chunks(W, m / W, plan.copy_engine ? (4 << 20) / (k * 2) : 0, plan.chunk_rows, plan.chunks);
    plan.comm_blocks = plan.copy_engine ? 0 : ag_comm_blocks(c.rank, n, o);
    const bool fits = W * plan.chunks <= ops::kFusedChunkFlags && plan.chunk_rows <= INT32_MAX;
    plan.why_not_fused =
        fits ? c.why_not_in_budget<ops::AgGemmOp<true, 1>>(plan.comm_blocks) : "more A chunks than flags";
  } else {
    plan.comm_blocks = ops::RsGemmOp<true, 1>::kClusterSize;  // block 0 meets
    plan.why_not_fused = rs_why_not(c, m);
    plan.partials = o.partials;
  }
  // Partials::kAuto: summed in the epilogue where the measured rule (ops::kSummedPartialsRules) and the
  // kernel's needs allow (store_ring 5 is the staged kernel's option: kStaged there), and then the fused
  // kernel at every M; kStaged elsewhere.
  using Partials = FusedOptions::Partials;
  const bool all_reduce = op == FusedOp::kMatmulAllReduce;
  const bool summed_auto = op != FusedOp::kAllGatherMatmul && o.partials == Partials::kAuto &&
                           o.store_ring != 5 && ops::auto_sums_in_epilogue(all_reduce, W) &&
                           summed_runs(c, out, m, n, o, all_reduce);
  if (plan.partials == Partials::kAuto)
    plan.partials = summed_auto ? Partials::kSummedInEpilogue : Partials::kStaged;
  const FusedPath rule = (summed_auto || gather_auto) && plan.why_not_fused.empty()
                             ? FusedPath::kFused
                             : ops::auto_path(op == FusedOp::kAllGatherMatmul, m, n, k, W);
  plan.path = c.path(o, m, plan.why_not_fused, rule);
  if (c.planning()) {
    c.plan->why_not = plan.why_not_fused.empty() ? "" : "fused kernel: " + plan.why_not_fused;
    if (plan.path == FusedPath::kFused) {
      c.plan->chunk_rows = plan.chunk_rows;
      c.plan->chunks = plan.chunks;
    }
  }
  return plan;
}

// FusedOptions::Gather::kCopyEngine: the fused kernel (`launch(arrivals)`, on the caller's stream) waits for
// each chunk's count while the copy stream pushes this rank's shard to each peer, chunk after chunk, to rank
// - 1 first (whose schedule takes this rank's rows right after its own), each chunk followed by its count
// there; then this rank's own rows of g where the caller takes them (the kernel reads its own shard in
// place). The pipeline's flags and handshake (CopyPipeline): a peer is pushed to once it consumed the
// previous call's pushes, and the counts are cleared after the kernel.
template <class Launch>
void copy_engine_gather(Call& c, const void* a_shard, char* g, int64_t m, int64_t k, const Choice& plan,
                        bool copy_self, Launch&& launch) {
  const int W = c.rank.world(), me = c.rank.rank();
  const int64_t rows = m / W, row_bytes = k * 2;
  CopyPipeline p(c, kAgPipeline);
  launch(p.arrival_flags());
  const char* from = static_cast<const char*>(a_shard);
  for (int s = 1; s < W; ++s)
    for (int64_t j = 0; j < plan.chunks; ++j) {
      const int64_t r0 = j * plan.chunk_rows, nr = std::min(plan.chunk_rows, rows - r0);
      p.push((me - s + W) % W, g + (me * rows + r0) * row_bytes, from + r0 * row_bytes,
             uint64_t(nr * row_bytes), static_cast<uint32_t>(j + 1));
    }
  if (copy_self) p.local_copy(g + me * rows * row_bytes, a_shard, uint64_t(rows * row_bytes));
  p.finish();
}

// The calls' bodies, which also plan (Call::plan set: every path stops before it launches anything).
FusedPath run_all_gather_matmul(Call& c, const void* a_shard, const void* b, void* out, void* gathered_a,
                                int64_t m, int64_t n, int64_t k, BLayout layout, const FusedOptions& o) {
  Communicator& comm = c.comm;
  Rank& rank = c.rank;
  const int W = rank.world();
  const int64_t rows = m / W;
  c.check_operands(a_shard, "a_shard", rows, b, out, m, m, n, k, layout);
  if (gathered_a) c.check_buffer(gathered_a, "gathered_a", m * k * 2);
  const Choice plan = choose(c, FusedOp::kAllGatherMatmul, m, n, k, o);
  const FusedPath path = plan.path;
  const bool sym_gathered = gathered_a && comm.in_heap(rank, gathered_a, m * k * 2);
  if (path == FusedPath::kPipelined) {
    pipelined_ag(c, a_shard, b, out, gathered_a, m, n, k, layout);
    return path;
  }
  if (path == FusedPath::kSequential) {
    char* g = gathered_a ? static_cast<char*>(gathered_a) : c.workspace(m * k * 2);
    const Shape2D shard{size_t(rows), size_t(k)};
    if (c.planning()) {
      c.plan_sequential(all_gather_plan(comm, rank, a_shard, g, shard, 0, DType::kBF16, c.stream));
      return path;
    }
    all_gather(comm, rank, a_shard, g, shard, 0, DType::kBF16, c.stream);
    c.gemm_into(g, b, out, m, n, k, layout);
    return path;
  }
  // The copy engine pushes into the pipeline's own area, never the caller's gathered_a: its handshake says a
  // peer finished its previous call of the pipeline, not that it reached this call (the communicator
  // blocks' meeting does).
  char* g = plan.copy_engine ? c.workspace(m * k * 2, kAgPipeline)
            : sym_gathered   ? static_cast<char*>(gathered_a)
                             : c.workspace(m * k * 2);
  // The shard into this rank's own rows of g only where the caller takes the gathered A.
  auto launch = [&](Flags arrivals) {
    if (layout == BLayout::kNK)
      launch_ag<true>(c, a_shard, b, out, g, m, n, k, plan, o, gathered_a != nullptr, arrivals);
    else
      launch_ag<false>(c, a_shard, b, out, g, m, n, k, plan, o, gathered_a != nullptr, arrivals);
  };
  if (plan.copy_engine && !c.planning())
    copy_engine_gather(c, a_shard, g, m, k, plan, gathered_a != nullptr, launch);
  else
    launch(Flags{});
  if (gathered_a && g != gathered_a && !c.planning())
    WEFT_CUDA_CHECK(cudaMemcpyAsync(gathered_a, g, m * k * 2, cudaMemcpyDeviceToDevice, c.stream));
  return path;
}

// matmul_reduce_scatter (all_reduce false) and matmul_all_reduce.
FusedPath run_matmul_reduce(Call& c, const void* a, const void* b, void* out, int64_t m, int64_t n, int64_t k,
                            BLayout layout, const FusedOptions& options, bool sum_everywhere) {
  Communicator& comm = c.comm;
  Rank& rank = c.rank;
  const int64_t rows = m / rank.world();
  c.check_operands(a, "a", m, b, out, sum_everywhere ? m : rows, m, n, k, layout);
  if (options.partials == FusedOptions::Partials::kSplitK) {
    WEFT_CHECK(sum_everywhere, c.where + "Partials::kSplitK is matmul_all_reduce's (at decode sizes)");
    check_options(c, options);
    // Auto: 128 x 256 items for one 16-row band (M <= 16), where their wider stages streamed the weight
    // faster (2 x H200, N 8192, K 7168: 44-46 us against 52-58); 128 x 128 above (M 64, 256: 53 / 70 us
    // against 57 / 82), bench/RESULTS.md.
    const bool wide = options.tile_n == 256 || (options.tile_n == 0 && m <= 16);
    if (layout == BLayout::kNK)
      wide ? launch_split_k_ar<true, 256>(c, a, b, out, m, n, k, options)
           : launch_split_k_ar<true, 128>(c, a, b, out, m, n, k, options);
    else
      wide ? launch_split_k_ar<false, 256>(c, a, b, out, m, n, k, options)
           : launch_split_k_ar<false, 128>(c, a, b, out, m, n, k, options);
    return FusedPath::kFused;
  }
  const Choice plan = choose(c, sum_everywhere ? FusedOp::kMatmulAllReduce : FusedOp::kMatmulReduceScatter, m,
                             n, k, options, out);
  const FusedPath path = plan.path;
  FusedOptions o = options;
  o.partials = plan.partials;
  if (path == FusedPath::kPipelined) {
    pipelined_rs(c, a, b, out, m, n, k, layout, sum_everywhere, o.pipeline_pieces);
    return path;
  }
  if (path == FusedPath::kSequential && sum_everywhere) {
    const size_t count = size_t(m) * n;
    if (c.planning()) {
      c.plan_sequential(all_reduce_plan(comm, rank, out, out, count, DType::kBF16, ReduceOp::kSum, c.stream));
      return path;
    }
    c.gemm_into(a, b, out, m, n, k, layout);
    all_reduce(comm, rank, out, out, count, DType::kBF16, ReduceOp::kSum, c.stream);
    return path;
  }
  if (path == FusedPath::kSequential) {
    char* tmp = c.workspace(m * n * 2);  // symmetric: reduce_scatter reads it in place
    const Shape2D slice{size_t(rows), size_t(n)};
    if (c.planning()) {
      c.plan_sequential(
          reduce_scatter_plan(comm, rank, tmp, out, slice, 0, DType::kBF16, ReduceOp::kSum, c.stream));
      return path;
    }
    c.gemm_into(a, b, tmp, m, n, k, layout);
    reduce_scatter(comm, rank, tmp, out, slice, 0, DType::kBF16, ReduceOp::kSum, c.stream);
    return path;
  }
  if (layout == BLayout::kNK)
    launch_rs<true>(c, a, b, out, m, n, k, o, sum_everywhere);
  else
    launch_rs<false>(c, a, b, out, m, n, k, o, sum_everywhere);
  return path;
}

// ---- all_gather_scaled_matmul: the FP8 GEMM gathering A (ops::AllGatherA on ops::Fp8GemmOp) -------------
// An FP8 team op's operands: a (all_gather_scaled_matmul: this rank's shard) and b FP8, their scales.
struct Fp8MmArgs {
  const void* a;
  const float* scale_a;
  const void* b;
  const float* scale_b;
  void* out;
  int64_t m, n, k;
  Fp8Type type;
  Fp8Scaling scaling;
  // Scales a row of A carries (all_gather_scaled_matmul): one (kRowCol) or one per 128 of K (kBlock).
  int scale_cols() const {
    return scaling == Fp8Scaling::kRowCol ? 1 : static_cast<int>((k + kFp8ScaleBlock - 1) / kFp8ScaleBlock);
  }
};

template <Fp8Scaling kScaling, bool kE5M2>
void launch_ag_fp8(Call& c, const Fp8MmArgs& x, char* gathered, float* scales, const Choice& plan,
                   const FusedOptions& o) {
  using Op = ops::AllGatherA<ops::Fp8GemmOp<__nv_bfloat16, kScaling, kE5M2, /*kScalesFromPeers=*/true>>;
  using Mainloop = typename Op::Mainloop;
  constexpr CUtensorMapDataType kU8 = CU_TENSOR_MAP_DATA_TYPE_UINT8;
  typename Op::Params p{};
  set_schedule<Op>(p.sched, x.m, x.n);
  p.a = tma::make_map_2d({gathered, kU8, 1, uint64_t(x.m), uint64_t(x.k), uint64_t(x.k)}, Mainloop::kABoxRows,
                         Mainloop::kABoxCols, "all_gather_scaled_matmul: A");
  p.b = tma::make_map_2d({x.b, kU8, 1, uint64_t(x.n), uint64_t(x.k), uint64_t(x.k)}, Mainloop::kBBoxRows,
                         Mainloop::kBBoxCols, "all_gather_scaled_matmul: B");
  p.c = tma::make_map_2d(
      {x.out, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, uint64_t(x.m), uint64_t(x.n), uint64_t(x.n) * 2},
      Op::Epilogue::kBoxRows, Op::Epilogue::kBoxCols, "all_gather_scaled_matmul: out");
  p.m = static_cast<int>(x.m);
  p.n = static_cast<int>(x.n);
  p.k_blocks = static_cast<int>((x.k + Op::kBK - 1) / Op::kBK);
  p.scale_a = scales;  // the gathered rows' scales
  p.scale_b = x.scale_b;
  p.store_mode = lcsc::StoreMode::kStore;
  set_all_gather<Op>(c, p, x.a, gathered, x.m, x.k, kU8, 1, plan, o, /*copy_self=*/true,  // the rows' scales
                     Flags{});
  p.scale_shard = x.scale_a;
  p.scale_gathered = scales;
  p.scale_cols = x.scale_cols();
  if (c.planned_kernel<Op>(p.sched, plan.comm_blocks)) return;
  // This rank's own rows read their scales among the gathered ones too (its A rows it reads in place).
  const int64_t rows = x.m / c.rank.world();
  WEFT_CUDA_CHECK(cudaMemcpyAsync(scales + c.rank.rank() * rows * p.scale_cols, x.scale_a,
                                  rows * p.scale_cols * sizeof(float), cudaMemcpyDeviceToDevice, c.stream));
  lcsc::Launcher<Op>::launch(p, p.sched.compute_blocks + plan.comm_blocks, c.stream);
  WEFT_CUDA_CHECK(cudaGetLastError());
}

// What every FP8 team op checks on every path: the type, K a multiple of 16 (FP8 rows of 16-byte multiples),
// no pipeline, the buffers' sizes (a: `a_rows` rows, out: `out_rows`; scales as gemm_fp8 reads them for a's
// rows), then the FP8 GEMM's own checks with its messages.
void check_fp8(const Call& c, const Fp8MmArgs& x, const FusedOptions& o, int64_t a_rows, int64_t out_rows) {
  const std::string& where = c.where;
  WEFT_CHECK(x.type == Fp8Type::kE4M3 || x.type == Fp8Type::kE5M2, where + "type must be kE4M3 or kE5M2");
  WEFT_CHECK(x.k % 16 == 0,
             where + "K = " + std::to_string(x.k) +
                 " must be a multiple of 16 (FP8 rows of 16-byte multiples, which TMA requires)");
  WEFT_CHECK(o.mode != FusedOptions::Mode::kPipelined,
             where + "has no copy-engine pipeline: use Mode::kAuto, kFused or kSequential");
  const int64_t groups = (x.k + kFp8ScaleBlock - 1) / kFp8ScaleBlock;
  const bool tensor = x.scaling == Fp8Scaling::kTensor, rowcol = x.scaling == Fp8Scaling::kRowCol;
  const int64_t a_scales = tensor ? 1 : rowcol ? a_rows : a_rows * groups;
  const int64_t b_scales = tensor ? 1 : rowcol ? x.n : (x.n + kFp8ScaleBlock - 1) / kFp8ScaleBlock * groups;
  c.check_buffer(x.a, "a", a_rows * x.k);
  c.check_buffer(x.b, "b", x.n * x.k);
  c.check_buffer(x.out, "out", out_rows * x.n * 2);
  c.check_buffer(x.scale_a, "scale_a", a_scales * 4, 4);
  c.check_buffer(x.scale_b, "scale_b", b_scales * 4, 4);
  gemm_fp8_plan(x.m, x.n, x.k, x.type, Fp8Scales{x.scaling, nullptr, nullptr}, DType::kBF16);
}

FusedPath run_all_gather_scaled_matmul(Call& c, const Fp8MmArgs& x, const FusedOptions& o) {
  WEFT_CHECK(x.scaling == Fp8Scaling::kRowCol || x.scaling == Fp8Scaling::kBlock,
             c.where +
                 "per-tensor scales are refused: each rank's shard would bring its own; quantize A per row "
                 "(Fp8Scaling::kRowCol) or per 1 x 128 group (kBlock), its scales then travel with its rows");
  check_fp8(c, x, o, x.m / c.rank.world(), x.m);
  const int W = c.rank.world();
  const int64_t rows = x.m / W, cols = x.scale_cols();
  Choice plan;
  ag_chunks(W, rows, 0, plan.chunk_rows, plan.chunks);
  plan.comm_blocks = ag_comm_blocks(c.rank, x.n, o, /*fp8=*/true);
  using AnyOp = ops::AllGatherA<ops::Fp8GemmOp<__nv_bfloat16, Fp8Scaling::kBlock, false, true>>;  // same grid
  const bool fits = W * plan.chunks <= ops::kFusedChunkFlags;
  plan.why_not_fused = fits ? c.why_not_in_budget<AnyOp>(plan.comm_blocks) : "more A chunks than flags";
  plan.path = c.path(o, x.m, plan.why_not_fused, FusedPath::kFused);
  if (c.planning()) c.plan->why_not = plan.why_not_fused.empty() ? "" : "fused kernel: " + plan.why_not_fused;
  // The gathered A and its rows' scales, in the symmetric workspace (peers write into them).
  const uint64_t a_bytes = ops::bytes_carved_by([&](ops::WorkspaceLayout& w) { w.take(x.m * x.k); });
  char* g = c.workspace(a_bytes + x.m * cols * 4);
  float* scales = reinterpret_cast<float*>(g + a_bytes);
  if (plan.path == FusedPath::kSequential) {
    const Shape2D a_rows{size_t(rows), size_t(x.k / 2)}, s_rows{size_t(rows), size_t(cols)};
    if (c.planning()) {  // A's bytes travel as bf16 pairs
      c.plan_sequential(all_gather_plan(c.comm, c.rank, x.a, g, a_rows, 0, DType::kBF16, c.stream));
      c.plan_more(all_gather_plan(c.comm, c.rank, x.scale_a, scales, s_rows, 0, DType::kFP32, c.stream));
      return plan.path;
    }
    all_gather(c.comm, c.rank, x.a, g, a_rows, 0, DType::kBF16, c.stream);
    all_gather(c.comm, c.rank, x.scale_a, scales, s_rows, 0, DType::kFP32, c.stream);
    GemmOptions go;
    go.max_blocks = c.rank.sm_budget();
    go.timeline = c.rank.view().timeline;
    gemm_fp8(g, x.b, x.out, x.m, x.n, x.k, x.type, Fp8Scales{x.scaling, scales, x.scale_b}, DType::kBF16,
             c.stream, go);
    return plan.path;
  }
  if (c.planning()) {
    c.plan->chunk_rows = plan.chunk_rows;
    c.plan->chunks = plan.chunks;
  }
  const bool e5 = x.type == Fp8Type::kE5M2;
  if (x.scaling == Fp8Scaling::kRowCol)
    e5 ? launch_ag_fp8<Fp8Scaling::kRowCol, true>(c, x, g, scales, plan, o)
       : launch_ag_fp8<Fp8Scaling::kRowCol, false>(c, x, g, scales, plan, o);
  else
    e5 ? launch_ag_fp8<Fp8Scaling::kBlock, true>(c, x, g, scales, plan, o)
       : launch_ag_fp8<Fp8Scaling::kBlock, false>(c, x, g, scales, plan, o);
  return plan.path;
}

// ---- scaled_matmul_reduce_scatter / all_reduce: the FP8 GEMM's scaled bf16 tiles to their owners ----------
// (ops::ReduceScatterC on ops::Fp8GemmOp; each rank's partial product is scaled by its own scales before the
// sum, so every scaling applies).
// The FP8 GEMM's operand maps and fields for launch_rs_as (its m and n: the GEMM's, hidden in the op's
// Params by the reduce-scatter's own n).
struct Fp8Maps {
  const Fp8MmArgs& x;
  template <class Op>
  void set(typename Op::Params& p, const void* c, int64_t c_rows) const {
    using Mainloop = typename Op::Mainloop;
    constexpr CUtensorMapDataType kU8 = CU_TENSOR_MAP_DATA_TYPE_UINT8;
    typename Op::Base::Params& g = p;
    g.a = tma::make_map_2d({x.a, kU8, 1, uint64_t(x.m), uint64_t(x.k), uint64_t(x.k)}, Mainloop::kABoxRows,
                           Mainloop::kABoxCols, "scaled matmul: A");
    g.b = tma::make_map_2d({x.b, kU8, 1, uint64_t(x.n), uint64_t(x.k), uint64_t(x.k)}, Mainloop::kBBoxRows,
                           Mainloop::kBBoxCols, "scaled matmul: B");
    g.c = tma::make_map_2d(
        {c, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, uint64_t(c_rows), uint64_t(x.n), uint64_t(x.n) * 2},
        Op::Epilogue::kBoxRows, Op::Epilogue::kBoxCols, "scaled matmul: C");
    g.m = static_cast<int>(x.m);
    g.n = static_cast<int>(x.n);
    g.k_blocks = static_cast<int>((x.k + Op::kBK - 1) / Op::kBK);
    g.scale_a = x.scale_a;
    g.scale_b = x.scale_b;
    g.store_mode = lcsc::StoreMode::kStore;
  }
};

// The FP8 reduce-scatter's kernel: one promotion register tile (with two, its storer's registers spill).
template <Fp8Scaling kScaling, bool kE5M2>
using RsFp8GemmOp = ops::ReduceScatterC<
    ops::Fp8GemmOp<__nv_bfloat16, kScaling, kE5M2, false, lcsc::GemmTileScheduler, /*overlapped=*/false>>;

template <Fp8Scaling kScaling>
void launch_rs_fp8(Call& c, const Fp8MmArgs& x, const FusedOptions& o, bool all_reduce) {
  if (x.type == Fp8Type::kE5M2)
    launch_rs_as<RsFp8GemmOp<kScaling, true>>(c, Fp8Maps{x}, x.out, x.m, x.n, o, all_reduce);
  else
    launch_rs_as<RsFp8GemmOp<kScaling, false>>(c, Fp8Maps{x}, x.out, x.m, x.n, o, all_reduce);
}

FusedPath run_scaled_matmul_reduce(Call& c, const Fp8MmArgs& x, const FusedOptions& o, bool all_reduce) {
  WEFT_CHECK(
      o.partials == FusedOptions::Partials::kAuto || o.partials == FusedOptions::Partials::kStaged,
      c.where + "takes FusedOptions::Partials::kAuto or kStaged only (the partials staged at their owners)");
  check_fp8(c, x, o, x.m, all_reduce ? x.m : x.m / c.rank.world());
  const std::string why_not = rs_why_not<RsFp8GemmOp<Fp8Scaling::kBlock, false>>(c, x.m);
  const FusedPath path = c.path(o, x.m, why_not, FusedPath::kFused);
  if (c.planning()) c.plan->why_not = why_not.empty() ? "" : "fused kernel: " + why_not;
  if (path == FusedPath::kFused) {
    if (x.scaling == Fp8Scaling::kTensor)
      launch_rs_fp8<Fp8Scaling::kTensor>(c, x, o, all_reduce);
    else if (x.scaling == Fp8Scaling::kRowCol)
      launch_rs_fp8<Fp8Scaling::kRowCol>(c, x, o, all_reduce);
    else
      launch_rs_fp8<Fp8Scaling::kBlock>(c, x, o, all_reduce);
    return path;
  }
  // Sequential, as the bf16 ops: the all-reduce's product in out and summed in place (all_reduce takes the
  // shared workspace for itself, so the product must not sit there); the reduce-scatter's in the workspace
  // (symmetric: reduce_scatter reads it in place, which it guards), then weft's reduce_scatter.
  const Shape2D slice{size_t(x.m / c.rank.world()), size_t(x.n)};
  const size_t count = size_t(x.m) * x.n;
  char* product = all_reduce ? static_cast<char*>(x.out) : c.workspace(x.m * x.n * 2);
  if (c.planning()) {
    c.plan_sequential(all_reduce ? all_reduce_plan(c.comm, c.rank, x.out, x.out, count, DType::kBF16,
                                                   ReduceOp::kSum, c.stream)
                                 : reduce_scatter_plan(c.comm, c.rank, product, x.out, slice, 0, DType::kBF16,
                                                       ReduceOp::kSum, c.stream));
    return path;
  }
  GemmOptions go;
  go.max_blocks = c.rank.sm_budget();
  go.timeline = c.rank.view().timeline;
  gemm_fp8(x.a, x.b, product, x.m, x.n, x.k, x.type, Fp8Scales{x.scaling, x.scale_a, x.scale_b}, DType::kBF16,
           c.stream, go);
  if (all_reduce)
    weft::all_reduce(c.comm, c.rank, x.out, x.out, count, DType::kBF16, ReduceOp::kSum, c.stream);
  else
    reduce_scatter(c.comm, c.rank, product, x.out, slice, 0, DType::kBF16, ReduceOp::kSum, c.stream);
  return path;
}

}  // namespace

FusedPath all_gather_matmul(Communicator& comm, Rank& rank, const void* a_shard, const void* b, void* out,
                            void* gathered_a, int64_t m, int64_t n, int64_t k, BLayout layout,
                            cudaStream_t stream, const FusedOptions& o) {
  Call c(comm, rank, stream, "all_gather_matmul", m, n, k, true);
  return run_all_gather_matmul(c, a_shard, b, out, gathered_a, m, n, k, layout, o);
}
Plan all_gather_matmul_plan(Communicator& comm, Rank& rank, const void* a_shard, const void* b,
                            const void* out, const void* gathered_a, int64_t m, int64_t n, int64_t k,
                            BLayout layout, cudaStream_t stream, const FusedOptions& o) {
  Plan plan;
  Call c(comm, rank, stream, "all_gather_matmul", m, n, k, true, &plan);
  run_all_gather_matmul(c, a_shard, b, const_cast<void*>(out), const_cast<void*>(gathered_a), m, n, k, layout,
                        o);
  return plan;
}

FusedPath matmul_reduce_scatter(Communicator& comm, Rank& rank, const void* a, const void* b, void* out,
                                int64_t m, int64_t n, int64_t k, BLayout layout, cudaStream_t stream,
                                const FusedOptions& o) {
  Call c(comm, rank, stream, "matmul_reduce_scatter", m, n, k, true);
  return run_matmul_reduce(c, a, b, out, m, n, k, layout, o, false);
}
Plan matmul_reduce_scatter_plan(Communicator& comm, Rank& rank, const void* a, const void* b, const void* out,
                                int64_t m, int64_t n, int64_t k, BLayout layout, cudaStream_t stream,
                                const FusedOptions& o) {
  Plan plan;
  Call c(comm, rank, stream, "matmul_reduce_scatter", m, n, k, true, &plan);
  run_matmul_reduce(c, a, b, const_cast<void*>(out), m, n, k, layout, o, false);
  return plan;
}

FusedPath matmul_all_reduce(Communicator& comm, Rank& rank, const void* a, const void* b, void* out,
                            int64_t m, int64_t n, int64_t k, BLayout layout, cudaStream_t stream,
                            const FusedOptions& o) {
  Call c(comm, rank, stream, "matmul_all_reduce", m, n, k, false);
  return run_matmul_reduce(c, a, b, out, m, n, k, layout, o, true);
}
Plan matmul_all_reduce_plan(Communicator& comm, Rank& rank, const void* a, const void* b, const void* out,
                            int64_t m, int64_t n, int64_t k, BLayout layout, cudaStream_t stream,
                            const FusedOptions& o) {
  Plan plan;
  Call c(comm, rank, stream, "matmul_all_reduce", m, n, k, false, &plan);
  run_matmul_reduce(c, a, b, const_cast<void*>(out), m, n, k, layout, o, true);
  return plan;
}

FusedPath all_gather_scaled_matmul(Communicator& comm, Rank& rank, const void* a_shard,
                                   const float* scale_a_shard, const void* b, const float* scale_b, void* out,
                                   int64_t m, int64_t n, int64_t k, Fp8Type type, Fp8Scaling scaling,
                                   cudaStream_t stream, const FusedOptions& o) {
  Call c(comm, rank, stream, "all_gather_scaled_matmul", m, n, k, true);
  return run_all_gather_scaled_matmul(
      c, Fp8MmArgs{a_shard, scale_a_shard, b, scale_b, out, m, n, k, type, scaling}, o);
}
Plan all_gather_scaled_matmul_plan(Communicator& comm, Rank& rank, const void* a_shard,
                                   const float* scale_a_shard, const void* b, const float* scale_b,
                                   const void* out, int64_t m, int64_t n, int64_t k, Fp8Type type,
                                   Fp8Scaling scaling, cudaStream_t stream, const FusedOptions& o) {
  Plan plan;
  Call c(comm, rank, stream, "all_gather_scaled_matmul", m, n, k, true, &plan);
  run_all_gather_scaled_matmul(
      c, Fp8MmArgs{a_shard, scale_a_shard, b, scale_b, const_cast<void*>(out), m, n, k, type, scaling}, o);
  return plan;
}

FusedPath scaled_matmul_reduce_scatter(Communicator& comm, Rank& rank, const void* a, const float* scale_a,
                                       const void* b, const float* scale_b, void* out, int64_t m, int64_t n,
                                       int64_t k, Fp8Type type, Fp8Scaling scaling, cudaStream_t stream,
                                       const FusedOptions& o) {
  Call c(comm, rank, stream, "scaled_matmul_reduce_scatter", m, n, k, true);
  return run_scaled_matmul_reduce(c, Fp8MmArgs{a, scale_a, b, scale_b, out, m, n, k, type, scaling}, o,
                                  false);
}
FusedPath scaled_matmul_all_reduce(Communicator& comm, Rank& rank, const void* a, const float* scale_a,
                                   const void* b, const float* scale_b, void* out, int64_t m, int64_t n,
                                   int64_t k, Fp8Type type, Fp8Scaling scaling, cudaStream_t stream,
                                   const FusedOptions& o) {
  Call c(comm, rank, stream, "scaled_matmul_all_reduce", m, n, k, false);
  return run_scaled_matmul_reduce(c, Fp8MmArgs{a, scale_a, b, scale_b, out, m, n, k, type, scaling}, o, true);
}
Plan scaled_matmul_reduce_plan(Communicator& comm, Rank& rank, const void* a, const float* scale_a,
                               const void* b, const float* scale_b, const void* out, int64_t m, int64_t n,
                               int64_t k, Fp8Type type, Fp8Scaling scaling, bool all_reduce,
                               cudaStream_t stream, const FusedOptions& o) {
  Plan plan;
  Call c(comm, rank, stream, all_reduce ? "scaled_matmul_all_reduce" : "scaled_matmul_reduce_scatter", m, n,
         k, !all_reduce, &plan);
  run_scaled_matmul_reduce(
      c, Fp8MmArgs{a, scale_a, b, scale_b, const_cast<void*>(out), m, n, k, type, scaling}, o, all_reduce);
  return plan;
}

}  // namespace weft
