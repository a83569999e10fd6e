// Device code of weft::flash_decode (weft/ops/flash_decode.hpp): one persistent kernel per rank, every block
// resident (the grid is sized to fit), in two phases.
//   1. Partials. Work items (sequence b, KV head h, split s, row group g): the block attends rows [16 g, 16 g
//      + 16) of the KV head's G = q_len x heads / kv_heads query rows over tokens [s chunk, (s + 1) chunk) of
//      b's cache on this rank, on tensor cores (mma.sync m16n8k16: at G = 8 the scores and P V take 2 G
//      FMAs per cached element, more than CUDA cores deliver at HBM speed). Each warp takes 16 tokens a
//      step (16-byte loads of K and V straight into MMA operands, V transposed in registers by movmatrix)
//      and keeps an online softmax (running max m, sum l, unnormalised O in fp32, exp2 domain); the block
//      merges its warps in shared memory. With one split (S = 1) the partial (O, m, l) goes to the inbox of
//      every rank that merges (every rank, or out_rank alone), then a relaxed add after a system fence into
//      their landed counts of (b, h). With several, the partial goes to this rank's own inbox and the item is
//      counted in the pair's local split_done count.
//   2. Merges, in items (b, h, rows): a row a block or a row a warp. With several splits, every rank first
//      merges its own: once split_done counts every item of (b, h), each row's S parts merged into one
//      (O, m, l), pushed to the ranks that merge with one landed add a row block: W partials a row cross the
//      links, not W x S (at batch 1, 64 / 8 heads and 32 splits those pushes moved 3 MiB a rank and took
//      12-15 us of a 38 us call at 4 GPUs). Then, on the ranks that merge: once every rank's partials of
//      (b, h) have landed (W adds a row block, or W x R with one split), each row's W parts merged (max,
//      rescaled sums, divided once) into out and lse; the last of the pair's blocks clears the count.
// Calls alternate between two inboxes and two sets of counts by the parity of the call's epoch (CallEpoch,
// in the op's state flags, the same call number on every rank). A rank pushes call n's partials into a
// rank's inbox only once that rank has finished its call n - 2 (the last to read that inbox): the last
// finisher of each call sets its call number into every peer's `released` flag of the parity (with every
// rank merging, that wait has always passed already: the peer's call n - 1 partials, merged here, came after
// its call n - 2 ended); so nothing overwrites what a slow rank still reads, whichever ranks merged which
// call, and a count is cleared by its owner before it is used again. No wait can block a phase-1 item of the
// rank waited for: phase-1 waits are for earlier calls, each block finishes its phase-1 items before its
// first phase-2 wait (a split merge waits for this rank's phase 1 and for the mergers' call n - 2, and
// comes before the block's first wait for this call's peers), and all blocks of every rank are resident.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "weft/comm/call_epoch.cuh"
#include "weft/comm/signal.cuh"
#include "weft/device/timeline.cuh"
#include "weft/team_view.hpp"
#include "weft/tile/mma_sync.cuh"

