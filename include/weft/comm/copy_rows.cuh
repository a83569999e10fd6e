// Copying rows of 16-byte vectors by one warp, to this GPU or a peer's: an L2 prefetch of the source rows,
// then a copy with four loads in flight per lane. Neither orders anything: publish with a release signal
// after the warp's stores (e.g. __syncwarp, then lane 0's signal_add).
//
// Or through the bulk-copy engine (BulkRowCopier): lane 0 loads chunks (contiguous, or rows gathered from a
// strided tensor) into a ring of shared buffers and stores each from there, with no registers for the bytes:
// with a ring of two, one chunk loads while the one before it is stored (a 4 KiB chunk each way, against the
// ~2 KiB a warp of 40 registers keeps in flight with loads and stores of its own). complete() waits for the
// stores and orders them before the lane's later signals.
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

  // Rows i in [0, rows) of `row_bytes` bytes (a multiple of 16, at most one staging buffer) from src + i *
  // src_stride to dst + i * dst_stride (bytes, 16-byte aligned; either side may be a peer's): a buffer
  // gathers as many rows as it holds, a bulk load each (one for all where the source rows are contiguous),
  // and scatters them likewise. Lane 0; returns once every store is issued.
  __device__ void copy_strided(const void* src, int64_t src_stride, void* dst, int64_t dst_stride, int rows,
                               int row_bytes) {
    if (lane_ != 0 || rows <= 0) return;
    const auto* from = static_cast<const uint8_t*>(src);
    auto* to = static_cast<uint8_t*>(dst);
    const int per = kChunk / row_bytes;  // rows per buffer
    const auto count = [&](int64_t c) { return static_cast<int>(min(int64_t(per), rows - c * per)); };
    const auto move = [&](int64_t c, auto&& one, auto&& all, int64_t stride) {
      const int n = count(c);
      if (stride == row_bytes) return all(int64_t(c) * per, n);
      for (int i = 0; i < n; ++i) one(int64_t(c) * per + i, i);
    };
    copy_chunks(
        (rows + per - 1) / per, [&](int64_t c) { return static_cast<uint32_t>(count(c) * row_bytes); },
        [&](int64_t c, uint8_t* buf, uint64_t* bar) {
          move(
              c,
              [&](int64_t r, int i) {
                bulk_load(buf + i * row_bytes, from + r * src_stride, row_bytes, bar);
              },
              [&](int64_t r, int n) { bulk_load(buf, from + r * src_stride, n * row_bytes, bar); },
              src_stride);
        },
        [&](int64_t c, const uint8_t* buf) {
          move(
              c, [&](int64_t r, int i) { bulk_store(to + r * dst_stride, buf + i * row_bytes, row_bytes); },
              [&](int64_t r, int n) { bulk_store(to + r * dst_stride, buf, n * row_bytes); }, dst_stride);
        });
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

  // Lane 0: `bytes` from src to each of dst_of(0), .., dst_of(count - 1), in chunks of a buffer each.
  template <class DstOf>
  __device__ void copy_bytes(const uint4* src, int64_t bytes, int count, DstOf dst_of) {
    const auto* from = reinterpret_cast<const uint8_t*>(src);
    const auto size = [&](int64_t c) {
      const int64_t rest = bytes - c * kChunk;
      return static_cast<uint32_t>(rest < kChunk ? rest : kChunk);
    };
    copy_chunks(
        (bytes + kChunk - 1) / kChunk, size,
        [&](int64_t c, uint8_t* buf, uint64_t* bar) { bulk_load(buf, from + c * kChunk, size(c), bar); },
        [&](int64_t c, const uint8_t* buf) {
          for (int i = 0; i < count; ++i) {
            auto* to = reinterpret_cast<uint8_t*>(dst_of(i));
            if (to != nullptr) bulk_store(to + c * kChunk, buf, size(c));
          }
        });
  }

  // Lane 0: `chunks` chunks of size(c) bytes, chunk c loaded into buffer c % kRing by load(c, buffer,
  // mbarrier) and, once landed, stored from it by store(c, buffer); the buffer of chunk c - 1 is reloaded
  // with chunk c - 1 + kRing once that chunk's stores have read it, which they had the time of one landing
  // to do.
  template <class Size, class Load, class Store>
  __device__ void copy_chunks(int64_t chunks, Size size, Load load, Store store) {
    const auto start = [&](int64_t c) {
      const int b = static_cast<int>(c % kRing);
      mbarrier_arrive_expect_tx(&s_.full[b], size(c));
      load(c, s_.buf[b], &s_.full[b]);
    };
    bulk_wait_read<0>();  // the previous call's stores have read their buffers
    for (int64_t c = 0; c < chunks && c < kRing; ++c) start(c);
    for (int64_t c = 0; c < chunks; ++c) {
      const int b = static_cast<int>(c % kRing);
      mbarrier_wait(&s_.full[b], (phase_ >> b) & 1u);
      phase_ ^= 1u << b;
      store(c, s_.buf[b]);
      bulk_commit();
      if (c >= 1 && c - 1 + kRing < chunks) {
        bulk_wait_read<1>();  // chunk c - 1's stores have read its buffer (chunk c's may still be reading)
        start(c - 1 + kRing);
      }
    }
  }

  Staging& s_;
  int lane_;
  uint32_t phase_ = 0;  // bit b: the parity buffer b's next landing completes
};

}  // namespace weft
