#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <random>
#include <vector>

#include "test_util.hpp"
#include "weft/runtime/heap_allocator.hpp"

using weft::HeapAllocator;
using weft_test::error_of;

namespace {
constexpr uint64_t kMiB = 1ull << 20;
constexpr uint64_t kG = 2 * kMiB;  // the usual VMM granularity
}  // namespace

TEST(HeapAllocator, FirstFitPlacesBlocksBackToBack) {
  HeapAllocator a(64 * kMiB, kG);
  EXPECT_EQ(a.allocate(1), 0u);
  EXPECT_EQ(a.allocate(kG), kG);
  EXPECT_EQ(a.allocate(3 * kMiB), 2 * kG);  // rounded to 2 granules
  EXPECT_EQ(a.allocate(kG + 1), 4 * kG);
  EXPECT_EQ(a.live_count(), 4u);
  EXPECT_EQ(a.free_block_count(), 1u);
  EXPECT_EQ(a.largest_free(), 64 * kMiB - 6 * kG);
}

TEST(HeapAllocator, RoundsUpToGranularity) {
  HeapAllocator a(64 * kMiB, kG);
  EXPECT_EQ(a.round_up(1), kG);
  EXPECT_EQ(a.round_up(kG - 1), kG);
  EXPECT_EQ(a.round_up(kG), kG);
  EXPECT_EQ(a.round_up(kG + 1), 2 * kG);
  EXPECT_EQ(a.round_up(0), 0u);
  const uint64_t off = a.allocate(5 * kMiB);
  EXPECT_EQ(a.size_of(off), 6 * kMiB);
  EXPECT_EQ(a.bytes_in_use(), 6 * kMiB);
  EXPECT_EQ(a.size_of(off + kG), 0u);  // inside a block, but not its start

  HeapAllocator b(1 << 16, 4096);
  EXPECT_EQ(b.granularity(), 4096u);
  EXPECT_EQ(b.capacity(), uint64_t{1} << 16);
  EXPECT_EQ(b.round_up(4097), 8192u);
}

TEST(HeapAllocator, IdenticalCallSequencesGiveIdenticalOffsets) {
  // Two "ranks" fed the same collective sequence must agree on every offset.
  HeapAllocator r0(256 * kMiB, kG), r1(256 * kMiB, kG);
  std::mt19937_64 rng(7);
  std::vector<uint64_t> live;
  for (int i = 0; i < 500; ++i) {
    if (!live.empty() && (rng() % 3 == 0)) {
      const size_t k = rng() % live.size();
      r0.free(live[k]);
      r1.free(live[k]);
      live.erase(live.begin() + static_cast<long>(k));
    } else {
      const uint64_t bytes = 1 + rng() % (9 * kMiB);
      std::string e0, e1;
      uint64_t o0 = ~0ull, o1 = ~1ull;
      e0 = error_of([&] { o0 = r0.allocate(bytes); });
      e1 = error_of([&] { o1 = r1.allocate(bytes); });
      ASSERT_EQ(e0, e1);
      if (e0 == "<no exception>") {
        ASSERT_EQ(o0, o1) << "step " << i;
        live.push_back(o0);
      }
    }
    ASSERT_EQ(r0.describe(), r1.describe());
  }
}

TEST(HeapAllocator, FreeMergesWithFollowingBlock) {
  HeapAllocator a(16 * kMiB, kMiB);
  const uint64_t x = a.allocate(kMiB), y = a.allocate(kMiB), z = a.allocate(kMiB);
  a.allocate(kMiB);  // keeps z's free space apart from the tail
  a.free(z);
  EXPECT_EQ(a.free_block_count(), 2u);  // [z] and the tail
  a.free(y);                            // y + z become one block
  EXPECT_EQ(a.free_block_count(), 2u);
  EXPECT_EQ(a.size_of(y), 0u);
  EXPECT_EQ(a.allocate(2 * kMiB), y);  // the merged hole is found first
  EXPECT_EQ(x, 0u);
}

