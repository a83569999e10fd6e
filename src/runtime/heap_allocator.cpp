#include "weft/runtime/heap_allocator.hpp"

#include <iterator>

#include "weft/runtime/error.hpp"

namespace weft {

namespace {
// Whole MiB as such; anything else exactly (a 4 KiB-granular heap must not report "0 MiB").
std::string mib(uint64_t b) {
  return b % (uint64_t{1} << 20) == 0 ? std::to_string(b >> 20) + " MiB" : std::to_string(b) + " bytes";
}
}  // namespace

HeapAllocator::HeapAllocator(uint64_t capacity, uint64_t granularity)
    : capacity_(capacity), granularity_(granularity) {
  WEFT_CHECK(granularity > 0 && (granularity & (granularity - 1)) == 0,
             "heap granularity must be a power of two, got " + std::to_string(granularity));
  WEFT_CHECK(capacity >= granularity && capacity % granularity == 0,
             "heap capacity " + std::to_string(capacity) +
                 " must be a positive multiple of the granularity " + std::to_string(granularity));
  free_[0] = capacity;
}

uint64_t HeapAllocator::round_up(uint64_t bytes) const {
  return (bytes + granularity_ - 1) & ~(granularity_ - 1);
}

uint64_t HeapAllocator::allocate(uint64_t bytes) {
  WEFT_CHECK(bytes > 0, "symmetric allocation of 0 bytes");
  WEFT_CHECK(bytes <= capacity_, "symmetric allocation of " + std::to_string(bytes) +
                                     " bytes exceeds the heap capacity of " + mib(capacity_));
  const uint64_t size = round_up(bytes);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < size) continue;
    const uint64_t off = it->first, rest = it->second - size;
    free_.erase(it);
    if (rest > 0) free_[off + size] = rest;
    live_[off] = size;
    in_use_ += size;
    return off;
  }
  throw_error("weft: symmetric heap exhausted: asked for " + mib(size) + ", " + mib(in_use_) + " of " +
              mib(capacity_) + " in use, largest free block " + mib(largest_free()) +
              " (raise WEFT_HEAP_BYTES or free buffers)");
}

void HeapAllocator::free(uint64_t offset) {
  auto live = live_.find(offset);
  WEFT_CHECK(live != live_.end(), "free of heap offset " + std::to_string(offset) +
                                      ", which is not a live symmetric allocation (double free?)");
  uint64_t off = live->first, size = live->second;
  live_.erase(live);
  in_use_ -= size;
  auto next = free_.lower_bound(off);
  if (next != free_.end() && off + size == next->first) {  // merge with the following block
    size += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {  // merge with the preceding block
    auto prev = std::prev(next);
    if (prev->first + prev->second == off) {
      prev->second += size;
      return;
    }
  }
  free_[off] = size;
}

uint64_t HeapAllocator::size_of(uint64_t offset) const {
  auto it = live_.find(offset);
  return it == live_.end() ? 0 : it->second;
}

uint64_t HeapAllocator::largest_free() const {
  uint64_t m = 0;
  for (auto& [o, s] : free_) m = std::max(m, s);
  return m;
}

std::string HeapAllocator::describe() const {
  std::string s = "heap " + mib(capacity_) + ", " + std::to_string(live_.size()) + " live (" + mib(in_use_) +
                  "), free blocks:";
  for (auto& [o, sz] : free_) s += " [" + std::to_string(o) + "+" + std::to_string(sz) + "]";
  return s;
}

}  // namespace weft
