// weft::gemm_fp8_plan and weft::quantize_fp8 refuse bad arguments with a message naming the rule, before
// they touch a GPU (so these run on the CPU-only CI machine).
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "test_util.hpp"
#include "weft/ops/gemm.hpp"
#include "weft/runtime/error.hpp"

namespace {

using namespace weft;
using weft_test::error_of;

const Fp8Scales kTensorScales{Fp8Scaling::kTensor, nullptr, nullptr};

std::string plan_error(int64_t m, int64_t n, int64_t k, DType out = DType::kBF16, GemmOptions o = {},
                       Fp8Type t = Fp8Type::kE4M3) {
  return error_of([&] { (void)gemm_fp8_plan(m, n, k, t, kTensorScales, out, o); });
}

TEST(GemmFp8Checks, RefusesWhatTmaCannotDo) {
  EXPECT_NE(plan_error(64, 64, 24).find("make K a multiple of 16"), std::string::npos);
  EXPECT_NE(plan_error(64, 60, 64).find("ldc"), std::string::npos);  // 60 bf16 = 120 bytes
  GemmOptions lda;
  lda.lda = 40;
  EXPECT_NE(plan_error(64, 64, 32, DType::kBF16, lda).find("multiples of 16 bytes"), std::string::npos);
}

TEST(GemmFp8Checks, RefusesBadShapesTypesAndOptions) {
  EXPECT_NE(plan_error(0, 64, 64).find("at least 1"), std::string::npos);
  EXPECT_NE(plan_error(64, 64, 64, DType::kFP16).find("bf16 or fp32"), std::string::npos);
  GemmOptions wide;
  wide.tile_n = 256;
  EXPECT_NE(plan_error(64, 64, 64, DType::kBF16, wide).find("tile_n"), std::string::npos);
  GemmOptions swiglu;
  swiglu.activation = Activation::kSwiGLU;
  EXPECT_NE(plan_error(64, 64, 64, DType::kBF16, swiglu).find("activation"), std::string::npos);
  EXPECT_NE(plan_error(64, 64, 64, DType::kBF16, {}, Fp8Type(7)).find("kE4M3 or kE5M2"), std::string::npos);
  const std::string e = error_of([] {
    (void)gemm_fp8_plan(64, 64, 64, Fp8Type::kE4M3, Fp8Scales{Fp8Scaling(9), nullptr, nullptr}, DType::kBF16);
  });
  EXPECT_NE(e.find("unknown Fp8Scaling"), std::string::npos) << e;
}

TEST(GemmFp8Checks, GroupedRefusesWhatItCannotRun) {
  auto grouped = [](int groups, int64_t rows, GemmOptions o = {}, int64_t row_stride = 0,
                    int64_t m_stride = 0, Fp8Scaling kind = Fp8Scaling::kBlock) {
    Fp8Scales scales{kind};
    scales.a_row_stride = row_stride;
    scales.a_m_stride = m_stride;
    return error_of([&] {
      (void)grouped_gemm_fp8_plan(groups, rows, 256, 256, Fp8Type::kE4M3, scales, DType::kBF16, o);
    });
  };
  EXPECT_NE(grouped(2, 256, {}, 0, 0, Fp8Scaling::kRowCol).find("takes block scales"), std::string::npos);
  EXPECT_NE(grouped(0, 256).find("groups must be at least 1"), std::string::npos);
  EXPECT_NE(grouped(2, 500).find("multiple of 128"), std::string::npos);
  GemmOptions ldb;
  ldb.ldb = 512;
  EXPECT_NE(grouped(2, 256, ldb).find("B and C must be dense"), std::string::npos);
  GemmOptions add;
  add.store = GemmStore::kReduceAdd;
  EXPECT_NE(grouped(2, 256, add).find("C is stored"), std::string::npos);
  EXPECT_NE(grouped(2, 256, {}, 1).find("a_row_stride"), std::string::npos);     // ceil(256 / 128) = 2
  EXPECT_NE(grouped(2, 256, {}, 0, 255).find("a_m_stride"), std::string::npos);  // below the rows
  EXPECT_NE(grouped(2, 256, {}, 2, 256).find("not both"), std::string::npos);
  GemmOptions lda;
  lda.lda = 272;  // a row stride past K, a multiple of 16: moe_dispatch_fp8's packed rows
  const std::string ok = grouped(2, 256, lda, 68);
  EXPECT_EQ(ok.find("lda"), std::string::npos) << ok;  // (without a GPU it stops at the device check)
  EXPECT_EQ(ok.find("stride"), std::string::npos) << ok;
  const std::string m_major = grouped(2, 256, {}, 0, 260);
  EXPECT_EQ(m_major.find("stride"), std::string::npos) << m_major;
}

TEST(GemmFp8Checks, QuantizeRefusesBadArguments) {
  float scale = 0;
  char buf[64];
  auto quantize = [&](DType in_type, int64_t rows, int64_t cols, int64_t ld_in = 0, void* in = nullptr) {
    return error_of([&] {
      quantize_fp8(in ? in : buf, in_type, buf, Fp8Type::kE4M3, &scale, rows, cols, Fp8Scaling::kBlock,
                   Fp8Operand::kA, nullptr, ld_in);
    });
  };
  EXPECT_NE(quantize(DType::kFP32, 4, 4).find("bf16 or fp16"), std::string::npos);
  EXPECT_NE(quantize(DType::kBF16, 0, 4).find("at least 1"), std::string::npos);
  EXPECT_NE(quantize(DType::kBF16, 4, 8, 4).find("at least cols"), std::string::npos);
  const std::string null_in = error_of([&] {
    quantize_fp8(nullptr, DType::kBF16, buf, Fp8Type::kE4M3, &scale, 4, 4, Fp8Scaling::kBlock, Fp8Operand::kA,
                 nullptr);
  });
  EXPECT_NE(null_in.find("must not be null"), std::string::npos) << null_in;
  // M-major scales: block scales of operand A only, a stride of at least rows.
  const auto m_major = [&](Fp8Scaling kind, Fp8Operand operand, int64_t stride) {
    return error_of([&] {
      quantize_fp8(buf, DType::kBF16, buf, Fp8Type::kE4M3, &scale, 4, 4, kind, operand, nullptr, 0, 0, stride);
    });
  };
  EXPECT_NE(m_major(Fp8Scaling::kBlock, Fp8Operand::kB, 4).find("block scales of operand A"), std::string::npos);
  EXPECT_NE(m_major(Fp8Scaling::kRowCol, Fp8Operand::kA, 4).find("block scales of operand A"), std::string::npos);
  EXPECT_NE(m_major(Fp8Scaling::kBlock, Fp8Operand::kA, 3).find("at least rows"), std::string::npos);
  // Rows of a stride: block scales of operand A only, at least the row's groups, not with M-major.
  const auto row_stride = [&](Fp8Scaling kind, Fp8Operand operand, int64_t cols, int64_t m_stride,
                              int64_t stride) {
    return error_of([&] {
      quantize_fp8(buf, DType::kBF16, buf, Fp8Type::kE4M3, &scale, 4, cols, kind, operand, nullptr, 0, 0,
                   m_stride, stride);
    });
  };
  EXPECT_NE(row_stride(Fp8Scaling::kBlock, Fp8Operand::kB, 4, 0, 1).find("block scales of operand A"),
            std::string::npos);
  EXPECT_NE(row_stride(Fp8Scaling::kTensor, Fp8Operand::kA, 4, 0, 1).find("block scales of operand A"),
            std::string::npos);
  EXPECT_NE(row_stride(Fp8Scaling::kBlock, Fp8Operand::kA, 300, 0, 2)
                .find("at least the row's 128-column groups (3)"),
            std::string::npos);
  EXPECT_NE(row_stride(Fp8Scaling::kBlock, Fp8Operand::kA, 4, 4, 1).find("two layouts"), std::string::npos);
}

TEST(GemmFp8Checks, ActivateQuantizeRefusesBadArguments) {
  float scale = 0;
  alignas(16) char buf[256];
  int32_t ends[1] = {4};
  auto call = [&](Activation act, int64_t cols, int64_t ld_in = 0, const Fp8QuantizeRows& which = {},
                  DType in_type = DType::kBF16) {
    return error_of([&] {
      activate_quantize_fp8(buf, in_type, act, buf, Fp8Type::kE4M3, &scale, 4, cols, nullptr, ld_in, 0, 0,
                            which);
    });
  };
  EXPECT_NE(call(Activation::kNone, 6).find("multiples of 4"), std::string::npos);
  EXPECT_NE(call(Activation::kSwiGLU, 8, 8).find("ld_in must be at least 16"), std::string::npos);
  EXPECT_NE(call(Activation(9), 8).find("unknown Activation"), std::string::npos);
  EXPECT_NE(call(Activation::kGELU, 8, 0, {}, DType::kFP32).find("bf16 or fp16"), std::string::npos);
  EXPECT_NE(call(Activation::kSiLU, 8, 0, Fp8QuantizeRows{nullptr, ends, 1}).find("needs which.group_end"),
            std::string::npos);
  const std::string m_major = error_of([&] {
    activate_quantize_fp8(buf, DType::kBF16, Activation::kNone, buf, Fp8Type::kE4M3, &scale, 4, 8, nullptr, 0,
                          0, 3);
  });
  EXPECT_NE(m_major.find("scale_m_stride (3) must be 0 or at least rows"), std::string::npos) << m_major;
}

}  // namespace
