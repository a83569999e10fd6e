// Fused tensor-parallel ops: communication overlapped with the GEMM inside one kernel (unicast NVLink only).
//
//   all_gather_matmul      A sharded along M ([M/W, K] on each rank) gathered and multiplied by this rank's
//                          B ([K, N] or an [N, K] weight): out [M, N] on each rank; optionally also the
//                          gathered A [M, K]. Inter-SM overlap: communicator blocks push A chunks to every
//                          rank and signal them; the GEMM's loader waits per chunk (local rows first).
//   matmul_reduce_scatter  A [M, K] . B ([K, N] or [N, K]) summed over ranks; rank r gets rows
//                          r*M/W..(r+1)*M/W of the [M, N] sum. Intra-SM overlap: the storer TMA-stores
//                          every bf16 tile into its owner's staging slot for this rank (tile rows dealt
//                          round-robin over the owners), then one reduce kernel sums the W slots of the
//                          rank's rows.
//   matmul_all_reduce      the same sum, all of [M, N] on every rank: as above, and the reduce kernel stores
//                          the summed rows into every rank's out.
//
// Every rank calls the op with the same arguments (single-process: once per local rank). bf16 in and out,
// fp32 accumulation. Dense row-major operands; M divisible by the world size (matmul_all_reduce: any M, such
// as a decode batch of 1..256 rows: the paths that split M over the ranks then give way to the sequential
// one, and refuse by name when forced); K and N multiples of 8 (TMA
// rows are 16-byte multiples); 16-byte aligned pointers on the rank's GPU. Any memory works: symmetric-heap
// buffers are used in place where that helps (AG: `gathered_a`; AR: `out`), anything else goes through
// Communicator::workspace, which grows on first use (run once before capturing a CUDA graph, or
// reserve_workspace). A buffer in the symmetric heap must be so on every rank, at one offset (each rank
// decides from its own pointer, and peers write into it there).
//
// Three paths (FusedPath), each forced by its Mode; kAuto takes the one that measured fastest for the
// shape (the table in src/ops/fused_rules.hpp, each row with its measurement), or kSequential below
// FusedOptions::min_fused_m:
//   kFused      one kernel (plus the reduce for RS / AR), as above: all_gather_matmul's where
//               communication outweighs the GEMM, RS / AR's at 4 GPUs up to 256 MiB of output.
//   kPipelined  the GEMM as row pieces of cuBLAS on every SM while the copy engines move data between
//               GPUs on a side stream. AG: A shards, rank by rank. RS / AR: a ring reduce-scatter whose
//               additions run in the GEMM's epilogue (each piece of a peer's rows is computed on top of
//               the partial sum that the previous rank pushed here, then pushed on; the owner's piece is
//               final), AR then pushing each final piece to every peer. Waits on peer flags (one-warp
//               kernels on side streams) order the GPUs and fail the call with a named device error
//               after the team's timeout when a peer dies or stalls. The first call on a GPU creates its copy
//               stream and cuBLAS handle: make one call before capturing a CUDA graph.
//   kSequential a cuBLAS GEMM with weft::all_gather / reduce_scatter / all_reduce.
// Grids follow the rank's SM budget (Rank::sm_budget): the fused kernels' communicator and GEMM blocks fit
// in it (AG's default communicator blocks: an eighth of it, 2..16), the pipelines' weft::gemm stays inside
// it; a forced fused kernel that cannot fit is refused, kAuto falls back. On virtual ranks (ranks sharing a
// GPU) the copy-engine pipeline is not captured into CUDA graphs (forced: refused; kAuto avoids it there).
// Where one thread drives several ranks (single-process) outside a capture, the pipelined and sequential
// paths run weft::gemm instead of cuBLAS: cuBLAS's first use of a kernel on a GPU can wait for that GPU's
// queued work, which may wait for a rank the thread has not driven yet (docs/DESIGN.md).
// kFused cannot run for RS / AR with world > 8 or M / W not a multiple of 64, nor for AG with too many A
// chunks: forced, it throws why; kAuto then falls back to kSequential. The return value says which path ran.
//
// Their flags, barrier slots and pipeline areas are granted by name at team creation (src/ops/fused.cu,
// weft/runtime/resources.hpp): error messages name them ("flag 3 of 'all_gather_matmul kernel: chunk
// arrivals'").
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "weft/ops/collectives.hpp"
#include "weft/ops/gemm.hpp"

