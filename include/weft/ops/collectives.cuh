// Device code of the collectives: each is a few phases of the primitives, run by every block on its own
// share of the data. Block b of every rank handles the same share, and the blocks with the same index meet
// in their own barrier slot (slot b of the kernel's `slots`, the team's block-meeting slots that the host
// passes in): no grid-wide synchronization anywhere.
//
// Every kernel but the LL one-shot starts with that per-block barrier. Passing it means every peer has
// started this call, so its previous kernels (which may still have been reading the buffers we are about to
// write) are done. The LL one-shot needs none: see its comment.
#pragma once
#include <initializer_list>
#include <type_traits>

#include "weft/comm/barrier.cuh"
#include "weft/comm/elementwise.cuh"
#include "weft/device/numeric.cuh"
#include "weft/device/timeline.cuh"
#include "weft/team_view.hpp"

namespace weft::coll {

// `rows` rows of `row_bytes` bytes; rows `stride` bytes apart.
struct Rows {
  char* base;
  uint64_t stride;
};

// This block's units of [0, n): chunks of 4 * blockDim.x units dealt round-robin to the blocks, so the
// whole grid streams through memory together. Contiguous per-block shares of a 1 GiB buffer keep
// 132 x 3 remote pages hot at once and lose ~7% to address translation; interleaved chunks keep a
// window of a few pages. Every phase of a kernel uses the same dealing, so block b's meeting covers
// exactly the data block b moved. Iterations [it_begin, it_end) of the block's deal only: pipelined
// kernels walk the deal in groups.
__device__ __forceinline__ uint64_t chunk_units(uint64_t n) {
  // Full chunks of 4 * blockDim units when there is enough work for every block; otherwise even shares,
  // so small messages still spread over the whole grid.
  const uint64_t even = (n + gridDim.x - 1) / gridDim.x;
  return min(uint64_t(4) * blockDim.x, max(uint64_t(blockDim.x), even));
}
// How many chunks of [0, n) this block is dealt.
__device__ __forceinline__ uint64_t chunk_iterations(uint64_t n) {
  const uint64_t chunk = chunk_units(n), first = uint64_t(blockIdx.x) * chunk;
  return first < n ? (n - first + uint64_t(gridDim.x) * chunk - 1) / (uint64_t(gridDim.x) * chunk) : 0;
}
inline constexpr uint64_t kAllIterations = ~uint64_t(0);

template <class F>
__device__ __forceinline__ void for_each_chunk(uint64_t n, F f, uint64_t it_begin = 0,
                                               uint64_t it_end = kAllIterations) {  // f(first unit, units)
  const uint64_t chunk = chunk_units(n), stride = uint64_t(gridDim.x) * chunk;
  uint64_t base = uint64_t(blockIdx.x) * chunk + it_begin * stride;
  for (uint64_t it = it_begin; it < it_end && base < n; ++it, base += stride) f(base, min(chunk, n - base));
}

// This block's contiguous share [begin, end) of n units (the LL one-shot: small, latency-bound).
struct Share {
  uint64_t begin, end;
  __device__ Share(uint64_t n) {
    const uint64_t per = (n + gridDim.x - 1) / gridDim.x;
    begin = min(n, per * blockIdx.x);
    end = min(n, begin + per);
  }
};

// Where unit i (of `unit` bytes) of a rows x per_row-units region lies: its row and its byte offset in
// the row; at(x) is its address in region x. One row (contiguous data) skips the division.
struct UnitAt {
  uint64_t row, offset;
  __device__ __forceinline__ UnitAt(uint64_t i, uint64_t rows, uint64_t per_row, uint64_t unit)
      : row(rows == 1 ? 0 : i / per_row), offset((i - row * per_row) * unit) {}
  __device__ __forceinline__ char* at(const Rows& x) const { return x.base + row * x.stride + offset; }
};

// Block b of every rank meets its counterparts in slot b of `slots`.
[[nodiscard]] __device__ __forceinline__ bool meet(const TeamView& team, BarrierSlots slots) {
  return barrier_block(team, slots[blockIdx.x]);
}

// The access unit of V bytes.
template <int V>
using Unit =
    std::conditional_t<V == 16, uint4,
                       std::conditional_t<V == 8, uint2, std::conditional_t<V == 4, uint32_t, uint16_t>>>;

// Copies units [base, base + len) of a rows x row_bytes region in units of V bytes (V divides row_bytes,
// both strides and both addresses: the host picks the widest). A single row (contiguous data, the common
// case) keeps 4 loads in flight per thread; NVLink stores need that much memory-level parallelism.
template <int V>
__device__ __forceinline__ void copy_chunk(Rows dst, Rows src, uint64_t rows, uint64_t row_bytes,
                                           uint64_t base, uint64_t len) {
  using U = Unit<V>;
  const uint64_t per_row = row_bytes / V;
  const uint64_t t = threadIdx.x, step = blockDim.x;
  if (rows == 1) {
    const U* from = reinterpret_cast<const U*>(src.base) + base;
    U* to = reinterpret_cast<U*>(dst.base) + base;
    if (len == 4 * step) {  // full chunk: 4 loads in flight per thread
      U v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) v[u] = from[t + u * step];
#pragma unroll
      for (int u = 0; u < 4; ++u) to[t + u * step] = v[u];
    } else {
      for (uint64_t j = t; j < len; j += step) to[j] = from[j];
    }
    return;
  }
  for (uint64_t j = t; j < len; j += step) {
    const UnitAt u(base + j, rows, per_row, V);
    *reinterpret_cast<U*>(u.at(dst)) = *reinterpret_cast<const U*>(u.at(src));
  }
}

// This block's share (chunk iterations [it_begin, it_end)) of a rows x row_bytes copy.
template <int V>
__device__ __forceinline__ void copy_rows(Rows dst, Rows src, uint64_t rows, uint64_t row_bytes,
                                          uint64_t it_begin = 0, uint64_t it_end = kAllIterations) {
  for_each_chunk(
      rows * (row_bytes / V),
      [&](uint64_t base, uint64_t len) { copy_chunk<V>(dst, src, rows, row_bytes, base, len); }, it_begin,
      it_end);
}

// dst = R over the world's sources (src_of(0) .. src_of(world - 1), same layout), also stored into every
// rank's copy of dst when `fanout` (the all-gather half of a two-shot all-reduce). Packs of 16 bytes when
// kVec, single elements otherwise; arithmetic in fp32.
template <Elem E, Reduce R, bool kVec, class SrcOf>
__device__ __forceinline__ void reduce_rows(const TeamView& team, Rows dst, SrcOf src_of, uint64_t rows,
                                            uint64_t row_elems, bool fanout, uint64_t it_begin = 0,
                                            uint64_t it_end = kAllIterations) {
  using T = typename ElemTraits<E>::T;
  constexpr int kLanes = kVec ? 16 / sizeof(T) : 1;
  const uint64_t per_row = row_elems / kLanes;
  for_each_chunk(
      rows * per_row,
      [&](uint64_t base, uint64_t len) {
        for (uint64_t i = base + threadIdx.x; i < base + len; i += blockDim.x) {
          const UnitAt u(i, rows, per_row, kLanes * sizeof(T));
          auto at = [&](const Rows& x) { return u.at(x); };
          T* out = reinterpret_cast<T*>(at(dst));
          if constexpr (kVec) {
            // Issue up to 8 sources' loads before combining any: remote loads overlap instead of queueing.
            constexpr int kBatch = 8;
            Pack<E> acc;
            for (int base = 0; base < team.world; base += kBatch) {
              uint4 raw[kBatch];
#pragma unroll
              for (int k = 0; k < kBatch; ++k)
                if (base + k < team.world) raw[k] = ld16(at(src_of(base + k)));
#pragma unroll
              for (int k = 0; k < kBatch; ++k) {
                if (base + k >= team.world) break;
                if (base + k == 0)
                  acc = Pack<E>::load(raw[0]);
                else
                  acc.template combine_with<R>(Pack<E>::load(raw[k]));
              }
            }
            const uint4 v = acc.store();
            if (fanout)
              broadcast16(team, out, v);
            else
              st16(out, v);
          } else {
            float acc = ElemTraits<E>::to_float(*reinterpret_cast<const T*>(at(src_of(0))));
            for (int s = 1; s < team.world; ++s)
              acc = combine<R>(acc, ElemTraits<E>::to_float(*reinterpret_cast<const T*>(at(src_of(s)))));
            const T v = ElemTraits<E>::from_float(acc);
            if (fanout)
              for (int p = 0; p < team.world; ++p) *team.peer_ptr(out, p) = v;
            else
              *out = v;
          }
        }
      },
      it_begin, it_end);
}

