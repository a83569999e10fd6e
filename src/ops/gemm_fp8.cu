// Host side of weft::gemm_fp8: validation with clear errors, tensor maps and launch (device code:
// weft/ops/gemm_fp8.cuh).
#include <algorithm>
#include <climits>
#include <string>

#include "op_args.hpp"
#include "weft/lcsc/launch.cuh"
#include "weft/ops/gemm.hpp"
#include "weft/ops/gemm_fp8.cuh"
#include "weft/runtime/error.hpp"
#include "weft/runtime/tensor_map.hpp"

namespace weft {
namespace {

struct Fp8Problem {
  const void *a, *b;
  void* c;
  int64_t m, n, k;
  Fp8Type ab_type;
  Fp8Scales scales;
  DType c_type;
  GemmOptions opt;
  int64_t lda = 0, ldb = 0, ldc = 0;
  const int32_t* group_end = nullptr;  // grouped: A's groups' ends; B stacked [groups, N, K]
  int groups = 0;
};

const char* scaling_name(Fp8Scaling s) {
  return s == Fp8Scaling::kTensor ? "per-tensor" : s == Fp8Scaling::kRowCol ? "per-row" : "block";
}

template <class Op>
Plan run_op(const Fp8Problem& pr, cudaStream_t stream, bool launch) {
  using Launcher = lcsc::Launcher<Op>;
  typename Op::Params p{};
  lcsc::SchedulerParams& s = p.sched;
  s.tiles_m = static_cast<int>((pr.m + Op::kBM - 1) / Op::kBM);
  s.tiles_n = static_cast<int>((pr.n + Op::kBN - 1) / Op::kBN);
  s.group_m = pr.opt.group_m > 0 ? pr.opt.group_m : 16;
  s.start_unit = pr.opt.start_tile;
  s.timeline = pr.opt.timeline;
  int blocks = Launcher::max_resident_clusters();
  if (pr.opt.max_blocks > 0) blocks = std::min(blocks, pr.opt.max_blocks);
  s.compute_blocks = std::min(blocks, s.units());

  Plan plan;
  plan.op = Op::kGrouped ? "grouped_gemm_fp8" : "gemm_fp8";
  plan.path = std::string(Op::kGrouped ? "persistent grouped FP8 GEMM, " : "persistent FP8 GEMM, ") +
              scaling_name(pr.scales.kind) + " scales" + (Op::kStagedScaleA ? ", A's staged by TMA" : "");
  plan.tiles = {Op::kBM, Op::kBN, Op::kBK, Op::kStages, s.group_m, int64_t(s.tiles_m) * s.tiles_n};
  plan.cluster = 1;
  plan.blocks = s.compute_blocks;
  plan.smem_bytes = static_cast<int>(lcsc::kSmemBytes<Op>);
  if (!launch) return plan;

  using Mainloop = typename Op::Mainloop;
  using Epilogue = typename Op::Epilogue;
  const bool f32 = pr.c_type == DType::kFP32;
  const uint32_t c_bytes = f32 ? 4 : 2;
  p.a = tma::make_map_2d(
      {pr.a, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, uint64_t(pr.m), uint64_t(pr.k), uint64_t(pr.lda)},
      Mainloop::kABoxRows, Mainloop::kABoxCols, "weft::gemm_fp8: A");
  const uint64_t b_rows = uint64_t(pr.n) * std::max(1, pr.groups);  // grouped: every expert's rows
  p.b = tma::make_map_2d({pr.b, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, b_rows, uint64_t(pr.k), uint64_t(pr.ldb)},
                         Mainloop::kBBoxRows, Mainloop::kBBoxCols, "weft::gemm_fp8: B");
  p.c = tma::make_map_2d({pr.c, f32 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                          c_bytes, uint64_t(pr.m), uint64_t(pr.n), uint64_t(pr.ldc) * c_bytes},
                         Epilogue::kBoxRows, Epilogue::kBoxCols, "weft::gemm_fp8: C");
  p.m = static_cast<int>(pr.m);
  p.n = static_cast<int>(pr.n);
  p.k_blocks = static_cast<int>((pr.k + Op::kBK - 1) / Op::kBK);
  p.scale_a = pr.scales.a;
  p.scale_b = pr.scales.b;
  if (pr.scales.a_m_stride > 0) {
    p.sa_row_step = 1;
    p.sa_k_step = static_cast<int>(pr.scales.a_m_stride);
  } else {
    p.sa_row_step = static_cast<int>(pr.scales.a_row_stride ? pr.scales.a_row_stride : p.k_blocks);
    p.sa_k_step = 1;
  }
  if constexpr (Op::kStagedScaleA)  // [k_blocks] rows of M scales
    p.scale_a_map = tma::make_map_2d({pr.scales.a, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, uint64_t(p.k_blocks),
                                      uint64_t(pr.m), uint64_t(pr.scales.a_m_stride) * 4},
                                     Mainloop::kScaleABoxRows, Mainloop::kScaleABoxCols,
                                     "weft::gemm_fp8: A's M-major block scales", CU_TENSOR_MAP_SWIZZLE_NONE);
  p.store_mode =
      pr.opt.store == GemmStore::kReduceAdd ? lcsc::StoreMode::kReduceAdd : lcsc::StoreMode::kStore;
  if constexpr (Op::kGrouped) {
    p.sched.group_end = pr.group_end;
    p.sched.group_rows = pr.opt.group_rows;
    p.sched.groups = pr.groups;
    p.n_blocks = static_cast<int>((pr.n + Op::kBN - 1) / Op::kBN);
  }
  Launcher::launch(p, s.compute_blocks, stream);
  return plan;
}

// Whether A's block scales ride in the pipeline's stages (Fp8GemmOp's kStagedScaleA): M-major ones TMA can
// copy (a 16-byte aligned base, a stride of whole 16 bytes); row-major ones, and others, the consumers load.
bool staged_scales(const Fp8Problem& pr) {
  return pr.scales.a_m_stride > 0 && pr.scales.a_m_stride % 4 == 0 &&
         reinterpret_cast<uintptr_t>(pr.scales.a) % 16 == 0;
}

template <class OutT, bool kE5M2>
Plan run_typed(const Fp8Problem& pr, cudaStream_t stream, bool launch) {
  if (pr.groups > 0) {
    if (pr.opt.group_rows != nullptr)  // (counted groups: a low-latency dispatch's)
      return staged_scales(pr) ? run_op<ops::GroupedFp8GemmOp<OutT, kE5M2, true>>(pr, stream, launch)
                               : run_op<ops::GroupedFp8GemmOp<OutT, kE5M2>>(pr, stream, launch);
    return staged_scales(pr) ? run_op<ops::GroupedFp8GemmOp<OutT, kE5M2, true, false>>(pr, stream, launch)
                             : run_op<ops::GroupedFp8GemmOp<OutT, kE5M2, false, false>>(pr, stream, launch);
  }
  switch (pr.scales.kind) {
    case Fp8Scaling::kTensor:
      return run_op<ops::Fp8GemmOp<OutT, Fp8Scaling::kTensor, kE5M2>>(pr, stream, launch);
    case Fp8Scaling::kRowCol:
      return run_op<ops::Fp8GemmOp<OutT, Fp8Scaling::kRowCol, kE5M2>>(pr, stream, launch);
    default:
      if (staged_scales(pr))
        return run_op<
            ops::Fp8GemmOp<OutT, Fp8Scaling::kBlock, kE5M2, false, lcsc::GemmTileScheduler, true, true>>(
            pr, stream, launch);
      return run_op<ops::Fp8GemmOp<OutT, Fp8Scaling::kBlock, kE5M2>>(pr, stream, launch);
  }
}

// The shape, types and options; strides filled in and checked against TMA's rules.
void check_problem(Fp8Problem& pr, const std::string& where) {
  const GemmOptions& o = pr.opt;
  WEFT_CHECK(pr.ab_type == Fp8Type::kE4M3 || pr.ab_type == Fp8Type::kE5M2,
             where + "ab_type must be Fp8Type::kE4M3 or kE5M2");
  WEFT_CHECK(pr.c_type == DType::kBF16 || pr.c_type == DType::kFP32,
             where + "C must be bf16 or fp32 (DType::kBF16, kFP32)");
  const Fp8Scaling kind = pr.scales.kind;
  WEFT_CHECK(kind == Fp8Scaling::kTensor || kind == Fp8Scaling::kRowCol || kind == Fp8Scaling::kBlock,
             where + "unknown Fp8Scaling");
  WEFT_CHECK(pr.m > 0 && pr.n > 0 && pr.k > 0, where + "M, N and K must be at least 1");
  WEFT_CHECK(pr.m <= INT32_MAX && pr.n <= INT32_MAX && pr.k <= INT32_MAX,
             where + "dimensions above 2^31 - 1 are not supported (TMA coordinates are 32-bit)");
  WEFT_CHECK(o.cluster <= 1 && o.tile_n == 0 && !o.zero_unused_rows && o.activation == Activation::kNone,
             where +
                 "options.cluster, tile_n, zero_unused_rows and activation are not taken by the FP8 GEMM "
                 "(its tile is 128 x 128, cluster 1)");
  WEFT_CHECK(o.group_m >= 0 && o.max_blocks >= 0, where + "options.group_m and max_blocks must be >= 0");
  WEFT_CHECK(o.group_rows == nullptr || pr.groups > 0,
             where + "options.group_rows is for the grouped FP8 GEMM (grouped_gemm_fp8)");
  pr.lda = o.lda ? o.lda : pr.k;
  pr.ldb = o.ldb ? o.ldb : pr.k;
  pr.ldc = o.ldc ? o.ldc : pr.n;
  WEFT_CHECK(pr.lda >= pr.k && pr.ldb >= pr.k, where + "lda and ldb must be at least K");
  WEFT_CHECK(pr.ldc >= pr.n, where + "ldc must be at least N");
  WEFT_CHECK(pr.lda % 16 == 0 && pr.ldb % 16 == 0,
             where + "A's and B's row strides (lda = " + std::to_string(pr.lda) +
                 ", ldb = " + std::to_string(pr.ldb) +
                 " one-byte elements) must be multiples of 16 bytes, which TMA requires; make K a multiple "
                 "of 16, e.g. by zero-padding");
  const int64_t k_blocks = (pr.k + 127) / 128, m_stride = pr.scales.a_m_stride,
                row_stride = pr.scales.a_row_stride;
  WEFT_CHECK(m_stride == 0 || (kind == Fp8Scaling::kBlock && m_stride >= pr.m && m_stride <= INT32_MAX),
             where + "scales.a_m_stride (" + std::to_string(m_stride) +
                 ") must be 0, or for block scales at least M (rows) and below 2^31");
  WEFT_CHECK(
      row_stride == 0 || (kind == Fp8Scaling::kBlock && row_stride >= k_blocks && row_stride <= INT32_MAX),
      where + "scales.a_row_stride (" + std::to_string(row_stride) +
          ") must be 0, or for block scales at least ceil(K / 128) = " + std::to_string(k_blocks) +
          " and below 2^31");
  WEFT_CHECK(
      m_stride == 0 || row_stride == 0,
      where +
          "A's block scales are M-major (scales.a_m_stride) or row-major (scales.a_row_stride), not both");
  const int64_t c_bytes = pr.c_type == DType::kFP32 ? 4 : 2;
  WEFT_CHECK((pr.ldc * c_bytes) % 16 == 0, where + "C's row stride ldc = " + std::to_string(pr.ldc) +
                                               " elements is not a multiple of 16 bytes, which TMA requires");
}

// The pointers: 16-byte aligned operands, 4-byte aligned scales on the device.
void check_pointers(const Fp8Problem& pr, const std::string& where) {
  WEFT_CHECK(pr.a && pr.b && pr.c, where + "A, B and C must not be null");
  for (const auto& [p, name] : {std::pair<const void*, const char*>{pr.a, "A"}, {pr.b, "B"}, {pr.c, "C"}})
    ops::check_pointer_alignment(p, name, 16, where);
  WEFT_CHECK(pr.scales.a && pr.scales.b, where + "scales.a and scales.b must not be null");
  ops::check_pointer_alignment(pr.scales.a, "scales.a", 4, where);
  ops::check_pointer_alignment(pr.scales.b, "scales.b", 4, where);
}

// The grouped GEMM's own rules: block scales, whole tiles of rows, dense B, C stored.
void check_grouped(const Fp8Problem& pr, bool launch, const std::string& where) {
  WEFT_CHECK(pr.groups >= 1, where + "groups must be at least 1");
  WEFT_CHECK(
      pr.scales.kind == Fp8Scaling::kBlock,
      where +
          "the grouped FP8 GEMM takes block scales (scales.kind Fp8Scaling::kBlock: A [rows, K / 128], B "
          "[groups, N / 128, K / 128])");
  WEFT_CHECK(pr.m % 128 == 0, where + "rows (the capacity) must be a multiple of 128, the tile's rows");
  WEFT_CHECK(pr.opt.ldb == 0 && pr.opt.ldc == 0, where + "B and C must be dense (ldb, ldc 0)");
  WEFT_CHECK(pr.opt.store == GemmStore::kStore, where + "C is stored (no reduce-add)");
  WEFT_CHECK(int64_t(pr.groups) * pr.n <= INT32_MAX, where + "B's rows (groups x N) past 2^31 - 1");
  if (launch) {
    WEFT_CHECK(pr.group_end != nullptr, where + "group_end must not be null");
    ops::check_pointer_alignment(pr.group_end, "group_end", 4, where);
    if (pr.opt.group_rows != nullptr)
      ops::check_pointer_alignment(pr.opt.group_rows, "options.group_rows", 4, where);
  }
}

Plan plan_or_launch(Fp8Problem pr, cudaStream_t stream, bool launch) {
  const std::string where = (pr.groups ? "weft::grouped_gemm_fp8(rows=" : "weft::gemm_fp8(M=") +
                            std::to_string(pr.m) + ", N=" + std::to_string(pr.n) +
                            ", K=" + std::to_string(pr.k) +
                            (pr.groups ? ", groups=" + std::to_string(pr.groups) : "") + "): ";
  check_problem(pr, where);
  if (pr.groups || pr.group_end) check_grouped(pr, launch, where);
  if (launch) check_pointers(pr, where);
  const ops::DeviceFacts dev = ops::device_facts();
  WEFT_CHECK(dev.cc == 90, "weft::gemm_fp8 runs on Hopper (sm_90) GPUs (wgmma, built for sm_90a); device " +
                               std::to_string(dev.device) + " is sm_" + std::to_string(dev.cc));
  const bool e5m2 = pr.ab_type == Fp8Type::kE5M2;
  if (pr.c_type == DType::kBF16)
    return e5m2 ? run_typed<__nv_bfloat16, true>(pr, stream, launch)
                : run_typed<__nv_bfloat16, false>(pr, stream, launch);
  return e5m2 ? run_typed<float, true>(pr, stream, launch) : run_typed<float, false>(pr, stream, launch);
}

}  // namespace

void gemm_fp8(const void* a, const void* b, void* c, int64_t m, int64_t n, int64_t k, Fp8Type ab_type,
              const Fp8Scales& scales, DType c_type, cudaStream_t stream, const GemmOptions& options) {
  plan_or_launch(Fp8Problem{a, b, c, m, n, k, ab_type, scales, c_type, options}, stream, true);
}

Plan gemm_fp8_plan(int64_t m, int64_t n, int64_t k, Fp8Type ab_type, const Fp8Scales& scales, DType c_type,
                   const GemmOptions& options) {
  return plan_or_launch(Fp8Problem{nullptr, nullptr, nullptr, m, n, k, ab_type, scales, c_type, options},
                        nullptr, false);
}

void grouped_gemm_fp8(const void* a, const void* b, void* c, const int32_t* group_end, int groups,
                      int64_t rows, int64_t n, int64_t k, Fp8Type ab_type, const Fp8Scales& scales,
                      DType c_type, cudaStream_t stream, const GemmOptions& options) {
  WEFT_CHECK(groups >= 1, "weft::grouped_gemm_fp8: groups must be at least 1, got " + std::to_string(groups));
  Fp8Problem pr{a, b, c, rows, n, k, ab_type, scales, c_type, options};
  pr.group_end = group_end;
  pr.groups = groups;
  plan_or_launch(pr, stream, true);
}

Plan grouped_gemm_fp8_plan(int groups, int64_t rows, int64_t n, int64_t k, Fp8Type ab_type,
                           const Fp8Scales& scales, DType c_type, const GemmOptions& options) {
  WEFT_CHECK(groups >= 1,
             "weft::grouped_gemm_fp8_plan: groups must be at least 1, got " + std::to_string(groups));
  Fp8Problem pr{nullptr, nullptr, nullptr, rows, n, k, ab_type, scales, c_type, options};
  pr.groups = groups;
  return plan_or_launch(pr, nullptr, false);
}

}  // namespace weft
