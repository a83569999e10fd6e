// wgmma (Hopper warpgroup MMA): shared-memory operand descriptors, the fences and group commit/wait that
// order the asynchronous MMAs, and mma_async wrappers for bf16 x bf16 and fp16 x fp16 -> fp32 at the
// shapes weft uses.
//
// A warpgroup (4 warps, 128 threads) issues wgmma.mma_async together; D (64 x N fp32) lives in registers,
// N / 2 floats per thread (see tile/fragment.cuh for which element is where); A (64 x 16) and B (16 x N)
// are read from shared memory through 64-bit descriptors. Operands here are 128-byte-swizzled Sw128Tiles:
//   K-major  (A always; B when it is an [N,K] weight): tile rows are M or N, columns K. The descriptor
//            starts at the operand's first row and K offset; 8-row groups are 1024 bytes apart (SBO).
//            Stepping K by 16 inside the 128-byte row moves the start address by 32 bytes.
//   MN-major (B row-major [K,N]): tile rows are K, columns N in blocks of 64. The descriptor starts at K row
//            k0; 8-row K groups are 1024 bytes apart (SBO), 64-column N blocks one block apart (LBO).
//
// Ordering rules (PTX ISA, "asynchronous warpgroup level matrix"): fence() before the first mma_async of a
// batch and whenever the accumulators were touched by other instructions; commit() closes a group;
// wait<N>() returns once at most N groups are pending: only then may the accumulators be read or the
// operand tiles be overwritten. fence_operands() keeps the compiler from moving accumulator accesses across
// those points.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "weft/device/bulk_copy.cuh"
#include "weft/tile/layout.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WEFT_WGMMA_AVAILABLE 1
#endif

