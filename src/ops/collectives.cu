// Host side of the collectives: argument checks, layout of each op in terms of the device phases
// (weft/ops/collectives.cuh), workspace, launch.
#include <algorithm>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "one_shot.hpp"
#include "op_args.hpp"
#include "weft/runtime/current_device.hpp"
#include "weft/runtime/kernel_preload.hpp"
#include "weft/ops/collectives.cuh"
#include "weft/ops/collectives.hpp"

namespace weft {

size_t dtype_size(DType t) {
  return t == DType::kFP32 ? 4 : 2;
}
const char* dtype_name(DType t) {
  return t == DType::kBF16 ? "bf16" : t == DType::kFP16 ? "fp16" : "fp32";
}
const char* reduce_op_name(ReduceOp op) {
  return op == ReduceOp::kSum ? "sum" : op == ReduceOp::kMax ? "max" : "min";
}

namespace {

using coll::Rows;
constexpr int kThreads = 512;
using ops::one_shot_max_bytes;

// The one-shot's per-block call counts and LL region (op_args.hpp); the meeting slots of every kernel.
const char* const kOneShot = "all_reduce / reduce_scatter / all_to_all: one-shot calls per block, LL region";
const ResourceDeclaration kOneShotResources{{kOneShot, ops::kMeetingSlots, 0, &ops::ll_region_bytes}};
const ResourceDeclaration kMeetings{{ops::kBlockMeetings, 0, ops::kMeetingSlots}};
// How a two-shot all-reduce or a reduce-scatter moves its data (the reduce half):
//   kPull   every rank reads its slice from all peers at once (2 meetings; best latency)
//   kSteps  the same one peer at a time, in a permutation of the GPUs
//   kPush   pushes slices into the owners' staging, pipelined in groups
// Up to kPullMaxBytes of input both pull; above, the all-reduce pushes (4 x H200, 1 GiB: 343-345 GB/s busbw
// vs stepwise 337, pull 320) and the reduce-scatter steps (2 x H200: 325 vs 319 GB/s at 256 MiB; 4 x H200:
// 325 / 331 at 256 MiB / 1 GiB, the pull 319 / 328 in an earlier session).
enum class Flow { kPull, kSteps, kPush };
constexpr uint64_t kPullMaxBytes = 4 << 20;
// all_to_all's parts up to this size go in one LL round (one_shot with exchange): the meet / push / meet
// exchange costs ~10 us below 128 KiB per rank (4 x H100, 2026-11-27), NCCL 6.5 us at 8 KiB with one process
// per GPU. A part moves as 2x its bytes in LL words, so large parts stay with the exchange.
constexpr uint64_t kAllToAllOneShotMax = 64 << 10;

struct Call : ops::OpCall {
  Call(Communicator& c, Rank& r, cudaStream_t s, const char* name, Plan* into = nullptr)
      : OpCall(c, r, s, std::string("weft::") + name + ": ", into) {
    if (into) into->op = name;
  }
  static bool overlap(const void* a, uint64_t an, const void* b, uint64_t bn) {
    auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
    return x < y + bn && y < x + an;
  }
  int blocks(uint64_t bytes) const { return ops::collective_blocks(rank, bytes); }
  BarrierSlots meetings() const { return ops::meeting_slots(comm, rank); }
  void launched() const { WEFT_CUDA_CHECK(cudaGetLastError()); }
  // Whether a one-shot round of `bytes` fits this rank's SM budget (it needs a block per slot part).
  bool one_shot_fits(uint64_t bytes) const {
    return ops::one_shot_min_blocks(rank.world(), bytes) <= ops::max_collective_blocks(rank);
  }
  // The grid of an LL round of `bytes` (the one-shot, the rooted LL round): LL moves 2x the bytes and polls,
  // so spread it wide, but every block's share must fit its part of a slot (callers check one_shot_fits).
  int ll_blocks(uint64_t bytes) const {
    const int world = rank.world();
    return std::clamp<int>(blocks(bytes * 8), ops::one_shot_min_blocks(world, bytes),
                           std::min(ops::one_shot_max_blocks(world), ops::max_collective_blocks(rank)));
  }
  // A team of one: every collective returns its input (no kernel, no meeting). True when it did.
  bool alone(const void* in, void* out, uint64_t bytes) const {
    if (rank.world() > 1) return false;
    if (planned(in != out ? "copy (team of one)" : "nothing (team of one)")) return true;
    if (in != out) WEFT_CUDA_CHECK(cudaMemcpyAsync(out, in, bytes, cudaMemcpyDeviceToDevice, stream));
    return true;
  }
};

// Widest access (16, 8, 4, 2 bytes) that divides every size, stride and address given.
int vector_width(std::initializer_list<uint64_t> values) {
  for (int v : {16, 8, 4})
    if (std::all_of(values.begin(), values.end(), [v](uint64_t x) { return x % v == 0; })) return v;
  return 2;
}

template <class F>
void with_elem(DType t, F&& f) {
  switch (t) {
    case DType::kBF16:
      return f(std::integral_constant<Elem, Elem::kBF16>{});
    case DType::kFP16:
      return f(std::integral_constant<Elem, Elem::kFP16>{});
    case DType::kFP32:
      return f(std::integral_constant<Elem, Elem::kFP32>{});
  }
}
template <class F>
void with_reduce(ReduceOp op, F&& f) {
  switch (op) {
    case ReduceOp::kSum:
      return f(std::integral_constant<Reduce, Reduce::kSum>{});
    case ReduceOp::kMax:
      return f(std::integral_constant<Reduce, Reduce::kMax>{});
    case ReduceOp::kMin:
      return f(std::integral_constant<Reduce, Reduce::kMin>{});
  }
}

void launch_exchange(Call& c, coll::Exchange x, int v, uint64_t total_bytes) {
  const int g = c.blocks(total_bytes);
  if (c.planned(x.via_workspace ? "exchange via workspace" : "exchange", g)) return;
  switch (v) {
    case 16:
      detail::preload<&coll::exchange_kernel<16>>();
      coll::exchange_kernel<16><<<g, kThreads, 0, c.stream>>>(x);
      break;
    case 8:
      detail::preload<&coll::exchange_kernel<8>>();
      coll::exchange_kernel<8><<<g, kThreads, 0, c.stream>>>(x);
      break;
    case 4:
      detail::preload<&coll::exchange_kernel<4>>();
      coll::exchange_kernel<4><<<g, kThreads, 0, c.stream>>>(x);
      break;
    default:
      detail::preload<&coll::exchange_kernel<2>>();
      coll::exchange_kernel<2><<<g, kThreads, 0, c.stream>>>(x);
      break;
  }
  c.launched();
}

// Instantiates `launch(elem, reduce, vec)` for the run-time dtype, op and vector choice.
template <class Launch>
void with_reduction(DType dt, ReduceOp op, bool vec, Launch&& launch) {
  with_elem(dt, [&](auto e) {
    with_reduce(op, [&](auto r) {
      if (vec)
        launch(e, r, std::true_type{});
      else
        launch(e, r, std::false_type{});
    });
  });
}

// 16-byte packs only: every caller checks the alignment (the two-shot all-reduce makes it).
void launch_reduce_scatter(Call& c, const coll::ReduceScatter& x, DType dt, ReduceOp op, uint64_t total_bytes,
                           const char* path) {
  const int g = c.blocks(total_bytes);
  if (c.planned(path, g)) return;
  with_elem(dt, [&](auto e) {
    with_reduce(op, [&](auto r) {
      detail::preload<&coll::reduce_scatter_kernel<e.value, r.value>>();
      coll::reduce_scatter_kernel<e.value, r.value><<<g, kThreads, 0, c.stream>>>(x);
    });
  });
  c.launched();
}

void launch_pull_reduce(Call& c, const coll::PullReduce& x, DType dt, ReduceOp op, bool vec,
                        uint64_t total_bytes, const char* path) {
  const int g = c.blocks(total_bytes);
  if (c.planned(path, g)) return;
  with_reduction(dt, op, vec, [&](auto e, auto r, auto v) {
    detail::preload<&coll::pull_reduce_kernel<e.value, r.value, v.value>>();
    coll::pull_reduce_kernel<e.value, r.value, v.value><<<g, kThreads, 0, c.stream>>>(x);
  });
  c.launched();
}

// The flow for `bytes` of input: as asked, else kPull up to kPullMaxBytes and `large` above; push and steps
// move 16-byte packs only (`vec`), else pull.
Flow pick_flow(ReduceFlow asked, uint64_t bytes, Flow large, bool vec) {
  Flow f = bytes <= kPullMaxBytes ? Flow::kPull : large;
  if (asked == ReduceFlow::kPull) f = Flow::kPull;
  if (asked == ReduceFlow::kSteps) f = Flow::kSteps;
  if (asked == ReduceFlow::kPush) f = Flow::kPush;
  return vec ? f : Flow::kPull;
}

// One round: every rank sends each peer p `bytes` starting at in + p * in_peer_step (in_peer_step 0: the
// whole input to everyone, an all-reduce; the peer's slice: a reduce-scatter) and reduces what it
// receives with its own part into out; or, with `exchange` (an all-to-all), places the part from rank s at
// out + s * out_peer_step. bytes <= one_shot_max_bytes; the steps multiples of 4.
void one_shot(Call& c, const void* in, uint64_t in_peer_step, void* out, uint64_t bytes, DType dt,
              ReduceOp op, bool exchange = false, uint64_t out_peer_step = 0) {
  const int world = c.rank.world();
  char* region = c.workspace(ops::ll_region_bytes(world), kOneShot);
  coll::OneShot x{c.rank.view(),
                  static_cast<const uint32_t*>(in),
                  in_peer_step / 4,
                  static_cast<uint32_t*>(out),
                  out_peer_step / 4,
                  (bytes + 3) / 4,
                  static_cast<uint32_t>(bytes % 4 ? 2 : 4),
                  reinterpret_cast<uint64_t*>(region),
                  ops::ll_slot_bytes(world) / 8,
                  ops::ll_block_words(world),
                  c.comm.resources(c.rank, kOneShot).flags};
  const int g = c.ll_blocks(bytes);
  if (c.planned(exchange ? "one-shot exchange" : "one-shot", g)) return;
  if (exchange) {  // moves words: the element type does not matter
    constexpr auto kernel = &coll::one_shot_kernel<Elem::kFP32, Reduce::kSum, true>;
    detail::preload<kernel>();
    kernel<<<g, kThreads, 0, c.stream>>>(x);
    return c.launched();
  }
  with_elem(dt, [&](auto e) {
    with_reduce(op, [&](auto r) {
      detail::preload<&coll::one_shot_kernel<e.value, r.value>>();
      coll::one_shot_kernel<e.value, r.value><<<g, kThreads, 0, c.stream>>>(x);
    });
  });
  c.launched();
}

void run_all_reduce(Call& c, const void* in, void* out, size_t count, DType dtype, ReduceOp op,
                    const CollectiveOptions& options) {
  Communicator& comm = c.comm;
  Rank& rank = c.rank;
  // A forced flow is a two-shot's: it makes an automatic choice two-shot.
  AllReduceAlgo algo = options.algo == AllReduceAlgo::kAuto && options.flow != ReduceFlow::kAuto
                           ? AllReduceAlgo::kTwoShot
                           : options.algo;
  if (count == 0) return;
  const uint64_t esize = dtype_size(dtype), bytes = count * esize;
  c.check_buffer(in, "in", bytes, 16);  // the vector and LL paths read whole 16-byte packs / 4-byte words
  c.check_buffer(out, "out", bytes, 16);
  if (in != out && Call::overlap(in, bytes, out, bytes)) c.fail("in and out overlap without being equal");
  if (c.alone(in, out, bytes)) return;
  const int world = rank.world();
  const uint64_t one_shot_max = one_shot_max_bytes(world);
  if (algo == AllReduceAlgo::kAuto)
    algo =
        bytes <= one_shot_max && c.one_shot_fits(bytes) ? AllReduceAlgo::kOneShot : AllReduceAlgo::kTwoShot;
  if (algo == AllReduceAlgo::kOneShot) {
    if (bytes > one_shot_max)
      c.fail("one-shot all-reduce is limited to " + std::to_string(one_shot_max) + " bytes at " +
             std::to_string(world) + " ranks, got " + std::to_string(bytes));
    if (!c.one_shot_fits(bytes))
      c.fail("one-shot all-reduce of " + std::to_string(bytes) + " bytes needs " +
             std::to_string(ops::one_shot_min_blocks(world, bytes)) + " resident blocks, more than rank " +
             std::to_string(rank.rank()) + "'s SM budget of " + std::to_string(rank.sm_budget()) +
             " (Options::sm_budget); use AllReduceAlgo::kAuto or kTwoShot");
    return one_shot(c, in, 0, out, bytes, dtype, op);
  }
  // Two-shot over the largest prefix that splits into equal 16-byte-multiple slices; the rest (under
  // 16 * world bytes) goes one-shot right after.
  const uint64_t unit = 16 / esize * world;
  const uint64_t main = count / unit * unit, tail = count - main;
  if (main > 0) {
    const uint64_t slice = main * esize / world;
    const bool sym_in = comm.in_heap(rank, in, bytes), sym_out = comm.in_heap(rank, out, bytes);
    const Flow flow = pick_flow(options.flow, main * esize, Flow::kPush, true);
    if (flow != Flow::kPush) {
      // Peers read my input directly (a copy in the workspace when it is not symmetric).
      char* ws = c.workspace((sym_in ? 0 : main * esize) + (sym_out ? 0 : main * esize));
      char* in_copy = ws;
      char* gather = ws + (sym_in ? 0 : main * esize);
      coll::PullReduce x{};
      x.team = rank.view();
      x.slots = c.meetings();
      x.in = Rows{sym_in ? const_cast<char*>(static_cast<const char*>(in)) : in_copy, 0};
      x.in_peer_step = slice;
      x.copy_from = Rows{sym_in ? nullptr : const_cast<char*>(static_cast<const char*>(in)), 0};
      x.out = Rows{(sym_out ? static_cast<char*>(out) : gather) + rank.rank() * slice, 0};
      x.rows = 1;
      x.row_bytes = slice;
      x.fanout = true;
      x.final_dst = sym_out ? nullptr : static_cast<char*>(out);
      x.final_src = gather;
      x.stepwise = flow == Flow::kSteps;
      launch_pull_reduce(c, x, dtype, op, true, main * esize,
                         flow == Flow::kSteps ? "two-shot steps" : "two-shot pull");
    } else {
      char* ws = c.workspace(slice * world * (sym_out ? 1 : 2));
      char* gather = ws + slice * world;  // fan-out target when out is not symmetric
      coll::ReduceScatter x{};
      x.team = rank.view();
      x.slots = c.meetings();
      x.in = Rows{const_cast<char*>(static_cast<const char*>(in)), 0};
      x.in_peer_step = slice;
      x.staging = Rows{ws, 0};
      x.staging_step = slice;
      x.out = Rows{(sym_out ? static_cast<char*>(out) : gather) + rank.rank() * slice, 0};
      x.rows = 1;
      x.row_bytes = slice;
      x.fanout = true;
      x.final_dst = sym_out ? nullptr : static_cast<char*>(out);
      x.final_src = gather;
      launch_reduce_scatter(c, x, dtype, op, main * esize, "two-shot push");
    }
  }
  if (tail > 0)
    one_shot(c, static_cast<const char*>(in) + main * esize, 0, static_cast<char*>(out) + main * esize,
             tail * esize, dtype, op);
}

void run_all_gather(Call& c, const void* in, void* out, Shape2D s, int dim, DType dtype) {
  Communicator& comm = c.comm;
  Rank& rank = c.rank;
  if (dim != 0 && dim != 1) c.fail("dim must be 0 or 1, got " + std::to_string(dim));
  if (s.count() == 0) return;
  const int world = rank.world();
  const uint64_t esize = dtype_size(dtype), in_bytes = s.count() * esize, out_bytes = in_bytes * world;
  c.check_buffer(in, "in", in_bytes, esize);
  c.check_buffer(out, "out", out_bytes, esize);
  const char* my_slot =
      static_cast<const char*>(out) + (dim == 0 ? rank.rank() * in_bytes : rank.rank() * s.cols * esize);
  const bool in_place = dim == 0 && in == my_slot;
  if (!in_place && Call::overlap(in, in_bytes, out, out_bytes))
    c.fail("in overlaps out; in-place all-gather passes in == out + rank * in_bytes (dim 0 only)");
  if (c.alone(in, out, in_bytes)) return;
  coll::Exchange x{};
  x.team = rank.view();
  x.slots = c.meetings();
  if (dim == 0) {  // one contiguous row per rank
    x.rows = 1;
    x.row_bytes = in_bytes;
    x.src = Rows{const_cast<char*>(static_cast<const char*>(in)), 0};
    x.dst_peer_step = in_bytes;
  } else {  // rank r's columns r*cols.. of every row
    x.rows = s.rows;
    x.row_bytes = s.cols * esize;
    x.src = Rows{const_cast<char*>(static_cast<const char*>(in)), x.row_bytes};
    x.dst_peer_step = x.row_bytes;
  }
  x.src_peer_step = 0;  // the same data for every peer
  const uint64_t dst_stride = dim == 0 ? 0 : x.row_bytes * world;
  x.via_workspace = !comm.in_heap(rank, out, out_bytes);
  char* dst = x.via_workspace ? c.workspace(out_bytes) : static_cast<char*>(out);
  x.dst = Rows{dst, dst_stride};
  x.final_dst = Rows{static_cast<char*>(out), dst_stride};
  x.final_peer_step = x.dst_peer_step;
  const int v =
      vector_width({x.row_bytes, dst_stride, x.src.stride, x.dst_peer_step, reinterpret_cast<uintptr_t>(dst),
                    reinterpret_cast<uintptr_t>(in), reinterpret_cast<uintptr_t>(out)});
  launch_exchange(c, x, v, out_bytes);
}

void run_reduce_scatter(Call& c, const void* in, void* out, Shape2D s, int dim, DType dtype, ReduceOp op,
                        const CollectiveOptions& options) {
  Communicator& comm = c.comm;
  Rank& rank = c.rank;
  if (dim != 0 && dim != 1) c.fail("dim must be 0 or 1, got " + std::to_string(dim));
  if (s.count() == 0) return;
  const int world = rank.world();
  const uint64_t esize = dtype_size(dtype), out_bytes = s.count() * esize, in_bytes = out_bytes * world;
  c.check_buffer(in, "in", in_bytes, esize);
  c.check_buffer(out, "out", out_bytes, esize);
  const bool in_place = dim == 0 && out == static_cast<const char*>(in) + rank.rank() * out_bytes;
  if (!in_place && Call::overlap(in, in_bytes, out, out_bytes))
    c.fail("out overlaps in; in-place reduce-scatter passes out == in + rank * out_bytes (dim 0 only)");
  if (c.alone(in, out, in_bytes)) return;
  coll::ReduceScatter x{};
  x.team = rank.view();
  x.slots = c.meetings();
  if (dim == 0) {
    x.rows = 1;
    x.row_bytes = out_bytes;
    x.in = Rows{const_cast<char*>(static_cast<const char*>(in)), 0};
    x.in_peer_step = out_bytes;
  } else {
    x.rows = s.rows;
    x.row_bytes = s.cols * esize;
    x.in = Rows{const_cast<char*>(static_cast<const char*>(in)), x.row_bytes * world};
    x.in_peer_step = x.row_bytes;
  }
  // Small contiguous slices: one round, no meeting (the LL words need 4-byte aligned slices).
  if (dim == 0 && out_bytes <= one_shot_max_bytes(world) && c.one_shot_fits(out_bytes) &&
      out_bytes % 4 == 0 && reinterpret_cast<uintptr_t>(in) % 4 == 0 &&
      reinterpret_cast<uintptr_t>(out) % 4 == 0 && options.flow == ReduceFlow::kAuto)
    return one_shot(c, in, out_bytes, out, out_bytes, dtype, op);
  // The push kernel moves 16-byte packs only (its element-wise form would spill); other layouts pull.
  const bool vec = vector_width({x.row_bytes, x.in.stride, x.in_peer_step, reinterpret_cast<uintptr_t>(in),
                                 reinterpret_cast<uintptr_t>(out)}) == 16;
  // Never pushed by default: the pipelined push ties the pull from 256 MiB (4 x H200: 328 vs 328 GB/s busbw
  // at 1 GiB) and loses at 64 MiB (186 vs 164 us); ReduceFlow::kPush selects it. Pushing stages in the
  // workspace: an input that lives there itself (the fused ops' sequential path reduces its GEMM output in
  // place) is pulled instead.
  const Flow flow = pick_flow(options.flow, in_bytes, Flow::kSteps, vec);
  char* staging = nullptr;
  if (flow == Flow::kPush) {
    staging = c.workspace(out_bytes * world);
    if (Call::overlap(in, in_bytes, staging, out_bytes * world)) staging = nullptr;
  }
  if (staging == nullptr) {
    // Rank r reads slice r of every rank's input (from a workspace copy when the input is not symmetric).
    const bool sym_in = comm.in_heap(rank, in, in_bytes);
    char* ws = c.workspace(sym_in ? 0 : in_bytes);
    coll::PullReduce y{};
    y.team = x.team;
    y.slots = x.slots;
    y.in = Rows{sym_in ? x.in.base : ws, x.in.stride};
    y.in_peer_step = x.in_peer_step;
    y.copy_from = Rows{sym_in ? nullptr : x.in.base, x.in.stride};
    y.out = Rows{static_cast<char*>(out), dim == 0 ? 0 : x.row_bytes};
    y.rows = x.rows;
    y.row_bytes = x.row_bytes;
    y.fanout = false;
    y.stepwise = flow == Flow::kSteps;
    // (the workspace copy is 16-byte aligned)
    launch_pull_reduce(c, y, dtype, op, vec, in_bytes, flow == Flow::kSteps ? "steps" : "pull");
    return;
  }
  x.staging = Rows{staging, dim == 0 ? 0 : x.row_bytes};
  x.staging_step = out_bytes;
  x.out = Rows{static_cast<char*>(out), dim == 0 ? 0 : x.row_bytes};
  x.fanout = false;
  launch_reduce_scatter(c, x, dtype, op, in_bytes, "push");
}

void run_all_to_all(Call& c, const void* in, void* out, size_t count_per_rank, DType dtype) {
  Communicator& comm = c.comm;
  Rank& rank = c.rank;
  if (count_per_rank == 0) return;
  const int world = rank.world();
  const uint64_t blk = count_per_rank * dtype_size(dtype), bytes = blk * world;
  c.check_buffer(in, "in", bytes, dtype_size(dtype));
  c.check_buffer(out, "out", bytes, dtype_size(dtype));
  if (in != out && Call::overlap(in, bytes, out, bytes)) c.fail("in and out overlap without being equal");
  if (c.alone(in, out, bytes)) return;
  // Small parts: one LL round (data and call epoch in one 8-byte store, no meetings), which also works in
  // place (each block sends its share of every part before it overwrites that share). The meet / push /
  // meet exchange costs ~10 us at any size below 128 KiB (4 x H100, bench/RESULTS.md), short of NCCL.
  const auto word_aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 4 == 0; };
  if (blk <= kAllToAllOneShotMax && blk % 4 == 0 && word_aligned(in) && word_aligned(out) &&
      c.one_shot_fits(blk))
    return one_shot(c, in, blk, out, blk, dtype, ReduceOp::kSum, true, blk);
  coll::Exchange x{};
  x.team = rank.view();
  x.slots = c.meetings();
  x.rows = 1;
  x.row_bytes = blk;
  x.src = Rows{const_cast<char*>(static_cast<const char*>(in)), 0};
  x.src_peer_step = blk;  // block p goes to rank p
  x.dst_peer_step = blk;  // and lands in block `source`
  // In place, peers would overwrite blocks not yet sent: receive into the workspace, then copy.
  x.via_workspace = in == out || !comm.in_heap(rank, out, bytes);
  char* dst = x.via_workspace ? c.workspace(bytes) : static_cast<char*>(out);
  x.dst = Rows{dst, 0};
  x.final_dst = Rows{static_cast<char*>(out), 0};
  x.final_peer_step = blk;
  launch_exchange(c, x,
                  vector_width({blk, reinterpret_cast<uintptr_t>(in), reinterpret_cast<uintptr_t>(out),
                                reinterpret_cast<uintptr_t>(dst)}),
                  bytes);
}

// The pushes are dealt in 16-byte units whatever each rank's buffers allow (coll::copy_dealt), so no
// alignment needs to agree across ranks. The grid is sized by what the busiest rank moves.
// At up to 8 ranks the receivers wait for per-chunk tags instead of an exit meeting, copying each chunk out
// of the workspace as it lands (coll::rooted_landed_kernel); past 8, coll::rooted_kernel. Both choices depend
// only on what every rank knows alike (the world size; via_workspace: out symmetric on every rank or on
// none). One run of flags for the rooted kernels and the owned reduce: both index it [block x 8 + sender] and
// tag it with block b's meeting epoch, which no two calls share (waits match it exactly), and one of them
// runs per call; a sub-team takes a copy of the run at its first use, so one run keeps the splits' share
// small.
const char* const kRootedLanded = "rooted collectives, reduce: chunks landed per block and sender";
static_assert(coll::kRootedLandedMaxWorld == coll::kOwnedReduceMaxWorld, "the two share one run of flags");
constexpr int kRootedLandedFlags = ops::kMeetingSlots * coll::kRootedLandedMaxWorld;
const ResourceDeclaration kRootedResources{{kRootedLanded, kRootedLandedFlags}};

void launch_rooted(Call& c, const coll::Rooted& r, uint64_t busiest_bytes, const char* name) {
  const int g = c.blocks(busiest_bytes);
  const bool landed = c.rank.world() <= coll::kRootedLandedMaxWorld;
  const char* how =
      landed ? (r.x.via_workspace ? " via workspace, copied out as it lands" : ", tagged per chunk")
             : (r.x.via_workspace ? " via workspace" : "");
  if (c.planned(std::string(name) + how, g)) return;
  if (landed) {
    detail::preload<&coll::rooted_landed_kernel>();
    coll::rooted_landed_kernel<<<g, kThreads, 0, c.stream>>>(r,
                                                             c.comm.resources(c.rank, kRootedLanded).flags);
  } else {
    detail::preload<&coll::rooted_kernel>();
    coll::rooted_kernel<<<g, kThreads, 0, c.stream>>>(r);
  }
  c.launched();
}

// Parts up to the one-shot's limit (one_shot_max_bytes) at up to 8 ranks: one LL round
// (coll::rooted_ll_kernel), no meeting. Its own LL region and counts; decided from what every rank knows
// alike (the world, the part's size, the SM budget), never from a rank's pointers (the kernel takes any
// 2-byte alignment).
const char* const kRootedLL = "broadcast / scatter / gather, small: calls and progress per block, LL region";
constexpr int kRootedLLFlags = ops::kMeetingSlots * (1 + coll::kRootedLLMaxWorld);
const ResourceDeclaration kRootedLLResources{{kRootedLL, kRootedLLFlags, 0, &ops::ll_region_bytes}};

bool rooted_ll(const Call& c, uint64_t part_bytes) {
  const int W = c.rank.world();
  return W <= coll::kRootedLLMaxWorld && part_bytes % 2 == 0 && part_bytes <= one_shot_max_bytes(W) &&
         c.one_shot_fits(part_bytes);
}

// One LL round of `bytes` per part: the part for rank p at in + p * in_peer_step, the part from rank s
// landing at out + s * out_peer_step.
void launch_rooted_ll(Call& c, int root, bool from_root, const void* in, uint64_t in_peer_step, void* out,
                      uint64_t out_peer_step, uint64_t bytes, const char* name) {
  const int world = c.rank.world();
  const Flags flags = c.comm.resources(c.rank, kRootedLL).flags;
  coll::RootedLL x{};
  x.team = c.rank.view();
  x.in = static_cast<const char*>(in);
  x.in_peer_step = in_peer_step;
  x.out = static_cast<char*>(out);
  x.out_peer_step = out_peer_step;
  x.bytes = bytes;
  x.root = root;
  x.from_root = from_root;
  x.ll = reinterpret_cast<uint64_t*>(c.workspace(ops::ll_region_bytes(world), kRootedLL));
  x.slot_words = ops::ll_slot_bytes(world) / 8;
  x.block_words = ops::ll_block_words(world);
  x.calls = Flags{flags.first, ops::kMeetingSlots};
  x.progress = Flags{flags.first + ops::kMeetingSlots, ops::kMeetingSlots * coll::kRootedLLMaxWorld};
  const int g = c.ll_blocks(bytes);
  if (c.planned(std::string(name) + ", one LL round", g)) return;
  detail::preload<&coll::rooted_ll_kernel>();
  coll::rooted_ll_kernel<<<g, kThreads, 0, c.stream>>>(x);
  c.launched();
}

void check_root(const Call& c, int root) {
  if (root < 0 || root >= c.rank.world())
    c.fail("root " + std::to_string(root) + " is not a rank of this team of " +
           std::to_string(c.rank.world()));
}

// A rooted exchange of `bytes` per part; the caller sets the layout (src, steps).
coll::Rooted rooted(Call& c, int root, bool from_root) {
  coll::Rooted r{};
  r.x.team = c.rank.view();
  r.x.slots = c.meetings();
  r.x.rows = 1;
  r.root = root;
  r.from_root = from_root;
  return r;
}

// Large broadcasts at 3 or more ranks: forwarded (coll::forwarded_broadcast_kernel), the root sending each
// byte once instead of W - 1 times (4 x H200, 256 MiB: the root's pushes to every rank took 2310 us, a
// scatter then an all-gather 1144, NCCL 777). At 2 ranks the root's one push is already the least it can
// send.
constexpr uint64_t kBroadcastForwardMin = 4 << 20;
const char* const kBroadcastLanded = "broadcast: chunks landed per block";
const ResourceDeclaration kBroadcastResources{{kBroadcastLanded, ops::kMeetingSlots}};

void run_broadcast(Call& c, const void* in, void* out, size_t count, DType dtype, int root) {
  check_root(c, root);
  if (count == 0) return;
  const uint64_t es = dtype_size(dtype), bytes = count * es;
  const bool is_root = c.rank.rank() == root;
  if (is_root) c.check_buffer(in, "in (the root's data)", bytes, es);
  c.check_buffer(out, "out", bytes, es);
  if (is_root && in != out && Call::overlap(in, bytes, out, bytes))
    c.fail("in and out overlap without being equal");
  if (c.alone(in, out, bytes)) return;
  const int W = c.rank.world();
  if (rooted_ll(c, bytes))
    return launch_rooted_ll(c, root, true, is_root ? in : out, 0, out, 0, bytes, "broadcast");
  // Every rank's out symmetric, or the data lands in the workspace (out symmetric on all ranks or on none).
  const bool via_workspace = !c.comm.in_heap(c.rank, out, bytes);
  char* land = via_workspace ? c.workspace(bytes) : static_cast<char*>(out);
  if (W >= 3 && bytes >= kBroadcastForwardMin) {
    coll::ForwardedBroadcast f{};
    f.team = c.rank.view();
    f.in = static_cast<const char*>(is_root ? in : out);
    f.land = land;
    f.out = static_cast<char*>(out);
    f.bytes = bytes;
    f.root = root;
    f.landed = c.comm.resources(c.rank, kBroadcastLanded).flags;
    f.slots = c.meetings();
    const int g = c.blocks(bytes);
    if (c.planned(std::string("forwarded") + (via_workspace ? " via workspace" : ""), g)) return;
    detail::preload<&coll::forwarded_broadcast_kernel>();
    coll::forwarded_broadcast_kernel<<<g, kThreads, 0, c.stream>>>(f);
    return c.launched();
  }
  coll::Rooted r = rooted(c, root, true);
  r.x.row_bytes = bytes;
  r.x.src = Rows{const_cast<char*>(static_cast<const char*>(is_root ? in : out)), 0};
  r.x.via_workspace = via_workspace;
  r.x.dst = Rows{land, 0};
  r.x.final_dst = Rows{static_cast<char*>(out), 0};
  launch_rooted(c, r, bytes * std::max(1, W - 1), "broadcast");
}

void run_scatter(Call& c, const void* in, void* out, size_t count, DType dtype, int root) {
  check_root(c, root);
  if (count == 0) return;
  const uint64_t bytes = count * dtype_size(dtype), all = bytes * c.rank.world();
  const bool is_root = c.rank.rank() == root;
  if (is_root) c.check_buffer(in, "in (the root's W parts)", all, dtype_size(dtype));
  c.check_buffer(out, "out", bytes, dtype_size(dtype));
  const char* mine = is_root ? static_cast<const char*>(in) + root * bytes : nullptr;
  if (is_root && out != mine && Call::overlap(in, all, out, bytes))
    c.fail("in and out overlap (in place: out == in + root * count elements)");
  if (c.alone(in, out, bytes)) return;
  if (rooted_ll(c, bytes))
    return launch_rooted_ll(c, root, true, is_root ? in : out, is_root ? bytes : 0, out, 0, bytes, "scatter");
  coll::Rooted r = rooted(c, root, true);
  r.x.row_bytes = bytes;
  r.x.src = Rows{const_cast<char*>(static_cast<const char*>(is_root ? in : out)), 0};
  r.x.src_peer_step = is_root ? bytes : 0;  // part p goes to rank p
  // Through the workspace: the root's out may be a part of its in (in place), at another place than the
  // receivers' outs, so the root cannot push into those by its own out's offset.
  r.x.via_workspace = true;
  r.x.dst = Rows{c.workspace(bytes), 0};
  r.x.final_dst = Rows{static_cast<char*>(out), 0};
  launch_rooted(c, r, bytes * std::max(1, c.rank.world() - 1), "scatter");
}

void run_gather(Call& c, const void* in, void* out, size_t count, DType dtype, int root) {
  check_root(c, root);
  if (count == 0) return;
  const uint64_t bytes = count * dtype_size(dtype), all = bytes * c.rank.world();
  const bool is_root = c.rank.rank() == root;
  c.check_buffer(in, "in", bytes, dtype_size(dtype));
  if (is_root) {
    c.check_buffer(out, "out (the root's W parts)", all, dtype_size(dtype));
    const char* mine = static_cast<const char*>(out) + root * bytes;
    if (in != mine && Call::overlap(in, bytes, out, all))
      c.fail("in and out overlap (in place: in == out + root * count elements)");
  }
  if (c.alone(in, out, bytes)) return;
  if (rooted_ll(c, bytes))  // a non-root's out is unused (null)
    return launch_rooted_ll(c, root, false, in, 0, out, is_root ? bytes : 0, bytes, "gather");
  coll::Rooted r = rooted(c, root, false);
  r.x.row_bytes = bytes;
  r.x.src = Rows{const_cast<char*>(static_cast<const char*>(in)), 0};
  r.x.dst_peer_step = bytes;  // rank q's part lands in part q
  // Only the root has an out: the parts land in the workspace (the same size on every rank), then in out.
  r.x.via_workspace = true;
  r.x.dst = Rows{c.workspace(all), 0};
  r.x.final_dst = Rows{static_cast<char*>(is_root ? out : r.x.dst.base), 0};
  r.x.final_peer_step = bytes;
  launch_rooted(c, r, all, "gather");
}

// From 2 to 8 ranks and 1 MiB (in whole 16-byte units): summed by the non-roots (coll::owned_reduce_kernel;
// at 2 ranks by the root, from the other rank's pushes), the root receiving each byte once. Otherwise the
// all-reduce into a workspace area of its own, then the root's copy: every rank takes part in the reduction;
// out is written at the root only. (A pull whose slices land in the root's area, without the all-reduce's
// second pass, measured no faster: 4 x H200, 256 MiB bf16, 1299 us against 1440 with symmetric inputs and no
// copy in, NCCL 785; and only a copy in makes every rank's input lie at the same offset, which an in-place
// root does not give.)
const char* const kReduceArea = "reduce: result";
constexpr uint64_t kOwnedReduceMin = 1 << 20;

// Decided from what every rank knows alike (the world, the size), never from a rank's own pointers.
bool owned_reduce(const Call& c, uint64_t bytes) {
  const int W = c.rank.world();
  return W >= 2 && W <= coll::kOwnedReduceMaxWorld && bytes >= kOwnedReduceMin && bytes % 16 == 0;
}

// The kernel reads and writes 16-byte units: an input not 16-byte aligned is first copied into a workspace
// area (every rank asks for it, so the team's workspaces grow alike), a root's out that is not aligned is
// written from the landing area after the kernel.
void launch_owned_reduce(Call& c, const void* in, void* out, uint64_t bytes, DType dtype, ReduceOp op,
                         int root) {
  const int W = c.rank.world();
  const bool is_root = c.rank.rank() == root;
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  coll::OwnedReduce x{};
  x.team = c.rank.view();
  x.units = bytes / 16;
  const uint64_t per = (x.units + W - 2) / (W - 1);
  char* in_copy = c.workspace(bytes, kReduceArea);
  x.land = reinterpret_cast<uint4*>(c.workspace(per * (W - 1) * 16));
  x.in = static_cast<const uint4*>(aligned(in) ? in : in_copy);
  x.out = is_root && aligned(out) ? static_cast<uint4*>(out) : x.land;  // land: no copy in the kernel
  x.root = root;
  x.landed = c.comm.resources(c.rank, kRootedLanded).flags;  // (shared with the rooted kernels)
  x.slots = c.meetings();
  if (!aligned(in) && !c.planned("copy of in to 16-byte alignment"))
    WEFT_CUDA_CHECK(cudaMemcpyAsync(in_copy, in, bytes, cudaMemcpyDeviceToDevice, c.stream));
  const int g = c.blocks(bytes);
  if (!c.planned(W == 2 ? "pushed to the root and summed there" : "summed by the non-roots", g)) {
    with_elem(dtype, [&](auto e) {
      with_reduce(op, [&](auto r) {
        detail::preload<&coll::owned_reduce_kernel<e.value, r.value>>();
        coll::owned_reduce_kernel<e.value, r.value><<<g, kThreads, 0, c.stream>>>(x);
      });
    });
    c.launched();
  }
  if (is_root && x.out == x.land && !c.planned("copy to the root's out"))
    WEFT_CUDA_CHECK(cudaMemcpyAsync(out, x.land, bytes, cudaMemcpyDeviceToDevice, c.stream));
}

void run_reduce(Call& c, const void* in, void* out, size_t count, DType dtype, ReduceOp op, int root) {
  check_root(c, root);
  if (count == 0) return;
  const uint64_t bytes = count * dtype_size(dtype);
  const bool is_root = c.rank.rank() == root;
  c.check_buffer(in, "in", bytes, dtype_size(dtype));
  if (is_root) c.check_buffer(out, "out", bytes, dtype_size(dtype));
  if (is_root && in != out && Call::overlap(in, bytes, out, bytes))
    c.fail("in and out overlap without being equal");
  if (c.alone(in, out, bytes)) return;
  if (owned_reduce(c, bytes)) return launch_owned_reduce(c, in, out, bytes, dtype, op, root);
  // in copied into the area and reduced in place there: every rank's input then sits at the same offset
  // of the same kind of memory, whatever the caller's buffers (the all-reduce's pull flows read each peer's
  // input at the reader's own offset).
  char* result = c.workspace(bytes, kReduceArea);
  if (!c.planned("copy of in into the area"))
    WEFT_CUDA_CHECK(cudaMemcpyAsync(result, in, bytes, cudaMemcpyDeviceToDevice, c.stream));
  run_all_reduce(c, result, result, count, dtype, op, {});
  if (!is_root || c.planned("copy to the root's out")) return;
  WEFT_CUDA_CHECK(cudaMemcpyAsync(out, result, bytes, cudaMemcpyDeviceToDevice, c.stream));
}

const char* const kCountsArea = "all_to_all_v: counts";
void run_all_to_all_v(Call& c, const void* in, const int64_t* send_counts, size_t in_capacity, void* out,
                      int64_t* recv_counts, size_t out_capacity, size_t row_elems, DType dtype) {
  const int W = c.rank.world();
  if (row_elems == 0) c.fail("row_elems must be at least 1");
  constexpr uint64_t kMost = uint64_t(1) << 62;
  if (row_elems > kMost / 4 || in_capacity > kMost / (row_elems * 4) ||
      out_capacity > kMost / (row_elems * 4))
    c.fail("in_capacity / out_capacity x row_elems overflow");
  const uint64_t es = dtype_size(dtype), row = row_elems * es, in_bytes = in_capacity * row,
                 out_bytes = out_capacity * row;
  if (in_capacity > 0) c.check_buffer(in, "in", in_bytes, es);
  if (out_capacity > 0) c.check_buffer(out, "out", out_bytes, es);
  c.check_buffer(send_counts, "send_counts", W * 8, 8);
  c.check_buffer(recv_counts, "recv_counts", W * 8, 8);
  if (in_capacity > 0 && out_capacity > 0 && Call::overlap(in, in_bytes, out, out_bytes))
    c.fail("in and out overlap (all_to_all_v is not in place)");
  coll::AllToAllV a{};
  a.team = c.rank.view();
  a.in = static_cast<const char*>(in);
  a.send_counts = send_counts;
  a.in_capacity = static_cast<int64_t>(in_capacity);
  a.out_capacity = static_cast<int64_t>(out_capacity);
  a.recv_counts = recv_counts;
  a.row_bytes = row;
  a.slots = c.meetings();
  a.table =
      reinterpret_cast<int64_t*>(c.workspace(uint64_t(W) * (coll::AllToAllV::kRow + W) * 8, kCountsArea));
  // out symmetric (the same buffer on every rank, out_capacity the same everywhere): pushed into directly;
  // else through the workspace, then copied out.
  const bool via_workspace = out_capacity > 0 && !c.comm.in_heap(c.rank, out, out_bytes);
  a.via_workspace = via_workspace ? 1 : 0;
  a.dst = via_workspace ? c.workspace(out_bytes) : static_cast<char*>(out);
  const int g = c.blocks(std::max<uint64_t>(out_bytes, 1));
  if (c.planned(via_workspace ? "counts + push via workspace + copy out" : "counts + push", g)) return;
  detail::preload<&coll::counts_kernel>();
  coll::counts_kernel<<<1, 64, 0, c.stream>>>(a);
  c.launched();
  detail::preload<&coll::push_kernel>();
  coll::push_kernel<<<g, kThreads, 0, c.stream>>>(a);
  c.launched();
  if (!via_workspace) return;
  detail::preload<&coll::copy_out_kernel>();
  coll::copy_out_kernel<<<g, kThreads, 0, c.stream>>>(a, static_cast<char*>(out));
  c.launched();
}

}  // namespace