TEST(HeapAllocator, FreeMergesWithPrecedingBlock) {
  HeapAllocator a(16 * kMiB, kMiB);
  a.allocate(kMiB);
  const uint64_t y = a.allocate(kMiB), z = a.allocate(kMiB);
  a.allocate(kMiB);
  a.free(y);
  EXPECT_EQ(a.free_block_count(), 2u);
  a.free(z);  // merges into y's block
  EXPECT_EQ(a.free_block_count(), 2u);
  EXPECT_EQ(a.allocate(2 * kMiB), y);
}

TEST(HeapAllocator, FreeMergesBothSidesAndTail) {
  HeapAllocator a(8 * kMiB, kMiB);
  const uint64_t x = a.allocate(kMiB), y = a.allocate(2 * kMiB), z = a.allocate(kMiB);
  a.free(x);
  a.free(z);  // z merges with the tail
  EXPECT_EQ(a.free_block_count(), 2u);
  EXPECT_EQ(a.largest_free(), 5 * kMiB);
  a.free(y);  // y merges with x before it and z+tail after it
  EXPECT_EQ(a.free_block_count(), 1u);
  EXPECT_EQ(a.largest_free(), 8 * kMiB);
  EXPECT_EQ(a.bytes_in_use(), 0u);
  EXPECT_EQ(a.live_count(), 0u);
  EXPECT_EQ(a.allocate(8 * kMiB), 0u);  // the whole heap is one block again
}

TEST(HeapAllocator, ReusesFreedHoleFirstFit) {
  HeapAllocator a(32 * kMiB, kMiB);
  a.allocate(kMiB);                            // 0
  const uint64_t hole = a.allocate(3 * kMiB);  // 1..3
  a.allocate(kMiB);                            // 4
  a.free(hole);
  EXPECT_EQ(a.allocate(kMiB), hole);             // lowest fitting hole
  EXPECT_EQ(a.allocate(3 * kMiB), 5 * kMiB);     // 2 MiB left in the hole: too small, goes to the tail
  EXPECT_EQ(a.allocate(2 * kMiB), hole + kMiB);  // fills the rest of the hole exactly
  EXPECT_EQ(a.free_block_count(), 1u);
}

TEST(HeapAllocator, ExhaustionMessageNamesLargestFreeBlock) {
  HeapAllocator a(8 * kMiB, kMiB);
  std::vector<uint64_t> offs;
  for (int i = 0; i < 8; ++i) offs.push_back(a.allocate(kMiB));
  for (int i = 0; i < 8; i += 2) a.free(offs[i]);  // four separate 1 MiB holes
  const std::string msg = error_of([&] { a.allocate(2 * kMiB); });
  EXPECT_HAS(msg, "symmetric heap exhausted");
  EXPECT_HAS(msg, "asked for 2 MiB");
  EXPECT_HAS(msg, "4 MiB of 8 MiB in use");
  EXPECT_HAS(msg, "largest free block 1 MiB");
  // A failed allocation changes nothing.
  EXPECT_EQ(a.bytes_in_use(), 4 * kMiB);
  EXPECT_EQ(a.live_count(), 4u);
  EXPECT_EQ(a.free_block_count(), 4u);
  EXPECT_EQ(a.allocate(kMiB), 0u);
}

TEST(HeapAllocator, ExhaustionMessageExactForSmallGranularity) {
  // Sizes below a MiB must not be reported as "0 MiB".
  HeapAllocator a(64 * 1024, 4096);
  const uint64_t x = a.allocate(16 * 1024);
  a.allocate(40 * 1024);
  a.free(x);  // free: 16 KiB hole + 8 KiB tail
  const std::string msg = error_of([&] { a.allocate(20 * 1024); });
  EXPECT_HAS(msg, "asked for 20480 bytes");
  EXPECT_HAS(msg, "largest free block 16384 bytes");
  EXPECT_LACKS(msg, " 0 MiB");
}

