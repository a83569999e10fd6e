// GPU tests of the communication primitives, one each: element-wise peer access (load, store, red-add,
// broadcast, reduce-from-peers) and TMA tiles (put, get, put-reduce-add, broadcast). Each kernel writes
// with the primitive, meets the team in an in-kernel barrier, and checks what landed; mismatches are
// counted in device memory and must be zero on every rank.
#include <cuda_bf16.h>

#include "harness.hpp"
#include "weft/comm/barrier.cuh"
#include "weft/comm/elementwise.cuh"
#include "weft/comm/tile.cuh"

using namespace weft;
using weft::test::TestContext;

namespace {

constexpr int kTileRows = 16, kTileCols = 64;  // fp32 tile: 16 rows x 256 bytes
constexpr int kStride = 96;                    // elements between rows in global memory (> kTileCols)

__device__ float pattern(int rank, int i) {
  return float(rank * 100000 + i);
}

// Everything a primitive test kernel needs: a symmetric scratch buffer and a mismatch counter.
struct Scratch {
  TeamView team;
  float* buf;                 // symmetric, >= 64 KiB of floats
  unsigned long long* wrong;  // this rank's mismatch count (not symmetric use)
};

__device__ void expect(Scratch s, bool ok) {
  if (!ok) atomicAdd(s.wrong, 1ull);
}

__global__ void elementwise_kernel(Scratch s) {
  const TeamView& t = s.team;
  const int next = (t.rank + 1) % t.world, prev = (t.rank + t.world - 1) % t.world;
  float* stored = s.buf;         // [0, 1024): written by the previous rank with peer_store16
  float* summed = s.buf + 1024;  // [1024, 2048): every rank red-adds rank+1
  float* bcast = s.buf + 2048;   // [2048, 3072): rank 0 broadcasts
  float* mine = s.buf + 3072;    // [3072, 4096): my own values, read by peers
  const int tid = threadIdx.x;   // 256 threads, 4 floats each
  mine[tid * 4 + 0] = pattern(t.rank, tid * 4 + 0);
  mine[tid * 4 + 1] = pattern(t.rank, tid * 4 + 1);
  mine[tid * 4 + 2] = pattern(t.rank, tid * 4 + 2);
  mine[tid * 4 + 3] = pattern(t.rank, tid * 4 + 3);
  if (!barrier_block(t)) return;
  const float4 v = make_float4(pattern(t.rank, tid * 4), pattern(t.rank, tid * 4 + 1),
                               pattern(t.rank, tid * 4 + 2), pattern(t.rank, tid * 4 + 3));
  peer_store16(t, stored + tid * 4, next, *reinterpret_cast<const uint4*>(&v));
  for (int p = 0; p < t.world; ++p)
    peer_red_add(t, summed + tid * 4, p, make_float4(t.rank + 1, t.rank + 1, t.rank + 1, t.rank + 1));
  if (t.rank == 0) broadcast16(t, bcast + tid * 4, *reinterpret_cast<const uint4*>(&v));
  const uint4 got = peer_load16(t, mine + tid * 4, next);  // the next rank's own values
  const float* g = reinterpret_cast<const float*>(&got);
  for (int k = 0; k < 4; ++k) expect(s, g[k] == pattern(next, tid * 4 + k));
  if (!barrier_block(t)) return;
  const float total = t.world * (t.world + 1) / 2.0f;
  for (int k = 0; k < 4; ++k) {
    expect(s, stored[tid * 4 + k] == pattern(prev, tid * 4 + k));
    expect(s, summed[tid * 4 + k] == total);
    expect(s, bcast[tid * 4 + k] == pattern(0, tid * 4 + k));
  }
  // reduce_from_peers16 over bf16 values rank+1 (exact in bf16): sum = W(W+1)/2, max = W, min = 1.
  __nv_bfloat16* h = reinterpret_cast<__nv_bfloat16*>(s.buf + 8192);
  for (int k = 0; k < 8; ++k) h[tid * 8 + k] = __float2bfloat16(float(t.rank + 1));
  if (!barrier_block(t)) return;
  const Pack<Elem::kBF16> sum = reduce_from_peers16<Elem::kBF16, Reduce::kSum>(t, h + tid * 8);
  const Pack<Elem::kBF16> mx = reduce_from_peers16<Elem::kBF16, Reduce::kMax>(t, h + tid * 8);
  const Pack<Elem::kBF16> mn = reduce_from_peers16<Elem::kBF16, Reduce::kMin>(t, h + tid * 8);
  for (int k = 0; k < 8; ++k) {
    expect(s, sum.v[k] == total);
    expect(s, mx.v[k] == float(t.world));
    expect(s, mn.v[k] == 1.0f);
  }
  // bf16 red-add: 8 bf16 per call, every rank adds rank+1 into every rank's copy.
  __nv_bfloat16* hs = reinterpret_cast<__nv_bfloat16*>(s.buf + 16384);
  __nv_bfloat16 add[8];
  for (int k = 0; k < 8; ++k) add[k] = __float2bfloat16(float(t.rank + 1));
  for (int p = 0; p < t.world; ++p) peer_red_add(t, hs + tid * 8, p, *reinterpret_cast<const uint4*>(add));
  if (!barrier_block(t)) return;
  for (int k = 0; k < 8; ++k) expect(s, __bfloat162float(hs[tid * 8 + k]) == total);
  (void)barrier_block(t);  // nobody leaves while a peer may still read this rank's memory (failure: reported)
}

// Tiles: a 16 x 64 fp32 tile in shared memory, rows kStride floats apart in global memory.
__global__ void tile_kernel(Scratch s) {
  const TeamView& t = s.team;
  __shared__ __align__(128) float tile[kTileRows * kTileCols];
  __shared__ __align__(8) uint64_t bar;
  const int next = (t.rank + 1) % t.world, prev = (t.rank + t.world - 1) % t.world;
  const TileShape shape{kTileRows, kTileCols * 4, kStride * 4};
  float* put_dst = s.buf;                            // written by the previous rank's tile_put
  float* get_src = s.buf + kTileRows * kStride;      // my values, fetched by the previous rank
  float* reduced = s.buf + 2 * kTileRows * kStride;  // every rank put-reduce-adds rank+1
  float* bcast = s.buf + 3 * kTileRows * kStride;    // rank 0 broadcasts
  for (int i = threadIdx.x; i < kTileRows * kTileCols; i += blockDim.x) {
    const int r = i / kTileCols, c = i % kTileCols;
    tile[i] = pattern(t.rank, i);
    get_src[r * kStride + c] = pattern(t.rank, i);
  }
  fence_proxy_async_smem();  // shared-memory writes above are read by the copy engine below
  if (!barrier_block(t)) return;
  if (threadIdx.x == 0) {
    tile_put(t, put_dst, next, tile, shape);
    if (t.rank == 0) tile_broadcast(t, bcast, tile, shape);
    bulk_commit();
    tile_puts_complete();
  }
  __syncthreads();
  // put-reduce: the tile now holds rank+1 everywhere; add it into every rank's `reduced`.
  for (int i = threadIdx.x; i < kTileRows * kTileCols; i += blockDim.x) tile[i] = float(t.rank + 1);
  fence_proxy_async_smem();
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int p = 0; p < t.world; ++p) tile_put_reduce_add<Elem::kFP32>(t, reduced, p, tile, shape);
    bulk_commit();
    tile_puts_complete();
  }
  if (!barrier_block(t)) return;
  // get: fetch the next rank's get_src tile into shared memory.
  if (threadIdx.x == 0) {
    mbarrier_init(&bar, 1);
    fence_barrier_init();
    mbarrier_arrive_expect_tx(&bar, kTileRows * kTileCols * 4);
    tile_get(t, get_src, next, tile, shape, &bar);
  }
  __syncthreads();
  mbarrier_wait(&bar, 0);
  const float total = t.world * (t.world + 1) / 2.0f;
  for (int i = threadIdx.x; i < kTileRows * kTileCols; i += blockDim.x) {
    const int r = i / kTileCols, c = i % kTileCols;
    expect(s, tile[i] == pattern(next, i));
    expect(s, put_dst[r * kStride + c] == pattern(prev, i));
    expect(s, reduced[r * kStride + c] == total);
    expect(s, bcast[r * kStride + c] == pattern(0, i));
  }
  // Gaps between rows were never written: still zero.
  for (int r = threadIdx.x; r < kTileRows; r += blockDim.x)
    expect(s, put_dst[r * kStride + kTileCols] == 0.0f);
  (void)barrier_block(t);  // a failure is reported by the host
}

