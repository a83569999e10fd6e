// Device code of weft::flash_decode (weft/ops/flash_decode.hpp): one persistent kernel per rank, every block
// resident (the grid is sized to fit), in two phases.
//   1. Partials. Work items (sequence b, KV head h, split s, row group g): the block attends rows [8 g, 8 g +
//      8) of the KV head's G = q_len x heads / kv_heads query rows over tokens [s chunk, (s + 1) chunk) of
//      b's cache on this rank, on CUDA cores (decode reads each cached byte once: it is bound by HBM, not by
//      arithmetic, at G <= 16). A group of D / 8 lanes takes one token (8 elements a lane, 16-byte loads of
//      K and V), kUnroll tokens in flight per group; scores are summed over the group by shuffles; each
//      group keeps an online softmax (running max m, sum l, unnormalised O in fp32, exp2 domain) and the
//      block merges its groups in shared memory. The partial (O, m, l) goes to every rank's inbox, then a
//      release add into every rank's landed count of (b, h).
//   2. Merge. Items (b, h): once every rank's S x R partials of (b, h) have landed (W x S x R adds), the
//      block merges them (max, rescaled sums, divided once) into out and lse, then clears the count.
// Calls alternate between two inboxes and two sets of counts by the parity of the call's epoch (CallEpoch,
// in the op's state flags): a rank pushes call n + 2's partials into a peer only after its own call n + 1
// has merged the peer's call n + 1 partials, which the peer pushed after its call n ended; so nothing
// overwrites what a slow peer still reads, and a count is cleared by its owner before it is used again.
// No phase-2 wait can block a phase-1 item: each block finishes its phase-1 items before its first wait, and
// all blocks of every rank are resident.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "weft/comm/call_epoch.cuh"
#include "weft/comm/signal.cuh"
#include "weft/team_view.hpp"

namespace weft::ops {

inline constexpr int kDecodeRows = 8;    // query rows per work item at most (1, 2, 4 or 8: the fewest >= G)
inline constexpr int kDecodeWarps = 4;   // per block
inline constexpr int kDecodeUnroll = 2;  // tokens in flight per lane group
inline constexpr int kDecodeMaxPairs = 2048;  // (sequence, KV head) pairs of a call: landed counts per parity
inline constexpr int kDecodeMaxParts =
    512;  // partials of a row to merge (world x splits): the merge's weights

// Why flash_decode refused a call on the device (DeviceError::thread; DeviceError::block: the sequence).
enum class DecodeBadInput : uint32_t {
  kLengthPastCapacity = 0,  // seqlens[b] (observed) > the capacity (expected)
  kBlockOutOfRange = 1,     // block_table[b][j] (observed) outside [0, num_blocks (expected))
};

template <class T>
struct DecodeParams {
  TeamView team;
  CallEpoch epoch;  // the op's state flags
  Flags landed;     // [2 parities][kDecodeMaxPairs]
  const T* q;       // [batch, q_len, heads, D]
  T* out;
  float* lse;  // [batch, q_len, heads] or null
  const T *k, *v;
  const int32_t* block_table;  // null: contiguous
  int block_size, max_blocks, num_blocks;
  const int32_t *seqlens, *offsets, *seq_total;  // offsets / seq_total may be null
  int batch, q_len, heads, kv_heads, group, rows, row_groups, splits, chunk, max_local;
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

template <class T>
__device__ __forceinline__ float to_f(T x) {
  return static_cast<float>(x);
}

// 8 elements of T (16 bytes) to fp32.
template <class T>
__device__ __forceinline__ void unpack8(const uint4& u, float (&f)[8]) {
  const T* x = reinterpret_cast<const T*>(&u);
#pragma unroll
  for (int i = 0; i < 8; ++i) f[i] = to_f(x[i]);
}

// kRows: the query rows a work item takes (the kernel's per-thread state: kRows x 8 elements of q and O).
template <class T, int kD, int kRows>
struct DecodeKernel {
  static_assert(kRows == 1 || kRows == 2 || kRows == 4 || kRows == 8, "rows per item");
  static constexpr int kLanes = kD / 8;               // lanes per token
  static constexpr int kGroupsPerWarp = 32 / kLanes;  // tokens side by side in a warp
  static constexpr int kGroups = kDecodeWarps * kGroupsPerWarp;
  static constexpr int kTokensPerStep = kGroups * kDecodeUnroll;  // a block's tokens per loop step
  static constexpr float kNeg = -1e30f;                           // "no score yet", finite

