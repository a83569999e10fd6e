// Device code of the fused tensor-parallel ops, each a short wrapper of the LCSC GEMM (ops/gemm.cuh) plus the
// communication primitives. Unicast only: peer stores, TMA reduce-add into a peer, signals, barriers.
//
// Per-call epoch: every fused kernel reads `state[0] + 1` (state: fused-op user flags in the signal pad,
// local to the rank) as its call epoch; every block, or consumer warpgroup, adds 1 to state[1] when it will
// not read the epoch again, and the last one stores the epoch into state[0] (and clears state[1] for the next
// call). Every rank makes the same fused calls in the same order, so epochs agree across ranks. Flags only
// grow.
//
//   AgGemmOp  all-gather + GEMM, inter-SM overlap (AllGatherA on the bf16 GEMM; on the FP8 GEMM, whose rows'
//             scales travel with them, all_gather_scaled_matmul). Tiles whose rows lie in this rank's shard
//             read the shard itself (a second A map): they need no wait and run first. Communicator blocks
//             meet their counterparts (so every peer's previous call is over), then push this rank's A shard,
//             chunk by chunk, into the peers' gathered A (rank - 1 first, then rank - 2, ...: rank - 1 walks
//             this rank's rows right after its own) and set that rank's flag of the chunk to the epoch;
//             the copy into this rank's own gathered A comes last (only tiles straddling two shards, and
//             the caller's gathered A, read it). The loader's wait_inputs waits for the flags of every
//             chunk a tile's rows touch; where rows carry scales, which the consumers read themselves, one
//             thread of each consumer warpgroup waits for them too.
//   RsGemmOp  GEMM + reduce-scatter, intra-SM overlap (ReduceScatterC on the bf16 GEMM; on the FP8 GEMM,
//             scaled_matmul_reduce_scatter / all_reduce). The storer TMA-stores each 64-row half tile (bf16)
//             into the staging slot of this rank in the workspace of the rank owning those rows (one tensor
//             map per owner); the tile order deals the owners' rows round-robin (where they split evenly),
//             so each rank writes to every owner at once. One communicator block meets the team first (every
//             owner has finished reading the previous call's staging) and raises a local flag the storers
//             wait on before their first store. After the GEMM, coll::reduce_scatter_kernel in its pre-staged
//             mode meets again (every rank's stores have landed) and sums the W slots of this rank's rows
//             (all-reduce: into every rank's copy of the output). bf16 partials, as NCCL's ring sums them:
//             half the link bytes of fp32 partials. With FusedOptions::Partials::kAddedAtOwner the maps point
//             at one zeroed sum per owner and the storer reduce-adds (Params::store_mode) instead, with no
//             reduce pass. Counted (Params::counted): once a half tile's adds have completed (checked when
//             the warpgroup stores its next tile, so no store waits on the link) the storer adds 1 to the
//             owner's count of that 64-row half; the owner's communicator blocks wait for each half's W x
//             tiles_n adds and, while the GEMM goes on, copy it into out (reduce-scatter) or push it to every
//             peer's out (all-reduce: the sum is the owner's slice of a symmetric out), then meet so that
//             every push into this rank's out has landed before its kernel ends. All ranks walk the tiles in
//             one order (no per-rank rotation), so the halves complete band by band. Staged and counted
//             (Partials::kStagedProgressive, Params::staged_slots): the tiles are stored into the slots as
//             staged, counted as added, and the communicator blocks sum each completed half's W slots
//             (sum_staged_half, in the staged reduce's order) into out, or every rank's out.
//             Summed in the epilogue (Partials::kSummedInEpilogue, EpilogueSummedC below): every SM computes,
//             the owner of a tile last (lcsc::OwnerRoundsScheduler); its epilogue adds the peers' staged
//             partials to its accumulators and stores the final tile; no reduce pass.
#pragma once
#include <type_traits>

#include "weft/comm/barrier.cuh"
#include "weft/comm/call_epoch.cuh"
#include "weft/comm/signal.cuh"
#include "weft/lcsc/owner_rounds_scheduler.cuh"
#include "weft/ops/collectives.cuh"
#include "weft/ops/gemm.cuh"

namespace weft::ops {

inline constexpr int kFusedMaxWorld = 8;       // RsGemmOp carries one tensor map per rank
inline constexpr int kFusedChunkFlags = 1024;  // AG chunk flags: (source rank, chunk) pairs at most
inline constexpr int kRsHalfFlags = 1024;  // RS / AR counted halves: 64-row halves of a rank's rows at most

// The block's threads copy n 16-byte units, 4 loads in flight per thread (a communicator block's push).
__device__ __forceinline__ void block_copy16(uint4* to, const uint4* from, int64_t n) {
  const int64_t step = blockDim.x;
  int64_t i = threadIdx.x;
  for (; i + 3 * step < n; i += 4 * step) {
    uint4 v[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) v[q] = from[i + q * step];
#pragma unroll
    for (int q = 0; q < 4; ++q) to[i + q * step] = v[q];
  }
  for (; i < n; i += step) to[i] = from[i];
}

// What every fused kernel synchronizes with (granted by the host, src/ops/fused.cu): its call count and
// finishers (CallEpoch), RS's "start meeting passed" flag, AG's chunk flags, and the block-meeting slots it
// shares with the collectives.
struct FusedSync {
  TeamView team;
  Flags state;   // [0] calls completed, [1] finishers of this call
  Flags ready;   // [0] RS: the start meeting has passed (this call's epoch)
  Flags chunks;  // AG: chunk j of source rank s has landed here, flag s * chunks_per_shard + j
  BarrierSlots meetings;
  int done_target;  // finishers per call: consumer warpgroups of compute blocks + communicator blocks
  __device__ CallEpoch calls() const { return CallEpoch{team.flag(state, 0)}; }
  __device__ uint64_t epoch() const { return calls().epoch(); }
  __device__ void done() const { calls().finished(uint64_t(done_target)); }  // reads the epoch no more
  // By the one finisher that finishes last (thread 0 of a communicator block): waits until every other
  // finisher of this call has finished (false: the wait failed, recorded). It may last the whole kernel:
  // the team's timeout applies to the finishers' count standing still, not to the wait.
  __device__ bool others_finished() const {
    return wait_ge_local_progressing(team, team.flag(state, 1), uint64_t(done_target - 1));
  }
};

// ---- all-gather + GEMM ---------------------------------------------------------------------------------
// AllGatherA<Gemm>: the hooks that gather A into any LCSC GEMM op with one A map (GemmOp bf16, Fp8GemmOp).
// A's rows are row_bytes apart, dense; rows may carry scales (the FP8 GEMM's per-row or per-row-and-k-block
// scales of A: scale_cols floats a row), which travel with their chunk, before its flag.
template <class Gemm>
struct AllGatherA : Gemm {
  using Base = Gemm;
  struct Params : Base::Params {
    FusedSync sync;
    CUtensorMap a_local;       // this rank's shard [shard_rows, K], same box as Base::Params::a
    const char* a_shard;       // [shard_rows, K], dense, this rank's
    char* gathered;            // [W * shard_rows, K], dense, symmetric (Base::Params::a maps it)
    const float* scale_shard;  // [shard_rows, scale_cols], this rank's (scale_cols 0: none)
    float* scale_gathered;     // [W * shard_rows, scale_cols], symmetric (what the GEMM reads)
    int64_t shard_rows, row_bytes;
    int scale_cols;
    int chunk_rows, chunks;  // per shard: chunk j = rows [j * chunk_rows, ..), its flag (source * chunks + j)
    // The shard also goes into this rank's own gathered rows: needed where the caller takes the gathered A,
    // a tile straddles two shards (its loads read both from `gathered`), or the GEMM reads every row's scales
    // there; else the peers' pushes alone (a quarter less of the communicator blocks' work at 4 GPUs).
    bool copy_self;
    // FusedOptions::Gather::kCopyEngine: chunk j of source s has landed once this rank's count of s's
    // pushes (flag s of `arrivals`, written by s's copy stream, host-set values cleared after every call)
    // reaches j + 1; count 0: the communicator blocks' epoch flags (`sync.chunks`).
    Flags arrivals;
  };

