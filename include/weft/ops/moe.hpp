// weft::moe_dispatch: the token exchange of an expert-parallel MoE layer (experts split evenly over the
// team: rank r holds experts [r E / W, (r + 1) E / W)). Each rank routes its tokens to top-k experts; a token
// travels once to each rank that holds any of its experts, and there fills one row of each of its experts'
// row groups. The layout (src/ops/moe_layout.hpp: groups by local expert, each padded to `align` rows;
// within a group rows by source rank, then token order) is computed on the device, with no host
// synchronisation, so a dispatch can be captured in a CUDA graph. Host-only header.
//
// Every rank of the team calls it with the same shape apart from `tokens` (single-process: once per local
// rank). tokens: [tokens, hidden] bf16 / fp16 device rows; experts: [tokens, top_k] int32 global expert ids
// on the device (-1: a dropped slot; one expert may appear twice). Buffers are sized for the worst case
// (max_tokens from every rank routed to this rank's experts), so no count has to reach the host.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "weft/dtype.hpp"
#include "weft/ops/gemm.hpp"
#include "weft/runtime/communicator.hpp"

namespace weft {

struct MoeShape {
  int64_t tokens = 0;      // this rank's tokens, 0..max_tokens
  int64_t max_tokens = 0;  // the most any rank passes: the same on every rank
  int64_t hidden = 0;      // a multiple of 8
  int num_experts = 0;     // a multiple of the world size
  int top_k = 0;           // 1..16
  int align = 128;         // each local expert's rows padded to a multiple of this (grouped GEMM tiles)
  // Padding rows zeroed: a backward meets them (a weight's gradient rows^T . dY, dY zero there, must not
  // meet NaN). false leaves them as they are for inference, where nothing reads their products (combine
  // reads the slots' rows only): at decode sizes the padding is most of the rows (a few rows an expert
  // against align 128), and zeroing it most of the dispatch's time.
  bool zero_padding = true;
  // The low-latency dispatch (decode batches): every local expert gets a group of fixed capacity, W x
  // max_tokens rows rounded up to 128, group e at e x that (moe_capacity() is then experts per rank times
  // it), filled from its start by one system-scope atomic per (token, expert) at the expert's rank: no count
  // exchange and no meeting before the rows move, one wait at the end for every rank's rows. A token crosses
  // to each rank holding any of its experts once (not once per expert) and is copied there into its other
  // rows. Groups are not padded (align is ignored): grouped_gemm runs over them with options.group_rows =
  // dispatched.group_rows (only the filled rows count; grouped_gemm_fp8 likewise on moe_dispatch_fp8's
  // rows). For inference: moe_combine takes its handle as the other's; not moe_combine_backward, the
  // dispatch inside the first GEMM, moe_counts, moe_grouped_gemm_combine nor the hierarchical MoE. A token
  // names each expert at most once (more rows than a group holds trap the kernel). A rank's next low-latency
  // dispatch may write into the groups as soon as every rank's rows of this one are in place: run moe_combine
  // (whose meeting follows every rank's expert GEMMs) in between, and not two low-latency dispatches of one
  // team at once. Every block of its kernel waits for the peers, so its grid is sized to be resident at once
  // on the rank's SM budget: a kernel of another stream holding those SMs delays it (up to the wait's
  // timeout).
  bool low_latency = false;
};

// What a dispatch leaves on this rank (device pointers). rows and group_end live in the communicator's
// workspace area "moe dispatch" and stay valid until the next dispatch on the team; row_of lives in the
// caller's workspace (with a copy of the expert ids).
struct MoeDispatched {
  const void* rows = nullptr;  // [capacity, hidden]: this rank's experts' rows, groups back to back
  const int32_t* group_end =
      nullptr;                       // [experts per rank]: each group's padded end (grouped_gemm's group_end)
  const int32_t* row_of = nullptr;   // [tokens, top_k]: the row each slot filled on its expert's rank, -1
                                     // for a dropped slot (combine reads the expert outputs there)
  const int32_t* experts = nullptr;  // [tokens, top_k]: the dispatch's expert ids, kept for combine
  int64_t capacity = 0;              // rows of `rows`: the worst case, a multiple of align (low_latency:
                                     // of 128)
  const int32_t* row_source = nullptr;  // [capacity]: per row, source * max_tokens * top_k + the slot
                                        // (token * top_k + j) it holds; -1 for a padding row
  const int32_t* counts = nullptr;      // [world][num_experts + 1]: each source's rows per expert, then its
                                        // token count (the layout's input, in the dispatch area)
  const int32_t* group_rows = nullptr;  // low_latency: [experts per rank] the rows each group received
                                        // (grouped_gemm's options.group_rows); row_source and counts null
};

// The dispatch and the first expert GEMM in one kernel: what moe_dispatch does (the same rows in the same
// places, the same handle), and c = rows . b_e per group as weft::grouped_gemm over the capacity (rows past
// the last group's end untouched), where each 128-row tile's GEMM starts once its rows have landed; the rows
// move in the idle warps of the GEMM's loader warpgroups. b: the local experts' weights [experts per rank,
// n, hidden] (BLayout::kNK) or [experts per rank, hidden, n] (kKN), bf16; c: [capacity, n] bf16, or
// [capacity, n / 2] with Activation::kSwiGLU (n a multiple of 256; weft::grouped_gemm's SwiGLU epilogue).
// Tokens bf16; align a multiple of 128. The kernel waits for peers, so it runs within the rank's SM budget
// (Options::sm_budget). The unfused pair (moe_dispatch, then grouped_gemm) stays the other choice, and the
// faster one where ranks share a GPU (virtual ranks: 0.54-0.84x of its speed at W = 8 .. 2,
// bench/RESULTS.md), since there every rank's GEMM runs at once on its share of the SMs and the ranks'
// weights share one L2.
MoeDispatched moe_dispatch_grouped_gemm(Communicator& comm, Rank& rank, const void* tokens,
                                        const int32_t* experts, const MoeShape& shape, void* workspace,
                                        size_t workspace_bytes, const void* b, BLayout b_layout, int64_t n,
                                        Activation activation, void* c, cudaStream_t stream = nullptr);
// What the call would do (weft/ops/plan.hpp: the communicator workspace areas it uses, its path, the grid,
// tiles and shared memory of its main kernel), or the weft::Error it would throw; the same arguments,
// nothing launched. Likewise the _plan of each op below.
Plan moe_dispatch_grouped_gemm_plan(Communicator& comm, Rank& rank, const void* tokens,
                                    const int32_t* experts, const MoeShape& shape, void* workspace,
                                    size_t workspace_bytes, const void* b, BLayout b_layout, int64_t n,
                                    Activation activation, void* c, cudaStream_t stream = nullptr);

// What a dispatch delivered to this rank, read back to the host (synchronises `stream`: the exact-count
// mode, not for CUDA graphs): per local expert the rows its group received (before padding) and the
// group's padded end; `rows`, the rows in use (the last end), so the expert GEMMs and what follows them can
// run over those rows instead of the worst-case capacity. Single-process teams: call it once every local
// rank's dispatch is queued (the dispatch waits on the GPU for its peers').
struct MoeCounts {
  std::vector<int64_t> expert_rows, group_end;
  int64_t rows = 0;
};
MoeCounts moe_counts(Rank& rank, const MoeDispatched& dispatched, const MoeShape& shape,
                     cudaStream_t stream = nullptr);

// Rows an expert buffer holds at most: every rank's max_tokens, each in up to top_k groups (an expert may be
// named twice), plus each group's padding.
int64_t moe_capacity(int world, const MoeShape& shape);
// The caller's workspace (device memory, 256-byte aligned) of a dispatch.
size_t moe_dispatch_workspace_bytes(int world, const MoeShape& shape);

MoeDispatched moe_dispatch(Communicator& comm, Rank& rank, const void* tokens, const int32_t* experts,
                           const MoeShape& shape, void* workspace, size_t workspace_bytes, DType dtype,
                           cudaStream_t stream = nullptr);
Plan moe_dispatch_plan(Communicator& comm, Rank& rank, const void* tokens, const int32_t* experts,
                       const MoeShape& shape, void* workspace, size_t workspace_bytes, DType dtype,
                       cudaStream_t stream = nullptr);

// The dispatch with FP8 tokens (DeepSeek-V3's recipe: about half the bytes on the links): this rank's tokens
// (bf16 / fp16, hidden a multiple of 16) quantized to e4m3 with 1 x 128 block scales (quantize_fp8's A
// scales), each row travelling with its scales in one packed row of row_bytes = hidden + 4 ceil(hidden /
// 128) bytes rounded up to 16: the values, then the fp32 scales. The rows land as moe_dispatch's do (the same
// places, groups and handle: dispatched.rows are the packed rows, and moe_combine takes this handle with the
// shape of hidden elements); grouped_gemm_fp8 reads them in place (A = values with lda = row_bytes, the
// scales block_scales(the experts' B scales); with MoeShape::low_latency, options.group_rows =
// dispatched.group_rows). The workspace: moe_dispatch_fp8_workspace_bytes().
struct MoeDispatchedFp8 {
  MoeDispatched dispatched;
  const uint8_t* values = nullptr;  // [capacity] rows of row_bytes: hidden e4m3 values each
  const float* scales = nullptr;    // each row's ceil(hidden / 128) scales, at values + hidden
  int64_t row_bytes = 0;
  int64_t scale_stride = 0;  // row_bytes / 4: floats from one row's scales to the next's
  // The rows' scales as grouped_gemm_fp8's A scales (row-major, a_row_stride = scale_stride), with b_scales.
  Fp8Scales block_scales(const float* b_scales) const {
    Fp8Scales s{Fp8Scaling::kBlock, scales, b_scales};
    s.a_row_stride = scale_stride;
    return s;
  }
};
size_t moe_dispatch_fp8_workspace_bytes(int world, const MoeShape& shape);
MoeDispatchedFp8 moe_dispatch_fp8(Communicator& comm, Rank& rank, const void* tokens, const int32_t* experts,
                                  const MoeShape& shape, void* workspace, size_t workspace_bytes, DType dtype,
                                  cudaStream_t stream = nullptr);
Plan moe_dispatch_fp8_plan(Communicator& comm, Rank& rank, const void* tokens, const int32_t* experts,
                           const MoeShape& shape, void* workspace, size_t workspace_bytes, DType dtype,
                           cudaStream_t stream = nullptr);

// Combine: out[t] = sum over j of weights[t, j] * (the expert output at row_of[t, j] on expert e_j's rank),
// in fp32 in ascending j (deterministic), rounded once to dtype; a token with every slot dropped gets zeros.
// The experts' outputs must be where every rank can read them: the buffer moe_combine_input() gives
// ([capacity, hidden] of dtype in the communicator's workspace area "moe combine", or for a low-latency
// dispatch's handle an area of its own; e.g. grouped_gemm's c). With a low-latency handle expert_out may
// also be any device memory in that layout: the rows its groups received (group_rows) are copied there
// first, not the worst-case capacity.
// `dispatched` is the dispatch's handle (its row_of), weights [tokens, top_k] fp32 and out [tokens, hidden]
// device memory. Every rank calls it (single-process: once per local rank) after writing its experts'
// outputs on the same stream. No meeting ends a combine (peers may still read this rank's area after its
// kernel): write the area again only after a dispatch or a moe_combine_backward of the team. Two
// micro-batches interleaved (dispatch A, dispatch B, combine A, combine B: two-batch overlap) run on two
// lanes of the team (Communicator::subteam(rank, W, 1, 1) for B: areas and flags of its own); on one lane
// B's rows and outputs would land on A's.
void* moe_combine_input(Communicator& comm, Rank& rank, const MoeShape& shape, DType dtype);
void moe_combine(Communicator& comm, Rank& rank, const void* expert_out, const MoeDispatched& dispatched,
                 const float* weights, void* out, const MoeShape& shape, DType dtype,
                 cudaStream_t stream = nullptr);
Plan moe_combine_plan(Communicator& comm, Rank& rank, const void* expert_out, const MoeDispatched& dispatched,
                      const float* weights, void* out, const MoeShape& shape, DType dtype,
                      cudaStream_t stream = nullptr);

// The backward of moe_combine, from dout [tokens, hidden] (the gradient of combine's out on this rank):
//   d_expert_out, [capacity, hidden] of dtype in dispatched.rows' layout (the buffer moe_combine_grad_input()
//     gives, symmetric: the token's rank writes each row): row_of[t, j] on expert e_j's rank holds
//     weights[t, j] * dout[t]; rows no slot fills hold zeros;
//   d_weights [tokens, top_k] fp32: <dout[t], the expert output of slot j> (0 for a dropped slot).
// expert_out: the forward's expert outputs, [expert_rows, hidden] of dtype in dispatched.rows' layout
// (expert_rows: the capacity, or the exact-count rows in use), in any device memory (16-byte aligned; not
// written): the call first meets the team, so that every peer's earlier combine has stopped reading this
// rank's combine area (no meeting ends a combine), then copies them there (moe_combine_input()'s buffer,
// whose contents it overwrites) for the peers to read (passing that buffer itself skips the copy; written
// there by the caller, it races with a peer's earlier combine unless a dispatch or another
// moe_combine_backward came between). Its last meeting ends every peer's reads of the area: a moe_combine
// may write its input there next. Every rank calls it (single-process: once per local rank). The gradient
// of the dispatched rows' tokens is then moe_combine of their gradient with weights 1 (the dispatch's
// backward).
void* moe_combine_grad_input(Communicator& comm, Rank& rank, const MoeShape& shape, DType dtype);
void moe_combine_backward(Communicator& comm, Rank& rank, const void* expert_out, int64_t expert_rows,
                          const MoeDispatched& dispatched, const float* weights, const void* dout,
                          void* d_expert_out, float* d_weights, const MoeShape& shape, DType dtype,
                          cudaStream_t stream = nullptr);
Plan moe_combine_backward_plan(Communicator& comm, Rank& rank, const void* expert_out, int64_t expert_rows,
                               const MoeDispatched& dispatched, const float* weights, const void* dout,
                               void* d_expert_out, float* d_weights, const MoeShape& shape, DType dtype,
                               cudaStream_t stream = nullptr);

// The second expert GEMM and the combine in one (the unfused path: grouped_gemm into moe_combine_input(),
// then moe_combine): out = combine of (a . b_e per group), where a [rows, inter] holds this rank's experts'
// rows in the dispatch's layout (rows: a multiple of 128 up to the capacity, at least the last group's end)
// and b the experts' weights [experts per rank, hidden, inter] (BLayout::kNK) or [experts per rank, inter,
// hidden] (kKN), bf16. The GEMM's epilogue sends each output row straight to the rank and slot it was
// dispatched from (MoeDispatched::row_source) into that rank's staging area ("moe combine staging",
// [max_tokens * top_k, hidden] bf16); after a meeting each rank sums its tokens' slots as moe_combine does
// (fp32, ascending j: the same results). bf16 only. Every rank calls it.
void moe_grouped_gemm_combine(Communicator& comm, Rank& rank, const void* a, const void* b, BLayout b_layout,
                              int64_t rows, int64_t inter, const MoeDispatched& dispatched,
                              const float* weights, void* out, const MoeShape& shape,
                              cudaStream_t stream = nullptr);
Plan moe_grouped_gemm_combine_plan(Communicator& comm, Rank& rank, const void* a, const void* b,
                                   BLayout b_layout, int64_t rows, int64_t inter,
                                   const MoeDispatched& dispatched, const float* weights, void* out,
                                   const MoeShape& shape, cudaStream_t stream = nullptr);

}  // namespace weft
