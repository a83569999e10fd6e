// weft::flash_decode: attention of a few new tokens per sequence over a KV cache held on one GPU or
// sharded over the team (context-parallel decoding), with flash-attn's flash_attn_with_kvcache conventions.
// One kernel per rank: split-KV partials over its part of every sequence's cache (the query heads of a KV
// head together, so each cached byte is read once), pushed with their log-sum-exps to every rank, and merged
// on every rank as they land (the output is replicated), or pushed to one rank and merged there
// (DecodeOptions::out_rank). No other kernel, no barrier, no host synchronisation: CUDA-graph capturable with
// lengths that change between replays. Host-only header.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "weft/dtype.hpp"
#include "weft/ops/plan.hpp"
#include "weft/runtime/communicator.hpp"

namespace weft {

struct DecodeShape {
  int64_t batch = 0;  // sequences
  int64_t q_len = 1;  // new tokens per sequence (their queries), >= 1
  int64_t heads = 0;  // query heads, a multiple of kv_heads (GQA; kv_heads 1: MQA)
  int64_t kv_heads = 0;
  int64_t head_dim = 128;  // 64 or 128
  // Tokens a sequence's cache holds at most on any rank: the contiguous cache's second dimension, or
  // max_blocks x block_size for a paged one. The same on every rank (it sizes the split of the work).
  int64_t max_local = 0;
};

// This rank's part of the cache, device memory.
struct DecodeCache {
  // Contiguous (block_table null): k, v [batch, max_local, kv_heads, head_dim]. Paged: k, v [num_blocks,
  // block_size, kv_heads, head_dim] and block_table [batch, max_blocks] (int32 block ids).
  const void* k = nullptr;
  const void* v = nullptr;
  const int32_t* block_table = nullptr;
  int64_t block_size = 0, max_blocks = 0, num_blocks = 0;
  const int32_t* seqlens =
      nullptr;  // [batch]: the tokens of each sequence's cache on this rank, 0..max_local
  // For causal masking among the q_len new tokens (DecodeOptions::causal): [batch] the global position of
  // this rank's first cached token (null: 0) and the sequence's whole length, the new tokens included (null:
  // seqlens, the team-of-one case where this rank holds the whole sequence). The queries are the last
  // q_len positions; query i sees the keys at positions <= seq_total - q_len + i.
  const int32_t* offsets = nullptr;
  const int32_t* seq_total = nullptr;
};

struct DecodeOptions {
  float scale = 0.f;   // softmax scale; 0: 1 / sqrt(head_dim)
  bool causal = true;  // among the new tokens (no effect at q_len 1)
  // -1: out and lse on every rank. A rank r: on rank r alone (the others push their partials there and
  // merge nothing: 1 / W of the pushes, and no merge work off r; their out and lse are not written and may
  // be null). The same on every rank of a call; calls may change it.
  int out_rank = -1;
};

// q [batch, q_len, heads, head_dim] (the same on every rank), out likewise (written on every rank, or on
// options.out_rank), lse [batch, q_len, heads] fp32 (natural log; null: not written). bf16 or fp16. Every
// rank of the team calls it (single-process: once per local rank) with the same shape. A sequence whose whole
// cache is empty gets zeros and an lse of -inf. Errors (shape, dtype, alignment, a length past the capacity,
// a block id out of range) are refused on the host where it can see them; lengths and block ids live on the
// device and fail the call there (reported by Communicator::synchronize()).
void flash_decode(Communicator& comm, Rank& rank, const void* q, const DecodeCache& cache, void* out,
                  float* lse, const DecodeShape& shape, DType dtype, cudaStream_t stream = nullptr,
                  const DecodeOptions& options = {});

// What flash_decode would do with these arguments, without doing it (weft/ops/plan.hpp: the workspace areas
// it uses, the grid), or the weft::Error it would throw.
Plan flash_decode_plan(Communicator& comm, Rank& rank, const void* q, const DecodeCache& cache, void* out,
                       float* lse, const DecodeShape& shape, DType dtype, cudaStream_t stream = nullptr,
                       const DecodeOptions& options = {});

}  // namespace weft