// The calls, and their plans: the same code, run with a launching Call or a planning one.
template <class... Args>
void run_op(const char* name, Communicator& comm, Rank& rank, cudaStream_t stream,
            void (*run)(Call&, Args...), std::type_identity_t<Args>... args) {
  Call c(comm, rank, stream, name);
  run(c, args...);
}
template <class... Args>
Plan plan_op(const char* name, Communicator& comm, Rank& rank, cudaStream_t stream,
             void (*run)(Call&, Args...), std::type_identity_t<Args>... args) {
  Plan plan;
  Call c(comm, rank, stream, name, &plan);
  run(c, args...);
  return plan;
}

void all_reduce(Communicator& comm, Rank& rank, const void* in, void* out, size_t count, DType dtype,
                ReduceOp op, cudaStream_t stream, const CollectiveOptions& options) {
  run_op("all_reduce", comm, rank, stream, run_all_reduce, in, out, count, dtype, op, options);
}
Plan all_reduce_plan(Communicator& comm, Rank& rank, const void* in, void* out, size_t count, DType dtype,
                     ReduceOp op, cudaStream_t stream, const CollectiveOptions& options) {
  return plan_op("all_reduce", comm, rank, stream, run_all_reduce, in, out, count, dtype, op, options);
}

void all_gather(Communicator& comm, Rank& rank, const void* in, void* out, Shape2D in_shape, int dim,
                DType dtype, cudaStream_t stream) {
  run_op("all_gather", comm, rank, stream, run_all_gather, in, out, in_shape, dim, dtype);
}
Plan all_gather_plan(Communicator& comm, Rank& rank, const void* in, void* out, Shape2D in_shape, int dim,
                     DType dtype, cudaStream_t stream) {
  return plan_op("all_gather", comm, rank, stream, run_all_gather, in, out, in_shape, dim, dtype);
}

