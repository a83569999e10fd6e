// weft::gemm_plan and weft::grouped_gemm_plan refuse bad arguments with a message naming the rule, before
// they touch a GPU (so these run on the CPU-only CI machine).
#include <gtest/gtest.h>

#include <string>

#include "test_util.hpp"
#include "weft/ops/gemm.hpp"
#include "weft/runtime/error.hpp"

namespace {

using namespace weft;
using weft_test::error_of;

std::string gemm_error(int64_t m, int64_t n, int64_t k, BLayout lay = BLayout::kNK, DType out = DType::kBF16,
                       GemmOptions o = {}) {
  return error_of([&] { (void)gemm_plan(m, n, k, lay, out, o); });
}
std::string grouped_error(int groups, int64_t rows, GemmOptions o = {}, DType out = DType::kBF16) {
  return error_of([&] { (void)grouped_gemm_plan(groups, rows, 256, 256, BLayout::kNK, out, o); });
}
bool has(const std::string& s, const char* part) {
  return s.find(part) != std::string::npos;
}

TEST(GemmChecks, RefusesBadShapesTypesAndOptions) {
  EXPECT_TRUE(has(gemm_error(0, 64, 64), "M, N and K must be at least 1"));
  EXPECT_TRUE(has(gemm_error(64, 64, 64, BLayout::kNK, DType::kFP16), "C must be bf16 or fp32"));
  EXPECT_TRUE(has(gemm_error(64, 64, 64, BLayout(7)), "unknown B layout"));
  GemmOptions cluster;
  cluster.cluster = 3;
  EXPECT_TRUE(has(gemm_error(64, 64, 64, BLayout::kNK, DType::kBF16, cluster), "options.cluster"));
  GemmOptions tile;
  tile.tile_n = 64;
  EXPECT_TRUE(has(gemm_error(64, 64, 64, BLayout::kNK, DType::kBF16, tile), "options.tile_n"));
  tile.tile_n = 128;
  tile.cluster = 2;
  EXPECT_TRUE(has(gemm_error(64, 64, 64, BLayout::kNK, DType::kBF16, tile), "cluster 1 only"));
}

TEST(GemmChecks, RefusesWhatTmaCannotDo) {
  const std::string k = gemm_error(64, 64, 20);  // 20 bf16 = 40 bytes a row of A
  EXPECT_TRUE(has(k, "lda")) << k;
  EXPECT_TRUE(has(k, "multiple of 16 bytes")) << k;
  EXPECT_TRUE(has(gemm_error(64, 60, 64, BLayout::kKN), "ldb")) << "B [K,N] rows of 60 bf16";
  EXPECT_TRUE(has(gemm_error(64, 62, 64, BLayout::kNK, DType::kFP32), "ldc")) << "C rows of 62 fp32";
}

TEST(GemmChecks, GroupedRefusesWhatItCannotRun) {
  EXPECT_TRUE(has(grouped_error(0, 256), "groups must be at least 1"));
  EXPECT_TRUE(has(grouped_error(2, 500), "multiple of 128"));
  GemmOptions ldb;
  ldb.ldb = 512;
  EXPECT_TRUE(has(grouped_error(2, 256, ldb), "strides must be dense"));
  GemmOptions add;
  add.store = GemmStore::kReduceAdd;
  EXPECT_TRUE(has(grouped_error(2, 256, add), "C is stored"));
  GemmOptions cluster;
  cluster.cluster = 2;
  EXPECT_TRUE(has(grouped_error(2, 256, cluster), "options.cluster must be 0 or 1"));
  GemmOptions gelu;
  gelu.activation = Activation::kGELU;
  EXPECT_TRUE(has(grouped_error(2, 256, gelu), "kNone or kSwiGLU, got Activation(3)"));
  GemmOptions swiglu;
  swiglu.activation = Activation::kSwiGLU;  // N = 256 takes it
  EXPECT_FALSE(has(grouped_error(2, 256, swiglu), "Activation")) << grouped_error(2, 256, swiglu);
  // A plan the rules allow: without a GPU it stops at the device check, past every rule above.
  const std::string ok = grouped_error(2, 256);
  for (const char* rule : {"groups", "multiple of 128", "dense", "C is stored", "cluster"})
    EXPECT_FALSE(has(ok, rule)) << ok;
}

}  // namespace