namespace weft::ops {

inline constexpr int kDecodeRows = 16;        // query rows per work item (the MMA's M; G > 16 takes several)
inline constexpr int kDecodeWarps = 4;        // per block
inline constexpr int kDecodeBlocksPerSm = 2;  // resident (its registers: ~240 a thread)
inline constexpr int kDecodeMaxPairs = 2048;  // (sequence, KV head) pairs of a call: landed counts per parity
inline constexpr int kDecodeMaxParts =
    512;  // partials of a row to merge (world x splits): the merge's weights
inline constexpr int kDecodeMaxWorld = kDecodeMaxParts;  // ranks: `released` flags per (rank, parity)

// Why flash_decode refused a call on the device (DeviceError::thread; DeviceError::block: the sequence).
enum class DecodeBadInput : uint32_t {
  kLengthPastCapacity = 0,  // seqlens[b] (observed) > the capacity (expected)
  kBlockOutOfRange = 1,     // block_table[b][j] (observed) outside [0, num_blocks (expected))
};

template <class T>
struct DecodeParams {
  TeamView team;
  CallEpoch epoch;  // the op's state flags
  Flags landed;     // [2 parities][kDecodeMaxPairs]: partials landed here
  Flags merged;     // [2 parities][kDecodeMaxPairs]: rows merged (local)
  Flags released;   // [kDecodeMaxWorld ranks][2 parities]: the last call of the parity that rank finished
  Flags split_done;  // [2 parities][kDecodeMaxPairs]: phase-1 items of the pair done here (local; S > 1)
  int out_rank;     // the rank that merges (gets out and lse); -1: every rank
  const T* q;       // [batch, q_len, heads, D]
  T* out;
  float* lse;  // [batch, q_len, heads] or null
  const T *k, *v;
  const int32_t* block_table;  // null: contiguous
  int block_size, max_blocks, num_blocks;
  const int32_t *seqlens, *offsets, *seq_total;  // offsets / seq_total may be null
  int batch, q_len, heads, kv_heads, group, rows, row_groups, splits, chunk, max_local;
  int merge_rows;    // rows a phase-2 block merges: 1 (its warps share a row's parts) or kDecodeWarps
  float scale_log2;  // softmax scale x log2(e)
  bool causal;
  // The inboxes (symmetric), one per call parity, each laid out for this call's shape: per source rank,
  // pair, split, row: O [D] fp32, then (m, l). Two areas, not one split in halves: a layout that follows the
  // shape would let a call of another shape write into the other parity's half.
  float* part_o[2];
  float2* part_ml[2];
};

__device__ __noinline__ void report_bad_input(const TeamView& team, int b, DecodeBadInput what, int64_t limit,
                                              int64_t seen) {
  // The peers' results lack this rank's part: their calls fail too.
  if (detail::report_error(team, DeviceErrorCode::kBadInput, static_cast<uint32_t>(b),
                           static_cast<uint32_t>(what), 0, static_cast<uint64_t>(limit),
                           static_cast<uint64_t>(seen), 0))
    detail::report_failure_to_peers(team);
}

// A uint4 of 8 16-bit elements as its four 32-bit pairs.
__device__ __forceinline__ uint32_t pair_of(const uint4& u, int i) {
  return i == 0 ? u.x : i == 1 ? u.y : i == 2 ? u.z : u.w;
}

// Tensor-core layout (tile/mma_sync.cuh): a warp takes 16 tokens per step against the item's 16 query rows.
// Lane 4 g + c loads 16 bytes of token g's (and g + 8's) K and V rows at dims [32 j + 8 c, +8) for each
// 32-dim slab j, and the same dims of query rows g and g + 8. A dot product does not care in which order
// it visits the dims, so the k index of S = Q K^T's MMAs walks those registers as loaded (slab j, half hh:
// the lane's pairs 2 hh and 2 hh + 1); P V's B operand is each loaded pair transposed by movmatrix, which
// makes output column 2 c' + e of tile (j, pp) the dim 32 j + 8 c' + 2 pp + e: lane 4 g + c then holds
// rows g and g + 8 of dims [32 j + 8 c, +8), the layout of its query loads.
template <class T, int kD>
struct DecodeKernel {
  static constexpr int kSlabs = kD / 32;                    // 32-dim slabs
  static constexpr int kTiles = kSlabs * 4;                 // P V output tiles of 8 dims
  static constexpr int kTokensPerStep = kDecodeWarps * 16;  // a block's tokens per loop step
  static constexpr float kNeg = -1e30f;                     // "no score yet", finite

  struct Smem {
    union {  // phase 1: the warps' partials; phase 2: each merged row's parts
      float o[kDecodeWarps][kDecodeRows][kD];
      float2 ml[kDecodeWarps][kDecodeMaxParts];
    } u;
    float m[kDecodeWarps][kDecodeRows], l[kDecodeWarps][kDecodeRows];
    float sum[kDecodeWarps][kD];  // phase 2: each warp's share of a row's weighted sum
    float stat[2][kDecodeWarps];  // phase 2: each warp's max and sum
  };

  using P = DecodeParams<T>;

  __device__ static int64_t part_index(const P& p, int src, int pair, int split, int row) {
    return ((int64_t(src) * (int64_t(p.batch) * p.kv_heads) + pair) * p.splits + split) * p.rows + row;
  }

  // Token t of sequence b on this rank: the row of K / V holding its KV head h, or -1 past the block table.
  __device__ static int64_t token_row(const P& p, int b, int t, int h, int& bad_block) {
    int64_t slot;
    if (p.block_table == nullptr) {
      slot = int64_t(b) * p.max_local + t;
    } else {
      const int blk = __ldg(p.block_table + int64_t(b) * p.max_blocks + t / p.block_size);
      if (blk < 0 || blk >= p.num_blocks) {
        bad_block = blk;
        return -1;
      }
      slot = int64_t(blk) * p.block_size + t % p.block_size;
    }
    return (slot * p.kv_heads + h) * kD;
  }

