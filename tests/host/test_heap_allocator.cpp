#include <gtest/gtest.h>

#include "weft/runtime/heap_allocator.hpp"

TEST(HeapAllocator, FirstAllocationAtZero) {
  weft::HeapAllocator a(64 << 20, 2 << 20);
  EXPECT_EQ(a.allocate(1), 0u);
}