  struct Smem {
    union {  // phase 1: the groups' partials; phase 2: each part's weight per row
      float o[kGroups][kRows][kD];
      float weight[kDecodeRows * kDecodeMaxParts];
    } u;
    float m[kGroups][kRows], l[kGroups][kRows];
    float row_max[kDecodeRows], row_total[kDecodeRows];
  };

  using P = DecodeParams<T>;

  __device__ static int64_t part_index(const P& p, int src, int pair, int split, int row) {
    return ((int64_t(src) * (int64_t(p.batch) * p.kv_heads) + pair) * p.splits + split) * p.rows + row;
  }

  // Token t of sequence b on this rank: the row of K / V holding its KV head h, or null past the capacity.
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

  // Phase 1, one item: rows [8 rg, 8 rg + 8) of pair (b, h) over split s's tokens.
  __device__ static void partial(const P& p, Smem& sm, int parity, int b, int h, int s, int rg) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int sub = lane / kLanes, x = lane % kLanes, group_id = warp * kGroupsPerWarp + sub;
    const int d0 = x * 8;
    int len = __ldg(p.seqlens + b);
    const int cap = p.block_table ? p.max_blocks * p.block_size : p.max_local;
    if (len < 0 || len > cap) {
      if (threadIdx.x == 0) report_bad_input(p.team, b, DecodeBadInput::kLengthPastCapacity, cap, len);
      len = 0;  // the call still completes its protocol; every rank's synchronize reports the refusal
    }
    const int t0 = s * p.chunk, t1 = min(len, t0 + p.chunk);
    const int offset = p.offsets ? __ldg(p.offsets + b) : 0;
    const int total = p.seq_total ? __ldg(p.seq_total + b) : len;
    // This lane's 8 elements of each row's query (scaled into the exp2 domain); a row past G stays zero.
    float q[kRows][8];
    int last_key[kRows];  // causal: the last global position row r may see
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int row = rg * kRows + r;
      const int qi = row / p.group, head = h * p.group + row % p.group;
      last_key[r] = p.causal ? total - p.q_len + qi : INT32_MAX;
      if (row < p.rows) {
        float f[8];
        unpack8<T>(
            *reinterpret_cast<const uint4*>(p.q + ((int64_t(b) * p.q_len + qi) * p.heads + head) * kD + d0),
            f);
#pragma unroll
        for (int j = 0; j < 8; ++j) q[r][j] = f[j] * p.scale_log2;
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) q[r][j] = 0.f;
        last_key[r] = -1;  // no key: the row stays empty
      }
    }
    float m[kRows], l[kRows], o[kRows][8];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      m[r] = kNeg;
      l[r] = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) o[r][j] = 0.f;
    }
    int bad_block = 0;
    bool bad = false;
    for (int base = t0; base < t1; base += kTokensPerStep) {
      uint4 kv[kDecodeUnroll][2];
      int pos[kDecodeUnroll];
      bool live[kDecodeUnroll];
#pragma unroll
      for (int u = 0; u < kDecodeUnroll; ++u) {
        const int t = base + (u * kGroups + group_id);
        live[u] = t < t1;
        pos[u] = offset + t;
        kv[u][0] = kv[u][1] = make_uint4(0, 0, 0, 0);
        if (live[u]) {
          const int64_t at = token_row(p, b, t, h, bad_block);
          if (at < 0) {
            live[u] = false;
            bad = true;
          } else {
            kv[u][0] = *reinterpret_cast<const uint4*>(p.k + at + d0);
            kv[u][1] = *reinterpret_cast<const uint4*>(p.v + at + d0);
          }
        }
      }
      float sc[kDecodeUnroll][kRows];
#pragma unroll
      for (int u = 0; u < kDecodeUnroll; ++u) {
        float kf[8];
        unpack8<T>(kv[u][0], kf);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          float acc = 0.f;
#pragma unroll
          for (int j = 0; j < 8; ++j) acc = fmaf(q[r][j], kf[j], acc);
#pragma unroll
          for (int off = kLanes / 2; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
          sc[u][r] = live[u] && pos[u] <= last_key[r] ? acc : kNeg;
        }
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        float mx = m[r];
#pragma unroll
        for (int u = 0; u < kDecodeUnroll; ++u) mx = fmaxf(mx, sc[u][r]);
        const float keep = exp2f(m[r] - mx);  // 1 while both are kNeg
        l[r] *= keep;
#pragma unroll
        for (int j = 0; j < 8; ++j) o[r][j] *= keep;
        m[r] = mx;
      }
#pragma unroll
      for (int u = 0; u < kDecodeUnroll; ++u) {
        float vf[8];
        unpack8<T>(kv[u][1], vf);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const float pr = sc[u][r] > 0.5f * kNeg ? exp2f(sc[u][r] - m[r]) : 0.f;
          l[r] += pr;
#pragma unroll
          for (int j = 0; j < 8; ++j) o[r][j] = fmaf(pr, vf[j], o[r][j]);
        }
      }
    }
    if (bad) report_bad_input(p.team, b, DecodeBadInput::kBlockOutOfRange, p.num_blocks, bad_block);
      // The block's groups merged: every group's state into shared memory, then thread i takes elements.
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int j = 0; j < 8; ++j) sm.u.o[group_id][r][d0 + j] = o[r][j];
      if (x == 0) {
        sm.m[group_id][r] = m[r];
        sm.l[group_id][r] = l[r];
      }
    }
    __syncthreads();
    const int pair = b * p.kv_heads + h;
    for (int e = threadIdx.x; e < kRows * kD; e += blockDim.x) {
      const int r = e / kD, d = e % kD, row = rg * kRows + r;
      float mx = kNeg;
      for (int g = 0; g < kGroups; ++g) mx = fmaxf(mx, sm.m[g][r]);
      float acc = 0.f, sum = 0.f;
      for (int g = 0; g < kGroups; ++g) {
        const float w = sm.l[g][r] > 0.f ? exp2f(sm.m[g][r] - mx) : 0.f;
        acc = fmaf(w, sm.u.o[g][r][d], acc);
        sum = fmaf(w, sm.l[g][r], sum);
      }
      if (row >= p.rows) continue;
      const int64_t i = part_index(p, p.team.rank, pair, s, row);
      for (int dst = 0; dst < p.team.world; ++dst) {
        *p.team.peer_ptr(p.part_o[parity] + i * kD + d, dst) = acc;
        if (d == 0) *p.team.peer_ptr(p.part_ml[parity] + i, dst) = make_float2(mx, sum);
      }
    }
    __syncthreads();  // every thread's stores, then one system fence and relaxed adds publish them
    if (threadIdx.x == 0) {
      __threadfence_system();
      for (int dst = 0; dst < p.team.world; ++dst)
        signal_add<Order::kRelaxed>(p.team, p.team.flag(p.landed, parity * kDecodeMaxPairs + pair), dst, 1);
    }
  }

  // Phase 2, one pair: every rank's partials merged into out and lse, then the count cleared. Rows in groups
  // of 8: each part's weight per row (exp2 of its max minus the rows' max; 0 for an empty part) computed once
  // into shared memory (the phase-1 buffers; parts <= kDecodeMaxParts), then every element's rescaled sum.
  __device__ static void merge(const P& p, Smem& sm, int parity, int b, int h) {
    const int pair = b * p.kv_heads + h;
    uint64_t* count = p.team.flag(p.landed, parity * kDecodeMaxPairs + pair);
    __shared__ bool ok;
    if (threadIdx.x == 0) ok = wait_ge(p.team, count, uint64_t(p.team.world) * p.splits * p.row_groups);
    __syncthreads();
    if (!ok) return;  // recorded; synchronize() reports it
    const int parts = p.team.world * p.splits;
    float* weight = sm.u.weight;  // [kDecodeRows][parts]
    float* total = sm.row_total;
    const float* po = p.part_o[parity];
    const float2* pml = p.part_ml[parity];
    for (int r0 = 0; r0 < p.rows; r0 += kDecodeRows) {
      const int nr = min(kDecodeRows, p.rows - r0);
      // One warp per row: the max, then the weights and their sum.
      for (int r = threadIdx.x / 32; r < nr; r += kDecodeWarps) {
        float mx = kNeg;
        for (int i = threadIdx.x % 32; i < parts; i += 32) {
          const float2 ml = pml[part_index(p, i / p.splits, pair, i % p.splits, r0 + r)];
          if (ml.y > 0.f) mx = fmaxf(mx, ml.x);
        }
#pragma unroll
        for (int off = 16; off > 0; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        float sum = 0.f;
        for (int i = threadIdx.x % 32; i < parts; i += 32) {
          const float2 ml = pml[part_index(p, i / p.splits, pair, i % p.splits, r0 + r)];
          const float w = ml.y > 0.f ? exp2f(ml.x - mx) : 0.f;
          weight[r * parts + i] = w;
          sum = fmaf(w, ml.y, sum);
        }
#pragma unroll
        for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
        if (threadIdx.x % 32 == 0) {
          total[r] = sum;
          sm.row_max[r] = mx;
        }
      }
      __syncthreads();
      for (int e = threadIdx.x; e < nr * kD; e += blockDim.x) {
        const int r = e / kD, d = e % kD, row = r0 + r;
        float acc = 0.f;
        for (int i = 0; i < parts; ++i) {
          const float w = weight[r * parts + i];
          if (w > 0.f) acc = fmaf(w, po[part_index(p, i / p.splits, pair, i % p.splits, row) * kD + d], acc);
        }
        const float sum = total[r];
        const int qi = row / p.group, head = h * p.group + row % p.group;
        const int64_t o = (int64_t(b) * p.q_len + qi) * p.heads + head;
        p.out[o * kD + d] = static_cast<T>(sum > 0.f ? acc / sum : 0.f);
        if (d == 0 && p.lse != nullptr)
          p.lse[o] = sum > 0.f ? (sm.row_max[r] + log2f(sum)) * 0.6931471805599453f : -INFINITY;
      }
      __syncthreads();  // the weights are rewritten for the next rows
    }
    if (threadIdx.x == 0) *reinterpret_cast<volatile uint64_t*>(count) = 0;  // every inbox read is done
  }
};