  // A warp's step from token base: tokens base + g (block 0) and base + 8 + g (block 1), 16 bytes of K and V
  // a slab (zeros past t1 or a bad block-table entry, recorded in bad / bad_block).
  __device__ static void load_step(const P& p, int b, int h, int base, int t1, uint4 (&kr)[2][kSlabs],
                                   uint4 (&vr)[2][kSlabs], int& bad_block, bool& bad) {
    const int g = threadIdx.x % 32 / 4, c = threadIdx.x % 4;
#pragma unroll
    for (int tb = 0; tb < 2; ++tb) {
      const int t = base + 8 * tb + g;
      int64_t at = -1;
      if (t < t1) {
        at = token_row(p, b, t, h, bad_block);
        bad |= at < 0;
      }
#pragma unroll
      for (int j = 0; j < kSlabs; ++j) {
        kr[tb][j] = vr[tb][j] = make_uint4(0, 0, 0, 0);
        if (at >= 0) {
          kr[tb][j] = *reinterpret_cast<const uint4*>(p.k + at + 32 * j + 8 * c);
          vr[tb][j] = *reinterpret_cast<const uint4*>(p.v + at + 32 * j + 8 * c);
        }
      }
    }
  }

  // Timeline marks (TimelinePhase::kDecode: DecodeStep) by thread 0; nothing without a buffer
  // (weft/timeline.hpp). A TimelineSpan marks a step up to the end of its scope, every exit included.
  __device__ static TimelineBuffer* timeline(const P& p) {
    return threadIdx.x == 0 ? p.team.timeline : nullptr;
  }
  __device__ static void mark(const P& p, DecodeStep step, bool end) {
    timeline_mark(timeline(p), TimelinePhase::kDecode, end, uint32_t(step));
  }

  // Phase 1, one item: rows [16 rg, 16 rg + 16) of pair (b, h) over split s's tokens.
  // The ranks that merge (receive partials): [first, last).
  __device__ static int first_merger(const P& p) {
    return p.out_rank >= 0 ? p.out_rank : 0;
  }
  __device__ static int last_merger(const P& p) {
    return p.out_rank >= 0 ? p.out_rank + 1 : p.team.world;
  }

  // Before call `call`'s first push: every rank that merges has finished call - 2 (the inbox's last reader).
  // False (recorded) on timeout or abort. Once a block has passed it, its later items push without asking.
  __device__ static bool released(const P& p, uint64_t call, int parity) {
    __shared__ bool ok;
    if (threadIdx.x == 0) {
      ok = true;
      for (int r = first_merger(p); r < last_merger(p) && ok && call > 2; ++r)
        ok = wait_ge(p.team, p.team.flag(p.released, 2 * r + parity), call - 2);
    }
    __syncthreads();
    return ok;
  }