  __device__ static uint64_t* flag(const Params& p, int src, int j) {
    return p.sync.team.flag(p.sync.chunks, src * p.chunks + j);
  }
  // First row of tile t inside this rank's shard, or -1 when the tile's rows are not all in it.
  __device__ static int64_t local_row(const Params& p, const lcsc::Tile& t) {
    const int64_t r0 = int64_t(t.m) * Base::kBM - int64_t(p.sync.team.rank) * p.shard_rows;
    return r0 >= 0 && r0 + Base::kBM <= p.shard_rows ? r0 : -1;
  }
  __device__ static void init(const Params& p, typename Base::Smem& s) {
    Base::init(p, s);
    tma::prefetch_map(&p.a_local);
  }
  __device__ static void load(const Params& p, typename Base::Smem& s, typename Base::Pipeline& pipe,
                              lcsc::PipeState& st, const lcsc::Tile& t) {
    const int64_t r = local_row(p, t);
    if (r < 0) return Base::load(p, s, pipe, st, t);
    Base::Mainloop::load(s.main, pipe, st, &p.a_local, &p.b, int(r), t.n * Base::kBN, p.k_blocks);
  }
  __device__ static void wait_inputs(const Params& p, const lcsc::Tile& t) {
    if (local_row(p, t) >= 0) return;  // the shard itself: ready before the kernel started
    wait_rows(p, t);
    acquire_for_tma();  // peers' generic stores before our TMA loads
  }
  // Rows' scales: the GEMM's consumers read them before their first pipeline wait (the loads overlap it), so
  // they cannot rely on the loader's wait: one thread of the warpgroup waits for the same chunks first.
  __device__ static void compute(const Params& p, typename Base::Smem& s, typename Base::Pipeline& pipe,
                                 lcsc::PipeState& st, const lcsc::Tile& t, int wg,
                                 typename Base::Accum& acc) {
    if (p.scale_cols > 0 && local_row(p, t) < 0) {
      if (tile::thread_in_warpgroup() == 0) wait_rows(p, t);
      tile::named_barrier_sync(lcsc::kEpilogueFirstBarrierId + wg, tile::kWarpgroupThreads);
    }
    Base::compute(p, s, pipe, st, t, wg, acc);
  }
  // Waits (acquiring) for the flag of every (source, chunk) the rows of tile t touch.
  __device__ static void wait_rows(const Params& p, const lcsc::Tile& t) {
    const uint64_t e = p.sync.epoch();
    const int64_t m_end = p.shard_rows * p.sync.team.world;
    const int64_t r0 = int64_t(t.m) * Base::kBM, r1 = min(r0 + Base::kBM, m_end) - 1;
    for (int64_t r = r0; r <= r1;) {  // one wait per (source, chunk) the rows touch
      const int src = int(r / p.shard_rows), j = int((r - src * p.shard_rows) / p.chunk_rows);
      // A failed wait is recorded (the host's synchronize() reports it); the loads still go out, so the
      // consumers' pipeline drains and the kernel ends instead of hanging on its stages.
      // Inlined: the loader runs on setmaxnreg's cut registers (weft/comm/signal.cuh, wait_ge_inlined).
      (void)wait_ge_inlined(p.sync.team,
                            p.arrivals.count ? p.sync.team.flag(p.arrivals, src) : flag(p, src, j),
                            p.arrivals.count ? uint64_t(j + 1) : e);
      r = src * p.shard_rows + min(int64_t(j + 1) * p.chunk_rows, p.shard_rows);
    }
  }
  __device__ static void finish(const Params& p, typename Base::Smem& s, int wg,
                                typename Base::StoreState& es) {
    Base::finish(p, s, wg, es);
    if (tile::thread_in_warpgroup() == 0) p.sync.done();
  }
  // Communicator blocks: meet the counterpart blocks (every peer has finished its previous call), then
  // push chunks of this rank's shard, task u = chunk u % chunks to peer rank - 1 - u / chunks (peers rank -
  // 1, rank - 2, ..., then self where copy_self), each followed by its flag.
  __device__ static bool comm_begin(const Params& p, typename Base::Smem&, int index) {
    return barrier_block(p.sync.team, p.sync.meetings[index]);
  }
  struct CommTasks : lcsc::StridedTasks {
    __device__ CommTasks(const Params& p, int index, int count)
        : lcsc::StridedTasks((p.sync.team.world - (p.copy_self ? 0 : 1)) * p.chunks, index, count) {}
  };
  __device__ static void comm_task(const Params& p, typename Base::Smem&, int u) {
    const TeamView& t = p.sync.team;
    const int world = t.world;
    const int dst = (t.rank - 1 - u / p.chunks + 2 * world) % world, j = u % p.chunks;
    const int64_t r0 = int64_t(j) * p.chunk_rows, rows = min(int64_t(p.chunk_rows), p.shard_rows - r0);
    const int64_t first = t.rank * p.shard_rows + r0;  // in the gathered rows
    block_copy16(t.peer_ptr(reinterpret_cast<uint4*>(p.gathered + first * p.row_bytes), dst),
                 reinterpret_cast<const uint4*>(p.a_shard + r0 * p.row_bytes), rows * p.row_bytes / 16);
    if (p.scale_cols > 0) {  // a few floats a row: plain stores
      float* to = t.peer_ptr(p.scale_gathered + first * p.scale_cols, dst);
      const float* from = p.scale_shard + r0 * p.scale_cols;
      for (int64_t i = threadIdx.x; i < rows * p.scale_cols; i += blockDim.x) to[i] = from[i];
    }
    __syncthreads();  // the block's stores, then one release signal covers them
    if (threadIdx.x == 0) signal_set(t, flag(p, t.rank, j), dst, p.sync.epoch());
  }
  __device__ static void comm_end(const Params& p, typename Base::Smem&, int) {
    __syncthreads();
    if (threadIdx.x == 0) p.sync.done();
  }
};

template <bool kBKMajor, int kCluster, int kTileN = 256>
using AgGemmOp = AllGatherA<GemmOp<__nv_bfloat16, kBKMajor, kCluster, kTileN>>;

// A communicator block's buffers for sum_staged_half, carved out of the GEMM's shared memory (which
// communicator blocks do not otherwise use): `stages` rings of every slot's next kChunkBytes, which the
// bulk-copy engine loads, the stages' mbarriers, and the count of chunks this block has summed (the stage and
// parity of its next). The threads' own loads (2 units x W slots a thread: 48 KiB in flight at W = 4)
// moved ~40 GB/s a block beside the GEMM (the timelines in bench/RESULTS.md); the copy engine keeps up to
// kLoadBytes in flight. The sums leave by the threads' own stores: bulk stores from shared memory (the first
// form) waited for their buffer behind the copy engine's later loads and ran ~2x slower still.
struct SlotSumStaging {
  // Of each slot, per stage: two 16-byte units per thread of the kernel's 384 (whole passes; a chunk ends in
  // a block-wide barrier, so not much smaller).
  static constexpr int kChunkBytes = 2 * 384 * 16;
  static constexpr int kMaxStages = 16;
  static constexpr int kLoadBytes = 192 * 1024;  // in flight, at most
  uint8_t* base;                                 // 128-byte aligned
  int world, stages;