namespace weft::wgmma {

// ---- descriptors -----------------------------------------------------------------------------
__device__ __forceinline__ uint64_t make_desc_sw128(const void* smem, uint32_t lbo_bytes,
                                                    uint32_t sbo_bytes) {
  const uint32_t addr = smem_addr(smem);
  return static_cast<uint64_t>((addr & 0x3FFFFu) >> 4) |
         (static_cast<uint64_t>((lbo_bytes & 0x3FFFFu) >> 4) << 16) |
         (static_cast<uint64_t>((sbo_bytes & 0x3FFFFu) >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

// Descriptor arithmetic: the start address is the low 14 bits in 16-byte units, so moving the operand by
// a multiple of 16 bytes (inside one shared-memory window) is an integer add. It never carries out of the
// low word: a 32-bit add, with no carry into the high word for the compiler to propagate.
__device__ __forceinline__ uint64_t desc_advance(uint64_t desc, uint32_t bytes) {
  const uint32_t lo = static_cast<uint32_t>(desc) + (bytes >> 4);
  return (desc & 0xFFFFFFFF00000000ull) | lo;
}

// K-major operand: rows [row0, row0 + 64 or N) and K columns [k0, k0 + 16) of a tile whose rows are M/N.
template <class Tile>
__device__ __forceinline__ uint64_t desc_k_major(const Tile& t, int row0, int k0) {
  constexpr int kElem = static_cast<int>(sizeof(typename Tile::Element));
  return make_desc_sw128(t.row_ptr(k0 / Tile::kBlockCols, row0) + (k0 % Tile::kBlockCols) * kElem, 16, 1024);
}
// Where K column k0 starts in a K-major tile, from its column 0: desc_k_major(t, row0, k0) is
// desc_advance(desc_k_major(t, row0, 0), k_major_offset<Tile>(k0)). A loop over k that advances one base
// descriptor by constants keeps one descriptor live per operand, not one per k step.
template <class Tile>
__host__ __device__ constexpr uint32_t k_major_offset(int k0) {
  return static_cast<uint32_t>((k0 / Tile::kBlockCols) * Tile::kBlockBytes +
                               (k0 % Tile::kBlockCols) * static_cast<int>(sizeof(typename Tile::Element)));
}
// MN-major operand: K rows [k0, k0 + 16) and the columns from n0 on of a tile whose rows are K (n0 a multiple
// of 8: the start may sit inside a 128-byte row, as a K-major start does).
template <class Tile>
__device__ __forceinline__ uint64_t desc_mn_major(const Tile& t, int k0, int n0 = 0) {
  constexpr int kElem = static_cast<int>(sizeof(typename Tile::Element));
  return make_desc_sw128(t.row_ptr(n0 / Tile::kBlockCols, k0) + (n0 % Tile::kBlockCols) * kElem,
                         Tile::kBlockBytes, 1024);
}

// ---- ordering --------------------------------------------------------------------------------
__device__ __forceinline__ void fence() {
#if defined(WEFT_WGMMA_AVAILABLE)
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void commit() {
#if defined(WEFT_WGMMA_AVAILABLE)
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}
template <int kPending>
__device__ __forceinline__ void wait() {
#if defined(WEFT_WGMMA_AVAILABLE)
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
#endif
}
template <int kRegs>
__device__ __forceinline__ void fence_operands(float (&d)[kRegs]) {
#pragma unroll
  for (int i = 0; i < kRegs; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// ---- mma_async: D(64 x N, fp32) = A(64 x 16) * B(16 x N) + (scale_d ? D : 0), bf16 or (kHalf) fp16 --
// kTransB = 0: B is K-major; 1: B is N-major. kTransA = 0: A is K-major; 1: A is M-major (a tile whose
// rows are K, read through desc_mn_major).
//
// ---- mma_async with A from registers: D(64 x N, fp32) = A(64 x 16, in registers) * B(16 x N) ----------
// A is the warpgroup's 64 x 16 bf16 / fp16 tile held as 4 x .b32 per thread (two each, the lower column in
// the lower half): a[0] = (row r, columns 2q, 2q+1), a[1] = (r + 8, 2q..), a[2] = (r, 2q + 8..), a[3] = (r +
// 8, 2q + 8..), with r = 16 w + lane / 4 and q = lane % 4: the accumulator layout of tile/fragment.cuh, so a
// 64 x N fp32 accumulator converted pairwise is the A operand of a following MMA (tile::pack_a). The A
// registers must not change until the MMA has completed (wait()).
//
// The wrappers per shape, mma_m64n{256,128,64,32}k16, mma_rs_m64n{64,128}k16 and the FP8
// mma_fp8_m64n{256,128,64}k32<kE5M2> (e4m3 or e5m2 operands, both K-major: 8-bit wgmma has no transpose),
// are generated from one table (tools/gen_wgmma.py): each spells out its N / 2 accumulator operands.
#include "weft/tile/wgmma_instructions.inc"

// Element types of the operands: bf16 (kHalf = false) or fp16 (true), the same for A and B.
template <class T>
inline constexpr bool kIsHalf = std::is_same_v<T, __half>;
template <class T>
inline constexpr bool kIsMmaElement = std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>;

template <int kN, int kTransB, int kTransA = 0, bool kHalf = false>
__device__ __forceinline__ void mma(float (&d)[kN / 2], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  static_assert(kN == 32 || kN == 64 || kN == 128 || kN == 256,
                "wgmma wrappers exist for N = 32, 64, 128, 256");
  if constexpr (kN == 256)
    mma_m64n256k16<kTransB, kTransA, kHalf>(d, desc_a, desc_b, scale_d);
  else if constexpr (kN == 128)
    mma_m64n128k16<kTransB, kTransA, kHalf>(d, desc_a, desc_b, scale_d);
  else if constexpr (kN == 64)
    mma_m64n64k16<kTransB, kTransA, kHalf>(d, desc_a, desc_b, scale_d);
  else
    mma_m64n32k16<kTransB, kTransA, kHalf>(d, desc_a, desc_b, scale_d);
}
template <int kN, int kTransB, int kTransA = 0>
__device__ __forceinline__ void mma_bf16(float (&d)[kN / 2], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  mma<kN, kTransB, kTransA, false>(d, desc_a, desc_b, scale_d);
}

template <int kN, int kTransB, bool kHalf = false>
__device__ __forceinline__ void mma_rs(float (&d)[kN / 2], const uint32_t (&a)[4], uint64_t desc_b,
                                       int scale_d) {
  static_assert(kN == 64 || kN == 128, "register-A wgmma wrappers exist for N = 64, 128");
  if constexpr (kN == 128)
    mma_rs_m64n128k16<kTransB, kHalf>(d, a, desc_b, scale_d);
  else
    mma_rs_m64n64k16<kTransB, kHalf>(d, a, desc_b, scale_d);
}
template <int kRegs>
__device__ __forceinline__ void fence_operands(uint32_t (&a)[kRegs]) {
#pragma unroll
  for (int i = 0; i < kRegs; ++i) asm volatile("" : "+r"(a[i])::"memory");
}

// ---- a whole K extent as one commit group ------------------------------------------------------------
// Where K step k0 of a shared-memory operand starts, from K = 0: in a K-major tile (kTrans = 0) K runs along
// the row (k_major_offset), in an MN-major one (kTrans = 1) K is the row index.
template <class Tile, int kTrans>
__host__ __device__ constexpr uint32_t k_offset(int k0) {
  return kTrans ? static_cast<uint32_t>(k0) * tile::kSwizzleBytes : k_major_offset<Tile>(k0);
}
// D (64 x kN) = A B (+ D when `accumulate`) over K = [0, kK), A and B in shared memory: a_desc / b_desc
// address K = 0 of tiles ATile / BTile, read K-major (kTrans* = 0) or MN-major (1); the tiles' element
// type (bf16 or fp16) picks the instruction. Issues kK / 16 MMAs advancing one base descriptor per operand
// by constants, and commits them as one group.
template <int kN, int kK, class ATile, int kTransA, class BTile, int kTransB>
__device__ __forceinline__ void mma_ss_group(float (&d)[kN / 2], uint64_t a_desc, uint64_t b_desc,
                                             bool accumulate) {
  using T = typename ATile::Element;
  static_assert(kIsMmaElement<T> && std::is_same_v<T, typename BTile::Element>, "bf16 or fp16 operands");
#pragma unroll
  for (int k = 0; k < kK / 16; ++k)
    mma<kN, kTransB, kTransA, kIsHalf<T>>(d, desc_advance(a_desc, k_offset<ATile, kTransA>(16 * k)),
                                          desc_advance(b_desc, k_offset<BTile, kTransB>(16 * k)),
                                          k > 0 || accumulate ? 1 : 0);
  commit();
}
// D (64 x kN) += A B over K = [0, kK), A from registers (kK / 4 registers: K step s in a[4 s .. 4 s + 3], see
// mma_rs; of B's element type), B in shared memory as in mma_ss_group; one commit group.
template <int kN, int kK, class BTile, int kTransB>
__device__ __forceinline__ void mma_rs_group(float (&d)[kN / 2], const uint32_t (&a)[kK / 4],
                                             uint64_t b_desc) {
  static_assert(kIsMmaElement<typename BTile::Element>, "bf16 or fp16 operands");
#pragma unroll
  for (int k = 0; k < kK / 16; ++k)
    mma_rs<kN, kTransB, kIsHalf<typename BTile::Element>>(
        d, reinterpret_cast<const uint32_t(&)[4]>(a[4 * k]),
        desc_advance(b_desc, k_offset<BTile, kTransB>(16 * k)), 1);
  commit();
}

}  // namespace weft::wgmma
