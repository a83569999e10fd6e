// What the two ring attention backward launchers share (src/ops/ring_attention_backward.cu: the queries
// travelling; ring_attention_backward_kv.cu: the keys travelling): the call's tensors, this rank's query
// ranges (their per-row terms' layout) with their upload and the prepare kernel over them, and the
// workspace's size over every rank and both shardings.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "ring_attention_plan.hpp"
#include "sequence_parallel.hpp"
#include "weft/ops/attention_backward.cuh"
#include "weft/runtime/error.hpp"
#include "weft/runtime/kernel_preload.hpp"

namespace weft::ops {

struct RingBackwardTensors {
  const void *q, *k, *v, *out, *dout;
  const float* lse;
  void *dq, *dk, *dv;
};

// This rank's query ranges that backward passes meet (ring_query_ranges): a range beginning at local row x
// keeps its rows' terms (LSE x log2 e, D) from term row 4 x on.
struct RingQueryRanges {
  std::vector<std::pair<int64_t, int64_t>> ranges;
  int64_t longest = 1;
  RingQueryRanges(const RingLayout& L, int r) : ranges(ring_query_ranges(L, r)) {
    for (const auto& [b, e] : ranges) longest = std::max(longest, e - b);
  }
  int64_t count() const { return static_cast<int64_t>(ranges.size()); }
  size_t words_bytes() const { return (2 * ranges.size() + 1) * 4; }  // begins, then ends (device int32)
  void upload(int32_t* words, cudaStream_t stream) const {
    const int64_t n = count();
    if (n == 0) return;
    std::vector<int32_t> w(2 * n);
    for (int64_t i = 0; i < n; ++i) {
      w[i] = static_cast<int32_t>(ranges[i].first);
      w[n + i] = static_cast<int32_t>(ranges[i].second);
    }
    upload_words(words, w, stream);
  }
  // The prepare kernel over the uploaded ranges (the single-GPU backward's, the ranges as packed sequences):
  // LSE x log2 e into lse_terms and D into dsum_terms, each [heads][term_stride].
  template <int kD, class T>
  void prepare(const int32_t* words, int64_t local, int64_t heads, int64_t term_stride,
               const RingBackwardTensors& b, float* lse_terms, float* dsum_terms, cudaStream_t stream) const {
    const int64_t n = count();
    if (n == 0) return;
    const AttentionRows rows{words,
                             words + n,
                             words,
                             words + n,
                             static_cast<int>(longest),
                             static_cast<int>(longest),
                             static_cast<int>(local)};
    constexpr int kThreads = 256;
    const int64_t grid = (n * longest * heads * 32 + kThreads - 1) / kThreads;
    detail::preload<&attention_bwd_prepare<kD, T>>();
    attention_bwd_prepare<kD, T><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
        static_cast<const T*>(b.out), static_cast<const T*>(b.dout), b.lse, lse_terms, dsum_terms, rows,
        static_cast<int>(n), static_cast<int>(heads), static_cast<int>(term_stride));
    WEFT_CUDA_CHECK(cudaGetLastError());
  }
};

// The most of bytes(rank, sharding) over every rank and both shardings of `causal` (a workspace sized once
// serves every rank and either layout a call may take).
template <class F>
size_t ring_most_bytes(int world, bool causal, F&& bytes) {
  size_t most = 0;
  for (int r = 0; r < world; ++r)
    for (const Sharding s : Sharding(causal).both()) most = std::max(most, size_t(bytes(r, s)));
  return most;
}

}  // namespace weft::ops