  __host__ __device__ static constexpr size_t bytes_for(int world, int stages) {
    return size_t(stages * world) * kChunkBytes + kMaxStages * sizeof(uint64_t) + sizeof(uint32_t);
  }
  // As many stages as fit `bytes` (at most kLoadBytes of loads; 0 when not even two fit).
  __host__ __device__ static constexpr int stages_for(int world, size_t bytes) {
    int s = kLoadBytes / (world * kChunkBytes);
    s = s > kMaxStages ? kMaxStages : s;
    while (s >= 2 && bytes_for(world, s) > bytes) --s;
    return s >= 2 ? s : 0;
  }
  __device__ SlotSumStaging(void* smem, size_t bytes, int w)
      : base(static_cast<uint8_t*>(smem)), world(w), stages(stages_for(w, bytes)) {}
  __device__ const uint4* in(int stage, int s) const {
    return reinterpret_cast<const uint4*>(base + size_t(stage * world + s) * kChunkBytes);
  }
  __device__ uint64_t* full(int stage) const {
    return reinterpret_cast<uint64_t*>(base + size_t(stages * world) * kChunkBytes) + stage;
  }
  __device__ uint32_t* summed() const { return reinterpret_cast<uint32_t*>(full(kMaxStages)); }
  // By every thread of the block, once, before the first sum.
  __device__ void init() const {
    if (threadIdx.x == 0) {
      for (int i = 0; i < stages; ++i) mbarrier_init(full(i), 1);
      *summed() = 0;
      fence_barrier_init();
    }
    __syncthreads();
  }
};

// A communicator block sums one half of this rank's rows over the W staged slots (slot r at staging + r x
// slot_elems), `bytes` of each: in fp32, its own slot first, then rank + 1, ... (the order of the staged
// reduce kernel, coll::reduce_scatter_kernel, so the bits are the same), rounded once; into dst, or the same
// place in every rank's copy of dst when fan_out. Thread 0 has acquired the slots (wait, then
// acquire_for_tma).
__device__ __forceinline__ void sum_staged_half(const TeamView& t, const SlotSumStaging& st, uint4* dst,
                                                const __nv_bfloat16* staging, int64_t slot_elems,
                                                int64_t bytes, bool fan_out) {
  constexpr int C = SlotSumStaging::kChunkBytes;
  const int W = t.world, S = st.stages;
  const int64_t chunks = (bytes + C - 1) / C;
  const uint32_t g0 = *st.summed();   // chunks this block summed before: the ring's position
  const auto load = [&](int64_t c) {  // thread 0: chunk c of every slot into its stage
    const int stage = int((g0 + c) % S);
    const uint32_t n = uint32_t(min(int64_t(C), bytes - c * C));
    mbarrier_arrive_expect_tx(st.full(stage), n * W);
    for (int s = 0; s < W; ++s) {
      const auto* slot = reinterpret_cast<const uint8_t*>(staging + int64_t((t.rank + s) % W) * slot_elems);
      bulk_load(const_cast<uint4*>(st.in(stage, s)), slot + c * C, n, st.full(stage));
    }
  };
  if (threadIdx.x == 0)
    for (int64_t c = 0; c < chunks && c < S; ++c) load(c);
  for (int64_t c = 0; c < chunks; ++c) {
    const uint32_t g = g0 + uint32_t(c);
    const int stage = int(g % S);
    const int64_t units = min(int64_t(C), bytes - c * C) / 16;
    mbarrier_wait(st.full(stage), (g / S) & 1);
    uint4* to = dst + c * (C / 16);
    for (int u = threadIdx.x; u < units; u += blockDim.x) {
      Pack<Elem::kBF16> acc = Pack<Elem::kBF16>::load(st.in(stage, 0)[u]);
      for (int s = 1; s < W; ++s)
        acc.template combine_with<Reduce::kSum>(Pack<Elem::kBF16>::load(st.in(stage, s)[u]));
      const uint4 v = acc.store();
      if (!fan_out) {
        st16(to + u, v);
        continue;
      }
      for (int k = 1; k <= W; ++k)  // rank + 1 first: the ranks' blocks start on different peers
        st16(t.peer_ptr(to + u, (t.rank + k) % W), v);
    }
    __syncthreads();  // every thread done with this stage: it may load again
    if (threadIdx.x == 0 && c + S < chunks) {
      fence_proxy_async_smem();  // the generic reads of the stage before the copy engine's writes into it
      load(c + S);
    }
  }
  if (threadIdx.x == 0) *st.summed() = g0 + uint32_t(chunks);
  __syncthreads();
}

// ---- GEMM + reduce-scatter (and the first half of all-reduce) -----------------------------------------
// A consumer warpgroup's last TMA stores (or adds) into an owner's half tile, counted at that owner once they
// have completed: by the warpgroup's leader (who issued them), when it stores its next tile (a mainloop
// later, so the wait rarely waits) or finishes.
struct PendingHalf {
  int owner = -1, flag = 0;  // owner -1: nothing pending; flag: the count it adds to at the owner
  __device__ void count(const TeamView& team, const Flags& counts) {
    if (owner < 0) return;
    bulk_wait<0>();
    release_after_tma();  // the completed TMA writes before the count that publishes them
    signal_add(team, team.flag(counts, flag), owner, 1);
    owner = -1;
  }
};

// ReduceScatterC<Gemm>: the hooks that send a GEMM's bf16 output tiles to their owners, over any LCSC GEMM op
// whose epilogue stores bf16 tiles through a tensor map (GemmOp bf16; Fp8GemmOp, which scales its tiles
// before the store). kCounted: the partials counted per half at the owner, added there or staged and summed
// by the communicator blocks (see the header); an instantiation of its own, so the staged kernel carries
// none of its registers.
template <class Gemm, bool kCounted = false>
struct ReduceScatterC : Gemm {
  using Base = Gemm;
  static_assert(!kCounted || Base::kClusterSize == 1,
                "counted: one communicator block per task, no clusters");
  static constexpr bool kCountedHalves = kCounted;
  struct Params : Base::Params {
    FusedSync sync;
    CUtensorMap
        owner[kFusedMaxWorld];  // rank r's slot (staged) or sum (added) for this rank's tiles, as seen here
    int shard_rows;
    // kCounted: halves[h] counts the adds into half h of this rank's sum, halves[kRsHalfFlags + h] the count
    // it reached at the end of the previous call (local).
    bool fan_out;  // all-reduce: push each completed half to every peer's out at the same place
    Flags halves;
    int tiles_n;         // adds per half from each rank
    int64_t n;           // columns
    __nv_bfloat16* sum;  // this rank's sum [shard_rows, n] (added)
    __nv_bfloat16* out;  // reduce-scatter: where each completed half goes; all-reduce (staged): out [m, n]
    // kCounted with staged slots (Partials::kStagedProgressive): the tiles are stored, not added, into the
    // owner's W slots of [shard_rows, n] (`staging`, this rank's inbox, slot r = rank r's), and a completed
    // half is their sum.
    const __nv_bfloat16* staging;
    bool staged_slots;
  };
  struct StoreState {
    typename Base::StoreState epi;
    bool ready;
    PendingHalf pending;  // kCounted: the half whose adds this warpgroup last issued
  };

