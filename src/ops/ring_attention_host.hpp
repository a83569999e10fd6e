// What the ring attention launchers share (src/ops/ring_attention.cu, ring_attention_backward.cu): the
// pass of a rank (ring_pass_of), its table of segments and ranges in the caller's workspace, the receive
// slots' chunking and the launch setup.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "attention_args.hpp"
#include "ring_attention_plan.hpp"
#include "sequence_parallel.hpp"
#include "weft/lcsc/launch.cuh"
#include "weft/ops/ring_attention.cuh"
#include "weft/runtime/communicator.hpp"
#include "weft/runtime/error.hpp"

namespace weft::ops {

// Chunks per slot: a function of the world size alone, so every call signals the same flags and each flag
// grows by kRingPiecesPerChunk per call.
inline RingSlots ring_slots(int world, int64_t slot_rows, int64_t local_rows, int* landed) {
  RingSlots s{};
  s.landed = landed;
  s.chunks = world < 2 ? 1 : std::min(kRingMaxChunksPerSlot, kRingChunkFlags / (world - 1));
  s.slot_rows = static_cast<int>(slot_rows);
  s.chunk_rows = static_cast<int>(std::max<int64_t>(1, (slot_rows + s.chunks - 1) / s.chunks));
  s.local_rows = static_cast<int>(local_rows);
  return s;
}

// A rank's pass and the sizes every launch derives from it.
struct RingPassSizes {
  RingLayout L;
  int rank = 0;
  RingTravel travel;
  RingPass pass;
  int64_t local = 0;      // this rank's rows
  int64_t slot_rows = 1;  // the longest rank's rows (a receive slot's)
  int64_t max_own = 1;    // the longest segment
  RingPassSizes(int world, int r, const std::vector<int64_t>& doc_lengths, Sharding sharding, RingTravel t,
                int grain)
      : L(ring_layout(doc_lengths, world, sharding.causal, grain, sharding.zigzag)),
        rank(r),
        travel(t),
        pass(ring_pass_of(L, r, t)) {
    local = L.local_rows(rank);
    slot_rows = std::max<int64_t>(1, max_local_rows(L));
    for (int64_t x = 0; x < pass.segments(); ++x)
      max_own = std::max(max_own, pass.own_end[x] - pass.own_begin[x]);
  }
  int64_t segments() const { return pass.segments(); }
  // The pass's table: own_begin, own_end (per segment), met_begin, met_end (per segment and step), then
  // push_begin, push_end (per slot).
  size_t table_bytes() const {
    return round256(size_t(2 * segments() * (1 + L.world) + 2 * std::max(1, L.world - 1) + 1) * 4);
  }
  // RingSlots::landed: [kRingMaxBlocks][world - 1] counts, zeroed before each kernel.
  size_t landed_bytes() const { return round256(size_t(kRingMaxBlocks) * std::max(1, L.world - 1) * 4); }
};

// The table's words, segments heaviest first (ring_segment_order), so the persistent blocks' last items are
// light ones and they end together; then the slots' push rows (ring_push_rows).
inline std::vector<int32_t> ring_table_words(const RingPassSizes& z, int box_rows) {
  const RingPass& pass = z.pass;
  const int64_t G = pass.segments(), W = pass.steps;
  const std::vector<int64_t> order = ring_segment_order(pass);
  const int64_t slots = std::max<int64_t>(1, W - 1);
  std::vector<int32_t> words(2 * G * (1 + W) + 2 * slots + 1, 0);
  for (int64_t y = 0; y < G; ++y) {
    const int64_t x = order[y];
    words[y] = static_cast<int32_t>(pass.own_begin[x]);
    words[G + y] = static_cast<int32_t>(pass.own_end[x]);
    for (int64_t s = 0; s < W; ++s) {
      words[2 * G + y * W + s] = static_cast<int32_t>(pass.met_begin[x * W + s]);
      words[2 * G + G * W + y * W + s] = static_cast<int32_t>(pass.met_end[x * W + s]);
    }
  }
  const std::vector<std::pair<int64_t, int64_t>> push =
      ring_push_rows(z.L, z.rank, z.travel, box_rows, z.slot_rows);
  // WEFT_RING_NO_COPY=1, a developer flag (the results are wrong): every piece only signals, so a benchmark
  // times the same kernels without their data movement; the difference is the exposed communication.
  const char* no_copy = std::getenv("WEFT_RING_NO_COPY");
  if (no_copy != nullptr && std::string(no_copy) == "1") return words;  // push rows [0, 0): none
  for (int64_t slot = 0; slot < slots; ++slot) {
    words[2 * G * (1 + W) + slot] = static_cast<int32_t>(push[slot].first);
    words[2 * G * (1 + W) + slots + slot] = static_cast<int32_t>(push[slot].second);
  }
  return words;
}
// Where the uploaded table's arrays start.
struct RingTable {
  const int32_t *own_begin, *own_end, *met_begin, *met_end, *push_begin, *push_end;
  RingTable(const int32_t* words, int64_t segments, int world)
      : own_begin(words),
        own_end(words + segments),
        met_begin(words + 2 * segments),
        met_end(words + 2 * segments + segments * world),
        push_begin(words + 2 * segments * (1 + world)),
        push_end(push_begin + std::max(1, world - 1)) {}
};

// The flags of one ring op (declared by its launcher): its call count and finishers (2 flags) and its chunk
// arrivals (kRingChunkFlags flags).
struct RingResources {
  const char *state, *arrived;
};

// What a ring launch sets up alike for both passes, in two parts.
// The scheduler's fields that follow from the sizes alone (`block_rows` own rows per work unit; heads = the
// scheduler's head count) and the grid within the rank's SM budget (every rank launches at least one block:
// its pushes feed its peers and its call count must advance with theirs). Plans and launches alike.
// `pair_causal`: causal units pair blocks j and count - 1 - j (lcsc/attention_scheduler.cuh), as they do
// unless an op's units are already small.
template <class Op>
int ring_schedule(const Rank& rank, const RingPassSizes& z, const RingTable& table, int64_t heads,
                  int block_rows, const AttentionOptions& options, lcsc::AttentionSchedulerParams& sched,
                  bool pair_causal = true) {
  sched.batch = static_cast<int>(z.segments());
  sched.heads = static_cast<int>(heads);
  sched.q_blocks = static_cast<int>((z.max_own + block_rows - 1) / block_rows);
  sched.row_begin = table.own_begin;
  sched.row_end = table.own_end;
  sched.block_rows = block_rows;
  sched.paired = z.pass.causal && pair_causal;
  const int resident = std::min(lcsc::Launcher<Op>::max_resident_clusters(), rank.sm_budget());
  const int blocks = std::max(1, attention_blocks(resident, options, sched.units()));
  sched.compute_blocks = blocks;
  return blocks;
}

// A ring kernel planning (OpCall::planning): its grid (ring_schedule's) and shared memory into the plan
// (OpCall::planned_op); true (launch nothing). Else false.
template <class Op>
bool ring_planned(OpCall& call, const RingPassSizes& z, const RingTable& table, int64_t heads, int block_rows,
                  const AttentionOptions& options, const char* op, const std::string& path,
                  bool pair_causal = true) {
  if (!call.planning()) return false;
  lcsc::AttentionSchedulerParams sched{};
  const int blocks = ring_schedule<Op>(call.rank, z, table, heads, block_rows, options, sched, pair_causal);
  return call.planned_op(op, path, blocks, static_cast<int>(lcsc::kSmemBytes<Op>));
}

// The launch setup: ring_schedule, the rank's timeline (timed kernels), L2 sections of up to `section_pairs`
// within a segment (ring_section_pairs; `section_granule`: their multiple), the team sync (finishers: every
// consumer warpgroup and helper warp) and the landed counts zeroed on `stream`. Returns the grid.
template <class Op>
int ring_launch_setup(Communicator& comm, Rank& rank, const RingPassSizes& z, const RingTable& table,
                      const RingResources& res, int64_t heads, int block_rows, int64_t section_pairs,
                      int64_t section_granule, const AttentionOptions& options, int* landed,
                      cudaStream_t stream, typename Op::Params& p, const std::string& where,
                      bool pair_causal = true) {
  lcsc::AttentionSchedulerParams& sched = p.sched;
  const int blocks = ring_schedule<Op>(rank, z, table, heads, block_rows, options, sched, pair_causal);
  set_team_timeline(p, rank);
  sched.section_pairs = static_cast<int>(
      ring_section_pairs(std::min<int64_t>(section_pairs, std::max<int64_t>(z.segments(), 1) * heads), heads,
                         z.segments(), section_granule));
  WEFT_CHECK(blocks <= kRingMaxBlocks, where + "more compute blocks than the landed counts hold");
  p.sync = {rank.view(), comm.resources(rank, res.state).flags, comm.resources(rank, res.arrived).flags,
            blocks * (Op::kConsumerWarpgroups + tile::kWarpgroupThreads / 32 - 1)};
  p.steps = z.L.world;
  WEFT_CUDA_CHECK(cudaMemsetAsync(landed, 0, z.landed_bytes(), stream));
  p.slots = ring_slots(z.L.world, z.slot_rows, z.local, landed);
  p.slots.push_begin = table.push_begin;
  p.slots.push_end = table.push_end;
  return blocks;
}

}  // namespace weft::ops
