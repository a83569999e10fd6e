// ops::WorkspaceLayout: the parts of a workspace start on 256-byte boundaries, and sizing and carving (the
// same code, without and with a base) agree.
#include <gtest/gtest.h>

#include <cstdint>

#include "ops/op_args.hpp"

namespace {

struct Parts {
  int32_t* counts;
  uint64_t* flags;
  char* rows;
};
// One op's carving, as a launcher and its sizing function would both run it.
Parts carve(weft::ops::WorkspaceLayout& w, size_t n) {
  Parts p;
  p.counts = w.take<int32_t>(n * 4);
  p.flags = w.take<uint64_t>(8);
  p.rows = w.take(n * 1000 + 1);
  return p;
}

TEST(WorkspaceLayout, SizingAndCarvingAgree) {
  weft::ops::WorkspaceLayout sized;
  const Parts none = carve(sized, 3);
  EXPECT_EQ(none.counts, nullptr);
  EXPECT_EQ(none.rows, nullptr);
  EXPECT_EQ(sized.bytes(), 256u + 256u + 3072u);  // 12 -> 256, 8 -> 256, 3001 -> 3072

  alignas(256) static char base[4096];
  weft::ops::WorkspaceLayout at(base);
  const Parts p = carve(at, 3);
  EXPECT_EQ(at.bytes(), sized.bytes());
  EXPECT_EQ(reinterpret_cast<char*>(p.counts), base);
  EXPECT_EQ(reinterpret_cast<char*>(p.flags), base + 256);
  EXPECT_EQ(p.rows, base + 512);
}

TEST(WorkspaceLayout, EmptyPartsTakeNoRoom) {
  weft::ops::WorkspaceLayout w;
  w.take(0);
  EXPECT_EQ(w.bytes(), 0u);
  EXPECT_EQ(weft::ops::round256(1), 256u);
  EXPECT_EQ(weft::ops::round256(256), 256u);
  EXPECT_EQ(weft::ops::round256(257), 512u);
}

}  // namespace