  __device__ static void init(const Params& p, typename Base::Smem& s) {
    Base::init(p, s);
    for (int r = 0; r < p.sync.team.world; ++r) tma::prefetch_map(&p.owner[r]);
  }
  __device__ static void store(const Params& p, typename Base::Smem& s, const lcsc::Tile& t, int wg,
                               const typename Base::Accum& acc, StoreState& es) {
    const TeamView& team = p.sync.team;
    const bool leader = tile::thread_in_warpgroup() == 0;
    if (!es.ready && leader) {  // only the leader issues TMA: only it waits
      // A failed wait is recorded and reported by synchronize(); the kernel runs to its end rather than
      // leave the other warpgroups waiting on the epilogue's barriers.
      (void)wait_ge(team, team.flag(p.sync.ready, 0), p.sync.epoch());
      acquire_for_tma();  // the peers' reads of their staging slots (generic) before our TMA stores into it
    }
    es.ready = true;
    if constexpr (kCounted)
      if (leader)
        es.pending.count(p.sync.team, p.halves);  // the previous tile's adds were issued a mainloop ago
    __syncwarp();  // the leader's lanes again with it before the epilogue's warp-aligned barriers
    // The host admits only shards of whole 64-row halves: a half has one owner (none past the last row).
    const int row = t.m * Base::kBM + 64 * wg, owner = row / p.shard_rows;
    if (owner >= team.world) return;
    Base::Epilogue::store(&p.owner[owner], p.store_mode, s.epi, es.epi, wg, acc, row - owner * p.shard_rows,
                          t.n * Base::kBN);
    if constexpr (kCounted) {
      es.pending = PendingHalf{owner, (row - owner * p.shard_rows) / 64};
    }
  }
  __device__ static void finish(const Params& p, typename Base::Smem&, int, StoreState& es) {
    Base::Epilogue::finish(es.epi);  // every store has landed
    if (tile::thread_in_warpgroup() == 0) {
      release_after_tma();
      if constexpr (kCounted) es.pending.count(p.sync.team, p.halves);
      p.sync.done();
    }
  }
  // Block 0 of the communicator: every rank has finished the previous call's reduce (stream-ordered before
  // its kernel), so its staging is free; then the storers may store. kCounted: every block then takes
  // halves (no wait needed: the previous call's counts were final when its kernel ended).
  __device__ static bool comm_begin(const Params& p, typename Base::Smem& s, int index) {
    const TeamView& t = p.sync.team;
    if constexpr (kCounted)
      if (p.staged_slots) staging_of(p, s).init();
    if (index == 0 && barrier_block(t, p.sync.meetings[0]) && threadIdx.x == 0)
      signal_set(t, t.flag(p.sync.ready, 0), t.rank, p.sync.epoch());
    return kCounted;
  }
  // A communicator block's buffers for the staged sums (two stages fit at every world size up to
  // kFusedMaxWorld: asserted where the counted kernel is launched, src/ops/fused.cu).
  __device__ static SlotSumStaging staging_of(const Params& p, typename Base::Smem& s) {
    return SlotSumStaging(&s, sizeof(s), p.sync.team.world);
  }
  __host__ __device__ static constexpr bool staged_sum_fits(int world) {
    return SlotSumStaging::stages_for(world, sizeof(typename Base::Smem)) >= 2;
  }
  struct CommTasks
      : lcsc::StridedTasks {  // kCounted: the halves of this rank's rows, in the order they complete
    __device__ CommTasks(const Params& p, int index, int count)
        : lcsc::StridedTasks(kCounted ? p.shard_rows / 64 : 0, index, count) {}
  };
  __device__ static void comm_task(const Params& p, typename Base::Smem& s, int h) {
    if constexpr (kCounted) {
      const TeamView& t = p.sync.team;
      uint64_t* done = t.flag(p.halves, kRsHalfFlags + h);
      const uint64_t target = *done + uint64_t(t.world) * p.tiles_n;
      // Spinning, not napping (20 us naps would add up to 20 us to the last half, after the GEMM): the block
      // has its SM to itself. A failed wait is recorded (synchronize() reports it); then nothing is summed,
      // copied or pushed from what may be partial (a push into a dead peer would turn the report into a
      // fault), the half's count is not taken as reached, and the block goes on to the kernel's end.
      bool reached = true;
      if (threadIdx.x == 0) {
        const TimelineSpan waiting(p.sched.timeline, TimelinePhase::kCommWait, static_cast<uint32_t>(h));
        reached = wait_ge(t, t.flag(p.halves, h), target);
        acquire_for_tma();  // the staged slots (peers' TMA stores, published by their counts) for our loads
      }
      reached = __syncthreads_and(reached);
      if (!reached) return;
      const int64_t first = int64_t(h) * 64 * p.n, units = 64 * p.n / 8;
      if (p.staged_slots) {
        // Into this rank's out (its slice of the all-reduce's out), the same place in every peer's.
        __nv_bfloat16* dst = p.out + (p.fan_out ? int64_t(t.rank) * p.shard_rows * p.n : 0) + first;
        sum_staged_half(t, staging_of(p, s), reinterpret_cast<uint4*>(dst), p.staging + first,
                        int64_t(p.shard_rows) * p.n, units * 16, p.fan_out);
        if (threadIdx.x == 0) *done = target;
        return;
      }
      const uint4* from = reinterpret_cast<const uint4*>(p.sum + first);
      if (p.fan_out) {  // the sum is this rank's slice of out: the same place in every peer's out
        for (int k = 1; k < t.world; ++k)
          block_copy16(t.peer_ptr(const_cast<uint4*>(from), (t.rank + k) % t.world), from, units);
      } else {
        block_copy16(reinterpret_cast<uint4*>(p.out + first), from, units);
      }
      if (threadIdx.x == 0) *done = target;  // local: read by the next call's task h
    }
  }
  // kCounted all-reduce: every rank's block `index` has pushed its halves (into this rank's out among others)
  // before this block ends, so the kernel ends only when every push into this rank's out has landed.
  __device__ static void comm_end(const Params& p, typename Base::Smem&, int index) {
    __syncthreads();
    if constexpr (kCounted)
      if (p.fan_out) (void)barrier_block(p.sync.team, p.sync.meetings[index]);
    if (threadIdx.x == 0) p.sync.done();
  }
};

// ---- GEMM + reduce-scatter, the partials summed in the owner's epilogue ---------------------------------
// Tiles of a rank's rows at most, Partials::kSummedInEpilogue (past them: kStaged): 32768 x 28672 at 2 GPUs
// on 128 x 256 tiles is 14336.
inline constexpr int kRsTileFlags = 16384;

// Adds a peer's partial of a warpgroup's half tile, which the loader brought into shared memory as kN / 64
// chunks of 64 x 64 bf16 (TMA boxes, 128-byte swizzle; `chunks` the first), to the warpgroup's fp32
// accumulator fragment (64 x kN): tile::store_accum_chunk's inverse, conflict-free.
template <int kN>
__device__ __forceinline__ void add_partial_chunks(tile::AccumM64<kN>& acc, const uint8_t* chunks) {
  const uint32_t lane = static_cast<uint32_t>(tile::lane_id()), sw = lane >> 2;
  const uint32_t row0 = 16u * static_cast<uint32_t>(tile::warp_in_warpgroup()) + sw;
#pragma unroll
  for (int c = 0; c < kN / 64; ++c) {
    const uint32_t base = smem_addr(chunks + c * 64 * 128) + row0 * 128;
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
      const int j = c * 8 + jj;
      const uint32_t off = ((static_cast<uint32_t>(jj) ^ sw) << 4) + 4u * (lane & 3u);
      uint32_t lo_bits, hi_bits;
      asm volatile("ld.shared.b32 %0, [%1];" : "=r"(lo_bits) : "r"(base + off));
      asm volatile("ld.shared.b32 %0, [%1];" : "=r"(hi_bits) : "r"(base + 8 * 128 + off));
      const float2 lo = __bfloat1622float2(reinterpret_cast<const __nv_bfloat162&>(lo_bits));
      const float2 hi = __bfloat1622float2(reinterpret_cast<const __nv_bfloat162&>(hi_bits));
      acc.d[4 * j] += lo.x;
      acc.d[4 * j + 1] += lo.y;
      acc.d[4 * j + 2] += hi.x;
      acc.d[4 * j + 3] += hi.y;
    }
  }
}

