// Shared-memory tile types with the 128-byte swizzle that TMA (CU_TENSOR_MAP_SWIZZLE_128B) writes and
// wgmma reads.
//
// A Sw128Tile<T, R, C> is R rows x C columns of T, row-major in the sense that columns are contiguous.
// It is stored as C / (128 / sizeof(T)) column blocks; each block is R rows of exactly 128 bytes (one TMA
// box of {128 / sizeof(T), R}). Inside a block, rows come in groups of 8 (1024 bytes, the swizzle atom) and
// the 16-byte chunk c of row r is stored at chunk position c ^ (r % 8), which spreads a column of 8 rows
// over all 32 banks. The pattern is computed by the hardware from address bits [4:6] ^ [7:9], so every
// tile (and every block) starts at a multiple of 1024 bytes.
//
// The same tile is a K-major wgmma operand when rows are M (or N) and columns K (64 bf16 per block), and an
// MN-major operand when rows are K and columns N (blocks of 64 N).
#pragma once
#include <cstdint>

namespace weft::tile {

inline constexpr int kSwizzleBytes = 128;
inline constexpr int kSwizzleAtomBytes = 1024;

// Byte offset of byte `byte_in_row` of row `row` inside a 128-byte-swizzled block.
__host__ __device__ constexpr uint32_t sw128_offset(uint32_t row, uint32_t byte_in_row) {
  return row * kSwizzleBytes + ((((byte_in_row >> 4) ^ (row & 7u)) << 4) | (byte_in_row & 15u));
}

template <class T, int R, int C>
struct alignas(kSwizzleAtomBytes) Sw128Tile {
  using Element = T;
  static constexpr int kRows = R;
  static constexpr int kCols = C;
  static constexpr int kBlockCols = kSwizzleBytes / static_cast<int>(sizeof(T));  // columns per block
  static constexpr int kBlocks = C / kBlockCols;
  static constexpr uint32_t kBlockBytes = static_cast<uint32_t>(R) * kSwizzleBytes;
  static constexpr uint32_t kBytes = kBlockBytes * kBlocks;
  static_assert(C % kBlockCols == 0, "columns must fill whole 128-byte rows");
  static_assert(R % 8 == 0, "rows come in swizzle atoms of 8");

  uint8_t bytes[kBytes];

  // Byte offset of element (r, c).
  __host__ __device__ static constexpr uint32_t offset(int r, int c) {
    return (c / kBlockCols) * kBlockBytes +
           sw128_offset(static_cast<uint32_t>(r), static_cast<uint32_t>((c % kBlockCols) * sizeof(T)));
  }
  __device__ uint8_t* block(int b) { return bytes + b * kBlockBytes; }
  __device__ const uint8_t* block(int b) const { return bytes + b * kBlockBytes; }
  // The first byte of row r of block b (rows of 8 share a swizzle atom; r % 8 == 0 keeps it atom-aligned).
  __device__ uint8_t* row_ptr(int b, int r) { return block(b) + r * kSwizzleBytes; }
  __device__ const uint8_t* row_ptr(int b, int r) const { return block(b) + r * kSwizzleBytes; }
};

}  // namespace weft::tile