// ---- all-gather / all-to-all: push my part into every peer, meet, (copy out of the workspace) ----------
// Rank p's copy of `dst_of(q)` receives this rank's `src_of(q)`; both are rows x row_bytes regions.
struct Exchange {
  TeamView team;
  Rows src;  // this rank's data for peer 0; + src_peer_step per peer
  uint64_t src_peer_step;
  Rows dst;  // where data from rank 0 lands (symmetric: out or workspace); + dst_peer_step per source
  uint64_t dst_peer_step;
  uint64_t rows, row_bytes;
  Rows final_dst;  // when dst is the workspace: the output, + final_peer_step per source
  uint64_t final_peer_step;
  bool via_workspace;
  BarrierSlots slots;  // block b meets in slots[b]
};

// A collective kernel's block on the rank's timeline (weft/timeline.hpp), by its thread 0, where kOn: the
// one-shot all-reduce and the fused ops' reduce (the pre-staged reduce-scatter). The other kernels are at the
// edge of their registers, where even an unused mark moved their spills.
template <bool kOn>
__device__ __forceinline__ void collective_mark(const TeamView& t, uint32_t kernel, bool end) {
  if constexpr (kOn)
    if (threadIdx.x == 0 && t.timeline != nullptr)
      timeline_mark(t.timeline, TimelinePhase::kCollective, end, kernel);
}

template <int V>
__global__ void __launch_bounds__(512) exchange_kernel(Exchange x) {
  const TeamView& t = x.team;
  if (!meet(t, x.slots)) return;
  // One peer per step, staggered so every rank starts with a different peer (the links carry a
  // permutation at each moment). This rank's own part is copied during the first step, chunk by chunk
  // beside the push: on its own it would leave the links idle for the length of an HBM copy (~7% of a
  // 1 GiB all-gather at 4 GPUs).
  for (int k = 1; k < max(t.world, 2); ++k) {
    const int peer = (t.rank + k) % t.world;
    for_each_chunk(x.rows * (x.row_bytes / V), [&](uint64_t base, uint64_t len) {
      for (int p : {peer, t.rank}) {  // one call site: a second copy_chunk costs registers (spills)
        if (p == t.rank && k != 1) break;
        if (p == peer && p == t.rank) continue;  // a team of one
        copy_chunk<V>(Rows{t.peer_ptr(x.dst.base + x.dst_peer_step * t.rank, p), x.dst.stride},
                      Rows{x.src.base + x.src_peer_step * p, x.src.stride}, x.rows, x.row_bytes, base, len);
      }
    });
  }
  if (!meet(t, x.slots) || !x.via_workspace) return;
  for (int q = 0; q < t.world; ++q)
    copy_rows<V>(Rows{x.final_dst.base + x.final_peer_step * q, x.final_dst.stride},
                 Rows{x.dst.base + x.dst_peer_step * q, x.dst.stride}, x.rows, x.row_bytes);
}

// ---- rooted: broadcast and scatter (the root pushes to every rank), gather (every rank to the root) ------
// The layout is the Exchange's (the part for rank p at src + src_peer_step * p, landing at dst +
// dst_peer_step * source); only the root sends (from_root) or only the root receives (gather). A rank's own
// part goes straight to its final place (skipped where it is already there: in place). With via_workspace
// the receivers copy what landed in the workspace out once every push has (the exit meeting). Parts are one
// row (rows = 1), copied by copy_dealt.
struct Rooted {
  Exchange x;
  int root;
  bool from_root;
};

// Bytes [first, last) of a copy (first a multiple of 16) by the block's threads, in V-byte accesses (V
// divides both pointers' alignment) and the last few bytes in 2-byte ones.
template <int V>
__device__ __forceinline__ void copy_span(char* dst, const char* src, uint64_t first, uint64_t last) {
  const uint64_t body = first + (last - first) / V * V;
  for (uint64_t b = first + uint64_t(V) * threadIdx.x; b < body; b += uint64_t(V) * blockDim.x)
    *reinterpret_cast<Unit<V>*>(dst + b) = *reinterpret_cast<const Unit<V>*>(src + b);
  for (uint64_t b = body + 2 * threadIdx.x; b < last; b += 2 * blockDim.x)
    *reinterpret_cast<uint16_t*>(dst + b) = *reinterpret_cast<const uint16_t*>(src + b);
}

// The 16-byte units [base, base + len) of a `bytes` copy (the last unit may be short) by the block's threads,
// with the widest accesses `align` (the pointers' alignment bits, or-ed) allows: 16 bytes, 4 in flight, in
// whole units; 8, 4 or 2 otherwise (the sizes and pointers of 16-bit and 32-bit elements are multiples of 2).
__device__ __forceinline__ void copy_units(char* dst, const char* src, uint64_t bytes, uint64_t base,
                                           uint64_t len, uintptr_t align) {
  if (align % 16 == 0 && base + len <= bytes / 16) {
    copy_chunk<16>(Rows{dst, 0}, Rows{const_cast<char*>(src), 0}, 1, (base + len) * 16, base, len);
    return;
  }
  const uint64_t first = base * 16, last = min(bytes, (base + len) * 16);
  if (align % 16 == 0)
    copy_span<16>(dst, src, first, last);
  else if (align % 8 == 0)
    copy_span<8>(dst, src, first, last);
  else if (align % 4 == 0)
    copy_span<4>(dst, src, first, last);
  else
    copy_span<2>(dst, src, first, last);
}
__device__ __forceinline__ uintptr_t align_of(const void* a, const void* b) {
  return reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b);
}

// This block's share of a `bytes` copy, dealt in 16-byte units whatever the pointers' alignment: the same
// share on every rank (a receiver's copy out reads only what its counterpart blocks pushed, whatever each
// rank's buffers allow), copied by copy_units. copy_dealt_beside also copies a second region of the same
// length, chunk by chunk beside the first: a rank's own part copied while its first push streams, instead of
// before it with the links idle. (Two functions: the second copy's code costs the single copy's callers
// registers.)
__device__ __forceinline__ void copy_dealt(char* dst, const char* src, uint64_t bytes) {
  const uintptr_t align = align_of(dst, src);
  for_each_chunk((bytes + 15) / 16,
                 [&](uint64_t base, uint64_t len) { copy_units(dst, src, bytes, base, len, align); });
}
__device__ __forceinline__ void copy_dealt_beside(char* dst, const char* src, char* dst2, const char* src2,
                                                  uint64_t bytes) {
  const uintptr_t align = align_of(dst, src) | align_of(dst2, src2);
  for_each_chunk((bytes + 15) / 16, [&](uint64_t base, uint64_t len) {
    copy_units(dst, src, bytes, base, len, align);
    copy_units(dst2, src2, bytes, base, len, align);
  });
}

// Internal linkage (static): a plain kernel in a header included by several translation units.
static __global__ void __launch_bounds__(512) rooted_kernel(Rooted r) {
  const Exchange& x = r.x;
  const TeamView& t = x.team;
  if (!meet(t, x.slots)) return;
  if (!r.from_root || t.rank == r.root) {
    // The own part goes straight to its final place (not in place; a gather's non-root keeps nothing),
    // beside the first push; the peers one at a time, staggered by rank (gather: to the root alone).
    const char* own_src = x.src.base + x.src_peer_step * t.rank;
    char* own_dst = x.via_workspace ? x.final_dst.base + x.final_peer_step * t.rank
                                    : x.dst.base + x.dst_peer_step * t.rank;
    if ((!r.from_root && t.rank != r.root) || own_dst == own_src) own_dst = nullptr;
    for (int k = 1; k < t.world; ++k) {
      const int to = (t.rank + k) % t.world;
      if (!r.from_root && to != r.root) continue;
      char* to_dst = t.peer_ptr(x.dst.base + x.dst_peer_step * t.rank, to);
      const char* to_src = x.src.base + x.src_peer_step * to;
      if (own_dst != nullptr)
        copy_dealt_beside(to_dst, to_src, own_dst, own_src, x.row_bytes);
      else
        copy_dealt(to_dst, to_src, x.row_bytes);
      own_dst = nullptr;
    }
    if (own_dst != nullptr) copy_dealt(own_dst, own_src, x.row_bytes);
  }
  if (!meet(t, x.slots) || !x.via_workspace) return;
  for (int q = 0; q < t.world; ++q) {  // what landed here: the root's part, or (at the root) every rank's
    const bool landed = r.from_root ? (q == r.root && t.rank != r.root) : (t.rank == r.root && q != t.rank);
    if (landed)
      copy_dealt(x.final_dst.base + x.final_peer_step * q, x.dst.base + x.dst_peer_step * q, x.row_bytes);
  }
}