// EpilogueSummedC<Gemm>: GEMM + reduce-scatter (all-reduce) with no reduce pass after it
// (Partials::kSummedInEpilogue), over a bf16 GemmOp walking lcsc::OwnerRoundsScheduler's order: every rank
// computes every tile, a peer's tiles first, its own (rows it owns) `delay` rounds after the peers' blocks
// computed theirs. A peer's tile is stored as kStaged stores it (this rank's slot of the owner's inbox) and,
// once its stores have completed (checked halfway through the warpgroup's next mainloop, so no store waits
// on the link and no count waits for a peer), counted at the owner: one add to the count of that tile
// (2 (W - 1) adds make it whole). For an own tile the loader, after
// issuing the mainloop's k-blocks (kStages behind the consumers: the wait overlaps the mainloop's tail and
// holds back the next tile's loads), waits for the tile's 2 (W - 1) counts and brings each peer's partial
// tile into pipeline stages (narrow tile: both halves in one; wide: a half a stage), rank + 1's first; the
// consumers add them to the accumulators from there (fp32, rounded once: not kStaged's bits, which round this
// rank's own partial to bf16 too) and store the sum into out (reduce-scatter) or into this rank's slice of
// every rank's out (all-reduce: out symmetric). Shards of whole 128-row tiles (a tile has one owner). One
// communicator block: the start meeting (every owner has finished reading the previous call's slots) and, for
// the all-reduce, an end meeting once every storer of this rank has finished, so no kernel ends before every
// peer's final tiles have landed in its out. Counts only grow; each tile's count at the end of the previous
// call is kept locally (tiles[kRsTileFlags + f]), so the shape may change between calls.
template <class Gemm>
struct EpilogueSummedC : Gemm {
  using Base = Gemm;
  using Accum = typename Base::Accum;
  static_assert(std::is_same_v<typename Base::Scheduler, lcsc::OwnerRoundsScheduler>,
                "the owners' rounds: every peer's partial of a tile before its owner's epilogue");
  static_assert(Base::kClusterSize == 1 && Base::kBM == 128 && Base::kConsumerWarpgroups == 2,
                "one CTA a tile, two 64-row halves");
  struct Params : Base::Params {
    FusedSync sync;
    CUtensorMap owner[kFusedMaxWorld];  // rank r's staging slot for this rank's partials, [shard_rows, n]
    // The final tiles of this rank's rows: reduce-scatter, out [shard_rows, n]; all-reduce, this rank's slice
    // of every rank's out, rank + 1's first (the ranks' blocks start on different peers), its own last.
    CUtensorMap dest[kFusedMaxWorld];
    int dests;
    int shard_rows;
    // [f]: the peers' partials of tile f (tile row r of this rank's rows, tile column c: f = r x tiles_n + c)
    // landed here, a count a half tile; [kRsTileFlags + f]: the count it reached at the end of the previous
    // call (local).
    Flags tiles;
    // This rank's W slots, [W x shard_rows, n] (slot s, rows [s shard_rows, (s + 1) shard_rows): rank s's
    // partials), box 64 x 64: the loader's reads of the partials.
    CUtensorMap inbox;
    bool fan_out;  // all-reduce: the end meeting (comm_end)
  };
  struct StoreState {
    typename Base::StoreState epi;
    bool ready;           // the start meeting passed (leader's)
    bool failed;          // the call failed (a wait of this rank, or a peer's failure): own tiles not stored
    PendingHalf pending;  // the peer's half tile this warpgroup last stored (counted on its tile's flag)
  };