void reduce_scatter(Communicator& comm, Rank& rank, const void* in, void* out, Shape2D out_shape, int dim,
                    DType dtype, ReduceOp op, cudaStream_t stream, const CollectiveOptions& options) {
  run_op("reduce_scatter", comm, rank, stream, run_reduce_scatter, in, out, out_shape, dim, dtype, op,
         options);
}
Plan reduce_scatter_plan(Communicator& comm, Rank& rank, const void* in, void* out, Shape2D out_shape,
                         int dim, DType dtype, ReduceOp op, cudaStream_t stream,
                         const CollectiveOptions& options) {
  return plan_op("reduce_scatter", comm, rank, stream, run_reduce_scatter, in, out, out_shape, dim, dtype, op,
                 options);
}

void all_to_all(Communicator& comm, Rank& rank, const void* in, void* out, size_t count_per_rank, DType dtype,
                cudaStream_t stream) {
  run_op("all_to_all", comm, rank, stream, run_all_to_all, in, out, count_per_rank, dtype);
}
Plan all_to_all_plan(Communicator& comm, Rank& rank, const void* in, void* out, size_t count_per_rank,
                     DType dtype, cudaStream_t stream) {
  return plan_op("all_to_all", comm, rank, stream, run_all_to_all, in, out, count_per_rank, dtype);
}

