// kAuto's path rule for the fused TP ops (src/ops/fused_rules.hpp): the decisions at the edges of every row
// of the table, so that a change of the rule is a visible change of these expectations.
#include <gtest/gtest.h>

#include "ops/fused_rules.hpp"

using weft::FusedPath;
using weft::ops::auto_ag_comm_blocks;
using weft::ops::auto_path;
using weft::ops::auto_sums_in_epilogue;

namespace {
constexpr bool kAG = true, kRS = false;
}

TEST(FusedRules, AllGatherMatmulFusedFrom8192RowsAtFourGpus) {
  EXPECT_EQ(auto_path(kAG, 8192, 4096, 8192, 4), FusedPath::kFused);
  EXPECT_EQ(auto_path(kAG, 8192, 4096, 8192, 8), FusedPath::kFused);  // larger teams take the 4-GPU rows
  EXPECT_EQ(auto_path(kAG, 8192, 7168, 8192, 4), FusedPath::kFused);  // any N per rank
  EXPECT_NE(auto_path(kAG, 4096, 4096, 8192, 4), FusedPath::kFused);  // M below 8192
  EXPECT_EQ(auto_path(kAG, 8192, 4096, 8192, 2), FusedPath::kPipelined);  // 2 GPUs: the pipeline
  EXPECT_EQ(auto_path(kAG, 16384, 14336, 8192, 2), FusedPath::kPipelined);
  EXPECT_NE(auto_path(kAG, 8192, 4096, 8192, 3), FusedPath::kFused);  // 3 GPUs: not measured
}

TEST(FusedRules, SummedMatmulsFusedAtFourAndUpTo2048RowsAtTwo) {
  EXPECT_EQ(auto_path(kRS, 16384, 8192, 8192, 4), FusedPath::kFused);
  EXPECT_EQ(auto_path(kRS, 32768, 28672, 8192, 4), FusedPath::kFused);  // 2^29.8: every size at 4 GPUs
  EXPECT_EQ(auto_path(kRS, 2048, 8192, 8192, 2), FusedPath::kFused);
  EXPECT_EQ(auto_path(kRS, 2048, 28672, 8192, 2), FusedPath::kFused);   // any N up to 2048 rows
  EXPECT_NE(auto_path(kRS, 4096, 8192, 8192, 2), FusedPath::kFused);    // from 4096 rows: the pipeline
  EXPECT_NE(auto_path(kRS, 1024, 8192, 8192, 3), FusedPath::kFused);    // 3 GPUs: no row
}

TEST(FusedRules, PipelineFromSixteenMiBPushesEightWithOnePeer) {
  // 3 GPUs (no fused row): 16 MiB pushes pipeline, less does not.
  EXPECT_EQ(auto_path(kRS, 3072, 8192, 8192, 3), FusedPath::kPipelined);   // 1024 rows x 8192 x 2 = 16 MiB
  EXPECT_EQ(auto_path(kRS, 1536, 8192, 8192, 3), FusedPath::kSequential);  // 8 MiB
  // 2 GPUs: the fused kernel up to 2048 rows; from 4096 rows the pipeline (its push M x N bytes >= 32 MiB).
  EXPECT_EQ(auto_path(kRS, 4096, 8192, 8192, 2), FusedPath::kPipelined);
  // AG at 2 GPUs, one push per call: 8 MiB is enough where N per rank <= 4096.
  EXPECT_EQ(auto_path(kAG, 1024, 4096, 8192, 2), FusedPath::kPipelined);  // 512 rows x 8192 x 2 = 8 MiB
  EXPECT_EQ(auto_path(kAG, 512, 4096, 8192, 2), FusedPath::kSequential);  // 4 MiB
  // AG at 2 GPUs with N per rank above 4096 waits for 16 MiB pushes (of A: M / 2 rows x K x 2 bytes).
  EXPECT_EQ(auto_path(kAG, 1024, 8192, 8192, 2), FusedPath::kSequential);  // 8 MiB
  EXPECT_EQ(auto_path(kAG, 2048, 8192, 8192, 2), FusedPath::kPipelined);   // 16 MiB
}

TEST(FusedRules, PartialsSummedInTheEpilogueForTheAllReduceAndTheTwoGpuReduceScatter) {
  constexpr bool kAR = true;
  EXPECT_TRUE(auto_sums_in_epilogue(kAR, 2));
  EXPECT_TRUE(auto_sums_in_epilogue(kAR, 4));
  EXPECT_TRUE(auto_sums_in_epilogue(kAR, 8));
  EXPECT_TRUE(auto_sums_in_epilogue(kRS, 2));
  EXPECT_FALSE(auto_sums_in_epilogue(kRS, 3));  // measured at 2 GPUs only
  EXPECT_FALSE(auto_sums_in_epilogue(kRS, 4));
}

TEST(FusedRules, EveryRowSaysWhereItWasMeasured) {
  for (const auto& r : weft::ops::kSummedPartialsRules)
    EXPECT_NE(std::string(r.measured).find("H200"), std::string::npos) << r.measured;
  for (const auto& r : weft::ops::kFusedKernelRules) {
    EXPECT_NE(std::string(r.measured).find("H200"), std::string::npos) << r.measured;
    EXPECT_LE(r.min_world, r.max_world);
  }
}

TEST(FusedRules, CopyEngineGatherAtTwoGpusFrom8192Rows) {
  using weft::ops::auto_gathers_by_copy_engine;
  EXPECT_TRUE(auto_gathers_by_copy_engine(2, 8192));
  EXPECT_TRUE(auto_gathers_by_copy_engine(2, 32768));
  EXPECT_FALSE(auto_gathers_by_copy_engine(2, 4096));  // the pipeline below
  EXPECT_FALSE(auto_gathers_by_copy_engine(4, 8192));  // slower than the communicator blocks at 4 GPUs
  EXPECT_FALSE(auto_gathers_by_copy_engine(3, 8192));  // not measured
}

TEST(FusedRules, AllGatherCommunicatorBlocksByNPerRank) {
  EXPECT_EQ(auto_ag_comm_blocks(132, 2048, false), 16);  // N per rank <= 4096: an eighth of the budget
  EXPECT_EQ(auto_ag_comm_blocks(132, 4096, false), 16);
  EXPECT_EQ(auto_ag_comm_blocks(132, 7168, false), 4);  // above: a 32nd
  EXPECT_EQ(auto_ag_comm_blocks(132, 7168, true), 8);   // FP8: a 16th
  EXPECT_EQ(auto_ag_comm_blocks(33, 7168, false), 2);   // at least 2 (a quarter of a GPU, virtual ranks)
  EXPECT_EQ(auto_ag_comm_blocks(66, 2048, false), 8);   // even counts
  EXPECT_EQ(auto_ag_comm_blocks(44, 2048, false), 4);   // 5 rounded down to even
}