  __device__ static void init(const Params& p, typename Base::Smem& s) {
    Base::init(p, s);
    for (int r = 0; r < p.sync.team.world; ++r) tma::prefetch_map(&p.owner[r]);
    for (int r = 0; r < p.dests; ++r) tma::prefetch_map(&p.dest[r]);
    tma::prefetch_map(&p.inbox);
  }
  // A peer's partial of a half tile: kBN / 64 chunks of 64 x 64 bf16. A pipeline stage holds both halves
  // (narrow tile: a stage's A and B tiles, 32 KiB) or one (wide: 32 of its 48 KiB).
  static constexpr uint32_t kChunkBytes = 64 * 128, kHalfBytes = Base::kBN / 64 * kChunkBytes;
  static constexpr int kHalvesPerStage = sizeof(typename Base::Mainloop::Stage) >= 2 * kHalfBytes ? 2 : 1;
  static_assert(sizeof(typename Base::Mainloop::Stage) >= kHalfBytes, "a peer's half tile fits a stage");
  __device__ static uint8_t* stage_bytes(typename Base::Smem& s, int stage) {
    return reinterpret_cast<uint8_t*>(&s.main.stage[stage]);
  }
  // The first row of the tile in its owner's rows.
  __device__ static int owner_row(const Params& p, const lcsc::OwnerTile& t) {
    return (t.m - t.owner * p.sched.shard_tiles_m) * Base::kBM;
  }
  // Loader (one thread): the mainloop's k-blocks; for an own tile then, once every peer's partials of both
  // halves have landed, each peer's partial into pipeline stages (a stage: one half, or both).
  // A failed wait is recorded (synchronize() reports it; later waits of the rank give up within ~20 us) and
  // the loads still go out, so no consumer waits for ever; the consumers then store no own tile (compute).
  __device__ static void load(const Params& p, typename Base::Smem& s, typename Base::Pipeline& pipe,
                              lcsc::PipeState& st, const lcsc::OwnerTile& t) {
    Base::load(p, s, pipe, st, t);
    const TeamView& team = p.sync.team;
    if (t.owner != team.rank) return;
    const int row = owner_row(p, t);
    {
      const int tile = row / Base::kBM * p.sched.tiles_n + t.n;
      uint64_t* reached = team.flag(p.tiles, kRsTileFlags + tile);
      const uint64_t target = *reached + uint64_t(2 * (team.world - 1));
      const TimelineSpan waiting(p.sched.timeline, TimelinePhase::kCommWait, static_cast<uint32_t>(tile));
      // Inlined: the loader runs on setmaxnreg's cut registers (weft/comm/signal.cuh, wait_ge_inlined).
      if (wait_ge_inlined(team, team.flag(p.tiles, tile), target)) *reached = target;
    }
    acquire_for_tma();  // the peers' TMA stores, published by their counts, before our TMA loads
    for (int k = 1; k < team.world; ++k) {
      const int src = team.rank + k < team.world ? team.rank + k : team.rank + k - team.world;
      for (int h0 = 0; h0 < 2; h0 += kHalvesPerStage) {
        uint64_t* full = pipe.producer_acquire(st, kHalvesPerStage * kHalfBytes);
        uint8_t* chunks = stage_bytes(s, st.stage);
        for (int h = 0; h < kHalvesPerStage; ++h)
          for (int c = 0; c < Base::kBN / 64; ++c)
            tma::load_2d(chunks + h * kHalfBytes + c * kChunkBytes, &p.inbox, t.n * Base::kBN + 64 * c,
                         src * p.shard_rows + row + 64 * (h0 + h), full);
        st.advance(Base::kStages);
      }
    }
  }
  // The leader's count of the previous peer tile, if any: its wait for that tile's stores to complete is a
  // timeline span of its own (kCommWait, arg: bit 31 and the tile), so a store's span splits into this wait
  // and the epilogue ring's.
  __device__ static void count_pending(const Params& p, StoreState& es) {
    if (es.pending.owner < 0) return;
    const TimelineSpan counting(p.sched.timeline, TimelinePhase::kCommWait,
                                1u << 31 | static_cast<uint32_t>(es.pending.flag));
    es.pending.count(p.sync.team, p.tiles);
  }
  // Consumers: the mainloop; for an own tile then each peer's partial of the warpgroup's half added, a stage
  // each, in the loader's order. The previous peer tile's count goes out first: a count waits for nothing
  // of another rank, while these stages wait for the loader's wait for peers' counts (counted after a wait
  // instead, two ranks' own tiles could each wait for the other's count at W >= 4).
  __device__ static void compute(const Params& p, typename Base::Smem& s, typename Base::Pipeline& pipe,
                                 lcsc::PipeState& st, const lcsc::OwnerTile& t, int wg, Accum& acc,
                                 StoreState& es) {
    const bool leader = tile::thread_in_warpgroup() == 0;
    // The previous peer tile's count halfway through this mainloop: its stores, issued a mainloop ago, have
    // completed by then even when every block stored its first tile at once (~a third of a mainloop at the
    // link's rate), and its owner's loader may be waiting for it (counted at the next store instead, a
    // first-wave partial reached its owner a whole mainloop after it landed).
    Base::Mainloop::mma(s.main, pipe, st, p.k_blocks, wg, acc, [&](int kb) {
      if (kb != p.k_blocks / 2) return;
      if (leader) count_pending(p, es);
      __syncwarp();
    });
    const TeamView& team = p.sync.team;
    if (t.owner != team.rank) return;
    if (leader) count_pending(p, es);
    __syncwarp();  // the leader's lanes again with it before the warp-aligned waits and barriers
    for (int k = 1; k < team.world; ++k) {
      for (int h0 = 0; h0 < 2; h0 += kHalvesPerStage) {
        pipe.consumer_wait(st);  // both warpgroups release every stage; a stage may hold the other's half
        if (wg >= h0 && wg < h0 + kHalvesPerStage)
          add_partial_chunks(acc, stage_bytes(s, st.stage) + (wg - h0) * kHalfBytes);
        // Every thread's reads of the stage done before its release; the generic reads before the TMA
        // writes that refill it.
        tile::named_barrier_sync(lcsc::kEpilogueFirstBarrierId + wg, tile::kWarpgroupThreads);
        if (tile::thread_in_warpgroup() == 0) fence_proxy_async_smem();
        pipe.consumer_release(st);
        st.advance(Base::kStages);
      }
    }
    // A failed wait (the loader's for these partials, or any earlier one of this rank, or a peer's copied
    // here) left the sum possibly partial: the warpgroup agrees to store none of its own tiles from now on
    // (an all-reduce would otherwise write it into peers whose own waits succeeded). The loader recorded
    // its failure before the stages it completed, so a consumer past them sees it.
    es.failed = ptx::bar_red_or(
        lcsc::kEpilogueFirstBarrierId + wg, tile::kWarpgroupThreads,
        es.failed || (leader && *reinterpret_cast<volatile uint32_t*>(&team.error->code) != 0u));
  }
  __device__ static void store(const Params& p, typename Base::Smem& s, const lcsc::OwnerTile& t, int wg,
                               Accum& acc, StoreState& es) {
    const TeamView& team = p.sync.team;
    const bool own = t.owner == team.rank;
    if (tile::thread_in_warpgroup() == 0) {  // only the leader issues TMA: only it waits
      if (!es.ready) {
        // A failed wait is recorded and reported by synchronize(); the tiles still go out.
        (void)wait_ge(team, team.flag(p.sync.ready, 0), p.sync.epoch());
        acquire_for_tma();  // the peers' reads of their slots (generic) before our TMA stores into them
      }
      count_pending(p, es);  // the previous tile's stores were issued a mainloop ago
    }
    __syncwarp();  // the leader's lanes again with it before the epilogue's warp-aligned barriers
    es.ready = true;
    const int row = owner_row(p, t) + 64 * wg, col0 = t.n * Base::kBN;  // row: in the owner's rows
    if (!own) {
      Base::Epilogue::store(&p.owner[t.owner], lcsc::StoreMode::kStore, s.epi, es.epi, wg, acc, row, col0);
      es.pending = PendingHalf{t.owner, row / Base::kBM * p.sched.tiles_n + t.n};
      return;
    }
    if (!es.failed)
      Base::Epilogue::store_to(lcsc::TmaRowsToEach{p.dest, p.dests, row}, s.epi, es.epi, wg, acc, col0);
  }
  __device__ static void finish(const Params& p, typename Base::Smem&, int, StoreState& es) {
    Base::Epilogue::finish(es.epi);  // every store has completed
    if (tile::thread_in_warpgroup() == 0) {
      release_after_tma();
      es.pending.count(p.sync.team, p.tiles);
      // All-reduce: this warpgroup's final tiles in the peers' outs, before the end meeting that its done()
      // lets start (comm_end).
      if (p.fan_out) fence_release();
      p.sync.done();
    }
  }
  // Block 0 of the communicator: every rank has finished the previous call (stream-ordered before this
  // kernel), so its slots are free; then the storers may store. No tasks.
  __device__ static bool comm_begin(const Params& p, typename Base::Smem&, int index) {
    const TeamView& t = p.sync.team;
    if (index == 0 && barrier_block(t, p.sync.meetings[0]) && threadIdx.x == 0)
      signal_set(t, t.flag(p.sync.ready, 0), t.rank, p.sync.epoch());
    return false;
  }
  // All-reduce: the last finisher of the call. Once every storer of this rank has finished (its final tiles
  // have landed in every out), it meets the peers' blocks, so the kernel ends only when every peer's final
  // tiles have landed in this rank's out.
  __device__ static void comm_end(const Params& p, typename Base::Smem&, int index) {
    __syncthreads();
    if (p.fan_out) {
      bool finished = true;
      if (threadIdx.x == 0) finished = p.sync.others_finished();
      if (__syncthreads_and(finished)) (void)barrier_block(p.sync.team, p.sync.meetings[index]);
    }
    if (threadIdx.x == 0) p.sync.done();
  }
};

// ---- GEMM + all-reduce at decode sizes: split-K, the partials summed at each column tile's owner ---------
// matmul_all_reduce where M is a decode batch (any M up to kSplitKMaxRows): out [M, N] = the sum over ranks
// of A_r [M, K] B_r. Reading the weight (N x K a rank) is the work, and M's 128-row tiles are few (N / 128
// at M <= 128), so K is split over the SMs: work item (m tile, n tile, slice s) multiplies its tile over
// k-blocks [s slice_blocks, (s + 1) slice_blocks). Column tile n belongs to rank n mod W. Each consumer warp
// stores its 16 rows (a band) of the item's fp32 partial, in fragment order (no shared memory), into the
// owner's slot for (tile, band, this rank, s) and sets that slot's flag there to the call's epoch. After its
// last item every consumer warpgroup of the grid, warp by warp: (1) as an owner, per (own tile, band with
// rows in M, 64-column part): waits for the W x S slot flags, sums the part of the slots in one order
// (ranks, then slices; fp32), rounds once to bf16 and writes it into every rank's result area, then sets
// its flag there; (2) per (tile, band, part) of out: waits for its flag here and copies it from the result
// area into out. Items
// never wait, (1) waits for items only, (2) for (1), every block is resident: no wait cycle. Slots and result
// areas serve the next call without a meeting: a rank starts call n + 1 once (2) saw every band of call n,
// so after every owner read its slots of call n; an owner writes call n + 1's bands once every rank's call
// n + 1 partials are in, so after every rank finished call n. Flags hold epochs (FusedSync) and only grow.
inline constexpr int kSplitKMaxRows = 256;     // M up to two 128-row tiles
inline constexpr int kSplitKMaxSlices = 4;     // S: W x S <= 32, a warp lane per slot flag
inline constexpr int kSplitKBands = 8;         // 16-row bands of a 128-row tile (a consumer warp's rows)
inline constexpr int kSplitKSlotFlags = 4096;  // (own tile, band, rank, slice) flags of a rank at most
inline constexpr int kSplitKBandFlags = 4096;  // (tile, band, column part) result flags at most

