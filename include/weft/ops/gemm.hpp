// weft::gemm: C = A.B on the current GPU with weft's own Hopper GEMM (bf16 in, fp32 accumulate, bf16 or f32
// out), the LCSC GEMM that the fused multi-GPU ops are built from. Host-only header.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "weft/dtype.hpp"  // C is kBF16 or kFP32
#include "weft/ops/activation_types.hpp"
#include "weft/ops/gemm_fp8_types.hpp"
#include "weft/ops/plan.hpp"
#include "weft/timeline.hpp"

namespace weft {

enum class BLayout {
  kKN,  // B is row-major [K,N]
  kNK,  // B is row-major [N,K]: an nn.Linear weight (C = A . B^T in that layout's terms)
};

enum class GemmStore {
  kStore,      // C = A.B
  kReduceAdd,  // C += A.B, element-wise in C's type (TMA reduce-add; several GPUs may add into one C)
};

struct GemmOptions {
  GemmStore store = GemmStore::kStore;
  // Row strides in elements; 0 means dense (A: K, B: K for kNK or N for kKN, C: N).
  int64_t lda = 0, ldb = 0, ldc = 0;
  int cluster = 0;     // CTAs per cluster sharing their B tile by TMA multicast: 0 auto (1), 1 or 2
  int tile_n = 0;      // output tile 128 x tile_n: 0 auto (by how well the tiles fill the SMs), 128 or 256
                       // (cluster 2: 256 only)
  int group_m = 0;     // tile rows (128 each) per band of the grouped tile order; 0: 16
  int start_tile = 0;  // rotates the tile order (fused ops give each rank its own start)
  int max_blocks = 0;  // cap on persistent compute blocks; 0: every SM
  bool zero_unused_rows = false;  // grouped_gemm only: C's rows past the last group's end are zeroed
  // grouped_gemm and grouped_gemm_fp8 only: the rows of each group that count (device int32 [groups]; null:
  // all). Group e still spans [group_end[e - 1], group_end[e]) (a fixed capacity, say); only its first
  // group_rows[e] rows are computed: tiles wholly past them are skipped (their C rows untouched), a tile they
  // end inside is computed whole (its C rows past the count hold no result); a count past the group's span
  // counts the span. The computed tiles are shared evenly by the blocks, wherever they lie. Not with a
  // scatter or dispatch, nor with the plain FP8 GEMM.
  const int32_t* group_rows = nullptr;
  // grouped_gemm only: Activation::kNone or kSwiGLU, applied by the epilogue. kSwiGLU: B's columns come in
  // blocks of 256, the first 128 of block b the gate and the last 128 the up projection of output columns
  // [128 b, 128 b + 128) (N a multiple of 256); C is [rows, N / 2] = silu(A.B_gate) * (A.B_up), from the
  // fp32 accumulators.
  Activation activation = Activation::kNone;
  TimelineBuffer* timeline = nullptr;  // non-null: the kernel records its phases there (weft/timeline.hpp)
};

// Enqueues C = A.B (or C += A.B) on `stream` for the current device.
//   a  [M,K] bf16, row-major (row stride lda)
//   b  bf16, [K,N] or [N,K] as b_layout says (row stride ldb)
//   c  [M,N] of c_type (kBF16 or kFP32), row-major (row stride ldc); may point into a peer's memory (a
//   symmetric-heap
//      buffer seen through Rank::at) for a remote store or reduce-add.
// Any M, N, K >= 1: partial tiles are handled. TMA needs 16-byte aligned base addresses and row strides
// that are multiples of 16 bytes (K, N divisible by 8 for bf16 rows, N by 4 for f32 rows); anything else
// throws weft::Error saying which operand and why, as does a GPU other than sm_90 (Hopper).
void gemm(const void* a, const void* b, void* c, int64_t m, int64_t n, int64_t k, BLayout b_layout,
          DType c_type, cudaStream_t stream, const GemmOptions& options = {});

// How weft::gemm runs a problem on the current device, without running it (weft/ops/plan.hpp: tiles,
// grid, shared memory). Validates the shape and options like gemm() does.
Plan gemm_plan(int64_t m, int64_t n, int64_t k, BLayout b_layout, DType c_type,
               const GemmOptions& options = {});

// FP8 operands' scales: fp32 device arrays whose shapes `kind` gives (weft/ops/gemm_fp8_types.hpp).
struct Fp8Scales {
  Fp8Scaling kind = Fp8Scaling::kTensor;
  const float* a = nullptr;
  const float* b = nullptr;
  // kBlock, where A's scale of row i and k-block j lies (one of the two strides, or neither):
  //   a_m_stride > 0 (at least M): M-major, at a[j * a_m_stride + i] (torch's layout for 1 x 128 blockwise
  //     scales: a [M, K / 128] view with strides (1, a_m_stride)); where TMA can copy them (a 16-byte
  //     aligned base, a stride of whole 16 bytes) they ride in the GEMM's pipeline, its fastest form;
  //   otherwise row-major, at a[i * a_row_stride + j] (a_row_stride 0: ceil(K / 128), dense; more: rows
  //     with room between, e.g. moe_dispatch_fp8's packed rows, MoeDispatchedFp8::scale_stride).
  int64_t a_m_stride = 0;
  int64_t a_row_stride = 0;
};

// Enqueues C = scaled (A . B^T) on `stream` for the current device, with FP8 operands
// (weft/ops/gemm_fp8.cuh):
//   a  [M,K] e4m3 or e5m2 (ab_type), row-major (row stride lda, in elements = bytes)
//   b  [N,K] e4m3 / e5m2, the same type as a: an nn.Linear weight (BLayout::kNK only: 8-bit wgmma reads
//      K-major operands only), row stride ldb
//   c  [M,N] bf16 or f32 (c_type), row stride ldc; stored or reduce-added (options.store)
// fp32 accumulation, promoted every 128 of K (DeepSeek-V3's recipe), so K = 16k stays within fp32 rounding
// of the exact sum of the scaled products. Any M, N >= 1 and K >= 1 with K (and the strides) a multiple of
// 16 bytes; options: store, lda / ldb / ldc, group_m, start_tile, max_blocks, timeline (tile_n, cluster
// and the grouped-only fields must stay 0 / default). Errors name the operand and the rule, as gemm()'s.
void gemm_fp8(const void* a, const void* b, void* c, int64_t m, int64_t n, int64_t k, Fp8Type ab_type,
              const Fp8Scales& scales, DType c_type, cudaStream_t stream, const GemmOptions& options = {});
Plan gemm_fp8_plan(int64_t m, int64_t n, int64_t k, Fp8Type ab_type, const Fp8Scales& scales, DType c_type,
                   const GemmOptions& options = {});

// Grouped FP8 GEMM (an MoE layer's experts on FP8 rows, DeepSeek-V3's recipe): A [rows, K] FP8 in `groups`
// groups back to back as grouped_gemm's (group_end: device int32, ascending, every end a multiple of 128;
// rows a multiple of 128, at least the last end; rows past it untouched), B [groups, N, K] FP8 (each group's
// K-major weight, stacked), C [rows, N] bf16 or f32: C's rows of group e = A's rows of group e times B_e^T,
// block scales only (scales.kind kBlock): scales.a A's [rows, ceil(K / 128)], row-major or M-major as
// Fp8Scales says (moe_dispatch_fp8's rows: a_row_stride = MoeDispatchedFp8::scale_stride), scales.b
// [groups, ceil(N / 128), ceil(K / 128)] row-major (quantize_fp8 of B as [groups x N, K] makes them where N
// is a multiple of 128). K a multiple of 16; options: lda (A's row stride in bytes, a multiple of 16: e.g.
// moe_dispatch_fp8's packed rows), group_m, max_blocks, timeline, group_rows (a low-latency dispatch's
// groups; B and C dense, C stored).
void grouped_gemm_fp8(const void* a, const void* b, void* c, const int32_t* group_end, int groups,
                      int64_t rows, int64_t n, int64_t k, Fp8Type ab_type, const Fp8Scales& scales,
                      DType c_type, cudaStream_t stream, const GemmOptions& options = {});
// (scales: the kind, the strides and the alignment of scales.a, which pick the path; no scale is read.)
Plan grouped_gemm_fp8_plan(int groups, int64_t rows, int64_t n, int64_t k, Fp8Type ab_type,
                           const Fp8Scales& scales, DType c_type, const GemmOptions& options = {});

// Which operand of gemm_fp8 a quantization makes: the kBlock scales are 1 x 128 groups along K for A and
// 128 x 128 blocks for B; the other kinds are the same for both (kRowCol: one per row of the operand).
enum class Fp8Operand { kA, kB };

// Enqueues out = in quantized to FP8 with the scales gemm_fp8 reads for `operand` (Fp8Scales{kind, ...}):
//   in      [rows, cols] bf16 or fp16 (in_type), row stride ld_in elements (0: cols)
//   out     [rows, cols] of out_type, row stride ld_out (0: cols): A [M,K] or B [N,K] of gemm_fp8
//   scales  fp32: kTensor [1]; kRowCol [rows]; kBlock: A [rows, ceil(cols / 128)], B [ceil(rows / 128),
//           ceil(cols / 128)], row-major; with scale_m_stride (kBlock, A only; >= rows) A's M-major: row i's
//           scale of group j at scales[j * scale_m_stride + i], Fp8Scales::a_m_stride's layout (a stride of
//           whole 16 bytes, rows rounded up to 4, and a 16-byte aligned base let gemm_fp8 copy them into its
//           pipeline); or with scale_row_stride (kBlock, A only; >= ceil(cols / 128)) rows of that many
//           floats: row i's at scales[i * scale_row_stride + j], Fp8Scales::a_row_stride's layout (e.g. each
//           row's scales behind its values in one packed row, as moe_dispatch_fp8 moves them)
// Each scale is amax / (the format's largest value: 448 e4m3, 57344 e5m2) over the elements it covers, each
// element x / scale rounded to nearest and saturated; so out x scale is in to FP8's precision.
void quantize_fp8(const void* in, DType in_type, void* out, Fp8Type out_type, float* scales, int64_t rows,
                  int64_t cols, Fp8Scaling kind, Fp8Operand operand, cudaStream_t stream, int64_t ld_in = 0,
                  int64_t ld_out = 0, int64_t scale_m_stride = 0, int64_t scale_row_stride = 0);

// The rows activate_quantize_fp8 writes: every row (group_rows null), or only the first group_rows[e] rows of
// each group e, rows [group_end[e - 1], group_end[e]) (device int32, ascending; a low-latency dispatch's
// groups: MoeDispatched::group_end, group_rows), the rest (and rows past the last end) left as they are.
struct Fp8QuantizeRows {
  const int32_t* group_end = nullptr;
  const int32_t* group_rows = nullptr;
  int groups = 0;
};
// Enqueues out = quantize_fp8(activation(in)) with A's 1 x 128 block scales, in one pass over in (an MoE
// expert's first GEMM output to the second FP8 GEMM's input, no bf16 intermediate):
//   in      [rows, in_cols] bf16 / fp16, row stride ld_in (0: in_cols); in_cols = 2 cols for kSwiGLU
//           ([gate | up]), cols otherwise
//   out     [rows, cols] of out_type, row stride ld_out (0: cols)
//   scales  A's block scales of out: row-major [rows, ceil(cols / 128)], or M-major with scale_m_stride
//           (>= rows; as quantize_fp8's)
// cols, ld_in and ld_out multiples of 4, in 8-byte and out 4-byte aligned (each lane of a warp moves four
// elements). Scales and values as quantize_fp8's of the activation computed in fp32 (the same bits as
// quantize_fp8 of a bf16 activation only where that rounding does not move an element).
void activate_quantize_fp8(const void* in, DType in_type, Activation activation, void* out, Fp8Type out_type,
                           float* scales, int64_t rows, int64_t cols, cudaStream_t stream, int64_t ld_in = 0,
                           int64_t ld_out = 0, int64_t scale_m_stride = 0, const Fp8QuantizeRows& which = {});

// Grouped GEMM (an MoE layer's experts on one GPU): A's rows come in `groups` groups back to back, group e
// being rows [group_end[e - 1], group_end[e]) (group_end: device int32 array, ascending, every end a multiple
// of 128, e.g. the dispatch's rows padded per expert), and C's rows of group e = A's rows of group e times
// B_e. b is [groups, N, K] (b_layout kNK: nn.Linear weights) or [groups, K, N] (kKN), bf16, dense. `rows` is
// A's and C's row count (a multiple of 128, at least the last group's end); rows past that end are left as
// they are (or zeroed, with options.zero_unused_rows). The counts stay on the GPU: nothing synchronises. An
// end that is not a multiple of 128 traps the kernel. options: tile_n, group_m and max_blocks as for gemm;
// cluster 1, dense strides, store only.
void grouped_gemm(const void* a, const void* b, void* c, const int32_t* group_end, int groups, int64_t rows,
                  int64_t n, int64_t k, BLayout b_layout, DType c_type, cudaStream_t stream,
                  const GemmOptions& options = {});
// How grouped_gemm runs a problem on the current device, without running it (tiles, grid, shared memory;
// the group ends are read on the GPU, so the plan holds for any counts). Validates the shape and options as
// grouped_gemm() does.
Plan grouped_gemm_plan(int groups, int64_t rows, int64_t n, int64_t k, BLayout b_layout, DType c_type,
                       const GemmOptions& options = {});

}  // namespace weft
