// Host side of weft::flash_decode (weft/ops/flash_decode.hpp): checks, the split of the work, the inboxes
// (two of the communicator's workspace areas, "flash decode inbox, even / odd calls", symmetric) and the
// launch (device code: weft/ops/flash_decode.cuh).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <string>

#include "op_args.hpp"
#include "weft/ops/flash_decode.cuh"
#include "weft/ops/flash_decode.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/kernel_preload.hpp"

namespace weft {
namespace {

const char* const kInbox[2] = {"flash decode inbox, even calls", "flash decode inbox, odd calls"};
const char* const kState = "flash_decode: call count, finishers";
const char* const kLanded = "flash_decode: partials landed per (sequence, KV head), per call parity";
const char* const kMerged = "flash_decode: rows merged per (sequence, KV head), per call parity";
const char* const kReleased = "flash_decode: the last call each rank finished, per call parity";
const char* const kSplitDone = "flash_decode: split items done per (sequence, KV head), per call parity";
const ResourceDeclaration kDecodeResources[] = {
    ResourceDeclaration{{kState, 2}},
    ResourceDeclaration{{kLanded, 2 * ops::kDecodeMaxPairs}},
    ResourceDeclaration{{kMerged, 2 * ops::kDecodeMaxPairs}},
    ResourceDeclaration{{kReleased, 2 * ops::kDecodeMaxWorld}},
    ResourceDeclaration{{kSplitDone, 2 * ops::kDecodeMaxPairs}},
};

constexpr int64_t kFewParts = 64;  // parts of a row a warp merges alone

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

void check_shape(const DecodeShape& s, const DecodeCache& c, int world, DType dtype,
                 const std::string& where) {
  WEFT_CHECK(dtype == DType::kBF16 || dtype == DType::kFP16,
             where + "q, the cache and out must be bf16 or fp16");
  WEFT_CHECK(s.head_dim == 64 || s.head_dim == 128,
             where + "head_dim must be 64 or 128, got " + std::to_string(s.head_dim));
  WEFT_CHECK(s.batch >= 1 && s.q_len >= 1 && s.kv_heads >= 1 && s.heads >= 1,
             where + "batch, q_len, heads and kv_heads must be at least 1");
  WEFT_CHECK(s.heads % s.kv_heads == 0, where + "heads (" + std::to_string(s.heads) +
                                            ") must be a multiple of kv_heads (" +
                                            std::to_string(s.kv_heads) + ")");
  WEFT_CHECK(s.batch * s.kv_heads <= ops::kDecodeMaxPairs,
             where + "batch x kv_heads = " + std::to_string(s.batch * s.kv_heads) + " is more than the " +
                 std::to_string(ops::kDecodeMaxPairs) + " (sequence, KV head) pairs a call takes");
  WEFT_CHECK(
      s.batch * s.q_len * s.heads * s.head_dim < INT32_MAX && s.q_len * s.heads / s.kv_heads < INT32_MAX,
      where + "sizes past 2^31 are not supported");
  if (c.block_table != nullptr) {
    WEFT_CHECK(c.block_size >= 1 && c.max_blocks >= 1 && c.num_blocks >= 1,
               where + "a paged cache needs block_size, max_blocks and num_blocks of at least 1");
    WEFT_CHECK(s.max_local == c.block_size * c.max_blocks,
               where + "max_local (" + std::to_string(s.max_local) + ") must be max_blocks x block_size (" +
                   std::to_string(c.block_size * c.max_blocks) + ") for a paged cache");
    WEFT_CHECK(c.num_blocks * c.block_size * s.kv_heads * s.head_dim < (int64_t(1) << 40) &&
                   c.num_blocks <= INT32_MAX,
               where + "a cache past 2^40 elements is not supported");
  } else {
    WEFT_CHECK(c.block_size == 0 && c.max_blocks == 0 && c.num_blocks == 0,
               where + "block_size, max_blocks and num_blocks are for a paged cache (block_table set)");
  }
  WEFT_CHECK(s.max_local >= 1 && s.max_local <= INT32_MAX,
             where + "max_local must be 1 .. 2^31 - 1, got " + std::to_string(s.max_local));
  (void)world;
}

// The work's split: every rank derives the same from the shape, the world size and the SM budget (the same
// on every rank), so the landed counts and the inbox layouts agree; the GPU's occupancy sizes only the grid.
// Items sized to the resident blocks' waves; each split at least 32 x W tokens (the partials pushed stay
// below ~1/4 of the KV bytes read) and whole loop steps; at most kDecodeMaxParts partials per row to merge.
struct Split {
  int rows, row_groups, splits, chunk, merge_rows, grid;
  size_t smem;
};

template <class T, int kD>
int resident_per_sm(int device, size_t smem) {
  static std::atomic<int> cached[64];  // per device (0: not asked yet)
  std::atomic<int>& c = cached[device % 64];
  int n = c.load();
  if (n == 0) {
    WEFT_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, ops::flash_decode_kernel<T, kD>,
                                                                  ops::kDecodeWarps * 32, smem));
    n = std::max(n, 1);
    c.store(n);
  }
  return n;
}

