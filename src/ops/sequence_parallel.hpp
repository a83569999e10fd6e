// What the sequence-parallel attention ops (context_attention.cu, ulysses_attention.cu) share: the layout's
// device form and the row moves between rank order and natural order. Rank order: every rank's local rows
// padded to the longest rank's count (`max_local`), rank s's local row x at s * max_local + x (what an
// all-gather or all-to-all of padded shards gives); natural order: the packed sequence's rows
// (ring_tokens' positions). Everything here is enqueued on a stream without host synchronization and from
// no pageable memory, so it can be captured in CUDA graphs.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "ring_attention_plan.hpp"
#include "weft/dtype.hpp"
#include "weft/ops/plan.hpp"
#include "weft/runtime/communicator.hpp"

namespace weft::ops {

inline size_t round256(size_t b) {
  return (b + 255) / 256 * 256;
}

int64_t max_local_rows(const RingLayout& L);

// Grows the communicator's shared workspace to what the largest of an op's collective calls needs, before
// the op enqueues any of them. In single-process mode the first rank's call grows it for every local rank:
// growing between two collectives of one op would leave ranks that already enqueued the first on the old
// buffer and the others on the new one.
void reserve_collective_workspace(Communicator& comm, const std::vector<Plan>& collectives,
                                  cudaStream_t stream);

// Writes `words` to device memory at `dst` through kernel arguments (no host buffer has to outlive the
// call; a graph captures the values).
void upload_words(int32_t* dst, const std::vector<int32_t>& words, cudaStream_t stream);

// index[natural row] = its rank-order row, for the whole sequence (sum of doc_length entries), built on the
// device from the layout's runs.
void write_rank_order_index(const RingLayout& L, int64_t max_local, int32_t* index, cudaStream_t stream);

// Row moves by that index, `row_bytes` (a multiple of 16) per row, `rows` natural rows:
//   to_natural:  natural[i] = ranked[index[i]]
//   to_ranked:   ranked[index[i]] = natural[i]   (rank-order padding rows untouched)
void rows_to_natural(const void* ranked, void* natural, const int32_t* index, int64_t rows, size_t row_bytes,
                     cudaStream_t stream);
void rows_to_ranked(const void* natural, void* ranked, const int32_t* index, int64_t rows, size_t row_bytes,
                    cudaStream_t stream);

// Per-head rows of fp32 (LSE): natural [heads, rows] and rank order [W][heads][max_local].
void lse_to_natural(const float* ranked, float* natural, const int32_t* index, int64_t heads, int64_t rows,
                    int64_t max_local, cudaStream_t stream);
void lse_to_ranked(const float* natural, float* ranked, const int32_t* index, int64_t heads, int64_t rows,
                   int64_t max_local, cudaStream_t stream);

// fp32 -> bf16 / fp16, n elements (even).
void round_fp32(const float* src, void* dst, int64_t n, DType dtype, cudaStream_t stream);

}  // namespace weft::ops
