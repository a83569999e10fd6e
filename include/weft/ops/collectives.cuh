// Device code of the collectives: each is a few phases of the primitives, run by every block on its own
// share of the data. Block b of every rank handles the same share, and the blocks with the same index meet
// in their own barrier slot (kCollectiveSlotBase + b): no grid-wide synchronization anywhere.
//
// Every kernel but the LL one-shot starts with that per-block barrier. Passing it means every peer has
// started this call, so its previous kernels (which may still have been reading the buffers we are about to
// write) are done. The LL one-shot needs none: see its comment.
#pragma once
#include <type_traits>

#include "weft/comm/barrier.cuh"
#include "weft/comm/elementwise.cuh"
#include "weft/device/numeric.cuh"
#include "weft/runtime/communicator.hpp"

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
// exactly the data block b moved.
template <class F>
__device__ __forceinline__ void for_each_chunk(uint64_t n, F f) {  // f(first unit, units in chunk)
  // Full chunks of 4 * blockDim units when there is enough work for every block; otherwise even shares,
  // so small messages still spread over the whole grid (not yet measured: see bench/RESULTS.md).
  const uint64_t even = (n + gridDim.x - 1) / gridDim.x;
  const uint64_t chunk = min(uint64_t(4) * blockDim.x, max(uint64_t(blockDim.x), even));
  for (uint64_t base = uint64_t(blockIdx.x) * chunk; base < n; base += uint64_t(gridDim.x) * chunk)
    f(base, min(chunk, n - base));
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

__device__ __forceinline__ bool meet(const TeamView& team) {
  return barrier_block(team, kCollectiveSlotBase + blockIdx.x);
}

// The access unit of V bytes.
template <int V>
using Unit =
    std::conditional_t<V == 16, uint4,
                       std::conditional_t<V == 8, uint2, std::conditional_t<V == 4, uint32_t, uint16_t>>>;

// Copies this block's share of a rows x row_bytes region in units of V bytes (V divides row_bytes, both
// strides and both addresses: the host picks the widest). A single row (contiguous data, the common case)
// keeps 4 loads in flight per thread; NVLink stores need that much memory-level parallelism.
template <int V>
__device__ __forceinline__ void copy_rows(Rows dst, Rows src, uint64_t rows, uint64_t row_bytes) {
  using U = Unit<V>;
  const uint64_t per_row = row_bytes / V;
  if (rows == 1) {
    const U* from = reinterpret_cast<const U*>(src.base);
    U* to = reinterpret_cast<U*>(dst.base);
    for_each_chunk(per_row, [&](uint64_t base, uint64_t len) {
      const uint64_t t = threadIdx.x, step = blockDim.x;
      if (len == 4 * step) {  // full chunk: 4 loads in flight per thread
        U v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) v[u] = from[base + t + u * step];
#pragma unroll
        for (int u = 0; u < 4; ++u) to[base + t + u * step] = v[u];
      } else {
        for (uint64_t j = t; j < len; j += step) to[base + j] = from[base + j];
      }
    });
    return;
  }
  for_each_chunk(rows * per_row, [&](uint64_t base, uint64_t len) {
    for (uint64_t j = threadIdx.x; j < len; j += blockDim.x) {
      const uint64_t i = base + j, r = i / per_row, c = i - r * per_row;
      *reinterpret_cast<U*>(dst.base + r * dst.stride + c * V) =
          *reinterpret_cast<const U*>(src.base + r * src.stride + c * V);
    }
  });
}