template <class T, int kD, int kRows>
__global__ void __launch_bounds__(kDecodeWarps * 32)
    flash_decode_kernel(const __grid_constant__ DecodeParams<T> p) {
  using K = DecodeKernel<T, kD, kRows>;
  extern __shared__ __align__(16) unsigned char decode_smem[];
  typename K::Smem& sm = *reinterpret_cast<typename K::Smem*>(decode_smem);
  const int parity = static_cast<int>(p.epoch.epoch() & 1u);
  const int pairs = p.batch * p.kv_heads;
  const int items = pairs * p.splits * p.row_groups;
  for (int it = blockIdx.x; it < items; it += gridDim.x) {
    const int rg = it % p.row_groups, s = it / p.row_groups % p.splits, pair = it / (p.row_groups * p.splits);
    K::partial(p, sm, parity, pair / p.kv_heads, pair % p.kv_heads, s, rg);
    __syncthreads();  // the shared merge buffers are reused by the next item
  }
  for (int pair = blockIdx.x; pair < pairs; pair += gridDim.x) {
    K::merge(p, sm, parity, pair / p.kv_heads, pair % p.kv_heads);
    __syncthreads();
  }
  if (threadIdx.x == 0) p.epoch.finished(gridDim.x);
}

}  // namespace weft::ops