TEST(HeapAllocator, RequestLargerThanCapacityIsRejected) {
  HeapAllocator a(8 * kMiB, kMiB);
  const std::string msg = error_of([&] { a.allocate(8 * kMiB + 1); });
  EXPECT_HAS(msg, "exceeds the heap capacity of 8 MiB");
  EXPECT_HAS(error_of([&] { a.allocate(~0ull); }), "exceeds the heap capacity");  // no round-up overflow
  EXPECT_EQ(a.bytes_in_use(), 0u);
}

TEST(HeapAllocator, ZeroSizeIsAnError) {
  HeapAllocator a(8 * kMiB, kMiB);
  EXPECT_HAS(error_of([&] { a.allocate(0); }), "0 bytes");
  EXPECT_EQ(a.live_count(), 0u);
}

TEST(HeapAllocator, DoubleFreeAndUnknownOffsetAreErrors) {
  HeapAllocator a(8 * kMiB, kMiB);
  const uint64_t x = a.allocate(2 * kMiB);
  const uint64_t y = a.allocate(kMiB);
  a.free(x);
  std::string msg = error_of([&] { a.free(x); });
  EXPECT_HAS(msg, "free of heap offset " + std::to_string(x));
  EXPECT_HAS(msg, "double free");
  EXPECT_HAS(error_of([&] { a.free(y + 4096); }), "not a live symmetric allocation");    // inside a block
  EXPECT_HAS(error_of([&] { a.free(6 * kMiB); }), "not a live symmetric allocation");    // free space
  EXPECT_HAS(error_of([&] { a.free(1ull << 40); }), "not a live symmetric allocation");  // past the end
  // The bad frees left the state alone.
  EXPECT_EQ(a.size_of(y), kMiB);
  EXPECT_EQ(a.bytes_in_use(), kMiB);
  EXPECT_EQ(a.free_block_count(), 2u);
}

TEST(HeapAllocator, GranularityMustBeAPowerOfTwo) {
  for (uint64_t g : {uint64_t{0}, uint64_t{3}, uint64_t{6} << 20, (uint64_t{2} << 20) + 1}) {
    const std::string msg = error_of([&] { HeapAllocator a(64 * kMiB, g); });
    EXPECT_HAS(msg, "granularity must be a power of two");
    EXPECT_HAS(msg, std::to_string(g));
  }
  EXPECT_EQ(error_of([] { HeapAllocator a(64, 1); }), "<no exception>");
}

TEST(HeapAllocator, CapacityMustBeAPositiveMultipleOfGranularity) {
  for (uint64_t cap : {uint64_t{0}, kMiB, 3 * kMiB, 64 * kMiB + 4096}) {
    const std::string msg = error_of([&] { HeapAllocator a(cap, kG); });
    EXPECT_HAS(msg, "heap capacity " + std::to_string(cap));
    EXPECT_HAS(msg, "multiple of the granularity");
  }
  HeapAllocator one(kG, kG);  // a single granule is fine
  EXPECT_EQ(one.allocate(1), 0u);
  EXPECT_HAS(error_of([&] { one.allocate(1); }), "exhausted");
}

TEST(HeapAllocator, BytesInUseBookkeeping) {
  HeapAllocator a(64 * kMiB, kG);
  const uint64_t x = a.allocate(1);
  EXPECT_EQ(a.bytes_in_use(), kG);
  const uint64_t y = a.allocate(5 * kMiB);
  EXPECT_EQ(a.bytes_in_use(), kG + 6 * kMiB);
  const uint64_t z = a.allocate(kG);
  EXPECT_EQ(a.bytes_in_use(), 2 * kG + 6 * kMiB);
  a.free(y);
  EXPECT_EQ(a.bytes_in_use(), 2 * kG);
  a.free(x);
  a.free(z);
  EXPECT_EQ(a.bytes_in_use(), 0u);
  EXPECT_EQ(a.largest_free(), 64 * kMiB);
  EXPECT_HAS(a.describe(), "0 live");
}