namespace weft {

enum class FusedPath { kFused, kSequential, kPipelined };
const char* fused_path_name(FusedPath p);

struct FusedOptions {
  enum class Mode { kAuto, kFused, kSequential, kPipelined } mode = Mode::kAuto;
  // Communicator blocks, 0 auto, else 1..32: all_gather_matmul's (auto: SM budget / 8 where N per rank is at
  // most 4096, / 32 above (FP8: / 16), 2..16), and the
  // counted matmul_reduce_scatter / all_reduce's (Partials kAddedAtOwner / kStagedProgressive; auto: SM
  // budget / 16, 1..8, at most one per 64-row half of a shard).
  int comm_blocks = 0;
  int64_t min_fused_m = 1024;  // kAuto: below this M the sequential path runs (besides the measured rule)
  int max_compute_blocks = 0;  // cap on GEMM blocks (benchmarks: "compute alone" at the fused op's SM count)
  int pipeline_pieces = 0;     // kPipelined RS / AR: row pieces per ring step, 0 auto; the same on every rank
  // all_gather_matmul's fused kernel and Partials::kSummedInEpilogue's: output tiles 128 x tile_n, 0 (auto:
  // 256), 128 or 256; Partials::kSplitK's items likewise (auto: 256 up to M = 16, else 128); the same on
  // every rank
  int tile_n = 0;
  // How the fused RS / AR kernel sums the W partial tiles of each row (the same on every rank):
  //   kAuto          kSummedInEpilogue where it runs for matmul_all_reduce, and for matmul_reduce_scatter at
  //                  2 GPUs (the measured rows: src/ops/fused_rules.hpp), Mode::kAuto then taking the fused
  //                  kernel from min_fused_m rows on; kStaged elsewhere, with store_ring 5 and for the FP8
  //                  ops. The all-reduce decides by whether out is in the symmetric heap: it must be on
  //                  every rank or on none (as every op's symmetric buffers), else the ranks take different
  //                  kernels and the call fails with a timeout
  //   kStaged        each rank stores its bf16 tile into its own staging slot at the owner; a reduce kernel
  //                  after the GEMM sums the W slots in a fixed order (bitwise reproducible)
  //   kAddedAtOwner  each rank reduce-adds its bf16 tile (TMA .add) into the owner's zeroed sum during the
  //                  GEMM, and the owner copies (RS) or pushes to every rank (AR, symmetric out) each 64-row
  //                  half as soon as it is complete (ops/fused.cuh); no reduce pass, W times less staging.
  //                  Every add rounds to bf16 (up to W - 1 roundings more than kStaged's fp32 sum of the W
  //                  partials) in an order that varies between runs, so the result's low bits may too (AR:
  //                  the same on every rank). Measured slower than kStaged at every shape on 4 x H100.
  //   kStagedProgressive  stored as kStaged, counted per 64-row half at the owner as kAddedAtOwner; the
  //                  owner's communicator blocks sum each half's W slots (fp32, kStaged's order: the same
  //                  bits) as soon as every rank has stored it, during the GEMM, into out (RS) or every
  //                  rank's out (AR, symmetric out); where that cannot run (halves past their flags, an AR
  //                  out outside the heap), kStaged
  //   kSummedInEpilogue  every SM computes tiles, no reduce kernel follows: each rank walks the tiles so that
  //                  the owner of a tile computes it a wave or two after the other ranks (ops/fused.cuh,
  //                  lcsc/owner_rounds_scheduler.cuh); a peer's tile is stored as kStaged stores it and
  //                  counted at its owner (a count a 64-row half), and the owner's epilogue adds the W - 1
  //                  landed partials (bf16) to its own fp32 accumulators, then stores the sum into out (RS)
  //                  or into every rank's out (AR, symmetric out). A fixed order (the same bits every run,
  //                  not kStaged's: the own partial is not rounded before the sum). Where M / W is not a
  //                  multiple of 128, the tiles exceed their flags or an AR out is outside the heap: kStaged
  //   kSplitK        matmul_all_reduce at decode sizes only (M <= 256, any M; options.mode aside): one
  //                  kernel, K split over the SMs, each (tile, slice)'s fp32 partial sent to the column
  //                  tile's owner, which sums the W x S partials (a fixed order) and writes the band into
  //                  every rank (ops::SplitKAllReduceOp). Not taken by kAuto until measured.
  enum class Partials {
    kAuto,
    kStaged,
    kAddedAtOwner,
    kStagedProgressive,
    kSummedInEpilogue,
    kSplitK
  } partials = Partials::kAuto;
  // The fused RS / AR kernel's storers (kStaged): the ring of output chunks a consumer warpgroup, 0 (auto: 2)
  // or 5 (with three pipeline stages instead of four: a tile's chunks to peers leave without waiting on each
  // other); the same on every rank. A developer option while the two are measured (the summed-in-epilogue
  // kernel with a ring of five: 1.00-1.03 of the ring of two's time at 2 x H200, removed).
  int store_ring = 0;
  // all_gather_matmul's fused kernel: what moves A's shards to the peers (the same on every rank):
  //   kAuto                kCopyEngine where it runs, at 2 GPUs from M = 8192 (Mode::kAuto then takes the
  //                        fused kernel there); else kCommunicatorBlocks (src/ops/fused_rules.hpp)
  //   kCommunicatorBlocks  communicator blocks beside the GEMM's blocks store each chunk, then its flag
  //   kCopyEngine          the copy engine: a chunk's cudaMemcpyAsync into the peer on a side stream, then a
  //                        stream write of its count there; the GEMM takes every SM but one (left for the
  //                        side stream's waits). Where it cannot run (virtual ranks, FP8, M / W not a
  //                        multiple of 128): kCommunicatorBlocks. As the pipeline, its first call on a GPU
  //                        creates the copy stream and must not be captured into a CUDA graph
  enum class Gather { kAuto, kCommunicatorBlocks, kCopyEngine } gather = Gather::kAuto;
};

FusedPath all_gather_matmul(Communicator& comm, Rank& rank, const void* a_shard, const void* b, void* out,
                            void* gathered_a, int64_t m, int64_t n, int64_t k, BLayout b_layout,
                            cudaStream_t stream = nullptr, const FusedOptions& options = {});

FusedPath matmul_reduce_scatter(Communicator& comm, Rank& rank, const void* a, const void* b, void* out,
                                int64_t m, int64_t n, int64_t k, BLayout b_layout,
                                cudaStream_t stream = nullptr, const FusedOptions& options = {});

FusedPath matmul_all_reduce(Communicator& comm, Rank& rank, const void* a, const void* b, void* out,
                            int64_t m, int64_t n, int64_t k, BLayout b_layout, cudaStream_t stream = nullptr,
                            const FusedOptions& options = {});

// all_gather_matmul on FP8 operands (e4m3 or e5m2, `type`): out [M, N] bf16 = the gathered A shards [M/W, K]
// times B [N, K]^T (a K-major weight), scaled as weft::gemm_fp8 scales, A's scales gathered with its rows:
// per row (Fp8Scaling::kRowCol: scale_a_shard [M/W], scale_b [N]) or per block (kBlock: scale_a_shard
// [M/W, ceil(K/128)], scale_b [ceil(N/128), ceil(K/128)]). Per-tensor scales are refused: each rank's shard
// would bring its own (quantize per row instead). K a multiple of 16. Paths: kFused (the FP8 GEMM with the
// all-gather's communicator blocks pushing A's chunks and their scales) and kSequential (weft's all_gather
// of A and of its scales, then gemm_fp8); Mode::kPipelined is refused. Half the link bytes of the bf16 op.
FusedPath all_gather_scaled_matmul(Communicator& comm, Rank& rank, const void* a_shard,
                                   const float* scale_a_shard, const void* b, const float* scale_b, void* out,
                                   int64_t m, int64_t n, int64_t k, Fp8Type type, Fp8Scaling scaling,
                                   cudaStream_t stream = nullptr, const FusedOptions& options = {});

// matmul_reduce_scatter / matmul_all_reduce on FP8 operands: a [M, K] and b [N, K] (K-major) FP8, each rank's
// product scaled by its own scales as weft::gemm_fp8 scales (any Fp8Scaling: scale_a / scale_b of gemm_fp8's
// shapes for this rank's a and b), the bf16 products summed over ranks: out [M / W, N] (this rank's rows) or
// [M, N]. K a multiple of 16. Paths: kFused (the FP8 GEMM storing its scaled bf16 tiles into their owners'
// staging slots, then the staged reduce; partials kStaged only) and kSequential (gemm_fp8, then weft's
// reduce_scatter / all_reduce; the all-reduce's path for M not divisible by W).
FusedPath scaled_matmul_reduce_scatter(Communicator& comm, Rank& rank, const void* a, const float* scale_a,
                                       const void* b, const float* scale_b, void* out, int64_t m, int64_t n,
                                       int64_t k, Fp8Type type, Fp8Scaling scaling,
                                       cudaStream_t stream = nullptr, const FusedOptions& options = {});
FusedPath scaled_matmul_all_reduce(Communicator& comm, Rank& rank, const void* a, const float* scale_a,
                                   const void* b, const float* scale_b, void* out, int64_t m, int64_t n,
                                   int64_t k, Fp8Type type, Fp8Scaling scaling, cudaStream_t stream = nullptr,
                                   const FusedOptions& options = {});

// What each call with these arguments would do (weft/ops/plan.hpp), without doing it: the path (plan.path
// starts with fused_path_name of the path the call returns), why the fused kernel cannot run here, the
// fused kernel's grid and tiles, and the workspace per area (the sequential path's collective included).
// The call itself runs this plan, so the two never disagree; it throws what the call would throw.
Plan all_gather_matmul_plan(Communicator& comm, Rank& rank, const void* a_shard, const void* b,
                            const void* out, const void* gathered_a, int64_t m, int64_t n, int64_t k,
                            BLayout b_layout, cudaStream_t stream = nullptr,
                            const FusedOptions& options = {});
Plan matmul_reduce_scatter_plan(Communicator& comm, Rank& rank, const void* a, const void* b, const void* out,
                                int64_t m, int64_t n, int64_t k, BLayout b_layout,
                                cudaStream_t stream = nullptr, const FusedOptions& options = {});
Plan matmul_all_reduce_plan(Communicator& comm, Rank& rank, const void* a, const void* b, const void* out,
                            int64_t m, int64_t n, int64_t k, BLayout b_layout, cudaStream_t stream = nullptr,
                            const FusedOptions& options = {});
Plan all_gather_scaled_matmul_plan(Communicator& comm, Rank& rank, const void* a_shard,
                                   const float* scale_a_shard, const void* b, const float* scale_b,
                                   const void* out, int64_t m, int64_t n, int64_t k, Fp8Type type,
                                   Fp8Scaling scaling, cudaStream_t stream = nullptr,
                                   const FusedOptions& options = {});
// scaled_matmul_all_reduce's plan with all_reduce, else scaled_matmul_reduce_scatter's.
Plan scaled_matmul_reduce_plan(Communicator& comm, Rank& rank, const void* a, const float* scale_a,
                               const void* b, const float* scale_b, const void* out, int64_t m, int64_t n,
                               int64_t k, Fp8Type type, Fp8Scaling scaling, bool all_reduce,
                               cudaStream_t stream = nullptr, const FusedOptions& options = {});

}  // namespace weft
