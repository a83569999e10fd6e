// Device side of the sequence-parallel helpers (sequence_parallel.hpp).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "op_args.hpp"
#include "sequence_parallel.hpp"
#include "weft/comm/barrier.cuh"
#include "weft/runtime/error.hpp"
#include "weft/runtime/kernel_preload.hpp"

namespace weft::ops {
namespace {

constexpr int kWordsPerLaunch = 960;  // under the classic 4 KB of kernel arguments
struct Words {
  int32_t w[kWordsPerLaunch];
};
__global__ void store_words(int32_t* dst, Words words, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = words.w[i];
}

constexpr int kRunsPerLaunch = 480;  // two words each
struct Runs {
  int32_t local[kRunsPerLaunch], natural[kRunsPerLaunch];
};
// Block b: the rows of run b (up to the next run's start or `end`): index[local + i] = natural + i.
__global__ void expand_runs(int32_t* index, Runs runs, int count, int32_t end) {
  const int b = blockIdx.x;
  const int32_t length = (b + 1 < count ? runs.local[b + 1] : end) - runs.local[b];
  for (int i = threadIdx.x; i < length; i += blockDim.x) index[runs.local[b] + i] = runs.natural[b] + i;
}

__device__ __forceinline__ int64_t first_head(const HeadShare& s, int j, int world) {
  return s.replicate ? 0 : j * s.groups / world;
}

// One 16-byte vector per step: element e of [n][W][width * head_vecs].
__global__ void push_rows_kernel(TeamView team, BarrierSlots slots, const uint4* src, int64_t n,
                                 uint4* natural, const int32_t* local_nat, HeadShare share, int head_vecs) {
  if (!barrier_block(team, slots[blockIdx.x])) return;
  const int W = team.world;
  const int64_t row = share.width * head_vecs, per_x = W * row, total = n * per_x;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t x = e / per_x, rest = e - x * per_x;
    const int j = static_cast<int>((rest / row + team.rank) % W);  // rank-staggered destinations
    const int64_t c = rest % row;
    team.peer_ptr(natural, j)[int64_t(__ldg(local_nat + x)) * row + c] =
        src[(x * share.groups + first_head(share, j, W)) * head_vecs + c];
  }
  (void)barrier_block(team, slots[blockIdx.x]);
}

// 8 values from 16-bit or fp32 memory, and 8 to 16-bit memory.
template <class In>
__device__ __forceinline__ void load8(const In* p, float (&v)[8]) {
  if constexpr (std::is_same_v<In, float>) {
    const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const In* h = reinterpret_cast<const In*>(&u);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = static_cast<float>(h[i]);
  }
}
template <class Out>
__device__ __forceinline__ void store8(Out* p, const float (&v)[8]) {
  uint4 u;
  Out* h = reinterpret_cast<Out*>(&u);
#pragma unroll
  for (int i = 0; i < 8; ++i) h[i] = static_cast<Out>(v[i]);
  *reinterpret_cast<uint4*>(p) = u;
}

// Element packs of 8: dst[x][g][d..d+8) = sum over the ranks s holding head g of s's natural[nat(x)][g -
// first(s)][d..d+8).
template <class In, class Out>
__global__ void pull_rows_kernel(TeamView team, BarrierSlots slots, const In* natural, Out* dst, int64_t n,
                                 const int32_t* local_nat, HeadShare share, int head_dim) {
  if (!barrier_block(team, slots[blockIdx.x])) return;
  const int W = team.world, packs = head_dim / 8;
  const int64_t per_x = share.groups * packs, total = n * per_x;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t x = e / per_x, rest = e - x * per_x, g = rest / packs, d = (rest - g * packs) * 8;
    const int64_t nat = __ldg(local_nat + x);
    float sum[8] = {};
    for (int k = 0; k < W; ++k) {
      const int s = (k + team.rank) % W;
      const int64_t first = first_head(share, s, W);
      if (g < first || g >= first + share.width) continue;
      float v[8];
      load8(team.peer_ptr(natural, s) + (nat * share.width + (g - first)) * head_dim + d, v);
#pragma unroll
      for (int i = 0; i < 8; ++i) sum[i] += v[i];
    }
    store8(dst + (x * share.groups + g) * head_dim + d, sum);
  }
}

// LSE: local [heads][n] <-> rank j's natural [heads / W][total] (head h of rank j is j * heads / W + h).
__global__ void move_lse_kernel(TeamView team, float* local, int64_t n, float* natural,
                                const int32_t* local_nat, int64_t heads, int64_t total, bool push) {
  const int64_t per_rank = heads / team.world, count = heads * n;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < count;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t h = e / n, x = e - h * n;
    const int j = static_cast<int>(h / per_rank);
    float* at = team.peer_ptr(natural, j) + (h - j * per_rank) * total + __ldg(local_nat + x);
    if (push)
      *at = local[e];
    else
      local[e] = *at;
  }
}

}  // namespace

int64_t max_local_rows(const RingLayout& L) {
  int64_t m = 0;
  for (int r = 0; r < L.world; ++r) m = std::max(m, L.local_rows(r));
  return m;
}

