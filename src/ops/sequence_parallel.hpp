// What the sequence-parallel attention ops (context_attention.cu, ulysses_attention.cu) share: the layout's
// device form and the moves of rows between a rank's local rows (ring layout) and natural-order buffers
// (the packed sequence's rows, ring_tokens' positions) in the ranks' symmetric heaps. Kernels push straight
// into the peers' buffers and pull straight from them: one pass over the data, no staging. Everything is
// enqueued without host synchronization and from no pageable memory, so it can be captured in CUDA graphs.
//
// Ordering. push_rows meets the team before it writes (every peer is done with the buffers of its previous
// call: its kernels before this one on its stream have finished) and after (every push into this rank has
// landed). pull_rows meets before it reads (every peer's kernels before it, e.g. the attention that wrote the
// buffer, have finished). push_lse / pull_lse do not meet: they go between push_rows calls / after a
// pull_rows, whose meetings order them.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "op_args.hpp"
#include "ring_attention_plan.hpp"
#include "weft/dtype.hpp"
#include "weft/ops/attention.hpp"
#include "weft/runtime/communicator.hpp"

namespace weft::ops {

int64_t max_local_rows(const RingLayout& L);

// The layout a call's options ask for (AttentionOptions::contiguous_shards).
inline Sharding sharding_of(const AttentionOptions& o) {
  return {o.causal, !o.contiguous_shards};
}

// Writes `words` to device memory at `dst` through kernel arguments (no host buffer has to outlive the
// call; a graph captures the values).
void upload_words(int32_t* dst, const std::vector<int32_t>& words, cudaStream_t stream);

// natural[x] = the natural row of rank r's local row x, for its L.local_rows(r) rows.
void write_local_to_natural(const RingLayout& L, int r, int32_t* natural, cudaStream_t stream);
// index[run.local + i] = run.natural + i for the runs (in local order, back to back).
void write_row_index(const std::vector<RowRun>& runs, int32_t* index, cudaStream_t stream);

// The operands of a sequence-parallel attention call on this rank's `local` rows (none checked when it has
// none): q, out [local][heads][head_dim] and k, v [local][kv_heads][head_dim], 16-bit; lse [heads][local]
// fp32 (the forward's: optional). The backward's adds dout, dq (q's shape), dk, dv (k's) and needs lse.
struct AttentionOperands {
  const void *q, *k, *v, *out;
  const float* lse;
  const void *dout = nullptr, *dq = nullptr, *dk = nullptr, *dv = nullptr;
};
inline void check_attention_operands(const OpCall& call, const AttentionOperands& x, bool backward,
                                     int64_t local, int64_t heads, int64_t kv_heads, int64_t head_dim) {
  if (local == 0) return;
  const uint64_t q_bytes = uint64_t(local * heads * head_dim) * 2;
  const uint64_t kv_bytes = uint64_t(local * kv_heads * head_dim) * 2;
  call.check_buffer(x.q, "q", q_bytes);
  call.check_buffer(x.k, "k", kv_bytes);
  call.check_buffer(x.v, "v", kv_bytes);
  call.check_buffer(x.out, "out", q_bytes);
  if (backward) {
    call.check_buffer(x.dout, "dout", q_bytes);
    call.check_buffer(x.dq, "dq", q_bytes);
    call.check_buffer(x.dk, "dk", kv_bytes);
    call.check_buffer(x.dv, "dv", kv_bytes);
    if (x.lse == nullptr) call.fail("lse (the forward's log-sum-exp) is required");
  }
  if (x.lse != nullptr) call.check_buffer(x.lse, "lse", uint64_t(local * heads) * 4, 4);
}

// Ring attention over a layout of grain `grain` (RingLayout::grain; the public ring ops are grain 1): the
// hybrid of Ulysses and ring attention runs it on its ring sub-teams. Its errors name the caller: `op`, and
// `sizing`, the function that sizes the caller's workspace. `plan`: the caller's plan (weft/ops/plan.hpp),
// into which the ring records its workspace area, kernel and path and launches nothing; null for a call.
struct RingCaller {
  const char *op, *sizing;
  Plan* plan = nullptr;
};
size_t ring_forward_workspace_bytes(int world, const std::vector<int64_t>& doc_lengths, bool causal,
                                    int64_t kv_heads, int64_t head_dim, int grain);
void ring_forward(Communicator& comm, Rank& rank, const void* q, const void* k, const void* v, void* out,
                  float* lse, const std::vector<int64_t>& doc_lengths, int64_t heads, int64_t kv_heads,
                  int64_t head_dim, void* workspace, size_t workspace_bytes, DType dtype, cudaStream_t stream,
                  const AttentionOptions& options, int grain, const RingCaller& caller);
size_t ring_backward_workspace_bytes(int world, const std::vector<int64_t>& doc_lengths, bool causal,
                                     int64_t heads, int64_t kv_heads, int64_t head_dim, int grain);
void ring_backward(Communicator& comm, Rank& rank, const void* q, const void* k, const void* v,
                   const void* out, const void* dout, const float* lse, void* dq, void* dk, void* dv,
                   const std::vector<int64_t>& doc_lengths, int64_t heads, int64_t kv_heads, int64_t head_dim,
                   void* workspace, size_t workspace_bytes, DType dtype, cudaStream_t stream,
                   const AttentionOptions& options, int grain, const RingCaller& caller);

// Which heads of a row of `groups` heads rank j holds in the natural-order buffers: [first(j), first(j) +
// width) with first(j) = j * groups / W (Ulysses' head groups; with fewer heads than ranks W / groups
// ranks share one), or all of them on every rank (`replicate`: the all-gather of K / V).
struct HeadShare {
  int64_t groups = 0, width = 0;
  bool replicate = false;
  static HeadShare split(int64_t groups, int world) {
    return {groups, std::max<int64_t>(1, groups / world), false};
  }
  static HeadShare all(int64_t groups) { return {groups, groups, true}; }
};

// Every rank's copy of `natural` ([total][share.width][head_dim], 16-bit, this rank's pointer into its
// symmetric heap) gets rows local_nat[x] of this rank's rows `src` ([n][share.groups][head_dim]), its heads.
void push_rows(Communicator& comm, Rank& rank, const void* src, int64_t n, void* natural,
               const int32_t* local_nat, const HeadShare& share, int64_t head_dim, int64_t max_local,
               cudaStream_t stream);
// This rank's rows `dst` ([n][share.groups][head_dim], 16-bit `dtype`) from rows local_nat[x] of every
// rank's copy of `natural` ([total][share.width][head_dim], 16-bit `dtype` or fp32), a head summed over
// the ranks that hold it (in fp32, rounded once).
void pull_rows(Communicator& comm, Rank& rank, const void* natural, bool natural_fp32, void* dst, int64_t n,
               const int32_t* local_nat, const HeadShare& share, int64_t head_dim, int64_t max_local,
               DType dtype, cudaStream_t stream);
// LSE between this rank's [heads][n] and every rank's natural [heads / W][total] (fp32; Ulysses' heads).
void push_lse(const Rank& rank, const float* lse, int64_t n, float* natural, const int32_t* local_nat,
              int64_t heads, int64_t total, cudaStream_t stream);
void pull_lse(const Rank& rank, const float* natural, float* lse, int64_t n, const int32_t* local_nat,
              int64_t heads, int64_t total, cudaStream_t stream);

}  // namespace weft::ops