// dst = R over the world's sources (src_of(0) .. src_of(world - 1), same layout), also stored into every
// rank's copy of dst when `fanout` (the all-gather half of a two-shot all-reduce). Packs of 16 bytes when
// kVec, single elements otherwise; arithmetic in fp32.
template <Elem E, Reduce R, bool kVec, class SrcOf>
__device__ __forceinline__ void reduce_rows(const TeamView& team, Rows dst, SrcOf src_of, uint64_t rows,
                                            uint64_t row_elems, bool fanout) {
  using T = typename ElemTraits<E>::T;
  constexpr int kLanes = kVec ? 16 / sizeof(T) : 1;
  const uint64_t per_row = row_elems / kLanes;
  for_each_chunk(rows * per_row, [&](uint64_t base, uint64_t len) {
    for (uint64_t i = base + threadIdx.x; i < base + len; i += blockDim.x) {
      const uint64_t r = rows == 1 ? 0 : i / per_row, off = (i - r * per_row) * kLanes * sizeof(T);
      auto at = [&](const Rows& x) { return x.base + r * x.stride + off; };
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
  });
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
};

template <int V>
__global__ void __launch_bounds__(512) exchange_kernel(Exchange x) {
  const TeamView& t = x.team;
  if (!meet(t)) return;
  for (int k = 0; k < t.world; ++k) {
    const int p = (t.rank + k) % t.world;  // stagger: every rank starts with a different peer
    Rows dst{t.peer_ptr(x.dst.base + x.dst_peer_step * t.rank, p), x.dst.stride};
    copy_rows<V>(dst, Rows{x.src.base + x.src_peer_step * p, x.src.stride}, x.rows, x.row_bytes);
  }
  if (!meet(t) || !x.via_workspace) return;
  for (int q = 0; q < t.world; ++q)
    copy_rows<V>(Rows{x.final_dst.base + x.final_peer_step * q, x.final_dst.stride},
                 Rows{x.dst.base + x.dst_peer_step * q, x.dst.stride}, x.rows, x.row_bytes);
}

// ---- reduce-scatter and two-shot all-reduce: push slices to their owners, reduce mine, (fan out) ------
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
  // Pre-staged (the fused ops' copy-engine pipeline): every source's slice, this rank's own included, is
  // already in staging, and flag arrived[s] (this rank's pad) reads 1 once source s's slice has landed.
  // Then the kernel waits for those flags instead of meeting and pushing (`in` is unused).
  const uint64_t* arrived;
};

template <Elem E, Reduce R, bool kVec>
__global__ void __launch_bounds__(512) reduce_scatter_kernel(ReduceScatter x) {
  using T = typename ElemTraits<E>::T;
  constexpr int V = kVec ? 16 : sizeof(T);
  const TeamView& t = x.team;
  if (x.arrived) {
    bool ok = true;
    if (threadIdx.x == 0)
      for (int s = 0; s < t.world && ok; ++s) ok = s == t.rank || wait_ge(t, x.arrived + s, 1);
    if (!__syncthreads_and(ok)) return;
  } else {
    if (!meet(t)) return;
    for (int k = 1; k < t.world; ++k) {
      const int p = (t.rank + k) % t.world;
      Rows dst{t.peer_ptr(x.staging.base + x.staging_step * t.rank, p), x.staging.stride};
      copy_rows<V>(dst, Rows{x.in.base + x.in_peer_step * p, x.in.stride}, x.rows, x.row_bytes);
    }
    if (!meet(t)) return;
  }
  auto src_of = [&](int s) {  // s = 0: my own slice (of the input, or staged); then the peers' staged slices
    if (s == 0 && !x.arrived) return Rows{x.in.base + x.in_peer_step * t.rank, x.in.stride};
    return Rows{x.staging.base + x.staging_step * ((t.rank + s) % t.world), x.staging.stride};
  };
  reduce_rows<E, R, kVec>(t, x.out, src_of, x.rows, x.row_bytes / sizeof(T), x.fanout);
  if (!x.fanout || !meet(t) || x.final_dst == nullptr) return;  // now every slice has landed
  // Block b copies exactly the parts it met for: its share of each slice (same partition as the reduce).
  for (int q = 0; q < t.world; ++q)
    copy_rows<V>(Rows{x.final_dst + q * x.row_bytes, 0},
                 Rows{const_cast<char*>(x.final_src) + q * x.row_bytes, 0}, 1, x.row_bytes);
}