void upload_words(int32_t* dst, const std::vector<int32_t>& words, cudaStream_t stream) {
  detail::preload<&store_words>();
  for (size_t at = 0; at < words.size(); at += kWordsPerLaunch) {
    const int n = static_cast<int>(std::min<size_t>(kWordsPerLaunch, words.size() - at));
    Words w{};
    std::copy_n(words.data() + at, n, w.w);
    store_words<<<1, 256, 0, stream>>>(dst + at, w, n);
    WEFT_CUDA_CHECK(cudaGetLastError());
  }
}

void write_local_to_natural(const RingLayout& L, int r, int32_t* natural, cudaStream_t stream) {
  std::vector<RowRun> runs;
  for (const RowRun& run : ring_runs(L))
    if (run.rank == r) runs.push_back(run);  // in local order
  write_row_index(runs, natural, stream);
}

void write_row_index(const std::vector<RowRun>& runs, int32_t* natural, cudaStream_t stream) {
  detail::preload<&expand_runs>();
  for (size_t at = 0; at < runs.size(); at += kRunsPerLaunch) {
    const int n = static_cast<int>(std::min<size_t>(kRunsPerLaunch, runs.size() - at));
    Runs batch{};
    for (int i = 0; i < n; ++i) {
      batch.local[i] = static_cast<int32_t>(runs[at + i].local);
      batch.natural[i] = static_cast<int32_t>(runs[at + i].natural);
    }
    const RowRun& last = runs[at + n - 1];
    expand_runs<<<n, 256, 0, stream>>>(natural, batch, n, static_cast<int32_t>(last.local + last.length));
    WEFT_CUDA_CHECK(cudaGetLastError());
  }
}

void push_rows(Communicator& comm, Rank& rank, const void* src, int64_t n, void* natural,
               const int32_t* local_nat, const HeadShare& share, int64_t head_dim, int64_t max_local,
               cudaStream_t stream) {
  // The grid from the longest rank's rows: the same on every rank (block b meets block b).
  const int blocks = collective_blocks(rank, uint64_t(max_local * rank.world() * share.width * head_dim * 2));
  detail::preload<&push_rows_kernel>();
  push_rows_kernel<<<blocks, 512, 0, stream>>>(
      rank.view(), meeting_slots(comm, rank), static_cast<const uint4*>(src), n, static_cast<uint4*>(natural),
      local_nat, share, static_cast<int>(head_dim * 2 / 16));
  WEFT_CUDA_CHECK(cudaGetLastError());
}

void pull_rows(Communicator& comm, Rank& rank, const void* natural, bool natural_fp32, void* dst, int64_t n,
               const int32_t* local_nat, const HeadShare& share, int64_t head_dim, int64_t max_local,
               DType dtype, cudaStream_t stream) {
  const int blocks = collective_blocks(rank, uint64_t(max_local * share.groups * head_dim * 2));
  auto launch = [&](auto* in, auto* out) {
    constexpr auto kernel = &pull_rows_kernel<std::remove_cv_t<std::remove_pointer_t<decltype(in)>>,
                                              std::remove_pointer_t<decltype(out)>>;
    detail::preload<kernel>();
    kernel<<<blocks, 512, 0, stream>>>(rank.view(), meeting_slots(comm, rank), in, out, n, local_nat, share,
                                       static_cast<int>(head_dim));
  };
  const bool half = dtype == DType::kFP16;
  if (natural_fp32 && half) launch(static_cast<const float*>(natural), static_cast<__half*>(dst));
  if (natural_fp32 && !half) launch(static_cast<const float*>(natural), static_cast<__nv_bfloat16*>(dst));
  if (!natural_fp32 && half) launch(static_cast<const __half*>(natural), static_cast<__half*>(dst));
  if (!natural_fp32 && !half)
    launch(static_cast<const __nv_bfloat16*>(natural), static_cast<__nv_bfloat16*>(dst));
  WEFT_CUDA_CHECK(cudaGetLastError());
}

void push_lse(const Rank& rank, const float* lse, int64_t n, float* natural, const int32_t* local_nat,
              int64_t heads, int64_t total, cudaStream_t stream) {
  if (n == 0) return;
  detail::preload<&move_lse_kernel>();
  move_lse_kernel<<<grid_stride_blocks(heads * n), 256, 0, stream>>>(rank.view(), const_cast<float*>(lse), n,
                                                                     natural, local_nat, heads, total, true);
  WEFT_CUDA_CHECK(cudaGetLastError());
}

void pull_lse(const Rank& rank, const float* natural, float* lse, int64_t n, const int32_t* local_nat,
              int64_t heads, int64_t total, cudaStream_t stream) {
  if (n == 0) return;
  detail::preload<&move_lse_kernel>();
  move_lse_kernel<<<grid_stride_blocks(heads * n), 256, 0, stream>>>(
      rank.view(), lse, n, const_cast<float*>(natural), local_nat, heads, total, false);
  WEFT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace weft::ops