template <class T, int kD>
Split split_of(const Rank& rank, const DecodeShape& s) {
  using K = ops::DecodeKernel<T, kD>;
  const int W = rank.world();
  Split x{};
  x.rows = static_cast<int>(s.q_len * (s.heads / s.kv_heads));
  x.row_groups = static_cast<int>(ceil_div(x.rows, ops::kDecodeRows));
  x.smem = sizeof(typename K::Smem);
  const int64_t pair_items = s.batch * s.kv_heads * x.row_groups;
  const int64_t min_chunk =
      ceil_div(std::max<int64_t>(32 * W, K::kTokensPerStep), K::kTokensPerStep) * K::kTokensPerStep;
  const int64_t most = std::max<int64_t>(
      1, std::min<int64_t>(ceil_div(s.max_local, min_chunk), ops::kDecodeMaxParts / std::max(W, 1)));
  // The split count whose items fill the resident blocks' waves best (time ~ waves / splits; the fewest
  // splits among equals: fewer partials to merge). Resident blocks from a constant (the kernel's registers
  // allow two per SM), not the occupancy query: the ranks' splits must agree.
  const int64_t slots = int64_t(ops::kDecodeBlocksPerSm) * rank.sm_budget();
  int64_t want = 1;
  for (int64_t n = 2; n <= std::min<int64_t>(most, 4 * ceil_div(slots, pair_items)); ++n)
    if (ceil_div(pair_items * n, slots) * want < ceil_div(pair_items * want, slots) * n) want = n;
  x.chunk = static_cast<int>(ceil_div(ceil_div(s.max_local, want), K::kTokensPerStep) * K::kTokensPerStep);
  x.splits = static_cast<int>(ceil_div(s.max_local, x.chunk));
  const int64_t resident = int64_t(resident_per_sm<T, kD>(rank.device(), x.smem)) * rank.sm_budget();
  // Phase 2: a row a warp where rows outnumber the blocks and each has few parts to merge (a block's chain
  // of dependent loads then serves four rows, in fewer rounds), else a row a block.
  const int64_t rows_total = s.batch * s.kv_heads * int64_t(x.rows);
  // (A row's parts: one a rank, after each rank's S splits were merged, in the same items, on that rank.)
  x.merge_rows = std::max<int64_t>(W, x.splits) <= kFewParts && rows_total > slots ? ops::kDecodeWarps : 1;
  x.grid = static_cast<int>(std::min<int64_t>(
      resident, std::max<int64_t>(pair_items * x.splits,
                                  s.batch * s.kv_heads * ceil_div(x.rows, x.merge_rows))));
  return x;
}

template <class T, int kD>
void launch(ops::OpCall& call, const void* q, const DecodeCache& c, void* out, float* lse,
            const DecodeShape& s, const DecodeOptions& o) {
  const Split x = split_of<T, kD>(call.rank, s);
  const int W = call.rank.world();
  const int64_t parts = int64_t(W) * s.batch * s.kv_heads * x.splits * x.rows;  // one parity's
  const uint64_t inbox_bytes = ops::bytes_carved_by([&](ops::WorkspaceLayout& w) {
    w.take(parts * kD * 4);
    w.take(parts * 8);
  });
  ops::DecodeParams<T> p{};
  p.team = call.rank.view();
  p.epoch = CallEpoch{p.team.flag(call.comm.resources(call.rank, kState).flags, 0)};
  p.landed = call.comm.resources(call.rank, kLanded).flags;
  p.merged = call.comm.resources(call.rank, kMerged).flags;
  p.released = call.comm.resources(call.rank, kReleased).flags;
  p.split_done = call.comm.resources(call.rank, kSplitDone).flags;
  p.out_rank = o.out_rank;
  p.q = static_cast<const T*>(q);
  p.out = static_cast<T*>(out);
  p.lse = lse;
  p.k = static_cast<const T*>(c.k);
  p.v = static_cast<const T*>(c.v);
  p.block_table = c.block_table;
  p.block_size = static_cast<int>(c.block_size);
  p.max_blocks = static_cast<int>(c.max_blocks);
  p.num_blocks = static_cast<int>(c.num_blocks);
  p.seqlens = c.seqlens;
  p.offsets = c.offsets;
  p.seq_total = c.seq_total;
  p.batch = static_cast<int>(s.batch);
  p.q_len = static_cast<int>(s.q_len);
  p.heads = static_cast<int>(s.heads);
  p.kv_heads = static_cast<int>(s.kv_heads);
  p.group = static_cast<int>(s.heads / s.kv_heads);
  p.rows = x.rows;
  p.row_groups = x.row_groups;
  p.splits = x.splits;
  p.chunk = x.chunk;
  p.merge_rows = x.merge_rows;
  p.max_local = static_cast<int>(s.max_local);
  const float scale = o.scale > 0.f ? o.scale : 1.f / std::sqrt(float(kD));
  p.scale_log2 = scale * 1.4426950408889634f;
  p.causal = o.causal;
  for (int parity = 0; parity < 2; ++parity) {
    ops::WorkspaceLayout inbox(call.workspace(inbox_bytes, kInbox[parity]));
    p.part_o[parity] = inbox.take<float>(parts * kD * 4);
    p.part_ml[parity] = inbox.take<float2>(parts * 8);
  }
  if (call.planned(o.out_rank < 0 ? "split-KV decode, partials merged on every rank"
                                  : "split-KV decode, partials merged on rank " + std::to_string(o.out_rank),
                   x.grid))
    return;
  constexpr auto kernel = &ops::flash_decode_kernel<T, kD>;
  detail::preload<kernel>();
  kernel<<<x.grid, ops::kDecodeWarps * 32, x.smem, call.stream>>>(p);
  WEFT_CUDA_CHECK(cudaGetLastError());
}