// ---- per-chunk tags (the forwarded broadcast, the rooted kernels, the owned reduce) --------------------
// A sender sets a receiver's flag to (epoch << 32) | (i + 1) after its chunk i; epoch is the low word of
// block b's meeting slot (the same on every rank, growing), read after the call's entry meeting. A wait
// matches the epoch exactly (a stale or wrapped tag times out instead of passing) and passes any count from
// i + 1 on: each flag has one writer per call, which counts up. A failed wait is recorded (synchronize()
// reports it) and returns false.
struct ChunkTags {
  uint32_t epoch;
  __device__ ChunkTags(const TeamView& t, BarrierSlots slots)
      : epoch(static_cast<uint32_t>(*t.barrier_epoch(slots[blockIdx.x]))) {}
  __device__ uint64_t operator()(uint32_t i) const { return (uint64_t(epoch) << 32) | (i + 1); }
  __device__ bool wait(const TeamView& t, const uint64_t* flag, uint32_t i) const {
    const uint32_t e = epoch, want = i + 1;
    return wait_until(
        t, flag, (*this)(i), [e, want](uint64_t v) { return uint32_t(v >> 32) == e && uint32_t(v) >= want; },
        [](uint64_t v) { return v; });
  }
};

// ---- rooted at up to 8 ranks: each chunk copied out as it lands, no exit meeting --------------------------
// The same exchange as rooted_kernel without its exit meeting: a sender's block b tags the receiver's flag
// landed[b][sender] with (this call's epoch << 32) | (i + 1) after its chunk i (the chunks of copy_dealt's
// dealing, the same on every rank); through the workspace, the receiver's block b copies chunk i out once
// every sender's tag has reached it, while the later chunks are still in flight; into symmetric outs (a
// broadcast's), it waits for its last chunk's tags only (flags only grow within a call). A rank
// only sends (the root of a broadcast or scatter; a gather's non-roots) or only receives (the others; a
// gather's root, which also copies its own part), so no wait depends on one of its own. The epoch is block
// b's meeting slot's, the same on every rank and growing: a stale or wrapped tag never matches; the next
// call's entry meeting keeps its pushes out of the workspace until this call's receivers have left.
inline constexpr int kRootedLandedMaxWorld = 8;

static __global__ void __launch_bounds__(512) rooted_landed_kernel(Rooted r, Flags landed) {
  const Exchange& x = r.x;
  const TeamView& t = x.team;
  if (!meet(t, x.slots)) return;
  const ChunkTags tag(t, x.slots);
  const auto flag = [&](int sender) {
    return t.flag(landed, int(blockIdx.x) * kRootedLandedMaxWorld + sender);
  };
  const uint64_t units = (x.row_bytes + 15) / 16;
  // The root's own part goes straight to its final place (skipped in place), beside its first push.
  const char* own_src = x.src.base + x.src_peer_step * t.rank;
  char* own_dst = x.final_dst.base + x.final_peer_step * t.rank;
  const bool own = t.rank == r.root && own_dst != own_src;
  const uintptr_t own_align = align_of(own_dst, own_src);
  const bool sends = r.from_root == (t.rank == r.root);
  if (sends) {
    bool first = true;
    for (int k = 1; k < t.world; ++k) {  // the peers one at a time, staggered by rank (gather: the root)
      const int to = (t.rank + k) % t.world;
      if (!r.from_root && to != r.root) continue;
      char* to_dst = t.peer_ptr(x.dst.base + x.dst_peer_step * t.rank, to);
      const char* to_src = x.src.base + x.src_peer_step * to;
      const uintptr_t align = align_of(to_dst, to_src);
      uint32_t i = 0;
      for_each_chunk(units, [&](uint64_t base, uint64_t len) {
        copy_units(to_dst, to_src, x.row_bytes, base, len, align);
        if (first && own) copy_units(own_dst, own_src, x.row_bytes, base, len, own_align);
        __syncthreads();  // the block's chunk, then one release signal covers it
        if (threadIdx.x == 0) signal_set(t, flag(t.rank), to, tag(i));
        ++i;
      });
      first = false;
    }
    return;
  }
  // A receiver: the root's part (broadcast, scatter), or at a gather's root every other rank's.
  const auto sender = [&](int q) { return q != t.rank && (!r.from_root || q == r.root); };
  // A failed wait is recorded; the copies still run, so the kernel ends.
  const auto wait_senders = [&](uint32_t i) {
    if (int(threadIdx.x) < t.world && sender(threadIdx.x)) (void)tag.wait(t, flag(threadIdx.x), i);
  };
  // (A receiver's own part is a gather root's only, and gather always lands in the workspace: the early
  // return below skips no own copy.)
  if (!x.via_workspace) {  // landed in place: the last chunk's tags cover the block's earlier chunks
    const uint64_t chunks = chunk_iterations(units);
    if (chunks > 0) wait_senders(static_cast<uint32_t>(chunks - 1));
    return;
  }
  uint32_t i = 0;
  for_each_chunk(units, [&](uint64_t base, uint64_t len) {
    if (own) copy_units(own_dst, own_src, x.row_bytes, base, len, own_align);
    wait_senders(i);
    __syncthreads();
    for (int q = 0; q < t.world; ++q) {
      if (!sender(q)) continue;
      char* to = x.final_dst.base + x.final_peer_step * q;
      const char* from = x.dst.base + x.dst_peer_step * q;
      copy_units(to, from, x.row_bytes, base, len, align_of(to, from));
    }
    ++i;
  });
}

// ---- broadcast at 3+ ranks, forwarded: the root sends each byte once ------------------------------------
// The data is cut into W - 1 parts, one per non-root rank (part j for rank root + 1 + j). Each block walks
// the same chunks of a part on every rank (for_each_chunk over a part's units; parts may differ in length
// only at the end). Chunk i: the root's block b pushes its units of every part into that part's rank (`land`,
// symmetric), then sets that rank's landed[b] to (this call's epoch << 32) | (i + 1); the non-root's block b
// waits for it and forwards the chunk of its part to the other non-roots. The root sends S bytes, a non-root
// (W - 2) / (W - 1) S: against the root's (W - 1) S of the plain push. The epoch is block b's meeting slot's,
// the same on every rank and growing, so the flags only grow. The exit meeting: every push has landed; then a
// non-root whose out is not `land` (not symmetric) copies out.
struct ForwardedBroadcast {
  TeamView team;
  const char* in;  // the root's data
  char* land;      // where the non-roots' data lands (symmetric: out, or the workspace)
  char* out;       // this rank's out
  uint64_t bytes;
  int root;
  Flags landed;  // landed[b]: the chunks of this rank's part block b of the root has pushed (tagged)
  BarrierSlots slots;
};