// ---- pull variant: every rank reads its slice straight from the others' inputs (reduce-from-peers) ----
// No staging: after the entry meeting, rank r reads slice r of every rank's (symmetric) input, reduces in
// fp32 and writes its output (two-shot all-reduce: into every rank's output). The exit meeting keeps
// inputs alive until every reader is done. A non-symmetric input is first copied into the workspace.
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
  if (!meet(t)) return;
  char* mine = x.in.base + x.in_peer_step * t.rank;
  auto src_of = [&](int s) { return Rows{t.peer_ptr(mine, (t.rank + s) % t.world), x.in.stride}; };
  reduce_rows<E, R, kVec>(t, x.out, src_of, x.rows, x.row_bytes / sizeof(T), x.fanout);
  if (!meet(t) || x.final_dst == nullptr) return;
  for (int q = 0; q < t.world; ++q)
    copy_rows<V>(Rows{x.final_dst + q * x.row_bytes, 0},
                 Rows{const_cast<char*>(x.final_src) + q * x.row_bytes, 0}, 1, x.row_bytes);
}

// ---- one-shot all-reduce, LL protocol: data and call epoch travel in one 8-byte store -------------------
// Every rank stores its input, 4 bytes at a time next to the call's epoch, into every peer's workspace
// (half `epoch & 1`, slot of the sender); each rank then polls its own workspace until every word carries
// this epoch and reduces. No barrier and no fence: an 8-byte store is seen whole or not at all. Two halves
// alternate by call, so a fast rank never overwrites words a slow rank is still reading.
struct OneShot {
  TeamView team;
  const uint32_t* in;
  uint32_t* out;
  uint64_t words;       // 4-byte words of input (the last may be half used: bf16/fp16 odd counts)
  uint32_t tail_bytes;  // bytes used in the last word (4 if full)
  uint64_t* ll;         // workspace: [2][world][words]
};

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

template <Elem E, Reduce R>
__global__ void __launch_bounds__(512) one_shot_kernel(OneShot x) {
  using T = typename ElemTraits<E>::T;
  const TeamView& t = x.team;
  uint64_t* state = t.collective_state();  // [0] calls completed, [1] blocks done in this call
  const uint32_t epoch = static_cast<uint32_t>(*reinterpret_cast<volatile uint64_t*>(state)) + 1;
  uint64_t* half = x.ll + (epoch & 1) * t.world * x.words;
  const Share share(x.words);
  for (uint64_t i = share.begin + threadIdx.x; i < share.end; i += blockDim.x) {
    const uint32_t v =
        (i + 1 == x.words && x.tail_bytes == 2) ? *reinterpret_cast<const uint16_t*>(x.in + i) : x.in[i];
    const uint64_t word = (uint64_t(epoch) << 32) | v;
    for (int k = 1; k < t.world; ++k)
      ptx::st_relaxed_sys(t.peer_ptr(half + t.rank * x.words + i, (t.rank + k) % t.world), word);
  }
  for (uint64_t i = share.begin + threadIdx.x; i < share.end; i += blockDim.x) {
    const bool half_word = i + 1 == x.words && x.tail_bytes == 2;
    uint32_t mine = half_word ? *reinterpret_cast<const uint16_t*>(x.in + i) : x.in[i];
    float acc[4 / sizeof(T)];
    for (int l = 0; l < int(4 / sizeof(T)); ++l)
      acc[l] = ElemTraits<E>::to_float(reinterpret_cast<const T*>(&mine)[l]);
    for (int k = 1; k < t.world; ++k) {
      uint32_t v;
      if (!ll_wait(t, half + ((t.rank + k) % t.world) * x.words + i, epoch, &v)) return;
      for (int l = 0; l < int(4 / sizeof(T)); ++l)
        acc[l] = combine<R>(acc[l], ElemTraits<E>::to_float(reinterpret_cast<const T*>(&v)[l]));
    }
    for (int l = 0; l < int(4 / sizeof(T)); ++l)
      reinterpret_cast<T*>(&mine)[l] = ElemTraits<E>::from_float(acc[l]);
    if (half_word)
      *reinterpret_cast<uint16_t*>(x.out + i) = static_cast<uint16_t>(mine);
    else
      x.out[i] = mine;
  }
  // The last block to finish advances the epoch for the next call (every block has read it by then).
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(reinterpret_cast<unsigned long long*>(state + 1), 1ull) + 1 == gridDim.x) {
      state[1] = 0;
      *reinterpret_cast<volatile uint64_t*>(state) = epoch;
    }
  }
}

}  // namespace weft::coll