struct SplitKTile : lcsc::Tile {
  int slice = 0;  // the item's K slice
};

// The items (m tile, n tile, slice), m fastest, then the slice: compute block c takes items c, c + C, ...
class SplitKScheduler {
 public:
  struct Params {
    int tiles_m = 0, tiles_n = 0, slices = 1;
    int compute_blocks = 0;
    TimelineBuffer* timeline = nullptr;  // the kernel's phases (lcsc/kernel.cuh), where set
  };
  using Work = SplitKTile;
  __host__ __device__ static int compute_blocks(const Params& p) { return p.compute_blocks; }
  __host__ __device__ SplitKScheduler(const Params& p, int cluster_index, int)
      : p_(p), next_(cluster_index) {}
  __host__ __device__ int units() const { return p_.tiles_m * p_.tiles_n * p_.slices; }
  __host__ __device__ bool next(Work& w) {
    if (next_ >= units()) return false;
    w.m = next_ % p_.tiles_m;
    const int rest = next_ / p_.tiles_m;
    w.slice = rest % p_.slices;
    w.n = rest / p_.slices;
    w.unit = next_;
    w.iteration = iteration_++;
    next_ += p_.compute_blocks;
    return true;
  }

 private:
  Params p_;
  int next_, iteration_ = 0;
};

// kTileN: the items' column tiles, 128 or 256 wide (fewer tiles, so more K slices, and a wider stage of B
// beside the same A stage: half of each stage is A's 128 rows, of which a decode batch fills few).
template <bool kBKMajor, int kTileN = 128>
struct SplitKAllReduceOp : GemmOp<__nv_bfloat16, kBKMajor, 1, kTileN, 0, 2, SplitKScheduler> {
  using Base = GemmOp<__nv_bfloat16, kBKMajor, 1, kTileN, 0, 2, SplitKScheduler>;
  using Base::kBM, Base::kBN;
  using typename Base::Accum, typename Base::Mainloop, typename Base::Pipeline, typename Base::Smem,
      typename Base::StoreState;
  static_assert(kBM == 16 * kSplitKBands && Base::kConsumerWarpgroups == 2, "two warpgroups of 4 bands");
  static constexpr int kSlotFloats = 16 * kBN;  // a band's partial: 16 rows x kBN fp32
  // The owners' sums go by column parts of a band (a warp each): enough units for the grid's warps at M = 1,
  // and a part's loads of kSumBatch slots in flight at once (kPartFloats / 4 float4s a lane each).
  static constexpr int kPartCols = 64, kColumnParts = kBN / kPartCols;
  static constexpr int kPartFloats = kPartCols / 2, kPartGroups = kPartCols / 32;  // a lane's, its pieces
  static constexpr int kSumBatch = 4;
  struct Params : Base::Params {
    FusedSync sync;
    int m, n, slices, slice_blocks;
    float* slots;           // this rank's (symmetric): [own tile][band][rank][slice][kSlotFloats]
    __nv_bfloat16* result;  // this rank's result area (symmetric), [M, N]
    __nv_bfloat16* out;     // [M, N]
    Flags slot_flags;       // [((own tile x kSplitKBands + band) x W + rank) x S + slice]
    Flags band_flags;       // [(tile m + tiles_m x tile n) x kSplitKBands + band]
  };

  __device__ static void init(const Params& p, Smem&) {
    tma::prefetch_map(&p.a);
    tma::prefetch_map(&p.b);
  }
  __device__ static int slice_blocks(const Params& p, const SplitKTile& t) {
    const int rest = p.k_blocks - t.slice * p.slice_blocks;
    return rest < p.slice_blocks ? rest : p.slice_blocks;
  }
  __device__ static void load(const Params& p, Smem& s, Pipeline& pipe, lcsc::PipeState& st,
                              const SplitKTile& t) {
    Mainloop::load(s.main, pipe, st, &p.a, &p.b, t.m * kBM, t.n * kBN, slice_blocks(p, t), 0,
                   t.slice * p.slice_blocks);
  }
  __device__ static void compute(const Params& p, Smem& s, Pipeline& pipe, lcsc::PipeState& st,
                                 const SplitKTile& t, int wg, Accum& acc) {
    Mainloop::mma(s.main, pipe, st, slice_blocks(p, t), wg, acc);
  }
  // A warp's band of the item's partial into its owner's slot (float4 q of lane l at [q][l]: each q's stores
  // of the warp contiguous), then the slot's flag there. Bands past M are not sent (nor waited for).
  __device__ static void store(const Params& p, Smem&, const SplitKTile& t, int wg, const Accum& acc,
                               StoreState&) {
    const TeamView& team = p.sync.team;
    const int band = 4 * wg + tile::warp_in_warpgroup(), lane = tile::lane_id();
    if (t.m * kBM + 16 * band >= p.m) return;
    const int owner = t.n % team.world;
    const int own = t.m + p.sched.tiles_m * (t.n / team.world);
    const int slot = ((own * kSplitKBands + band) * team.world + team.rank) * p.slices + t.slice;
    float4* dst = reinterpret_cast<float4*>(team.peer_ptr(p.slots + int64_t(slot) * kSlotFloats, owner));
#pragma unroll
    for (int q = 0; q < Accum::kRegs / 4; ++q)
      dst[q * 32 + lane] = make_float4(acc.d[4 * q], acc.d[4 * q + 1], acc.d[4 * q + 2], acc.d[4 * q + 3]);
    __syncwarp();  // the warp's stores before its signal (release, system scope)
    if (lane == 0) signal_set(team, team.flag(p.slot_flags, slot), owner, p.sync.epoch());
  }
  // (1) and (2) of the header, then the warpgroup counts itself finished (CallEpoch).
  __device__ static void finish(const Params& p, Smem&, int wg, StoreState&) {
    const int warp =
        (static_cast<int>(blockIdx.x) * Base::kConsumerWarpgroups + wg) * 4 + tile::warp_in_warpgroup();
    const int warps = p.sched.compute_blocks * Base::kConsumerWarpgroups * 4;
    const uint64_t epoch = p.sync.epoch();
    // Timeline: (1) as comm_task 0, (2) as comm_task 1, by the warpgroup's first thread.
    TimelineBuffer* const timeline = tile::thread_in_warpgroup() == 0 ? p.sched.timeline : nullptr;
    bool ok;
    {
      const TimelineSpan summing(timeline, TimelinePhase::kCommTask, 0);
      ok = sum_own_bands(p, warp, warps, epoch);
    }
    {
      const TimelineSpan copying(timeline, TimelinePhase::kCommTask, 1);
      ok = ok && copy_bands(p, warp, warps, epoch);
    }
    (void)ok;  // a failed wait is recorded (the host reports it); the warpgroup still counts itself finished
    tile::named_barrier_sync(lcsc::kEpilogueFirstBarrierId + wg, tile::kWarpgroupThreads);
    if (tile::thread_in_warpgroup() == 0) p.sync.done();
  }

 private:
  // Bands of rows in M, over all m tiles (band b of m tile b / kSplitKBands).
  __device__ static int row_bands(const Params& p) {
    return (p.m + 15) / 16;
  }