static __global__ void __launch_bounds__(512) forwarded_broadcast_kernel(ForwardedBroadcast f) {
  const TeamView& t = f.team;
  if (!meet(t, f.slots)) return;
  const ChunkTags tag(t, f.slots);
  const int W = t.world, parts = W - 1;
  const uint64_t units = (f.bytes + 15) / 16, per = (units + parts - 1) / parts;
  const auto rank_of = [&](int j) { return (f.root + 1 + j) % W; };
  // Units [j * per + base, .. + len) of part j, clipped to the part and the data: (first, count).
  const auto span = [&](int j, uint64_t base, uint64_t len, uint64_t& first) -> uint64_t {
    const uint64_t end = min(min(uint64_t(j + 1) * per, units), uint64_t(j) * per + base + len);
    first = uint64_t(j) * per + base;
    return end > first ? end - first : 0;
  };
  uint32_t i = 0;
  if (t.rank == f.root) {
    const bool own = f.out != f.in;
    const uintptr_t push_align = align_of(f.in, f.land), own_align = align_of(f.in, f.out);
    for_each_chunk(per, [&](uint64_t base, uint64_t len) {
      for (int j = 0; j < parts; ++j) {
        uint64_t first;
        const uint64_t n = span(j, base, len, first);
        if (n == 0) continue;
        copy_units(t.peer_ptr(f.land, rank_of(j)), f.in, f.bytes, first, n, push_align);
        if (own) copy_units(f.out, f.in, f.bytes, first, n, own_align);
      }
      __syncthreads();  // the block's pushes, then one release signal per part covers them
      if (int(threadIdx.x) < parts) signal_set(t, t.flag(f.landed, blockIdx.x), rank_of(threadIdx.x), tag(i));
      ++i;
    });
  } else {
    const int mine = (t.rank - f.root - 1 + W) % W;
    const uintptr_t align = align_of(f.land, nullptr);
    for_each_chunk(per, [&](uint64_t base, uint64_t len) {
      // A failed wait is recorded; the forwarding still runs, so the kernel ends.
      if (threadIdx.x == 0) (void)tag.wait(t, t.flag(f.landed, blockIdx.x), i);
      __syncthreads();
      uint64_t first;
      const uint64_t n = span(mine, base, len, first);
      for (int k = 1; n > 0 && k < parts; ++k)
        copy_units(t.peer_ptr(f.land, rank_of((mine + k) % parts)), f.land, f.bytes, first, n, align);
      ++i;
    });
  }
  if (!meet(t, f.slots) || t.rank == f.root || f.land == f.out) return;
  // Out of the workspace by the pushes' own split: block b's exit meeting covers only what the blocks b
  // wrote.
  const uintptr_t align = align_of(f.out, f.land);
  for_each_chunk(per, [&](uint64_t base, uint64_t len) {
    for (int j = 0; j < parts; ++j) {
      uint64_t first;
      const uint64_t n = span(j, base, len, first);
      if (n > 0) copy_units(f.out, f.land, f.bytes, first, n, align);
    }
  });
}

// ---- reduce at 2..8 ranks, summed by the non-roots: the root receives each byte once -------------------
// At 3 or more ranks the data (16-byte units) is cut into W - 1 parts, one per non-root rank, its owner (part
// j: rank root + 1 + j); at 2 ranks the root owns the one part, summed straight into out (settle_at_root).
// Block b walks the same chunks of a part on every rank (for_each_chunk over a part's units). Chunk i: every
// rank pushes its units of each part it does not own into that part's owner (`land`, symmetric: the owner's W
// - 1 slots of a part, slot k for the sender owner + 1 + k) and sets the owner's landed[b][sender] to (this
// call's epoch << 32) | (i + 1). The owner's block b waits for its W - 1 senders, reduces its own units and
// the landed ones in fp32 (its own first, then the slots in order: the same order for every element), pushes
// the result into the root's `land` at the part's place and sets the root's landed[b][owner]; the root's
// block b waits for every owner's chunk and copies it to out (each block pushes chunk i before it settles
// chunk i - 1: one chunk in flight). Each rank sends and receives about S bytes (an owner receives S, sends
// (W - 2) / (W - 1) S + S / (W - 1)); the all-reduce and the root's copy moved 2 (W - 1) / W S each way and
// copied S twice. The epoch is block b's meeting slot's, the same on every rank and growing: a stale or
// wrapped tag never matches. A unit a block pushes is read before the same block writes it (in place at the
// root is safe); the next call's entry meeting keeps its pushes out of a slot until this call's reader has
// left.
inline constexpr int kOwnedReduceMaxWorld = 8;
struct OwnedReduce {
  TeamView team;
  const uint4* in;  // this rank's data, `units` 16-byte units
  uint4* land;      // symmetric, (W - 1) x per units: an owner's slots; the root's landing of the result
  uint4* out;       // the root's out (unused elsewhere)
  uint64_t units;
  int root;
  Flags landed;  // [block * kOwnedReduceMaxWorld + sender]: chunks of block b from `sender` landed (tagged)
  BarrierSlots slots;
};

template <Elem E, Reduce R>
__global__ void __launch_bounds__(512) owned_reduce_kernel(OwnedReduce x) {
  const TeamView& t = x.team;
  if (!meet(t, x.slots)) return;
  const ChunkTags tag(t, x.slots);
  // At 2 ranks the root owns the one part: the other rank pushes its data once and the root sums it into out
  // (S bytes one way, not S each way and a second hop).
  const bool root_owns = t.world == 2;
  const int W = t.world, parts = root_owns ? 1 : W - 1;
  const uint64_t per = (x.units + parts - 1) / parts;
  // My part (-1: none, a rank that only sends).
  const int mine = root_owns          ? (t.rank == x.root ? 0 : -1)
                   : t.rank == x.root ? -1
                                      : (t.rank - x.root - 1 + W) % W;
  const auto owner_of = [&](int j) { return root_owns ? x.root : (x.root + 1 + j) % W; };
  const auto flag = [&](int sender) {
    return t.flag(x.landed, int(blockIdx.x) * kOwnedReduceMaxWorld + sender);
  };
  // Units [base, base + len) of the chunk clipped to part j: how many (the last part may be short).
  const auto clipped = [&](int j, uint64_t base, uint64_t len) -> uint64_t {
    const uint64_t first = uint64_t(j) * per, end = min(first + per, x.units);
    return first + base < end ? min(len, end - first - base) : 0;
  };
  // Chunk i's pushes into the owners, then one release signal per owner covers them.
  const auto push = [&](uint32_t i, uint64_t base, uint64_t len) {
    for (int j = 0; j < parts; ++j) {
      const uint64_t n = j == mine ? 0 : clipped(j, base, len);
      if (n == 0) continue;
      const int o = owner_of(j), slot = (t.rank - o - 1 + W) % W;
      copy_chunk<16>(Rows{reinterpret_cast<char*>(t.peer_ptr(x.land + slot * per + base, o)), 0},
                     Rows{reinterpret_cast<char*>(const_cast<uint4*>(x.in + j * per + base)), 0}, 1, n * 16,
                     0, n);
    }
    __syncthreads();
    if (int(threadIdx.x) < parts && int(threadIdx.x) != mine)
      signal_set(t, flag(t.rank), owner_of(threadIdx.x), tag(i));
  };
  // The root owning the part (2 ranks): chunk i once the other rank's has landed, summed into out.
  const auto settle_at_root = [&](uint32_t i, uint64_t base, uint64_t len) {
    if (mine < 0) return;  // the sender: nothing lands here
    if (int(threadIdx.x) < W && int(threadIdx.x) != t.rank) (void)tag.wait(t, flag(threadIdx.x), i);
    __syncthreads();
    const uint64_t n = clipped(0, base, len);
    for (uint64_t u = threadIdx.x; u < n;
         u += blockDim.x) {  // (out may be `land`: each unit read, then written)
      Pack<E> acc = Pack<E>::load(ld16(x.in + base + u));
      acc.template combine_with<R>(Pack<E>::load(ld16(x.land + base + u)));
      st16(x.out + base + u, acc.store());
    }
  };
  // Chunk i once it has landed: an owner reduces it and pushes the result to the root, the root copies the
  // results to out. The owner waits for every sender, the root for every owner: either way every rank but
  // this one (flags only grow within a call: a later chunk's tag passes an earlier chunk's wait). A failed
  // wait is recorded (synchronize() reports it); the kernel still runs to its end.
  const auto settle = [&](uint32_t i, uint64_t base, uint64_t len) {
    if (int(threadIdx.x) < W && int(threadIdx.x) != t.rank) (void)tag.wait(t, flag(threadIdx.x), i);
    __syncthreads();
    if (mine >= 0) {
      const uint64_t n = clipped(mine, base, len), at = uint64_t(mine) * per + base;
      uint4* to = t.peer_ptr(x.land + at, x.root);
      for (uint64_t u = threadIdx.x; u < n; u += blockDim.x) {
        Pack<E> acc = Pack<E>::load(ld16(x.in + at + u));
        for (int k = 0; k < parts; ++k)
          acc.template combine_with<R>(Pack<E>::load(ld16(x.land + k * per + base + u)));
        st16(to + u, acc.store());
      }
      __syncthreads();
      if (threadIdx.x == 0) signal_set(t, flag(t.rank), x.root, tag(i));
    } else if (x.out != x.land) {
      for (int j = 0; j < parts; ++j) {
        const uint64_t n = clipped(j, base, len), at = uint64_t(j) * per + base;
        if (n > 0)
          copy_chunk<16>(Rows{reinterpret_cast<char*>(x.out + at), 0},
                         Rows{reinterpret_cast<char*>(x.land + at), 0}, 1, n * 16, 0, n);
      }
    }
  };
  // One chunk in flight: chunk i is pushed before chunk i - 1 is settled, so the links carry chunk i while
  // the block waits for chunk i - 1's senders (the root: its owners) instead of a round trip per chunk.
  const auto settle_chunk = [&](uint32_t i, uint64_t base, uint64_t len) {
    if (root_owns)
      settle_at_root(i, base, len);
    else
      settle(i, base, len);
  };
  uint32_t i = 0;
  uint64_t last_base = 0, last_len = 0;
  for_each_chunk(per, [&](uint64_t base, uint64_t len) {
    push(i, base, len);
    if (i > 0) settle_chunk(i - 1, last_base, last_len);
    last_base = base;
    last_len = len;
    ++i;
  });
  if (i > 0) settle_chunk(i - 1, last_base, last_len);
}

