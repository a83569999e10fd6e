// Host side of weft::gemm: validation with clear errors, tensor maps, tile configuration and launch.
#include <algorithm>
#include <climits>
#include <cstdio>
#include <string>
#include <type_traits>

#include "grouped_gemm_scatter.hpp"
#include "op_args.hpp"
#include "tile_width.hpp"
#include "weft/lcsc/launch.cuh"
#include "weft/ops/gemm.cuh"
#include "weft/ops/gemm.hpp"
#include "weft/runtime/current_device.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/kernel_preload.hpp"
#include "weft/runtime/tensor_map.hpp"

namespace weft {
namespace {

struct Problem {
  const void* a;
  const void* b;
  void* c;
  int64_t m, n, k, lda, ldb, ldc;
  BLayout b_layout;
  DType c_type;
  GemmOptions opt;
  const int32_t* group_end = nullptr;  // grouped: the groups' row ends (device); m is the rows' capacity
  int groups = 0;
  const ops::ScatterRows* scatter = nullptr;  // grouped: C's rows sent where this says (c is not written)
  const ops::MoeDispatchRows* dispatch = nullptr;  // grouped: A's rows moved here by the kernel's helpers
};

std::string hex(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%p", p);
  return buf;
}

using ops::device_facts;
using ops::DeviceFacts;

// C's columns: N, or N / 2 when the epilogue's SwiGLU pairs them.
int64_t c_cols(const Problem& pr) {
  return pr.opt.activation == Activation::kSwiGLU ? pr.n / 2 : pr.n;
}

// C's rows [*end, rows) zeroed (16-byte vectors, row_vecs per row): the rows a grouped GEMM leaves past its
// last group, whose end only the device knows.
__global__ void zero_rows_past(uint4* c, const int32_t* end, int64_t rows, int64_t row_vecs) {
  const int64_t first = int64_t(__ldg(end)) * row_vecs, last = rows * row_vecs;
  for (int64_t i = first + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < last;
       i += int64_t(gridDim.x) * blockDim.x)
    c[i] = make_uint4(0, 0, 0, 0);
}

// Plans (and, with a stream, launches) one problem with the GemmOp instantiation for these types.
template <class Op, bool kKMajor, int kCluster>
Plan run_op(const Problem& pr, cudaStream_t stream, bool launch) {
  using Mainloop = typename Op::Mainloop;
  using Epilogue = typename Op::Epilogue;
  using Launcher = lcsc::Launcher<Op>;

  typename Op::Params p{};
  lcsc::SchedulerParams& s = p.sched;
  s.tiles_m = static_cast<int>((pr.m + Op::kBM - 1) / Op::kBM);
  s.tiles_n = static_cast<int>((pr.n + Op::kBN - 1) / Op::kBN);
  s.cluster_m = kCluster;
  s.group_m = pr.opt.group_m > 0 ? pr.opt.group_m : 16;
  s.start_unit = pr.opt.start_tile;
  s.timeline = pr.opt.timeline;
  int clusters = Launcher::max_resident_clusters();
  if (pr.opt.max_blocks > 0) clusters = std::min(clusters, std::max(1, pr.opt.max_blocks / kCluster));
  // By the tiles of the rows' capacity: with group_rows, the live tiles the scheduler walks are counted on
  // the device (the blocks past them find none).
  clusters = std::min(clusters, s.units());
  s.compute_blocks = clusters * kCluster;

  Plan plan;
  plan.op = pr.groups ? "grouped_gemm" : "gemm";
  plan.path = pr.groups ? "persistent grouped GEMM" : "persistent GEMM";
  plan.tiles = {Op::kBM, Op::kBN, Op::kBK, Op::kStages, s.group_m, int64_t(s.tiles_m) * s.tiles_n};
  plan.cluster = kCluster;
  plan.blocks = s.compute_blocks;
  plan.smem_bytes = static_cast<int>(lcsc::kSmemBytes<Op>);
  if (!launch) return plan;

  const bool f32 = pr.c_type == DType::kFP32;
  const uint32_t c_bytes = f32 ? 4 : 2;
  p.a = tma::make_map_2d(
      {pr.a, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, uint64_t(pr.m), uint64_t(pr.k), uint64_t(pr.lda) * 2},
      Mainloop::kABoxRows, Mainloop::kABoxCols, "weft::gemm: A");
  const uint64_t b_rows = (kKMajor ? pr.n : pr.k) * std::max(1, pr.groups), b_cols = kKMajor ? pr.k : pr.n;
  p.b = tma::make_map_2d({pr.b, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, b_rows, b_cols, uint64_t(pr.ldb) * 2},
                         Mainloop::kBBoxRows, Mainloop::kBBoxCols, "weft::gemm: B");
  p.c = tma::make_map_2d({pr.c, f32 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                          c_bytes, uint64_t(pr.m), uint64_t(c_cols(pr)), uint64_t(pr.ldc) * c_bytes},
                         Epilogue::kBoxRows, Epilogue::kBoxCols, "weft::gemm: C");
  p.k_blocks = static_cast<int>((pr.k + Op::kBK - 1) / Op::kBK);
  p.store_mode =
      pr.opt.store == GemmStore::kReduceAdd ? lcsc::StoreMode::kReduceAdd : lcsc::StoreMode::kStore;
  if constexpr (requires { p.dispatch; }) {
    p.dispatch = *pr.dispatch;
    s.claims = pr.dispatch->tile_claims;
  }
  if constexpr (lcsc::kClaimsTiles<Op>)
    WEFT_CHECK(s.claims != nullptr, "weft::gemm: an op that claims its tiles needs a claims counter");
  if constexpr (requires { p.scatter; }) {
    p.scatter = *pr.scatter;
    p.n = static_cast<int>(pr.n);
  }
  if constexpr (requires { p.sched.group_end; }) {
    p.sched.group_end = pr.group_end;
    p.sched.group_rows = pr.opt.group_rows;
    p.sched.groups = pr.groups;
    p.b_rows = static_cast<int>(kKMajor ? pr.n : pr.k);
  }
  Launcher::launch(p, s.compute_blocks, stream);
  return plan;
}

template <class OutT, bool kKMajor, int kCluster, int kTileN>
Plan run(const Problem& pr, cudaStream_t stream, bool launch) {
  if (pr.groups) {
    if constexpr (kCluster == 1 && std::is_same_v<OutT, __nv_bfloat16>)
      if (pr.dispatch != nullptr) {
        if constexpr (kTileN == 256)
          if (pr.opt.activation == Activation::kSwiGLU)
            return run_op<ops::GroupedGemmDispatchOp<
                              ops::GroupedGemmSwigluOp<OutT, kKMajor, ops::kMoeDispatchStages<256>, false>>,
                          kKMajor, 1>(pr, stream, launch);
        return run_op<ops::GroupedGemmDispatchOp<
                          ops::GroupedGemmOp<OutT, kKMajor, kTileN, ops::kMoeDispatchStages<kTileN>, false>>,
                      kKMajor, 1>(pr, stream, launch);
      }
    // Without group_rows, the kernels without the scheduler's walk of live tiles (whose data-dependent
    // branches cost the consumers' loop; ops::GroupedFp8GemmOp).
    const bool counted = pr.opt.group_rows != nullptr;
    if constexpr (kCluster == 1 && kTileN == 256)
      if (pr.opt.activation == Activation::kSwiGLU)
        return counted ? run_op<ops::GroupedGemmSwigluOp<OutT, kKMajor>, kKMajor, 1>(pr, stream, launch)
                       : run_op<ops::GroupedGemmSwigluOp<OutT, kKMajor, 0, false>, kKMajor, 1>(pr, stream,
                                                                                               launch);
    if constexpr (kCluster == 1 && kTileN == 256 && std::is_same_v<OutT, __nv_bfloat16>)
      if (pr.scatter != nullptr)
        return run_op<ops::GroupedGemmScatterOp<kKMajor>, kKMajor, 1>(pr, stream, launch);
    if constexpr (kCluster == 1)
      return counted ? run_op<ops::GroupedGemmOp<OutT, kKMajor, kTileN>, kKMajor, 1>(pr, stream, launch)
                     : run_op<ops::GroupedGemmOp<OutT, kKMajor, kTileN, 0, false>, kKMajor, 1>(pr, stream,
                                                                                               launch);
    throw_error("weft::grouped_gemm runs with cluster 1 only");
  }
  return run_op<ops::GemmOp<OutT, kKMajor, kCluster, kTileN>, kKMajor, kCluster>(pr, stream, launch);
}

// The instantiations: 128 x 256 tiles with cluster 1 or 2, 128 x 128 tiles with cluster 1.
template <class OutT, bool kKMajor>
Plan run_config(const Problem& pr, int cluster, int tile_n, cudaStream_t stream, bool launch) {
  if (cluster == 2) return run<OutT, kKMajor, 2, 256>(pr, stream, launch);
  return tile_n == 128 ? run<OutT, kKMajor, 1, 128>(pr, stream, launch)
                       : run<OutT, kKMajor, 1, 256>(pr, stream, launch);
}

// The grouped GEMM's own checks (and tile width), or the plain GEMM's refusal of grouped-only options.
void check_grouping(Problem& pr, bool launch, const std::string& where) {
  if (pr.groups || pr.group_end) {
    WEFT_CHECK(pr.groups >= 1, where + "groups must be at least 1");
    WEFT_CHECK(pr.m % 128 == 0, where + "rows (the capacity) must be a multiple of 128, the tile's rows");
    WEFT_CHECK(pr.opt.cluster <= 1, where + "options.cluster must be 0 or 1");
    WEFT_CHECK(pr.opt.lda == 0 && pr.opt.ldb == 0 && pr.opt.ldc == 0, where + "strides must be dense (0)");
    WEFT_CHECK(pr.opt.store == GemmStore::kStore, where + "C is stored (no reduce-add)");
    WEFT_CHECK(int64_t(pr.groups) * (pr.b_layout == BLayout::kNK ? pr.n : pr.k) <= INT32_MAX,
               where + "B's rows (groups x N or K) past 2^31 - 1 are not supported");
    if (launch) {
      WEFT_CHECK(pr.group_end != nullptr, where + "group_end must not be null");
      WEFT_CHECK(reinterpret_cast<uintptr_t>(pr.group_end) % 4 == 0,
                 where + "group_end is not 4-byte aligned");
      WEFT_CHECK(reinterpret_cast<uintptr_t>(pr.opt.group_rows) % 4 == 0,
                 where + "options.group_rows is not 4-byte aligned");
    }
    // A partial group's tile is computed whole: rows past its count would reach a scatter's or dispatch's
    // destinations.
    WEFT_CHECK(pr.opt.group_rows == nullptr || (pr.scatter == nullptr && pr.dispatch == nullptr),
               where + "options.group_rows is for grouped_gemm's own output (no scatter, no dispatch)");
    if (pr.scatter != nullptr) {
      WEFT_CHECK(pr.c_type == DType::kBF16 && pr.opt.activation == Activation::kNone &&
                     !pr.opt.zero_unused_rows && (pr.opt.tile_n == 0 || pr.opt.tile_n == 256),
                 where + "a scattering epilogue stores bf16 rows of 128 x 256 tiles, with no activation");
      pr.opt.tile_n = 256;
    }
    if (pr.dispatch != nullptr)
      WEFT_CHECK(pr.c_type == DType::kBF16 && !pr.opt.zero_unused_rows,
                 where + "a dispatching GEMM stores bf16 C and leaves the rows past the last group alone");
    WEFT_CHECK(pr.opt.activation == Activation::kNone || pr.opt.activation == Activation::kSwiGLU,
               where + "grouped_gemm's epilogue applies Activation::kNone or kSwiGLU, got Activation(" +
                   std::to_string(static_cast<int>(pr.opt.activation)) +
                   ") (activate_quantize_fp8 applies the others)");
    if (pr.opt.activation == Activation::kSwiGLU) {
      WEFT_CHECK(pr.n % 256 == 0,
                 where + "the SwiGLU epilogue needs N (gate and up columns) a multiple of 256");
      WEFT_CHECK(pr.opt.tile_n == 0 || pr.opt.tile_n == 256,
                 where + "the SwiGLU epilogue runs with tile_n 256");
      pr.opt.tile_n = 256;
    }
  } else {
    WEFT_CHECK(
        !pr.opt.zero_unused_rows && pr.opt.activation == Activation::kNone && pr.opt.group_rows == nullptr,
        where + "options.zero_unused_rows, activation and group_rows are for grouped_gemm only");
  }
}

// Fills in the strides and checks them (and, when launching, the pointers' alignment) against TMA's rules.
void check_strides(Problem& pr, bool launch, const std::string& where) {
  const bool nk = pr.b_layout == BLayout::kNK;
  const GemmOptions& opt = pr.opt;
  pr.lda = opt.lda ? opt.lda : pr.k;
  pr.ldb = opt.ldb ? opt.ldb : (nk ? pr.k : pr.n);
  pr.ldc = opt.ldc ? opt.ldc : c_cols(pr);
  const char* c_name = pr.c_type == DType::kFP32 ? "f32" : "bf16";
  const int64_t c_bytes = pr.c_type == DType::kFP32 ? 4 : 2;
  WEFT_CHECK(pr.lda >= pr.k, where + "lda = " + std::to_string(pr.lda) + " is smaller than K");
  WEFT_CHECK(pr.ldb >= (nk ? pr.k : pr.n),
             where + "ldb = " + std::to_string(pr.ldb) + " is smaller than " + (nk ? "K" : "N"));
  WEFT_CHECK(pr.ldc >= c_cols(pr),
             where + "ldc = " + std::to_string(pr.ldc) + " is smaller than C's columns");

  // TMA: every row of every operand starts on a 16-byte boundary.
  auto stride_msg = [&](const std::string& operand, const char* ld, int64_t elems, int64_t bytes_per,
                        const char* dim, int multiple) {
    return where + operand + ": its row stride " + ld + " = " + std::to_string(elems) + " elements (" +
           std::to_string(elems * bytes_per) +
           " bytes) is not a multiple of 16 bytes, which TMA requires; make " + dim + " (or " + ld +
           ") a multiple of " + std::to_string(multiple) + ", e.g. by zero-padding";
  };
  WEFT_CHECK(pr.lda % 8 == 0, stride_msg("A is row-major [M,K] bf16", "lda", pr.lda, 2, "K", 8));
  WEFT_CHECK(pr.ldb % 8 == 0, nk ? stride_msg("B is an [N,K] bf16 weight", "ldb", pr.ldb, 2, "K", 8)
                                 : stride_msg("B is row-major [K,N] bf16", "ldb", pr.ldb, 2, "N", 8));
  WEFT_CHECK((pr.ldc * c_bytes) % 16 == 0, stride_msg(std::string("C is row-major [M,N] ") + c_name, "ldc",
                                                      pr.ldc, c_bytes, "N", static_cast<int>(16 / c_bytes)));
  if (launch) {
    auto align_msg = [&](const char* operand, const void* p) {
      return where + operand + " = " + hex(p) + " is not 16-byte aligned, which TMA requires";
    };
    WEFT_CHECK(pr.a != nullptr && pr.b != nullptr && pr.c != nullptr, where + "A, B and C must not be null");
    WEFT_CHECK(reinterpret_cast<uintptr_t>(pr.a) % 16 == 0, align_msg("A", pr.a));
    WEFT_CHECK(reinterpret_cast<uintptr_t>(pr.b) % 16 == 0, align_msg("B", pr.b));
    WEFT_CHECK(reinterpret_cast<uintptr_t>(pr.c) % 16 == 0, align_msg("C", pr.c));
  }
}

// Validates everything but the pointers' values (checked by the caller when it has them), picks the
// instantiation and plans or launches.
Plan plan_or_launch(const Problem& in, cudaStream_t stream, bool launch) {
  Problem pr = in;
  const std::string where = (pr.groups ? "weft::grouped_gemm(rows=" : "weft::gemm(M=") +
                            std::to_string(pr.m) + ", N=" + std::to_string(pr.n) +
                            ", K=" + std::to_string(pr.k) +
                            (pr.groups ? ", groups=" + std::to_string(pr.groups) : std::string()) + "): ";
  check_grouping(pr, launch, where);
  const bool nk = pr.b_layout == BLayout::kNK;
  const GemmOptions& opt = pr.opt;
  WEFT_CHECK(pr.b_layout == BLayout::kNK || pr.b_layout == BLayout::kKN, where + "unknown B layout");
  WEFT_CHECK(pr.c_type == DType::kBF16 || pr.c_type == DType::kFP32,
             where + "C must be bf16 or fp32 (DType::kBF16, kFP32)");
  WEFT_CHECK(pr.m > 0 && pr.n > 0 && pr.k > 0, where + "M, N and K must be at least 1");
  WEFT_CHECK(pr.m <= INT32_MAX && pr.n <= INT32_MAX && pr.k <= INT32_MAX,
             where + "dimensions above 2^31 - 1 are not supported (TMA coordinates are 32-bit)");
  WEFT_CHECK(opt.cluster >= 0 && opt.cluster <= 2,
             where + "options.cluster must be 0 (auto), 1 or 2, got " + std::to_string(opt.cluster));
  WEFT_CHECK(opt.group_m >= 0 && opt.max_blocks >= 0, where + "options.group_m and max_blocks must be >= 0");
  WEFT_CHECK(opt.tile_n == 0 || opt.tile_n == 128 || opt.tile_n == 256,
             where + "options.tile_n must be 0 (auto), 128 or 256, got " + std::to_string(opt.tile_n));
  WEFT_CHECK(opt.tile_n != 128 || opt.cluster != 2, where + "options.tile_n = 128 runs with cluster 1 only");

  check_strides(pr, launch, where);
  const DeviceFacts dev = device_facts();
  WEFT_CHECK(dev.cc == 90, "weft::gemm runs on Hopper (sm_90) GPUs (wgmma, built for sm_90a); device " +
                               std::to_string(dev.device) + " is sm_" + std::to_string(dev.cc));

  // Auto is 1: the B multicast of cluster 2 measured 75-78% of cuBLAS at 8192^3 on H200 against 102% for
  // cluster 1 (weft-bench gemm, 2026-11-21); it stays selectable until its pipeline is fixed.
  const int cluster = opt.cluster ? opt.cluster : 1;
  const int sms = opt.max_blocks > 0 ? std::min(opt.max_blocks, dev.sms) : dev.sms;  // the SMs it may use
  const int tile_n = cluster == 2 ? 256 : opt.tile_n ? opt.tile_n : ops::auto_tile_n(pr.m, pr.n, sms);
  if (pr.c_type == DType::kBF16)
    return nk ? run_config<__nv_bfloat16, true>(pr, cluster, tile_n, stream, launch)
              : run_config<__nv_bfloat16, false>(pr, cluster, tile_n, stream, launch);
  return nk ? run_config<float, true>(pr, cluster, tile_n, stream, launch)
            : run_config<float, false>(pr, cluster, tile_n, stream, launch);
}

}  // namespace

void gemm(const void* a, const void* b, void* c, int64_t m, int64_t n, int64_t k, BLayout b_layout,
          DType c_type, cudaStream_t stream, const GemmOptions& opt) {
  plan_or_launch(Problem{a, b, c, m, n, k, 0, 0, 0, b_layout, c_type, opt}, stream, true);
}

Plan gemm_plan(int64_t m, int64_t n, int64_t k, BLayout b_layout, DType c_type, const GemmOptions& opt) {
  return plan_or_launch(Problem{nullptr, nullptr, nullptr, m, n, k, 0, 0, 0, b_layout, c_type, opt}, nullptr,
                        false);
}

Plan ops::grouped_gemm_scatter(const void* a, const void* b, const int32_t* group_end, int groups,
                               int64_t rows, int64_t n, int64_t k, BLayout b_layout,
                               const ScatterRows& scatter, cudaStream_t stream, const GemmOptions& opt,
                               bool launch) {
  // C's map is built (and never used): it points at the destination buffer.
  Problem pr{a, b, scatter.dest, rows, n, k, 0, 0, 0, b_layout, DType::kBF16, opt, group_end, groups};
  pr.scatter = &scatter;
  return plan_or_launch(pr, stream, launch);
}

Plan ops::grouped_gemm_dispatch(const void* b, void* c, int64_t rows, int64_t n, int64_t k, BLayout b_layout,
                                const MoeDispatchRows& dispatch, cudaStream_t stream, const GemmOptions& opt,
                                bool launch) {
  Problem pr{dispatch.rows,  b, c, rows, n, k, 0, 0, 0, b_layout, DType::kBF16, opt, dispatch.group_end,
             dispatch.groups};
  pr.dispatch = &dispatch;
  return plan_or_launch(pr, stream, launch);
}

Plan grouped_gemm_plan(int groups, int64_t rows, int64_t n, int64_t k, BLayout b_layout, DType c_type,
                       const GemmOptions& opt) {
  // groups = 0 with no group_end would plan a dense GEMM: refused here by name.
  WEFT_CHECK(groups >= 1,
             "weft::grouped_gemm_plan: groups must be at least 1, got " + std::to_string(groups));
  return plan_or_launch(
      Problem{nullptr, nullptr, nullptr, rows, n, k, 0, 0, 0, b_layout, c_type, opt, nullptr, groups},
      nullptr, false);
}

void grouped_gemm(const void* a, const void* b, void* c, const int32_t* group_end, int groups, int64_t rows,
                  int64_t n, int64_t k, BLayout b_layout, DType c_type, cudaStream_t stream,
                  const GemmOptions& opt) {
  plan_or_launch(Problem{a, b, c, rows, n, k, 0, 0, 0, b_layout, c_type, opt, group_end, groups}, stream,
                 true);
  if (opt.zero_unused_rows) {
    const int64_t cols = opt.activation == Activation::kSwiGLU ? n / 2 : n;
    const int64_t row_vecs = cols * (c_type == DType::kFP32 ? 4 : 2) / 16;  // rows are 16-byte multiples
    detail::preload<&zero_rows_past>();
    zero_rows_past<<<2 * device_facts().sms, 256, 0, stream>>>(static_cast<uint4*>(c), group_end + groups - 1,
                                                               rows, row_vecs);
    WEFT_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace weft