  __device__ static bool sum_own_bands(const Params& p, int warp, int warps, uint64_t epoch) {
    const TeamView& team = p.sync.team;
    const int W = team.world, parts = W * p.slices, lane = tile::lane_id();
    const int units_per_tile = row_bands(p) * kColumnParts;  // (band, column part), bands over all m tiles
    const int own_n = (p.sched.tiles_n - team.rank + W - 1) / W;  // column tiles rank, rank + W, ...
    for (int u = warp; u < own_n * units_per_tile; u += warps) {
      const int j = u / units_per_tile, bp = u % units_per_tile, cp = bp % kColumnParts;
      const int tm = bp / kColumnParts / kSplitKBands, band = bp / kColumnParts % kSplitKBands;
      const int tn = team.rank + j * W, own = tm + p.sched.tiles_m * j;
      const int first = (own * kSplitKBands + band) * parts;
      bool ok = true;
      if (lane < parts) ok = wait_ge_inlined(team, team.flag(p.slot_flags, first + lane), epoch);
      if (!__all_sync(0xffffffffu, ok)) return false;
      __syncwarp();  // orders each lane's acquire before every lane's reads of the slots
      // The part's float4s of each slot (fragment order: float4 q of lane l at [q][l], q = a column block
      // of 8), kSumBatch slots' loads in flight before their adds; the adds in slot order (ranks, then
      // slices: one order on every owner).
      float sum[kPartFloats];
#pragma unroll
      for (int i = 0; i < kPartFloats; ++i) sum[i] = 0.f;
      for (int part0 = 0; part0 < parts; part0 += kSumBatch) {
        float4 v[kSumBatch][kPartFloats / 4];
#pragma unroll
        for (int b = 0; b < kSumBatch; ++b)
          if (part0 + b < parts) {
            const float4* from =
                reinterpret_cast<const float4*>(p.slots + int64_t(first + part0 + b) * kSlotFloats) +
                cp * (kPartFloats / 4) * 32;
#pragma unroll
            for (int q = 0; q < kPartFloats / 4; ++q)
              v[b][q] = __ldcg(from + q * 32 + lane);  // (L2: written by peers and other SMs)
          }
#pragma unroll
        for (int b = 0; b < kSumBatch; ++b)
          if (part0 + b < parts)
#pragma unroll
            for (int q = 0; q < kPartFloats / 4; ++q) {
              sum[4 * q] += v[b][q].x;
              sum[4 * q + 1] += v[b][q].y;
              sum[4 * q + 2] += v[b][q].z;
              sum[4 * q + 3] += v[b][q].w;
            }
      }
      // Whole 16-byte pieces of rows to every rank (a warp's store: 64 contiguous bytes in each of 8 rows),
      // not the fragment's 4-byte column pairs, which leave each 32-byte sector half written per store.
      uint4 piece[2][kPartGroups];
      row_pieces(sum, piece);
      const int row0 = tm * kBM + 16 * band + lane / 4, col0 = tn * kBN + cp * kPartCols + 8 * (lane % 4);
      for (int d = 1; d <= W; ++d) {  // rank + 1 first, this rank last
        const int r = (team.rank + d) % W;
        __nv_bfloat16* res = team.peer_ptr(p.result, r);
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int jj = 0; jj < kPartGroups; ++jj) {
            const int row = row0 + 8 * h, col = col0 + 32 * jj;
            if (row < p.m && col < p.n)  // (N a multiple of 8: the piece's 8 columns are all in)
              *reinterpret_cast<uint4*>(res + int64_t(row) * p.n + col) = piece[h][jj];
          }
      }
      __syncwarp();  // every lane's writes before the signals (release, system scope)
      if (lane < W) signal_set(team, team.flag(p.band_flags, part_flag(p, tm, tn, band, cp)), lane, epoch);
    }
    return true;
  }

  // The flag of (m tile, n tile, band, column part) in every rank's band_flags.
  __device__ static int part_flag(const Params& p, int tm, int tn, int band, int cp) {
    return ((tm + p.sched.tiles_m * tn) * kSplitKBands + band) * kColumnParts + cp;
  }

  // A warp's sums of a column part of its band (tile::AccumM64's fragment: lane 4 g + q holds columns
  // 8 j + 2 q, + 1 of rows g and g + 8, j = 0..kPartCols / 8 - 1 in the part) as bf16 pieces of 8 columns:
  // piece[h][jj] = row g + 8 h, columns 8 (4 jj + q) .. + 7 of the part.
  // Each group of four column blocks is a 4 x 4 transpose of packed pairs inside the quad: in round s the
  // lane swaps with lane q ^ s the pair the other one needs (k = q ^ s: block 4 jj + k's pair goes out,
  // the partner's pair of block 4 jj + q comes in as the piece's pair k).
  __device__ static void row_pieces(const float (&sum)[kPartFloats], uint4 (&piece)[2][kPartGroups]) {
    const int q = tile::lane_id() % 4;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int jj = 0; jj < kPartGroups; ++jj) {
        uint32_t pair[4], got[4] = {0u, 0u, 0u, 0u};
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          const int i = 4 * (4 * jj + t) + 2 * h;
          pair[t] = tile::pack2<__nv_bfloat16>(sum[i], sum[i + 1]);
        }
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          const int k = q ^ s;
          const uint32_t out = (k & 2) ? ((k & 1) ? pair[3] : pair[2]) : ((k & 1) ? pair[1] : pair[0]);
          const uint32_t in = __shfl_xor_sync(0xffffffffu, out, s);
#pragma unroll
          for (int t = 0; t < 4; ++t) got[t] = k == t ? in : got[t];
        }
        piece[h][jj] = make_uint4(got[0], got[1], got[2], got[3]);
      }
  }

  __device__ static bool copy_bands(const Params& p, int warp, int warps, uint64_t epoch) {
    const TeamView& team = p.sync.team;
    const int lane = tile::lane_id(), units_per_tile = row_bands(p) * kColumnParts;
    for (int u = warp; u < p.sched.tiles_n * units_per_tile; u += warps) {
      const int tn = u / units_per_tile, bp = u % units_per_tile, cp = bp % kColumnParts;
      const int tm = bp / kColumnParts / kSplitKBands, band = bp / kColumnParts % kSplitKBands;
      const int row0 = tm * kBM + 16 * band, col0 = tn * kBN + cp * kPartCols;
      if (col0 >= p.n) continue;  // a part past N: never summed, never flagged
      bool ok = true;
      if (lane == 0)
        ok = wait_ge_inlined(team, team.flag(p.band_flags, part_flag(p, tm, tn, band, cp)), epoch);
      if (!__shfl_sync(0xffffffffu, ok, 0)) return false;
      __syncwarp();  // orders lane 0's acquire before every lane's reads of the band
      const int pieces = (p.n - col0 < kPartCols ? p.n - col0 : kPartCols) / 8;  // 16-byte pieces of a row
      for (int e = lane; e < 16 * pieces; e += 32) {
        const int row = row0 + e / pieces, col = col0 + 8 * (e % pieces);
        if (row < p.m)
          *reinterpret_cast<uint4*>(p.out + int64_t(row) * p.n + col) = __ldcg(
              reinterpret_cast<const uint4*>(p.result + int64_t(row) * p.n + col));  // (peers wrote it)
      }
    }
    return true;
  }
};

// kTileN 256 (128 x 256 tiles, as the staged kernel's) or 128.
template <bool kBKMajor, int kTileN = 256>
using RsSummedGemmOp =
    EpilogueSummedC<GemmOp<__nv_bfloat16, kBKMajor, 1, kTileN, 0, 2, lcsc::OwnerRoundsScheduler>>;

// The storers ring two output chunks a warpgroup (TmaStoreEpilogue's default); kWideRing: a ring of five for
// three pipeline stages instead of four (GemmOp<..., 256, 3, 5>), so that a tile's four chunks to peers leave
// without waiting on each other (a store reads its buffer only as fast as the link takes it):
// FusedOptions::store_ring, while the two are measured.
template <bool kBKMajor, int kCluster, bool kCounted = false, bool kWideRing = false>
using RsGemmOp =
    ReduceScatterC<std::conditional_t<kWideRing, GemmOp<__nv_bfloat16, kBKMajor, kCluster, 256, 3, 5>,
                                      GemmOp<__nv_bfloat16, kBKMajor, kCluster>>,
                   kCounted>;

}  // namespace weft::ops