// ---- all-to-all with variable splits: counts on the device, three kernels ---------------------------
// 1. counts_kernel (one block): meet; send this rank's row (its in_capacity, out_capacity, whether out goes
//    through the workspace, then its W send counts) into every rank's table (symmetric, [source][3 + W]
//    int64); meet, so every table is complete. Thread 0 then checks the whole table (every rank sees the same
//    one, so every rank decides alike): unequal out capacities, a negative count, a row past its sender's in
//    or a column past out_capacity refuse the call on every rank (DeviceErrorCode::kBadCounts, the offender
//    named; recv_counts zero) before anything moves; else recv_counts = column r.
// 2. push_kernel (the grid): each block takes its share of every part, one peer per step (staggered), into
//    the receiver's out (symmetric) or workspace at the offset the table gives (the parts of lower ranks
//    first); meet (every push into this rank has landed).
// 3. copy_out_kernel (through the workspace only): the received rows to out.
// The next call's entry meeting keeps a fast rank's table writes and pushes away from a slow rank still in
// this call's kernels.
struct AllToAllV {
  TeamView team;
  const char* in;
  const int64_t* send_counts;  // device [W]
  int64_t in_capacity;         // rows of in
  char* dst;                   // out or the workspace (symmetric: the same offset on every rank)
  int64_t out_capacity;        // rows of out, the same on every rank (checked)
  int64_t via_workspace;       // 1: out is not symmetric (the same on every rank: checked)
  int64_t* table;              // symmetric [W][kRow + W]
  int64_t* recv_counts;        // device [W]
  uint64_t row_bytes;          // counts and capacities are in rows of this many bytes
  BarrierSlots slots;
  // A rank's row of the table: its in_capacity, out_capacity and via_workspace, then its W send counts.
  static constexpr int kRow = 3;
};

inline __device__ int64_t table_at(const AllToAllV& a, int source, int column) {
  return a.table[source * (AllToAllV::kRow + a.team.world) + column];
}
inline __device__ int64_t sent_count(const AllToAllV& a, int source, int to) {
  return table_at(a, source, AllToAllV::kRow + to);
}

// Why a call is refused (DeviceErrorCode::kBadCounts; DeviceError::thread carries it).
enum class BadCounts : uint32_t {
  kPastOutCapacity = 0,  // a receiver's rows past out_capacity
  kPastInput = 1,        // a sender's rows past its in
  kNegative = 2,         // a negative count
  kUnequalOut = 3,       // out_capacity or out's symmetry differs between ranks
};

// Records a refused call for the host: `rank` the offender.
inline __device__ void report_bad_counts(const AllToAllV& a, int rank, BadCounts what, int64_t limit,
                                         int64_t needed) {
  (void)detail::report_error(a.team, DeviceErrorCode::kBadCounts, static_cast<uint32_t>(rank),
                             static_cast<uint32_t>(what), 0, static_cast<uint64_t>(limit),
                             static_cast<uint64_t>(needed), 0);
}

// The whole table's checks (one thread; every rank sees the same table and decides alike). Sums stop at
// the limit they are checked against, so no count can overflow them.
inline __device__ bool counts_fit(const AllToAllV& a) {
  const int W = a.team.world;
  const int64_t out_cap = table_at(a, 0, 1), via = table_at(a, 0, 2);
  for (int s = 0; s < W; ++s) {
    if (table_at(a, s, 1) != out_cap || table_at(a, s, 2) != via) {
      report_bad_counts(a, s, BadCounts::kUnequalOut, out_cap, table_at(a, s, 1));
      return false;
    }
    const int64_t in_cap = table_at(a, s, 0);
    int64_t sent = 0;
    for (int q = 0; q < W; ++q) {
      const int64_t c = sent_count(a, s, q);
      if (c < 0) {
        report_bad_counts(a, s, BadCounts::kNegative, 0, c);
        return false;
      }
      if (c > in_cap - sent) {
        report_bad_counts(a, s, BadCounts::kPastInput, in_cap, c > in_cap ? c : sent + c);
        return false;
      }
      sent += c;
    }
  }
  for (int q = 0; q < W; ++q) {
    int64_t got = 0;
    for (int s = 0; s < W; ++s) {
      const int64_t c = sent_count(a, s, q);
      if (c > out_cap - got) {
        report_bad_counts(a, q, BadCounts::kPastOutCapacity, out_cap, c > out_cap ? c : got + c);
        return false;
      }
      got += c;
    }
  }
  return true;
}

// Internal linkage (static), as rooted_kernel.
static __global__ void __launch_bounds__(64) counts_kernel(AllToAllV a) {
  const TeamView& t = a.team;
  const int W = t.world, row = AllToAllV::kRow + W;
  if (!meet(t, a.slots)) return;
  for (int i = threadIdx.x; i < W * row; i += blockDim.x) {  // my row into rank p's table
    const int p = i / row, j = i % row;
    const int64_t v = j == 0   ? a.in_capacity
                      : j == 1 ? a.out_capacity
                      : j == 2 ? a.via_workspace
                               : a.send_counts[j - AllToAllV::kRow];
    *t.peer_ptr(a.table + t.rank * row + j, p) = v;
  }
  if (!meet(t, a.slots)) return;
  __shared__ bool fit;
  if (threadIdx.x == 0) fit = counts_fit(a);
  __syncthreads();
  // Refused (or failed before): no counts received, and nothing moves.
  for (int q = threadIdx.x; q < W; q += blockDim.x) a.recv_counts[q] = fit ? sent_count(a, q, t.rank) : 0;
}

static __global__ void __launch_bounds__(512) push_kernel(AllToAllV a) {
  const TeamView& t = a.team;
  const int W = t.world;
  if (*reinterpret_cast<volatile uint32_t*>(&t.error->code) != 0) return;  // refused on every rank
  for (int k = 0; k < W; ++k) {
    const int p = (t.rank + k) % W;
    int64_t src_at = 0, dst_at = 0;  // my part for p starts after my parts for lower ranks; lands after
    for (int q = 0; q < p; ++q) src_at += sent_count(a, t.rank, q);  // my parts for lower ranks
    for (int s = 0; s < t.rank; ++s) dst_at += sent_count(a, s, p);  // lower ranks' parts for p
    const uint64_t bytes = uint64_t(sent_count(a, t.rank, p)) * a.row_bytes;
    if (bytes > 0)
      copy_dealt(t.peer_ptr(a.dst + dst_at * a.row_bytes, p), a.in + src_at * a.row_bytes, bytes);
  }
  (void)meet(t, a.slots);
}