void broadcast(Communicator& comm, Rank& rank, const void* in, void* out, size_t count, DType dtype, int root,
               cudaStream_t stream) {
  run_op("broadcast", comm, rank, stream, run_broadcast, in, out, count, dtype, root);
}
Plan broadcast_plan(Communicator& comm, Rank& rank, const void* in, void* out, size_t count, DType dtype,
                    int root, cudaStream_t stream) {
  return plan_op("broadcast", comm, rank, stream, run_broadcast, in, out, count, dtype, root);
}

void scatter(Communicator& comm, Rank& rank, const void* in, void* out, size_t count, DType dtype, int root,
             cudaStream_t stream) {
  run_op("scatter", comm, rank, stream, run_scatter, in, out, count, dtype, root);
}
Plan scatter_plan(Communicator& comm, Rank& rank, const void* in, void* out, size_t count, DType dtype,
                  int root, cudaStream_t stream) {
  return plan_op("scatter", comm, rank, stream, run_scatter, in, out, count, dtype, root);
}

void gather(Communicator& comm, Rank& rank, const void* in, void* out, size_t count, DType dtype, int root,
            cudaStream_t stream) {
  run_op("gather", comm, rank, stream, run_gather, in, out, count, dtype, root);
}
Plan gather_plan(Communicator& comm, Rank& rank, const void* in, void* out, size_t count, DType dtype,
                 int root, cudaStream_t stream) {
  return plan_op("gather", comm, rank, stream, run_gather, in, out, count, dtype, root);
}

