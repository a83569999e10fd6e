// The one-shot (LL protocol) collectives' sizes (internal to src/ops: collectives.cu and its tests): how
// large a one-shot call may be per world size and how its LL region is laid out.
#pragma once
#include <algorithm>
#include <cstdint>

namespace weft::ops {

// One-shot all-reduce limit by world size. The LL push moves 2x the bytes to each of W - 1 peers; the
// two-shot moves (W - 1) / W of them twice but meets the team twice. At 2 GPUs one peer takes the whole push
// and the one-shot stays ahead up to 1 MiB (4.7 us at 128 KiB vs two-shot 10.1 us at 512 KiB,
// bench/RESULTS.md); at 4 GPUs it stops paying at 256 KiB.
inline uint64_t one_shot_max_bytes(int world) {
  return world == 2 ? (1u << 20) : (256u << 10);
}
// The one-shot's LL region (a workspace area of its own, made at team creation): two halves of `world`
// slots of ll_slot_bytes (the LL protocol stores 8 bytes per 4 data bytes), every slot in a fixed place. A
// slot holds one fixed part of ll_block_words words per block (each block keeps its own call count): a
// one-shot call runs on words / ll_block_words to one_shot_max_blocks blocks. 1024 words per block (2 per
// thread) at most sizes, at most 128 blocks.
inline uint64_t ll_block_words(int world) {
  return std::max<uint64_t>(1024, one_shot_max_bytes(world) / 4 / 128);
}
inline int one_shot_max_blocks(int world) {
  return static_cast<int>(one_shot_max_bytes(world) / 4 / ll_block_words(world));
}
inline uint64_t ll_slot_bytes(int world) {
  return 8ull * ll_block_words(world) * one_shot_max_blocks(world);
}
inline uint64_t ll_region_bytes(int world) {
  return 2ull * world * ll_slot_bytes(world);
}
// Blocks a one-shot call of `bytes` needs at least: every block's share must fit its part of a slot.
inline int one_shot_min_blocks(int world, uint64_t bytes) {
  const uint64_t words = (bytes + 3) / 4;
  return static_cast<int>((words + ll_block_words(world) - 1) / ll_block_words(world));
}

}  // namespace weft::ops