// out = the received elements (the column's sum), from the workspace; a grid-stride copy.
static __global__ void __launch_bounds__(512) copy_out_kernel(AllToAllV a, char* out) {
  const TeamView& t = a.team;
  if (*reinterpret_cast<volatile uint32_t*>(&t.error->code) != 0) return;
  int64_t got = 0;
  for (int s = 0; s < t.world; ++s) got += sent_count(a, s, t.rank);
  copy_dealt(out, a.dst, uint64_t(got) * a.row_bytes);
}

// ---- reduce-scatter and two-shot all-reduce: push slices to their owners, reduce mine (and fan out) ---
struct ReduceScatter {
  TeamView team;
  Rows in;  // the input's slice for rank 0; + in_peer_step per rank
  uint64_t in_peer_step;
  Rows staging;  // workspace: slot of source rank 0 (packed rows); + staging_step per source
  uint64_t staging_step;
  Rows out;  // my reduced slice (with fanout: in a symmetric buffer, stored to every rank)
  uint64_t rows, row_bytes;
  bool fanout;            // two-shot all-reduce: the reduced slice goes to every rank
  char* final_dst;        // fanout into the workspace (out not symmetric): gathered result at final_src,
  const char* final_src;  // copied to final_dst slice by slice (nullptr: out is the symmetric target)
  BarrierSlots slots;     // block b meets in slots[b]
};

// Groups a block's pushes are announced in: the reduce of group g - 1 runs while peers still push group g.
inline constexpr uint64_t kPushGroups = 8;

// 16-byte packs only (the host checks the alignment): the element-wise form would spill.
// kStaged (the fused kernels): every source's slice, this rank's own included, is already in staging, and
// the kernel only reduces (`in` is unused): every rank's previous kernel stored the slices, and the entry
// meeting orders those stores before the reads.
template <Elem E, Reduce R, bool kStaged = false>
__global__ void __launch_bounds__(512) reduce_scatter_kernel(ReduceScatter x) {
  using T = typename ElemTraits<E>::T;
  constexpr int V = 16;
  const TeamView& t = x.team;
  collective_mark<kStaged>(t, 1u, false);
  auto src_of = [&](int s) {  // s = 0: my own slice (of the input, or staged); then the peers' staged slices
    if (s == 0 && !kStaged) return Rows{x.in.base + x.in_peer_step * t.rank, x.in.stride};
    return Rows{x.staging.base + x.staging_step * ((t.rank + s) % t.world), x.staging.stride};
  };
  if (!meet(t, x.slots)) return collective_mark<kStaged>(t, 1u, true);
  // Push my chunks of every peer's slice group by group; announce each group (barrier_arrive) and reduce
  // the previous one once every peer announced it. Odd blocks start with a half group so that the blocks
  // do not all reduce at once (the links would idle meanwhile). Pre-staged: one group, no pushes.
  const uint64_t iters = chunk_iterations(x.rows * (x.row_bytes / V));
  const uint64_t group = max(uint64_t(1), kStaged ? iters : (iters + kPushGroups - 1) / kPushGroups);
  const uint64_t shift = (blockIdx.x & 1) && !kStaged ? group / 2 : 0;
  const uint64_t groups = iters == 0 ? 0 : (iters + shift + group - 1) / group;
  auto start = [&](uint64_t g) { return g == 0 ? 0 : min(iters, g * group - shift); };  // of group g
  uint64_t announced = 0;
  for (uint64_t g = 0; g <= groups; ++g) {
    const uint64_t previous = announced;
    if (g < groups && !kStaged) {
      for (int k = 1; k < t.world; ++k) {
        const int p = (t.rank + k) % t.world;
        Rows dst{t.peer_ptr(x.staging.base + x.staging_step * t.rank, p), x.staging.stride};
        copy_rows<V>(dst, Rows{x.in.base + x.in_peer_step * p, x.in.stride}, x.rows, x.row_bytes, start(g),
                     start(g + 1));
      }
      announced = barrier_arrive(t, x.slots[blockIdx.x]);
    }
    if (g > 0) {
      if (!kStaged && !barrier_wait(t, x.slots[blockIdx.x], previous))
        return collective_mark<kStaged>(t, 1u, true);
      reduce_rows<E, R, true>(t, x.out, src_of, x.rows, x.row_bytes / sizeof(T), x.fanout, start(g - 1),
                              start(g));
    }
  }
  // Now every slice has landed.
  if (!x.fanout || !meet(t, x.slots) || x.final_dst == nullptr) return collective_mark<kStaged>(t, 1u, true);
  // Block b copies exactly the parts it met for: its share of each slice (same partition as the reduce).
  for (int q = 0; q < t.world; ++q)
    copy_rows<V>(Rows{x.final_dst + q * x.row_bytes, 0},
                 Rows{const_cast<char*>(x.final_src) + q * x.row_bytes, 0}, 1, x.row_bytes);
  collective_mark<kStaged>(t, 1u, true);
}

// dst = a (+) b in 16-byte packs, arithmetic in fp32, 4 units of each source in flight per thread.
template <Elem E, Reduce R>
__device__ __forceinline__ void combine_rows(Rows dst, Rows a, Rows b, uint64_t rows, uint64_t row_bytes) {
  const uint64_t per_row = row_bytes / 16;
  auto at = [&](const Rows& x, uint64_t i) { return UnitAt(i, rows, per_row, 16).at(x); };
  for_each_chunk(rows * per_row, [&](uint64_t base, uint64_t len) {
    constexpr int kInFlight = 4;
    for (uint64_t j = threadIdx.x; j < len; j += kInFlight * blockDim.x) {
      uint4 va[kInFlight], vb[kInFlight];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u)
        if (j + u * blockDim.x < len) {
          va[u] = ld16(at(a, base + j + u * blockDim.x));
          vb[u] = ld16(at(b, base + j + u * blockDim.x));
        }
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        if (j + u * blockDim.x >= len) break;
        Pack<E> acc = Pack<E>::load(va[u]);
        acc.template combine_with<R>(Pack<E>::load(vb[u]));
        st16(at(dst, base + j + u * blockDim.x), acc.store());
      }
    }
  });
}

// ---- pull variant: every rank reads its slice straight from the others' inputs (reduce-from-peers) ----
// No staging: after the entry meeting, rank r reads slice r of every rank's (symmetric) input, reduces in
// fp32 and writes its output (two-shot all-reduce: into every rank's output). The exit meeting keeps
// inputs alive until every reader is done. A non-symmetric input is first copied into the workspace.
//
// Stepwise (large messages): in weft-bench transfer, reads from every peer at once reach 323 GB/s per GPU
// and reads from one peer 375 (4 x H200), so rank r instead reads peer r + 1, then r + 2, ..., adding each
// into its output (the running sum rounds to the element type at each step, as a ring does), and fans the sum
// out one peer at a time too: at each step the ranks read from (and write to) a permutation of the GPUs.
struct PullReduce {
  TeamView team;
  Rows in;  // symmetric input (or its workspace copy): slice of rank 0; + in_peer_step per rank
  uint64_t in_peer_step;
  Rows copy_from;  // non-symmetric input to copy into `in` first (base nullptr: none)
  Rows out;        // my reduced slice (with fanout: in a symmetric buffer, stored to every rank)
  uint64_t rows, row_bytes;
  bool fanout;
  char* final_dst;  // fanout into the workspace: gathered result at final_src, copied slice by slice
  const char* final_src;
  bool stepwise;       // one peer at a time (16-byte packs only)
  BarrierSlots slots;  // block b meets in slots[b]
};