// First fit over granules, written the slow obvious way.
struct ReferenceHeap {
  std::vector<bool> used;
  std::map<uint64_t, uint64_t> live;  // first granule -> granules
  explicit ReferenceHeap(size_t granules) : used(granules, false) {}

  long allocate(uint64_t n) {
    for (size_t start = 0; start + n <= used.size(); ++start) {
      size_t k = 0;
      while (k < n && !used[start + k]) ++k;
      if (k == n) {
        for (size_t i = 0; i < n; ++i) used[start + i] = true;
        live[start] = n;
        return static_cast<long>(start);
      }
      start += k;  // skip past the used granule
    }
    return -1;
  }
  void free(uint64_t start) {
    for (size_t i = 0; i < live.at(start); ++i) used[start + i] = false;
    live.erase(start);
  }
  std::pair<size_t, size_t> free_runs_and_largest() const {
    size_t runs = 0, largest = 0, cur = 0;
    for (size_t i = 0; i <= used.size(); ++i) {
      if (i < used.size() && !used[i]) {
        ++cur;
      } else if (cur > 0) {
        ++runs;
        largest = std::max(largest, cur);
        cur = 0;
      }
    }
    return {runs, largest};
  }
};

TEST(HeapAllocator, RandomSequenceMatchesReferenceModel) {
  constexpr uint64_t g = 64 * 1024, granules = 256;
  HeapAllocator a(granules * g, g);
  ReferenceHeap ref(granules);
  std::mt19937_64 rng(2024);
  std::vector<uint64_t> live;  // byte offsets
  int allocs = 0, failures = 0, frees = 0;
  for (int step = 0; step < 4000; ++step) {
    const bool do_free = !live.empty() && rng() % 100 < 45;
    if (do_free) {
      const size_t k = rng() % live.size();
      a.free(live[k]);
      ref.free(live[k] / g);
      live.erase(live.begin() + static_cast<long>(k));
      ++frees;
    } else {
      const uint64_t bytes = 1 + rng() % (24 * g);
      const long want = ref.allocate((bytes + g - 1) / g);
      uint64_t got = 0;
      const std::string err = error_of([&] { got = a.allocate(bytes); });
      if (want < 0) {
        EXPECT_HAS(err, "exhausted");
        ++failures;
      } else {
        ASSERT_EQ(err, "<no exception>") << "step " << step;
        ASSERT_EQ(got, static_cast<uint64_t>(want) * g) << "step " << step << ": not the first fit";
        ASSERT_EQ(a.size_of(got), (bytes + g - 1) / g * g);
        live.push_back(got);
        ++allocs;
      }
    }
    // Invariants: live blocks inside the heap and disjoint; bookkeeping matches the model.
    uint64_t in_use = 0, end_of_prev = 0;
    for (auto& [start, n] : ref.live) {
      const uint64_t off = start * g, size = a.size_of(off);
      ASSERT_EQ(size, n * g);
      ASSERT_GE(off, end_of_prev);
      ASSERT_LE(off + size, a.capacity());
      end_of_prev = off + size;
      in_use += size;
    }
    ASSERT_EQ(a.live_count(), ref.live.size());
    ASSERT_EQ(a.bytes_in_use(), in_use);
    const auto [runs, largest] = ref.free_runs_and_largest();
    ASSERT_EQ(a.free_block_count(), runs)
        << "free list not coalesced at step " << step << ": " << a.describe();
    ASSERT_EQ(a.largest_free(), largest * g);
  }
  EXPECT_GT(allocs, 1000);
  EXPECT_GT(failures, 10);  // the sequence did reach exhaustion
  EXPECT_GT(frees, 1000);
  for (uint64_t off : live) a.free(off);
  EXPECT_EQ(a.free_block_count(), 1u);
  EXPECT_EQ(a.largest_free(), a.capacity());
}