// The call, or its plan (weft/ops/plan.hpp) with `plan`: the same code up to the launch.
void run(Communicator& comm, Rank& rank, const void* q, const DecodeCache& cache, void* out, float* lse,
         const DecodeShape& shape, DType dtype, cudaStream_t stream, const DecodeOptions& options,
         Plan* plan) {
  ops::OpCall call(comm, rank, stream, ops::team_where("weft::flash_decode", rank), plan);
  if (plan) plan->op = "flash_decode";
  const std::string& where = call.where;
  check_shape(shape, cache, rank.world(), dtype, where);
  WEFT_CHECK(options.scale >= 0.f, where + "options.scale must be 0 (1 / sqrt(head_dim)) or positive");
  WEFT_CHECK(rank.world() <= ops::kDecodeMaxWorld,
             where + "teams of up to " + std::to_string(ops::kDecodeMaxWorld) + " ranks");
  WEFT_CHECK(options.out_rank >= -1 && options.out_rank < rank.world(),
             where + "options.out_rank must be -1 (every rank) or a rank of the team (0.." +
                 std::to_string(rank.world() - 1) + "), got " + std::to_string(options.out_rank));
  const bool writes_out = options.out_rank < 0 || options.out_rank == rank.rank();
  WEFT_CHECK(
      rank.world() == 1 || !options.causal || shape.q_len == 1 ||
          (cache.offsets != nullptr && cache.seq_total != nullptr),
      where + "on a team, causal masking among " + std::to_string(shape.q_len) +
          " new tokens needs cache.offsets and cache.seq_total (each rank's part, the global lengths)");
  const int64_t d = shape.head_dim, tok = shape.kv_heads * d;
  const int64_t q_bytes = shape.batch * shape.q_len * shape.heads * d * 2;
  call.check_buffer(q, "q", q_bytes);
  if (writes_out) call.check_buffer(out, "out", q_bytes);
  const int64_t slots =
      cache.block_table ? cache.num_blocks * cache.block_size : shape.batch * shape.max_local;
  call.check_buffer(cache.k, "cache.k", slots * tok * 2);
  call.check_buffer(cache.v, "cache.v", slots * tok * 2);
  call.check_buffer(cache.seqlens, "cache.seqlens", shape.batch * 4, 4);
  if (cache.block_table)
    call.check_buffer(cache.block_table, "cache.block_table", shape.batch * cache.max_blocks * 4, 4);
  if (cache.offsets) call.check_buffer(cache.offsets, "cache.offsets", shape.batch * 4, 4);
  if (cache.seq_total) call.check_buffer(cache.seq_total, "cache.seq_total", shape.batch * 4, 4);
  if (lse && writes_out) call.check_buffer(lse, "lse", shape.batch * shape.q_len * shape.heads * 4, 4);
  if (dtype == DType::kFP16)
    d == 64 ? launch<__half, 64>(call, q, cache, out, lse, shape, options)
            : launch<__half, 128>(call, q, cache, out, lse, shape, options);
  else
    d == 64 ? launch<__nv_bfloat16, 64>(call, q, cache, out, lse, shape, options)
            : launch<__nv_bfloat16, 128>(call, q, cache, out, lse, shape, options);
}

}  // namespace

void flash_decode(Communicator& comm, Rank& rank, const void* q, const DecodeCache& cache, void* out,
                  float* lse, const DecodeShape& shape, DType dtype, cudaStream_t stream,
                  const DecodeOptions& options) {
  run(comm, rank, q, cache, out, lse, shape, dtype, stream, options, nullptr);
}

Plan flash_decode_plan(Communicator& comm, Rank& rank, const void* q, const DecodeCache& cache, void* out,
                       float* lse, const DecodeShape& shape, DType dtype, cudaStream_t stream,
                       const DecodeOptions& options) {
  Plan plan;
  run(comm, rank, q, cache, out, lse, shape, dtype, stream, options, &plan);
  return plan;
}

}  // namespace weft
