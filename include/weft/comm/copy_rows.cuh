// Copying rows of 16-byte vectors by one warp, to this GPU or a peer's: an L2 prefetch of the source rows,
// then a copy with four loads in flight per lane. Neither orders anything: publish with a release signal
// after the warp's stores (e.g. __syncwarp, then lane 0's signal_add).
//
// Or through the bulk-copy engine (BulkRowCopier): lane 0 loads chunks into a ring of shared buffers and
// stores each from there, with no registers for the bytes: with a ring of two, one chunk loads while the one
// before it is stored (a 4 KiB chunk each way, against the ~2 KiB a warp of 40 registers keeps in flight with
// loads and stores of its own). complete() waits for the stores and orders them before the lane's later
// signals.
#pragma once
#include <cstdint>

#include "weft/device/bulk_copy.cuh"
#include "weft/device/ptx.cuh"

namespace weft {

// Starts pulling rows [r0, r1) of src ([rows][row_vecs] 16-byte vectors) into L2, by lane 0: an
// asynchronous bulk prefetch that takes no registers, so the copy loops that follow find their lines in L2
// instead of waiting on DRAM for each 2 KiB a copying warp (24 registers) can have in flight.
__device__ inline void prefetch_rows_l2(const uint4* src, int r0, int r1, int rows, int row_vecs, int lane) {
  const int64_t valid = int64_t(max(0, min(r1, rows) - r0)) * row_vecs;
  if (lane == 0 && valid > 0)
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src + int64_t(r0) * row_vecs),
                 "r"(static_cast<uint32_t>(valid * 16))
                 : "memory");
}

// Rows [r0, r1) of src ([rows][row_vecs] 16-byte vectors; zeros from row `rows` on) to dst (already offset
// to row r0), by one warp.
__device__ inline void warp_copy_rows(const uint4* src, uint4* dst, int r0, int r1, int rows, int row_vecs,
                                      int lane) {
  const int64_t n = int64_t(r1 - r0) * row_vecs, valid = int64_t(max(0, min(r1, rows) - r0)) * row_vecs;
  const uint4* from = src + int64_t(r0) * row_vecs;
  int64_t i = lane;
  for (; i + 96 < valid; i += 128) {  // 4 loads in flight per lane
    uint4 v[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) v[q] = from[i + 32 * q];
#pragma unroll
    for (int q = 0; q < 4; ++q) dst[i + 32 * q] = v[q];
  }
  for (; i < valid; i += 32) dst[i] = from[i];
  for (; i < n; i += 32) dst[i] = make_uint4(0, 0, 0, 0);
}

// One helper warp's staging in shared memory: kBuffers buffers of kBytes and the mbarriers their loads
// complete on.
template <int kBytes, int kBuffers = 2>
struct BulkStaging {
  static_assert(kBytes % 16 == 0 && kBuffers >= 2, "bulk copies move 16-byte multiples; the ring needs two");
  static constexpr int kChunkBytes = kBytes, kChunks = kBuffers;
  alignas(128) uint8_t buf[kBuffers][kBytes];
  uint64_t full[kBuffers];
};

// Rows of 16-byte vectors by one warp through its BulkStaging (construct it in every lane of the warp, once
// per kernel: lane 0 initialises the mbarriers). Global addresses may be this GPU's or a peer's.
template <class Staging>
class BulkRowCopier {
 public:
  __device__ explicit BulkRowCopier(Staging& s) : s_(s), lane_(static_cast<int>(threadIdx.x % 32)) {
    if (lane_ == 0) {
      for (int b = 0; b < Staging::kChunks; ++b) mbarrier_init(&s_.full[b], 1);
      fence_barrier_init();  // the inits before the copy engine's completions on them
    }
    __syncwarp();
  }

  // Rows [r0, r1) of src ([rows][row_vecs] 16-byte vectors; zeros from row `rows` on) to dst (already offset
  // to row r0), like warp_copy_rows. Returns once every store is issued; the zeros are the lanes' own stores.
  __device__ void copy_rows(const uint4* src, uint4* dst, int r0, int r1, int rows, int row_vecs) {
    const int64_t n = int64_t(r1 - r0) * row_vecs, valid = int64_t(max(0, min(r1, rows) - r0)) * row_vecs;
    if (lane_ == 0 && valid > 0)
      copy_bytes(src + int64_t(r0) * row_vecs, valid * 16, 1, [&](int) { return dst; });
    for (int64_t i = valid + lane_; i < n; i += 32) dst[i] = make_uint4(0, 0, 0, 0);
  }

  // Lane 0: `bytes` from src to each of dst_of(0), .., dst_of(count - 1) (nullptr: skipped), each chunk
  // loaded once and stored to all of them. Returns once every store is issued.
  template <class DstOf>
  __device__ void broadcast(const uint4* src, int64_t bytes, int count, DstOf dst_of) {
    if (lane_ == 0 && bytes > 0) copy_bytes(src, bytes, count, dst_of);
  }

  // Lane 0: waits until this warp's bulk stores have been performed and orders them (async proxy) before
  // the lane's later operations. Then __syncwarp and a release by any lane publish the copies and the zeros.
  __device__ void complete() {
    if (lane_ != 0) return;
    bulk_wait<0>();
    ptx::fence_proxy_async_global();
  }

 private:
  static constexpr int kChunk = Staging::kChunkBytes, kRing = Staging::kChunks;

  // Lane 0. Chunk c goes through buffer c % kRing: its load, then (once landed) its stores; the buffer of
  // chunk c - 1 is reloaded with chunk c - 1 + kRing once that chunk's stores have read it, which they had
  // the time of one landing to do.
  template <class DstOf>
  __device__ void copy_bytes(const uint4* src, int64_t bytes, int count, DstOf dst_of) {
    const auto* from = reinterpret_cast<const uint8_t*>(src);
    const int64_t chunks = (bytes + kChunk - 1) / kChunk;
    const auto size = [&](int64_t c) {
      const int64_t rest = bytes - c * kChunk;
      return static_cast<uint32_t>(rest < kChunk ? rest : kChunk);
    };
    const auto load = [&](int64_t c) {
      const int b = static_cast<int>(c % kRing);
      mbarrier_arrive_expect_tx(&s_.full[b], size(c));
      bulk_load(s_.buf[b], from + c * kChunk, size(c), &s_.full[b]);
    };
    bulk_wait_read<0>();  // the previous call's stores have read their buffers
    for (int64_t c = 0; c < chunks && c < kRing; ++c) load(c);
    for (int64_t c = 0; c < chunks; ++c) {
      const int b = static_cast<int>(c % kRing);
      mbarrier_wait(&s_.full[b], (phase_ >> b) & 1u);
      phase_ ^= 1u << b;
      for (int i = 0; i < count; ++i) {
        auto* to = reinterpret_cast<uint8_t*>(dst_of(i));
        if (to != nullptr) bulk_store(to + c * kChunk, s_.buf[b], size(c));
      }
      bulk_commit();
      if (c >= 1 && c - 1 + kRing < chunks) {
        bulk_wait_read<1>();  // chunk c - 1's stores have read its buffer (chunk c's may still be reading)
        load(c - 1 + kRing);
      }
    }
  }

  Staging& s_;
  int lane_;
  uint32_t phase_ = 0;  // bit b: the parity buffer b's next landing completes
};

}  // namespace weft