template <Elem E, Reduce R, bool kVec>
__global__ void __launch_bounds__(512) pull_reduce_kernel(PullReduce x) {
  using T = typename ElemTraits<E>::T;
  constexpr int V = kVec ? 16 : sizeof(T);
  const TeamView& t = x.team;
  if (x.copy_from.base != nullptr)  // same per-slice partition as the reads below
    for (int q = 0; q < t.world; ++q)
      copy_rows<V>(Rows{x.in.base + x.in_peer_step * q, x.in.stride},
                   Rows{x.copy_from.base + x.in_peer_step * q, x.copy_from.stride}, x.rows, x.row_bytes);
  if (!meet(t, x.slots)) return;
  char* mine = x.in.base + x.in_peer_step * t.rank;
  auto src_of = [&](int s) { return Rows{t.peer_ptr(mine, (t.rank + s) % t.world), x.in.stride}; };
  if (kVec && x.stepwise && t.world > 1) {
    for (int k = 1; k < t.world; ++k)  // out = mine + peer r+1, then out += peer r+k
      combine_rows<E, R>(x.out, k == 1 ? Rows{mine, x.in.stride} : x.out, src_of(k), x.rows, x.row_bytes);
    for (int k = 1; x.fanout && k < t.world; ++k)  // same chunks as the reduce: this thread wrote them
      copy_rows<16>(Rows{t.peer_ptr(x.out.base, (t.rank + k) % t.world), x.out.stride}, x.out, x.rows,
                    x.row_bytes);
  } else {
    reduce_rows<E, R, kVec>(t, x.out, src_of, x.rows, x.row_bytes / sizeof(T), x.fanout);
  }
  if (!meet(t, x.slots) || x.final_dst == nullptr) return;
  for (int q = 0; q < t.world; ++q)
    copy_rows<V>(Rows{x.final_dst + q * x.row_bytes, 0},
                 Rows{const_cast<char*>(x.final_src) + q * x.row_bytes, 0}, 1, x.row_bytes);
}

// ---- one-shot all-reduce / reduce-scatter, LL protocol: data and call epoch travel in one 8-byte store ---
// Every rank stores its data for each peer (the whole input for an all-reduce, the peer's slice for a
// reduce-scatter), 4 bytes at a time next to the call's epoch, into that peer's workspace; each rank then
// polls its own workspace until every word carries this epoch and reduces. No barrier and no fence: an
// 8-byte store is seen whole or not at all.
// Block b of every rank moves the same share, so each block keeps its own epoch (the one-shot calls it took
// part in, the same count on every rank) and its own fixed part of each slot: no block waits for another,
// and the call ends without a grid-wide count. Two halves alternate by call: block b writing its call n's
// half has finished its call n - 1, for which it waited on every peer's block b, so each of those had
// finished its call n - 2, the last reader of that half of block b's part.
struct OneShot {
  TeamView team;
  const uint32_t* in;     // the data for rank 0; + in_peer_step words per rank (0: the same for all)
  uint64_t in_peer_step;  // words
  uint32_t* out;
  // kExchange (all-to-all): the words from rank s land at out + s * out_peer_step, nothing is reduced.
  uint64_t out_peer_step;
  uint64_t words;       // 4-byte words per destination (the last may be half used: bf16/fp16 odd counts)
  uint32_t tail_bytes;  // bytes used in the last word (4 if full)
  uint64_t* ll;         // workspace: [2][world][slot_words], a slot = [blocks][block_words]
  uint64_t slot_words, block_words;
  Flags calls;  // calls[b]: the one-shot calls block b of this rank has completed (local state)
};

// Waits until the LL word carries `epoch`; its data in *value.
__device__ __forceinline__ bool ll_wait(const TeamView& team, const uint64_t* word, uint32_t epoch,
                                        uint32_t* value) {
  for (int spin = 0; spin < 256; ++spin) {
    const uint64_t x = ptx::ld_relaxed_sys(word);
    if (static_cast<uint32_t>(x >> 32) == epoch) {
      *value = static_cast<uint32_t>(x);
      return true;
    }
  }
  // Slow path: the shared timed wait, on a predicate over the same word.
  const bool ok = wait_until(
      team, word, epoch, [epoch](uint64_t x) { return static_cast<uint32_t>(x >> 32) == epoch; },
      [](uint64_t x) { return x >> 32; });
  *value = static_cast<uint32_t>(ptx::ld_relaxed_sys(word));
  return ok;
}
// The same for a pair of words (16-byte aligned), polled with one 16-byte load; n = 1: the first only.
__device__ __forceinline__ bool ll_wait_pair(const TeamView& team, const uint64_t* pair, int n,
                                             uint32_t epoch, uint32_t value[2]) {
  if (n == 2)
    for (int spin = 0; spin < 256; ++spin) {
      uint64_t a, b;
      ptx::ld_relaxed_sys_v2(pair, &a, &b);
      if (static_cast<uint32_t>(a >> 32) == epoch && static_cast<uint32_t>(b >> 32) == epoch) {
        value[0] = static_cast<uint32_t>(a);
        value[1] = static_cast<uint32_t>(b);
        return true;
      }
    }
  for (int h = 0; h < n; ++h)
    if (!ll_wait(team, pair + h, epoch, &value[h])) return false;
  return true;
}

// Each thread moves pairs of words (one 16-byte store or poll per pair and peer): half the instructions of
// single words, and wider NVLink writes. kExchange: an all-to-all (each peer's part placed, not reduced).
template <Elem E, Reduce R, bool kExchange = false>
__global__ void __launch_bounds__(512) one_shot_kernel(OneShot x) {
  using T = typename ElemTraits<E>::T;
  constexpr int kLanes = 4 / sizeof(T);
  const TeamView& t = x.team;
  collective_mark<true>(t, 3u, false);
  // (The count's address is recomputed at the end rather than kept: registers are short here.)
  const uint64_t call = *reinterpret_cast<volatile uint64_t*>(t.flag(x.calls, blockIdx.x)) + 1;
  // The epoch in the words is never 0 (what a workspace holds before its first call), also after 2^32 calls.
  const uint32_t epoch = static_cast<uint32_t>(call % 0xffffffffull) + 1;
  // Word j of this block's share, from rank s, lands at part[s * slot_words + j] of the receiver.
  uint64_t* part = x.ll + (call & 1) * t.world * x.slot_words + blockIdx.x * x.block_words;
  auto word_of = [&](int p, uint64_t i) {  // word i of the data for rank p
    const uint32_t* w = x.in + p * x.in_peer_step + i;
    return (i + 1 == x.words && x.tail_bytes == 2) ? uint32_t(*reinterpret_cast<const uint16_t*>(w)) : *w;
  };
  const Share share((x.words + 1) / 2);  // pairs; at most block_words / 2 of them (the host sizes the grid)
  auto words_in = [&](uint64_t q) { return 2 * q + 1 < x.words ? 2 : 1; };
  for (uint64_t q = share.begin + threadIdx.x; q < share.end; q += blockDim.x)
    for (int k = 1; k < t.world; ++k) {
      const int p = (t.rank + k) % t.world;
      uint64_t* dst = t.peer_ptr(part + t.rank * x.slot_words + 2 * (q - share.begin), p);
      const uint64_t lo = (uint64_t(epoch) << 32) | word_of(p, 2 * q);
      if (words_in(q) == 2)
        ptx::st_relaxed_sys_v2(dst, lo, (uint64_t(epoch) << 32) | word_of(p, 2 * q + 1));
      else
        ptx::st_relaxed_sys(dst, lo);
    }
  auto put = [&](uint32_t* to, uint64_t i, uint32_t word) {  // word i of a destination; a half-used tail
    if (i + 1 == x.words && x.tail_bytes == 2)
      *reinterpret_cast<uint16_t*>(to + i) = static_cast<uint16_t>(word);
    else
      to[i] = word;
  };
  if constexpr (kExchange) {
    for (uint64_t q = share.begin + threadIdx.x; q < share.end; q += blockDim.x) {
      const int n = words_in(q);
      for (int h = 0; h < n; ++h)
        put(x.out + t.rank * x.out_peer_step, 2 * q + h, word_of(t.rank, 2 * q + h));
      for (int k = 1; k < t.world; ++k) {
        const int src_rank = (t.rank + k) % t.world;
        uint32_t v[2];
        const uint64_t* src = part + src_rank * x.slot_words + 2 * (q - share.begin);
        if (!ll_wait_pair(t, src, n, epoch, v)) return collective_mark<true>(t, 3u, true);
        for (int h = 0; h < n; ++h) put(x.out + src_rank * x.out_peer_step, 2 * q + h, v[h]);
      }
    }
  } else {
    for (uint64_t q = share.begin + threadIdx.x; q < share.end; q += blockDim.x) {
      const int n = words_in(q);
      uint32_t mine[2] = {word_of(t.rank, 2 * q), n == 2 ? word_of(t.rank, 2 * q + 1) : 0u};
      float acc[2][kLanes];
      for (int h = 0; h < 2; ++h)
        for (int l = 0; l < kLanes; ++l)
          acc[h][l] = ElemTraits<E>::to_float(reinterpret_cast<const T*>(&mine[h])[l]);
      for (int k = 1; k < t.world; ++k) {
        uint32_t v[2];
        const uint64_t* src = part + ((t.rank + k) % t.world) * x.slot_words + 2 * (q - share.begin);
        if (!ll_wait_pair(t, src, n, epoch, v)) return collective_mark<true>(t, 3u, true);
        for (int h = 0; h < n; ++h)
          for (int l = 0; l < kLanes; ++l)
            acc[h][l] = combine<R>(acc[h][l], ElemTraits<E>::to_float(reinterpret_cast<const T*>(&v[h])[l]));
      }
      for (int h = 0; h < n; ++h) {
        for (int l = 0; l < kLanes; ++l)
          reinterpret_cast<T*>(&mine[h])[l] = ElemTraits<E>::from_float(acc[h][l]);
        put(x.out, 2 * q + h, mine[h]);
      }
    }
  }
  __syncthreads();  // every thread has read the epoch; the next call (stream-ordered) reads the new one
  if (threadIdx.x == 0) *t.flag(x.calls, blockIdx.x) = call;
  collective_mark<true>(t, 3u, true);
}