  // `gated`: whether this block has passed released() in this call (the same in every thread).
  __device__ static void partial(const P& p, Smem& sm, int parity, uint64_t call, bool& gated, int b, int h,
                                 int s, int rg) {
    mark(p, DecodeStep::kPartial, false);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, c = lane % 4;
    int len = __ldg(p.seqlens + b);
    const int cap = p.block_table ? p.max_blocks * p.block_size : p.max_local;
    if (len < 0 || len > cap) {
      if (threadIdx.x == 0) report_bad_input(p.team, b, DecodeBadInput::kLengthPastCapacity, cap, len);
      len = 0;  // the call still completes its protocol; every rank's synchronize reports the refusal
    }
    const int t0 = s * p.chunk, t1 = min(len, t0 + p.chunk);
    const int offset = p.offsets ? __ldg(p.offsets + b) : 0;
    const int total = p.seq_total ? __ldg(p.seq_total + b) : len;
    // Query rows g and g + 8 of the group as A fragments; a row past the group's stays zero and sees no key.
    uint32_t qa[kSlabs][2][4];
    int last_key[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int row = rg * kDecodeRows + g + 8 * i;
      const int qi = row / p.group, head = h * p.group + row % p.group;
      const bool real = row < p.rows;
      last_key[i] = !real ? -1 : p.causal ? total - p.q_len + qi : INT32_MAX;
#pragma unroll
      for (int j = 0; j < kSlabs; ++j) {
        uint4 u = make_uint4(0, 0, 0, 0);
        if (real)
          u = *reinterpret_cast<const uint4*>(p.q + ((int64_t(b) * p.q_len + qi) * p.heads + head) * kD +
                                              32 * j + 8 * c);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          qa[j][hh][i] = pair_of(u, 2 * hh);          // a0 / a1: k 2c..2c+1
          qa[j][hh][2 + i] = pair_of(u, 2 * hh + 1);  // a2 / a3: k 2c+8..2c+9
        }
      }
    }
    float m[2] = {kNeg, kNeg}, l[2] = {0.f, 0.f}, o[kTiles][4];
#pragma unroll
    for (int n = 0; n < kTiles; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    int bad_block = 0;
    bool bad = false;
    uint4 kr[2][kSlabs], vr[2][kSlabs];
    load_step(p, b, h, t0 + 16 * warp, t1, kr, vr, bad_block, bad);
    for (int base = t0 + 16 * warp; base < t1; base += kTokensPerStep) {
      // The next step's K and V in flight while this step's are used (else a warp waits out HBM's latency
      // every step, with only the SM's few other warps to cover it).
      uint4 nk[2][kSlabs], nv[2][kSlabs];
      load_step(p, b, h, base + kTokensPerStep, t1, nk, nv, bad_block, bad);
      // S = Q K^T: tile tb holds tokens base + 8 tb + 2c + e of rows g (e = 0, 1) and g + 8 (2, 3).
      float sc[2][4];
#pragma unroll
      for (int tb = 0; tb < 2; ++tb) {
        sc[tb][0] = sc[tb][1] = sc[tb][2] = sc[tb][3] = 0.f;
#pragma unroll
        for (int j = 0; j < kSlabs; ++j)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh)
            tile::mma_16816<T>(sc[tb], qa[j][hh], pair_of(kr[tb][j], 2 * hh), pair_of(kr[tb][j], 2 * hh + 1));
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int t = base + 8 * tb + 2 * c + (e & 1);
          sc[tb][e] = t < t1 && offset + t <= last_key[e >> 1] ? sc[tb][e] * p.scale_log2 : kNeg;
        }
      }
      // Online softmax per row (i = 0: row g, 1: row g + 8): the max over the step's 16 tokens (the quad's
      // lanes hold them), the old state rescaled, then P in the A layout of P V.
      float pr[2][4];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float mx = fmaxf(fmaxf(sc[0][2 * i], sc[0][2 * i + 1]), fmaxf(sc[1][2 * i], sc[1][2 * i + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        mx = fmaxf(mx, m[i]);
        const float keep = exp2f(m[i] - mx);  // 1 while both are kNeg
        m[i] = mx;
        l[i] *= keep;
#pragma unroll
        for (int n = 0; n < kTiles; ++n) {
          o[n][2 * i] *= keep;
          o[n][2 * i + 1] *= keep;
        }
#pragma unroll
        for (int tb = 0; tb < 2; ++tb)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float x = sc[tb][2 * i + e];
            const float v = x > 0.5f * kNeg ? exp2f(x - mx) : 0.f;
            pr[tb][2 * i + e] = v;
            l[i] += v;
          }
      }
      const uint32_t pa[4] = {
          tile::MmaType<T>::pack(pr[0][0], pr[0][1]), tile::MmaType<T>::pack(pr[0][2], pr[0][3]),
          tile::MmaType<T>::pack(pr[1][0], pr[1][1]), tile::MmaType<T>::pack(pr[1][2], pr[1][3])};
      // O += P V: tile (j, pp)'s B operand is pair pp of each token block's slab j, transposed.
#pragma unroll
      for (int j = 0; j < kSlabs; ++j)
#pragma unroll
        for (int pp = 0; pp < 4; ++pp)
          tile::mma_16816<T>(o[4 * j + pp], pa, tile::movmatrix_trans(pair_of(vr[0][j], pp)),
                             tile::movmatrix_trans(pair_of(vr[1][j], pp)));
#pragma unroll
      for (int tb = 0; tb < 2; ++tb)
#pragma unroll
        for (int j = 0; j < kSlabs; ++j) {
          kr[tb][j] = nk[tb][j];
          vr[tb][j] = nv[tb][j];
        }
    }
    if (bad) report_bad_input(p.team, b, DecodeBadInput::kBlockOutOfRange, p.num_blocks, bad_block);
      // The warps merged: each warp's state into shared memory (rows g and g + 8 of dims [32 j + 8 c, +8)),
      // then the block's threads take 4 elements at a time.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
      l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
      float* row = sm.u.o[warp][g + 8 * i];
#pragma unroll
      for (int j = 0; j < kSlabs; ++j)
#pragma unroll
        for (int pp = 0; pp < 4; ++pp)
          *reinterpret_cast<float2*>(row + 32 * j + 8 * c + 2 * pp) =
              make_float2(o[4 * j + pp][2 * i], o[4 * j + pp][2 * i + 1]);
      if (c == 0) {
        sm.m[warp][g + 8 * i] = m[i];
        sm.l[warp][g + 8 * i] = l[i];
      }
    }
    __syncthreads();
    mark(p, DecodeStep::kPartial, true);
    const TimelineSpan pushing(timeline(p), TimelinePhase::kDecode, uint32_t(DecodeStep::kPush));
    const bool local = p.splits > 1;  // this rank's splits merged here first (merge<kRows, true>)
    if (!local && !gated && !(gated = released(p, call, parity))) return;
    const int pair = b * p.kv_heads + h;
    for (int e = threadIdx.x; e < kDecodeRows * kD / 4; e += blockDim.x) {
      const int r = e / (kD / 4), d = e % (kD / 4) * 4, row = rg * kDecodeRows + r;
      if (row >= p.rows) continue;
      float mx = kNeg;
#pragma unroll
      for (int w = 0; w < kDecodeWarps; ++w) mx = fmaxf(mx, sm.m[w][r]);
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < kDecodeWarps; ++w) {
        const float wt = sm.l[w][r] > 0.f ? exp2f(sm.m[w][r] - mx) : 0.f;
        const float4 v = *reinterpret_cast<const float4*>(&sm.u.o[w][r][d]);
        acc.x = fmaf(wt, v.x, acc.x);
        acc.y = fmaf(wt, v.y, acc.y);
        acc.z = fmaf(wt, v.z, acc.z);
        acc.w = fmaf(wt, v.w, acc.w);
        sum = fmaf(wt, sm.l[w][r], sum);
      }
      const int64_t i = part_index(p, p.team.rank, pair, s, row);
      if (local) {  // this rank's own inbox, read by merge<kRows, true>
        *reinterpret_cast<float4*>(p.part_o[parity] + i * kD + d) = acc;
        if (d == 0) p.part_ml[parity][i] = make_float2(mx, sum);
        continue;
      }
      for (int dst = first_merger(p); dst < last_merger(p); ++dst) {
        *reinterpret_cast<float4*>(p.team.peer_ptr(p.part_o[parity] + i * kD + d, dst)) = acc;
        if (d == 0) *p.team.peer_ptr(p.part_ml[parity] + i, dst) = make_float2(mx, sum);
      }
    }
    __syncthreads();  // every thread's stores, then one system fence and relaxed adds publish them
    if (!local) {
      if (threadIdx.x == 0) publish(p, parity, pair);
      return;
    }
    // The item counted in the pair's local split_done count (a fence orders the block's stores before it);
    // merge<kRows, true> waits for every item of the pair.
    if (threadIdx.x == 0) {
      __threadfence();
      atomicAdd(
          reinterpret_cast<unsigned long long*>(p.team.flag(p.split_done, parity * kDecodeMaxPairs + pair)),
          1ull);
    }
  }
  // Orders this thread's earlier memory operations before its later signals, for the ranks that read them:
  // across GPUs a system fence; on a team of one only this GPU reads them (a GPU-scope fence, far cheaper at
  // a call's tail, where every block passes one).
  __device__ static void fence_for_readers(const P& p) {
    if (p.team.world == 1)
      __threadfence();
    else
      __threadfence_system();
  }
  // By thread 0, after the block's pushes of a pair's partials: one fence, then one relaxed add to the pair's
  // landed count at every rank that merges.
  __device__ static void publish(const P& p, int parity, int pair) {
    fence_for_readers(p);
    for (int dst = first_merger(p); dst < last_merger(p); ++dst)
      signal_add<Order::kRelaxed>(p.team, p.team.flag(p.landed, parity * kDecodeMaxPairs + pair), dst, 1);
  }
  // The row blocks of a pair in phase 2 (rows [r0, r0 + merge_rows) each).
  __device__ static int row_blocks(const P& p) {
    return (p.rows + p.merge_rows - 1) / p.merge_rows;
  }
  // The adds a pair's landed count takes per call at a rank that merges: one a rank and row block (several
  // splits, merged on their rank first), or one a rank and row group (one split).
  __device__ static uint64_t landed_target(const P& p) {
    return uint64_t(p.team.world) * (p.splits > 1 ? row_blocks(p) : p.row_groups);
  }

  // Rows [r0, r0 + kRows) of a pair (kRows 1 or kDecodeWarps), in two forms that share the arithmetic of a
  // merge (the parts' max, each part's weight, the rescaled sums):
  //   kSplits (several splits, on every rank): once every phase-1 item of the pair is counted in split_done
  //     (and, before the block's first push, the merging ranks have released this parity's inbox),
  //     this rank's S split partials of each row merged into one (O = the rescaled sums, m = their max, l =
  //     the rescaled total; not divided) and pushed to every rank that merges at split 0's place, then
  //     published (a landed add a row block). Spread over the pair's row blocks (with one row a block, all
  //     four warps share a row's splits), not left to the pair's last phase-1 item: one block merging a pair
  //     alone is a chain of dependent L2 loads (16 us of a 48 us call at batch 1, 64 / 8 heads, 32 splits).
  //     On a team of one the merged row is final (out and lse), as below.
  //   otherwise (on the ranks that merge): once every rank's partials of the pair have landed, each row's W
  //     parts merged and divided once into out and lse.
  // The kDecodeWarps / kRows warps of a row share its parts (w, w + that, ...), 4 loads in flight: one row a
  // block where the parts are many (a long sequence, few pairs), a row a warp where they are few (many
  // pairs: fewer items, each a chain of dependent loads). The last block of the pair clears its count.
  // L2 loads: other blocks and ranks wrote the parts during this kernel.
  template <int kRows, bool kSplits>
  __device__ static void merge(const P& p, Smem& sm, int parity, uint64_t call, bool& gated, int b, int h,
                               int r0) {
    constexpr int kWarpsPerRow = kDecodeWarps / kRows;
    const int pair = b * p.kv_heads + h, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int rw = warp / kWarpsPerRow, wi = warp % kWarpsPerRow, row = r0 + rw;
    const bool live = row < p.rows;
    uint64_t* count = kSplits ? p.team.flag(p.split_done, parity * kDecodeMaxPairs + pair)
                              : p.team.flag(p.landed, parity * kDecodeMaxPairs + pair);
    const uint64_t target = kSplits ? uint64_t(p.splits) * p.row_groups : landed_target(p);
    __shared__ bool ok;
    const DecodeStep wait_step = kSplits ? DecodeStep::kMergeSplits : DecodeStep::kWaitPartials;
    mark(p, wait_step, false);
    if (threadIdx.x == 0)
      ok = kSplits ? wait_ge_local(p.team, count, target) : wait_ge(p.team, count, target);
    __syncthreads();
    const bool push = kSplits && p.team.world > 1;  // else the row is final: out and lse
    bool go = ok;
    if (push && go && !gated) go = gated = released(p, call, parity);  // before the first push to a peer
    if (!kSplits || !go) mark(p, wait_step, true);
    if (!go) return;  // recorded; synchronize() reports it
    const TimelineSpan merging(kSplits ? nullptr : timeline(p), TimelinePhase::kDecode,
                               uint32_t(DecodeStep::kMerge));
    const int parts = kSplits ? p.splits : p.team.world;
    auto part = [&](int i) {  // part i of the row: split i of this rank, or rank i's (at split 0's place)
      return kSplits ? part_index(p, p.team.rank, pair, i, row) : part_index(p, i, pair, 0, row);
    };
    const float* po = p.part_o[parity];
    float2* ml = sm.u.ml[rw];  // the row's (m, l) per part, then (weight, l)
    float mx = kNeg;
    for (int i = wi * 32 + lane; live && i < parts; i += 32 * kWarpsPerRow) {
      const float2 x = __ldcg(p.part_ml[parity] + part(i));
      ml[i] = x;
      if (x.y > 0.f) mx = fmaxf(mx, x.x);
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    if (lane == 0) sm.stat[0][warp] = mx;
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kWarpsPerRow; ++k) mx = fmaxf(mx, sm.stat[0][rw * kWarpsPerRow + k]);
    float total = 0.f;
    for (int i = wi * 32 + lane; live && i < parts; i += 32 * kWarpsPerRow) {
      const float2 x = ml[i];
      const float w = x.y > 0.f ? exp2f(x.x - mx) : 0.f;
      ml[i].x = w;
      total = fmaf(w, x.y, total);
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) total += __shfl_xor_sync(0xffffffffu, total, off);
    if (lane == 0) sm.stat[1][warp] = total;
    __syncthreads();  // the weights and the sums
    total = 0.f;
#pragma unroll
    for (int k = 0; k < kWarpsPerRow; ++k) total += sm.stat[1][rw * kWarpsPerRow + k];
    constexpr int kPer = kD / 32;  // elements a lane sums: dims [kPer lane, +kPer)
    using Vec = std::conditional_t<kPer == 4, float4, float2>;
    static_assert(sizeof(Vec) == kPer * sizeof(float), "a lane's dims in one vector");
    float acc[kPer] = {};
    constexpr int kInFlight = 4;
    for (int i0 = wi; live && i0 < parts; i0 += kWarpsPerRow * kInFlight) {
      Vec v[kInFlight];
      float w[kInFlight];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        const int i = i0 + u * kWarpsPerRow;
        w[u] = 0.f;
        v[u] = Vec{};
        if (i < parts) {  // every part was written (an empty one as zeros): no NaN from a zero weight
          w[u] = ml[i].x;
          v[u] = __ldcg(reinterpret_cast<const Vec*>(po + part(i) * kD + kPer * lane));
        }
      }
#pragma unroll
      for (int u = 0; u < kInFlight; ++u)
#pragma unroll
        for (int e = 0; e < kPer; ++e) acc[e] = fmaf(w[u], reinterpret_cast<const float*>(&v[u])[e], acc[e]);
    }
    // The row's sums: a lane's dims in acc (one warp a row), or summed over the row's warps in shared memory.
    const int qi = row / p.group, head = h * p.group + row % p.group;
    const int64_t o = (int64_t(b) * p.q_len + qi) * p.heads + head;
    // kSplits: the merged row's place, split 0's. Overwriting it here is safe: each lane rewrites only the
    // dims it loaded, lane 0 the (m, l) it read (kept in shared memory), and with a row a block the stores
    // come after the block's sum below.
    const int64_t at = part_index(p, p.team.rank, pair, 0, row);
    if constexpr (kWarpsPerRow == 1) {
      if (live && push) {
        Vec merged;
#pragma unroll
        for (int e = 0; e < kPer; ++e) reinterpret_cast<float*>(&merged)[e] = acc[e];
        for (int dst = first_merger(p); dst < last_merger(p); ++dst) {
          *reinterpret_cast<Vec*>(p.team.peer_ptr(p.part_o[parity] + at * kD + kPer * lane, dst)) = merged;
          if (lane == 0) *p.team.peer_ptr(p.part_ml[parity] + at, dst) = make_float2(mx, total);
        }
      } else if (live) {
#pragma unroll
        for (int e = 0; e < kPer; ++e)
          p.out[o * kD + kPer * lane + e] = static_cast<T>(total > 0.f ? acc[e] / total : 0.f);
        if (lane == 0 && p.lse != nullptr)
          p.lse[o] = total > 0.f ? (mx + log2f(total)) * 0.6931471805599453f : -INFINITY;
      }
    } else {
#pragma unroll
      for (int e = 0; e < kPer; ++e) sm.sum[warp][kPer * lane + e] = acc[e];
      __syncthreads();  // also: every warp's loads of split 0 before its place is overwritten below
      for (int d = threadIdx.x; d < kD; d += blockDim.x) {
        float x = 0.f;
#pragma unroll
        for (int w = 0; w < kDecodeWarps; ++w) x += sm.sum[w][d];
        if (push) {
          for (int dst = first_merger(p); dst < last_merger(p); ++dst) {
            *p.team.peer_ptr(p.part_o[parity] + at * kD + d, dst) = x;
            if (d == 0) *p.team.peer_ptr(p.part_ml[parity] + at, dst) = make_float2(mx, total);
          }
          continue;
        }
        p.out[o * kD + d] = static_cast<T>(total > 0.f ? x / total : 0.f);
        if (d == 0 && p.lse != nullptr)
          p.lse[o] = total > 0.f ? (mx + log2f(total)) * 0.6931471805599453f : -INFINITY;
      }
    }
    // kSplits: the block's pushes published. Every block of the pair has passed its wait once all its rows
    // are counted (in split_done past the phase-1 items, or in merged): the last block clears the counts
    // for the call after next of this parity.
    __syncthreads();
    if (threadIdx.x == 0) {
      if (push) publish(p, parity, pair);
      const uint64_t rows = static_cast<uint64_t>(min(kRows, p.rows - r0));
      uint64_t* merged = kSplits ? count : p.team.flag(p.merged, parity * kDecodeMaxPairs + pair);
      const uint64_t done = kSplits ? target + uint64_t(p.rows) : uint64_t(p.rows);
      if (atomicAdd(reinterpret_cast<unsigned long long*>(merged), rows) + rows == done) {
        *reinterpret_cast<volatile uint64_t*>(count) = 0;
        *reinterpret_cast<volatile uint64_t*>(merged) = 0;
      }
    }
    if (kSplits) mark(p, wait_step, true);
  }

  // This block's phase-2 items of one form: (pair, row block) from blockIdx.x in steps of the grid.
  template <bool kSplits>
  __device__ static void merge_items(const P& p, Smem& sm, int parity, uint64_t call, bool& gated) {
    const int pairs = p.batch * p.kv_heads, blocks = row_blocks(p);
    for (int it = blockIdx.x; it < pairs * blocks; it += gridDim.x) {
      const int pair = it / blocks, r0 = it % blocks * p.merge_rows;
      if (p.merge_rows == 1)
        merge<1, kSplits>(p, sm, parity, call, gated, pair / p.kv_heads, pair % p.kv_heads, r0);
      else
        merge<kDecodeWarps, kSplits>(p, sm, parity, call, gated, pair / p.kv_heads, pair % p.kv_heads, r0);
      __syncthreads();
    }
  }
};