template <class Kernel>
void run_primitive_kernel(TestContext& ctx, Kernel kernel, int threads, const char* what) {
  Communicator& c = ctx.comm();
  SymmetricBuffer b = c.alloc(1 << 20);
  std::vector<unsigned long long*> wrong(c.num_local());
  for (int i = 0; i < c.num_local(); ++i) {
    WEFT_CUDA_CHECK(cudaSetDevice(c.local(i).device()));
    WEFT_CUDA_CHECK(cudaMemset(b.local[i], 0, b.bytes));
    WEFT_CUDA_CHECK(cudaMalloc(&wrong[i], sizeof(unsigned long long)));
    WEFT_CUDA_CHECK(cudaMemset(wrong[i], 0, sizeof(unsigned long long)));
  }
  c.synchronize();
  c.host_barrier();
  for (int i = 0; i < c.num_local(); ++i) {
    Rank& r = c.local(i);
    WEFT_CUDA_CHECK(cudaSetDevice(r.device()));
    kernel<<<1, threads, 0, r.stream()>>>(Scratch{r.view(), reinterpret_cast<float*>(b.local[i]), wrong[i]});
    WEFT_CUDA_CHECK(cudaGetLastError());
  }
  c.synchronize();
  for (int i = 0; i < c.num_local(); ++i) {
    unsigned long long n = 0;
    WEFT_CUDA_CHECK(cudaSetDevice(c.local(i).device()));
    WEFT_CUDA_CHECK(cudaMemcpy(&n, wrong[i], sizeof(n), cudaMemcpyDeviceToHost));
    WEFT_CUDA_CHECK(cudaFree(wrong[i]));
    WEFT_EXPECT(n == 0, what << ": rank " << c.local(i).rank() << " saw " << n << " wrong values");
  }
  c.free(b);
}

}  // namespace

WEFT_GPU_TEST(primitives_elementwise_peer_access) {
  run_primitive_kernel(ctx, elementwise_kernel, 256,
                       "peer load/store/red-add, broadcast16, reduce_from_peers16");
}

WEFT_GPU_TEST(primitives_tma_tiles) {
  run_primitive_kernel(ctx, tile_kernel, 256, "tile put/get/put-reduce-add/broadcast");
}
