// Device side of the sequence-parallel helpers (sequence_parallel.hpp).
#include <algorithm>

#include "sequence_parallel.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/kernel_preload.hpp"
#include "weft/tile/fragment.cuh"

namespace weft::ops {
namespace {

constexpr int kWordsPerLaunch = 960;  // under the classic 4 KB of kernel arguments
struct Words {
  int32_t w[kWordsPerLaunch];
};
__global__ void store_words(int32_t* dst, Words words, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = words.w[i];
}

constexpr int kRunsPerLaunch = 320;  // three words each
struct Runs {
  int32_t natural[kRunsPerLaunch], ranked[kRunsPerLaunch], length[kRunsPerLaunch];
};
// One block per run: index[natural + i] = ranked + i.
__global__ void expand_runs(int32_t* index, Runs runs) {
  const int b = blockIdx.x;
  for (int i = threadIdx.x; i < runs.length[b]; i += blockDim.x)
    index[runs.natural[b] + i] = runs.ranked[b] + i;
}

__global__ void move_rows(const uint4* src, uint4* dst, const int32_t* index, int64_t rows, int row_vecs,
                          bool to_natural) {
  const int64_t n = rows * row_vecs;
  for (int64_t x = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; x < n;
       x += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = x / row_vecs;
    const int c = static_cast<int>(x - row * row_vecs);
    const int64_t other = int64_t(__ldg(index + row)) * row_vecs + c;
    if (to_natural)
      dst[x] = src[other];
    else
      dst[other] = src[x];
  }
}

// natural [heads, rows] <-> ranked [W][heads][max_local].
__global__ void move_lse(const float* src, float* dst, const int32_t* index, int64_t heads, int64_t rows,
                         int64_t max_local, bool to_natural) {
  const int64_t n = heads * rows;
  for (int64_t x = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; x < n;
       x += int64_t(gridDim.x) * blockDim.x) {
    const int64_t h = x / rows, i = x - h * rows;
    const int64_t at = __ldg(index + i), s = at / max_local, local = at - s * max_local;
    const int64_t other = (s * heads + h) * max_local + local;
    if (to_natural)
      dst[x] = src[other];
    else
      dst[other] = src[x];
  }
}

template <class T>
__global__ void round_pairs(const float* src, T* dst, int64_t n) {
  for (int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * 2; i < n;
       i += int64_t(gridDim.x) * blockDim.x * 2)
    *reinterpret_cast<uint32_t*>(dst + i) = tile::pack2<T>(src[i], src[i + 1]);
}

int grid_for(int64_t n) {
  return static_cast<int>(std::clamp<int64_t>((n + 255) / 256, 1, 1056));
}

}  // namespace

int64_t max_local_rows(const RingLayout& L) {
  int64_t m = 0;
  for (int r = 0; r < L.world; ++r) m = std::max(m, L.local_rows(r));
  return m;
}

void reserve_collective_workspace(Communicator& comm, const std::vector<Plan>& collectives,
                                  cudaStream_t stream) {
  uint64_t need = 0;
  for (const Plan& p : collectives) need = std::max(need, p.workspace_bytes());
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  WEFT_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (need > 0) comm.workspace(need, capture != cudaStreamCaptureStatusNone);
}

void upload_words(int32_t* dst, const std::vector<int32_t>& words, cudaStream_t stream) {
  for (size_t at = 0; at < words.size(); at += kWordsPerLaunch) {
    const int n = static_cast<int>(std::min<size_t>(kWordsPerLaunch, words.size() - at));
    Words w{};
    std::copy_n(words.data() + at, n, w.w);
    detail::preload<&store_words>();
    store_words<<<1, 256, 0, stream>>>(dst + at, w, n);
    WEFT_CUDA_CHECK(cudaGetLastError());
  }
}

void write_rank_order_index(const RingLayout& L, int64_t max_local, int32_t* index, cudaStream_t stream) {
  const std::vector<RowRun> runs = ring_runs(L);
  for (size_t at = 0; at < runs.size(); at += kRunsPerLaunch) {
    const int n = static_cast<int>(std::min<size_t>(kRunsPerLaunch, runs.size() - at));
    Runs r{};
    for (int i = 0; i < n; ++i) {
      const RowRun& run = runs[at + i];
      r.natural[i] = static_cast<int32_t>(run.natural);
      r.ranked[i] = static_cast<int32_t>(run.rank * max_local + run.local);
      r.length[i] = static_cast<int32_t>(run.length);
    }
    detail::preload<&expand_runs>();
    expand_runs<<<n, 256, 0, stream>>>(index, r);
    WEFT_CUDA_CHECK(cudaGetLastError());
  }
}

void rows_to_natural(const void* ranked, void* natural, const int32_t* index, int64_t rows, size_t row_bytes,
                     cudaStream_t stream) {
  const int vecs = static_cast<int>(row_bytes / 16);
  detail::preload<&move_rows>();
  move_rows<<<grid_for(rows * vecs), 256, 0, stream>>>(static_cast<const uint4*>(ranked),
                                                       static_cast<uint4*>(natural), index, rows, vecs, true);
  WEFT_CUDA_CHECK(cudaGetLastError());
}

void rows_to_ranked(const void* natural, void* ranked, const int32_t* index, int64_t rows, size_t row_bytes,
                    cudaStream_t stream) {
  const int vecs = static_cast<int>(row_bytes / 16);
  detail::preload<&move_rows>();
  move_rows<<<grid_for(rows * vecs), 256, 0, stream>>>(static_cast<const uint4*>(natural),
                                                       static_cast<uint4*>(ranked), index, rows, vecs, false);
  WEFT_CUDA_CHECK(cudaGetLastError());
}

void lse_to_natural(const float* ranked, float* natural, const int32_t* index, int64_t heads, int64_t rows,
                    int64_t max_local, cudaStream_t stream) {
  detail::preload<&move_lse>();
  move_lse<<<grid_for(heads * rows), 256, 0, stream>>>(ranked, natural, index, heads, rows, max_local, true);
  WEFT_CUDA_CHECK(cudaGetLastError());
}

void lse_to_ranked(const float* natural, float* ranked, const int32_t* index, int64_t heads, int64_t rows,
                   int64_t max_local, cudaStream_t stream) {
  detail::preload<&move_lse>();
  move_lse<<<grid_for(heads * rows), 256, 0, stream>>>(natural, ranked, index, heads, rows, max_local, false);
  WEFT_CUDA_CHECK(cudaGetLastError());
}

void round_fp32(const float* src, void* dst, int64_t n, DType dtype, cudaStream_t stream) {
  if (n <= 0) return;
  detail::preload<&round_pairs<__half>>();
  detail::preload<&round_pairs<__nv_bfloat16>>();
  if (dtype == DType::kFP16)
    round_pairs<<<grid_for(n / 2), 256, 0, stream>>>(src, static_cast<__half*>(dst), n);
  else
    round_pairs<<<grid_for(n / 2), 256, 0, stream>>>(src, static_cast<__nv_bfloat16*>(dst), n);
  WEFT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace weft::ops