template <class T, int kD>
__global__ void __launch_bounds__(kDecodeWarps * 32)
    flash_decode_kernel(const __grid_constant__ DecodeParams<T> p) {
  using K = DecodeKernel<T, kD>;
  extern __shared__ __align__(16) unsigned char decode_smem[];
  typename K::Smem& sm = *reinterpret_cast<typename K::Smem*>(decode_smem);
  // The block's whole span (start to exit, beside the steps' marks): what a call spends outside its steps.
  TimelineBuffer* const recorder = threadIdx.x == 0 ? p.team.timeline : nullptr;
  timeline_mark(recorder, TimelinePhase::kBlock, false);
  const uint64_t call = p.epoch.epoch();
  const int parity = static_cast<int>(call & 1u);
  const int pairs = p.batch * p.kv_heads;
  const int items = pairs * p.splits * p.row_groups;
  bool gated = false;
  for (int it = blockIdx.x; it < items; it += gridDim.x) {
    const int rg = it % p.row_groups, s = it / p.row_groups % p.splits, pair = it / (p.row_groups * p.splits);
    K::partial(p, sm, parity, call, gated, pair / p.kv_heads, pair % p.kv_heads, s, rg);
    __syncthreads();  // the shared merge buffers are reused by the next item
  }
  // Phase 2: a row a block, or a row a warp (DecodeParams::merge_rows, 1 or kDecodeWarps: another count
  // would overlap rows and never clear the pair's counts). With several splits every rank first merges its
  // own (each block takes the same (pair, row block) items in both loops, in the same order on every rank:
  // a block's merging waits come after all its split merges, which wait only on this rank's phase 1).
  if (p.merge_rows != 1 && p.merge_rows != kDecodeWarps) __trap();
  if (p.splits > 1) K::template merge_items<true>(p, sm, parity, call, gated);
  // (On a team of one the split merges made out already.)
  if ((p.out_rank < 0 || p.out_rank == p.team.rank) && !(p.splits > 1 && p.team.world == 1))
    K::template merge_items<false>(p, sm, parity, call, gated);
  // The call's end, told to every rank: it may push its call + 2 into this rank's inbox of this parity. The
  // fence orders this block's reads of the inbox before the last finisher's release.
  if (threadIdx.x == 0) {
    const TimelineSpan release(recorder, TimelinePhase::kDecode, uint32_t(DecodeStep::kRelease));
    K::fence_for_readers(p);
    if (p.epoch.finished(gridDim.x))
      for (int dst = 0; dst < p.team.world; ++dst)  // itself too: its own pushes wait on the same flags
        signal_set(p.team, p.team.flag(p.released, 2 * p.team.rank + parity), dst, call);
  }
  timeline_mark(recorder, TimelinePhase::kBlock, true);
}

}  // namespace weft::ops