void reduce(Communicator& comm, Rank& rank, const void* in, void* out, size_t count, DType dtype, ReduceOp op,
            int root, cudaStream_t stream) {
  run_op("reduce", comm, rank, stream, run_reduce, in, out, count, dtype, op, root);
}
Plan reduce_plan(Communicator& comm, Rank& rank, const void* in, void* out, size_t count, DType dtype,
                 ReduceOp op, int root, cudaStream_t stream) {
  return plan_op("reduce", comm, rank, stream, run_reduce, in, out, count, dtype, op, root);
}

void all_to_all_v(Communicator& comm, Rank& rank, const void* in, const int64_t* send_counts,
                  size_t in_capacity, void* out, int64_t* recv_counts, size_t out_capacity, size_t row_elems,
                  DType dtype, cudaStream_t stream) {
  run_op("all_to_all_v", comm, rank, stream, run_all_to_all_v, in, send_counts, in_capacity, out, recv_counts,
         out_capacity, row_elems, dtype);
}
Plan all_to_all_v_plan(Communicator& comm, Rank& rank, const void* in, const int64_t* send_counts,
                       size_t in_capacity, void* out, int64_t* recv_counts, size_t out_capacity,
                       size_t row_elems, DType dtype, cudaStream_t stream) {
  return plan_op("all_to_all_v", comm, rank, stream, run_all_to_all_v, in, send_counts, in_capacity, out,
                 recv_counts, out_capacity, row_elems, dtype);
}

}  // namespace weft
