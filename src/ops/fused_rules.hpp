// kAuto's choice of path for the fused tensor-parallel ops, as data: which measured shapes take the fused
// kernel, and from which push size the copy-engine pipeline beats cuBLAS + weft's collective. Each row names
// the measurement it comes from (bench/RESULTS.md, "Fused tensor-parallel ops"). Host only, so the rule is
// tested on the host (tests/host/test_fused_rules.cpp). World sizes above 4 were not measured: they take the
// 4-GPU rows.
#pragma once
#include <cstddef>
#include <cstdint>

#include "weft/ops/fused.hpp"

namespace weft::ops {

// The fused kernel, where a row matches: the op (all_gather_matmul, or matmul_reduce_scatter /
// matmul_all_reduce), the world sizes, and bounds on M and N per rank (inclusive).
struct FusedKernelRule {
  bool all_gather;
  int min_world, max_world;
  int64_t min_m, max_m, max_n_per_rank;
  const char* measured;
};
inline constexpr int64_t kNoBound = INT64_MAX;
inline constexpr int kAnyWorld = 1 << 30;
inline constexpr FusedKernelRule kFusedKernelRules[] = {
    // all_gather_matmul from M = 8192 at 4 GPUs (N per rank 2048 and 7168 measured; the communicator blocks
    // by N per rank, ag_comm_blocks). At 2 GPUs the pipeline (each shard's GEMM on weft::gemm) beats the
    // communicator blocks at every M (8192 x 8192 764.2 vs 834.1 us, 16384 x 8192 1684.1 vs 1710.5, N 28672
    // by 4-11%); the copy engine's gather from 8192 rows beats both (kCopyEngineGatherRules).
    {true, 4, kAnyWorld, 8192, kNoBound, kNoBound,
     "4 x H200, 2026-11-28 (bench/RESULTS.md, \"all_gather_matmul at 4 GPUs: the pipeline on weft::gemm, "
     "communicator blocks by N\"): 8192 / 16384 x 8192 473.9 / 815.8 us vs the pipeline's 510.2 / 1039.8; "
     "x 28672 with 8 communicator blocks 1470.9 / 2858.1 vs 1621.2 / 3163.7 (with 4, auto_ag_comm_blocks "
     "since: 1371.2 / 2762.4); below M = 8192 the pipeline or the sequential path (4096 x 8192: 323.0 "
     "pipelined vs 407.8)"},
    // Every output size.
    {false, 4, kAnyWorld, 0, kNoBound, kNoBound,
     "4 x H200, 2026-11-27 (bench/RESULTS.md, the 4-GPU fused table): the fused kernel beat the ring "
     "pipeline at every shape, M 1024..32768 x N 8192 and 28672 (RS 32768 x 8192 1850.6 vs 1962.5 us, "
     "8192 x 28672 1631.5 vs 1813.4; AR 32768 x 8192 2773.7 vs 3357.7, 8192 x 28672 2416.4 vs 3050.1)"},
    // M <= 2048 at any N; from M = 4096 the pipeline.
    {false, 2, 2, 0, 2048, kNoBound,
     "2 x H200, against the ring pipeline: RS 1024 x 8192 116.5 vs 138.3 us, AR 137.6 vs 172.6 (session 10); "
     "2026-11-27 (bench/RESULTS.md, the 2-GPU fused table): RS 2048 x 28672 748.8 vs 806.0, AR 850.3 vs "
     "1025.6; the pipeline wins from M = 4096 (4096 x 8192 RS 434.0 vs 453.2, session 10; 8192 x 8192 AR "
     "954.0 vs 979.0) and ties at 8192 x 28672 (RS 3001.0 vs 3074.2, AR 3455.9 vs 3369.5)"},
};

// The pipeline, elsewhere, once each push (M / W rows of A for AG, of the output for RS / AR) reaches
// kPipelineMinPush, or kPipelineMinPushOnePeer where one push per call goes to one peer (2 GPUs), except
// all_gather_matmul at 2 GPUs with N per rank above kOnePeerAgMaxN (the GEMM dwarfs the gather).
// Measured: 4 x H200, session 4: 1.04-1.51x at 4 GPUs and 1.07-1.47x at 2 GPUs over the sequential path;
// 8 MiB pushes at 4 GPUs lost (0.84-0.98x); AG at 2 GPUs with N / W > 4096 tied or lost with 8 MiB pushes
// (0.93x, 1.00x; the sequential path 1.09x). Below: cuBLAS + weft's collective (1.03-1.36x cuBLAS + NCCL).
inline constexpr uint64_t kPipelineMinPush = 16u << 20, kPipelineMinPushOnePeer = 8u << 20;
inline constexpr int64_t kOnePeerAgMaxN = 4096;

// FusedOptions::Partials::kAuto: the partials summed in the owner's epilogue (kSummedInEpilogue, where its
// kernel runs) for these, and then the fused kernel at every M from min_fused_m on; kStaged elsewhere.
struct SummedPartialsRule {
  bool all_reduce;
  int min_world, max_world;
  const char* measured;
};
inline constexpr SummedPartialsRule kSummedPartialsRules[] = {
    {true, 2, kAnyWorld,
     "2 x H200, 2026-11-28 (bench/RESULTS.md, \"the summed-in-epilogue kernel on wide tiles\"): AR "
     "0.88-0.95 of the staged kernel's time and 0.87-0.95 of the pipeline's at M 2048 / 8192 x N 8192 / "
     "28672 (8192 x 28672: 3070.4 vs 3430.7 staged, 3478.6 pipelined); the fan-out it hides grows with W. "
     "4 x H200, 2026-11-28 (\"Fused ops at 4 GPUs with kAuto's partials\"): 1.04-1.10 of the bound at M "
     "2048..16384 x N 8192 / 28672, 0.89-0.97 of the staged kernel's time"},
    {false, 2, 2,
     "2 x H200, 2026-11-28, same tables, two runs: RS 0.97-1.02 of the staged kernel at M = 2048 and "
     "0.97-1.01 at 8192 (8192 x 8192: 812.5 vs 836.8), where the path rule took the pipeline, 3-9% slower "
     "than either fused kernel (868.5, 3082.0 vs 2978.0 at 8192 x 28672). At 4 GPUs (same day, \"Fused ops "
     "at 4 GPUs with kAuto's partials\") -2..+8% against kStaged: kStaged there"},
};

// all_gather_matmul's fused kernel with FusedOptions::comm_blocks 0: its communicator blocks, an even count
// from 2 to 16: an eighth of the SM budget where N per rank is at most 4096 (16 on a whole 132-SM H100 /
// H200) and a 32nd above (4; FP8, whose GEMM takes half the time for half the bytes, a 16th: 8). The wider
// GEMM hides the gather with fewer pushers and wants the SMs. Measured (4 x H200, bench/RESULTS.md,
// "communicator blocks by N" and "all_gather_matmul with 4 communicator blocks"): 8192 / 16384 / 32768 x
// 28672 1371.2 / 2762.4 / 5824.4 us with 4 blocks, 1485.2 / 2895.4 / 5882.6 with 8, 1607.7 / 3056.6 with 16
// (2 blocks: 2126.0 / 3988.2); x 8192: 16 blocks 473.9 / 815.8 vs 8's 511.8 / 966.3 and 4's 863.5 / 1645.6.
// FP8 with 4 blocks: not measured.
inline int auto_ag_comm_blocks(int sm_budget, int64_t n_per_rank, bool fp8) {
  const int divisor = n_per_rank <= 4096 ? 8 : fp8 ? 16 : 32;
  const int blocks = sm_budget / divisor;
  return (blocks < 2 ? 2 : blocks > 16 ? 16 : blocks) / 2 * 2;
}

// Whether any row of `rules` matches.
template <class Rule, size_t N, class Match>
constexpr bool any_row(const Rule (&rules)[N], Match match) {
  for (const Rule& r : rules)
    if (match(r)) return true;
  return false;
}

inline bool auto_sums_in_epilogue(bool all_reduce, int world) {
  return any_row(kSummedPartialsRules, [&](const SummedPartialsRule& r) {
    return r.all_reduce == all_reduce && world >= r.min_world && world <= r.max_world;
  });
}

// FusedOptions::Gather::kAuto: all_gather_matmul's fused kernel fed by the copy engine (where it runs) at
// these world sizes from min_m rows on, and then the fused kernel there; the communicator blocks elsewhere.
struct CopyEngineGatherRule {
  int min_world, max_world;
  int64_t min_m;
  const char* measured;
};
inline constexpr CopyEngineGatherRule kCopyEngineGatherRules[] = {
    {2, 2, 8192,
     "2 x H200, 2026-11-28 (bench/RESULTS.md, \"the copy engine's gather\"): 8192 / 16384 x 8192 752.5 / "
     "1570.0 us vs the pipeline's 801.0 / 1583.7; x 28672 2831.4 / 5654.6 vs 2918.6 / 5766.9; below 8192 "
     "rows the pipeline (2048 x 8192: 197.0 vs 273.7). At 4 GPUs 1.3-1.7x slower than the communicator "
     "blocks at N 8192 (8192 x 8192: 756.3 vs 472.8 us): not taken there"},
};

inline bool auto_gathers_by_copy_engine(int world, int64_t m) {
  return any_row(kCopyEngineGatherRules, [&](const CopyEngineGatherRule& r) {
    return world >= r.min_world && world <= r.max_world && m >= r.min_m;
  });
}

inline FusedPath auto_path(bool all_gather, int64_t m, int64_t n_per_rank, int64_t k, int world) {
  for (const FusedKernelRule& r : kFusedKernelRules)
    if (r.all_gather == all_gather && world >= r.min_world && world <= r.max_world && m >= r.min_m &&
        m <= r.max_m && n_per_rank <= r.max_n_per_rank)
      return FusedPath::kFused;
  const uint64_t push_bytes = uint64_t(m / world) * uint64_t(all_gather ? k : n_per_rank) * 2;
  const bool one_peer = world == 2 && !(all_gather && n_per_rank > kOnePeerAgMaxN);
  return push_bytes >= (one_peer ? kPipelineMinPushOnePeer : kPipelineMinPush) ? FusedPath::kPipelined
                                                                               : FusedPath::kSequential;
}

}  // namespace weft::ops