// ---- rooted collectives, small: one LL round -----------------------------------------------------------
// Broadcast and scatter (the root to every rank) and gather (every rank to the root) of up to
// one_shot_max_bytes per part, as the one-shot moves its data: each 4 bytes travel beside the call's epoch in
// one 8-byte store into the receiver's LL region, which the receiver polls. No meeting: the exchange costs
// one crossing of the links instead of the meetings' three.
// Unlike the one-shot's, a sender here waits on no one within a call, so the half it writes is handed back
// explicitly: at the end of each call block b of every rank (sender or receiver) writes the call's count
// into progress[b][its rank] at every peer, and a sender's block b, before it writes half (call & 1), waits
// until each of its receivers' block b has finished call - 2, that half's last reader (long done in a
// stream of calls). Every rank posts, so the root may change from call to call. A region and counts of its
// own: the one-shot's reuse argument needs every block to have waited on every peer in its previous call.
inline constexpr int kRootedLLMaxWorld = 8;

struct RootedLL {
  TeamView team;
  const char* in;         // the part for rank p at in + p * in_peer_step (0: the same part for every rank)
  uint64_t in_peer_step;  // bytes
  char* out;              // the part from rank s lands at out + s * out_peer_step (0: a single sender)
  uint64_t out_peer_step;
  uint64_t bytes;  // per part, a multiple of 2; in and out 2-byte aligned at least
  int root;
  bool from_root;  // broadcast, scatter: the root sends; gather: the root receives
  uint64_t* ll;    // this team's LL region: [2][world][slot_words], a slot = [blocks][block_words]
  uint64_t slot_words, block_words;
  Flags calls;     // calls[b]: the calls block b of this rank has completed (local state)
  Flags progress;  // progress[b * kRootedLLMaxWorld + p]: the calls rank p's block b has completed
};

// Word i (4 bytes, the last one possibly 2) of a `bytes` part at p, whatever p's 2-byte alignment.
__device__ __forceinline__ uint32_t load_word(const char* p, uint64_t i, uint64_t bytes) {
  const char* at = p + 4 * i;
  const bool full = 4 * i + 4 <= bytes;
  if (full && reinterpret_cast<uintptr_t>(at) % 4 == 0) return *reinterpret_cast<const uint32_t*>(at);
  const uint32_t lo = *reinterpret_cast<const uint16_t*>(at);
  return full ? lo | uint32_t(*reinterpret_cast<const uint16_t*>(at + 2)) << 16 : lo;
}
__device__ __forceinline__ void store_word(char* p, uint64_t i, uint64_t bytes, uint32_t word) {
  char* at = p + 4 * i;
  const bool full = 4 * i + 4 <= bytes;
  if (full && reinterpret_cast<uintptr_t>(at) % 4 == 0) {
    *reinterpret_cast<uint32_t*>(at) = word;
    return;
  }
  *reinterpret_cast<uint16_t*>(at) = static_cast<uint16_t>(word);
  if (full) *reinterpret_cast<uint16_t*>(at + 2) = static_cast<uint16_t>(word >> 16);
}

static __global__ void __launch_bounds__(512) rooted_ll_kernel(RootedLL x) {
  const TeamView& t = x.team;
  const uint64_t call = *reinterpret_cast<volatile uint64_t*>(t.flag(x.calls, blockIdx.x)) + 1;
  const uint32_t epoch = static_cast<uint32_t>(call % 0xffffffffull) + 1;  // never 0, as the one-shot's
  // Word pair q of this block's share, from rank s, lands at part[s * slot_words + 2 * (q - share.begin)].
  uint64_t* part = x.ll + (call & 1) * t.world * x.slot_words + blockIdx.x * x.block_words;
  const uint64_t words = (x.bytes + 3) / 4;
  const Share share((words + 1) / 2);  // pairs; at most block_words / 2 of them (the host sizes the grid)
  const auto words_in = [&](uint64_t q) { return 2 * q + 1 < words ? 2 : 1; };
  const auto progress = [&](int p) { return t.flag(x.progress, int(blockIdx.x) * kRootedLLMaxWorld + p); };
  // Whether rank p receives from this rank's sending, and whether this rank receives from rank s.
  const auto receives = [&](int p) { return p != x.root ? x.from_root : !x.from_root; };
  const bool sends = x.from_root == (t.rank == x.root);
  if (sends) {
    const int p = threadIdx.x;
    if (call > 2 && p < t.world && p != t.rank && receives(p)) (void)wait_ge(t, progress(p), call - 2);
    __syncthreads();
    for (uint64_t q = share.begin + threadIdx.x; q < share.end; q += blockDim.x)
      for (int k = 1; k < t.world; ++k) {
        const int to = (t.rank + k) % t.world;
        if (!receives(to)) continue;
        const char* src = x.in + to * x.in_peer_step;
        uint64_t* dst = t.peer_ptr(part + t.rank * x.slot_words + 2 * (q - share.begin), to);
        const uint64_t lo = (uint64_t(epoch) << 32) | load_word(src, 2 * q, x.bytes);
        if (words_in(q) == 2)
          ptx::st_relaxed_sys_v2(dst, lo, (uint64_t(epoch) << 32) | load_word(src, 2 * q + 1, x.bytes));
        else
          ptx::st_relaxed_sys(dst, lo);
      }
  }
  if (t.rank == x.root) {  // the root's own part, skipped in place
    const char* src = x.in + x.root * x.in_peer_step;
    char* dst = x.out + x.root * x.out_peer_step;
    if (src != dst)
      for (uint64_t i = 2 * share.begin + threadIdx.x; i < min(words, 2 * share.end); i += blockDim.x)
        store_word(dst, i, x.bytes, load_word(src, i, x.bytes));
  }
  if (!sends)
    for (uint64_t q = share.begin + threadIdx.x; q < share.end; q += blockDim.x)
      for (int k = 1; k < t.world; ++k) {
        const int from = (t.rank + k) % t.world;
        if (x.from_root && from != x.root) continue;
        uint32_t v[2];
        const int n = words_in(q);
        if (!ll_wait_pair(t, part + from * x.slot_words + 2 * (q - share.begin), n, epoch, v)) return;
        for (int h = 0; h < n; ++h) store_word(x.out + from * x.out_peer_step, 2 * q + h, x.bytes, v[h]);
      }
  __syncthreads();  // the block's reads of the region are done before any peer may write it again
  if (threadIdx.x == 0) *t.flag(x.calls, blockIdx.x) = call;
  if (int(threadIdx.x) < t.world && int(threadIdx.x) != t.rank)
    signal_set(t, progress(t.rank), threadIdx.x, call);
}

}  // namespace weft::coll
