// Offset arithmetic of the symmetric heap, kept apart from CUDA so it can be tested anywhere.
//
// Every rank runs the same allocator over the same sequence of collective alloc/free calls, so every
// allocation lands at the same offset on every rank; a peer's copy of a buffer is then
// peer_base[r] + offset. First fit over a sorted free list, sizes rounded up to the VMM granularity.
#pragma once
#include <cstdint>
#include <map>
#include <string>

namespace weft {

class HeapAllocator {
 public:
  HeapAllocator(uint64_t capacity, uint64_t granularity);

  uint64_t capacity() const { return capacity_; }
  uint64_t granularity() const { return granularity_; }
  uint64_t round_up(uint64_t bytes) const;

  // Returns the offset of a block of round_up(bytes) bytes. Throws weft::Error when it does not fit
  // (with the largest free block in the message) or for a zero-size request.
  uint64_t allocate(uint64_t bytes);
  // Frees the block that starts at `offset`; throws for an offset that is not a live allocation.
  void free(uint64_t offset);

  uint64_t size_of(uint64_t offset) const;  // 0 if not live
  uint64_t bytes_in_use() const { return in_use_; }
  uint64_t largest_free() const;
  size_t live_count() const { return live_.size(); }
  size_t free_block_count() const { return free_.size(); }
  std::string describe() const;

 private:
  uint64_t capacity_, granularity_, in_use_ = 0;
  std::map<uint64_t, uint64_t> free_;  // offset -> size, coalesced
  std::map<uint64_t, uint64_t> live_;  // offset -> size
};

}  // namespace weft
