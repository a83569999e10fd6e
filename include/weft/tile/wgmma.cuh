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
// clang-format off
#define WEFT_MMA_M64N256K16(AB) \
  asm volatile( \
      "{\n .reg .pred p;\n" \
      " setp.ne.b32 p, %130, 0;\n" \
      " wgmma.mma_async.sync.aligned.m64n256k16.f32." AB "." AB " {" \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31," \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47," \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63," \
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79," \
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95," \
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111," \
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127" \
      "}, %128, %129, p, 1, 1, %132, %131;\n}\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127]) \
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransB), "n"(kTransA))
template <int kTransB, int kTransA = 0, bool kHalf = false>
__device__ __forceinline__ void mma_m64n256k16(float (&d)[128], uint64_t desc_a, uint64_t desc_b,
                                                   int scale_d) {
#if defined(WEFT_WGMMA_AVAILABLE)
  if constexpr (kHalf)
    WEFT_MMA_M64N256K16("f16");
  else
    WEFT_MMA_M64N256K16("bf16");
#else
  __trap();
#endif
}

#define WEFT_MMA_M64N128K16(AB) \
  asm volatile( \
      "{\n .reg .pred p;\n" \
      " setp.ne.b32 p, %66, 0;\n" \
      " wgmma.mma_async.sync.aligned.m64n128k16.f32." AB "." AB " {" \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31," \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47," \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63" \
      "}, %64, %65, p, 1, 1, %68, %67;\n}\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransB), "n"(kTransA))
template <int kTransB, int kTransA = 0, bool kHalf = false>
__device__ __forceinline__ void mma_m64n128k16(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                                   int scale_d) {
#if defined(WEFT_WGMMA_AVAILABLE)
  if constexpr (kHalf)
    WEFT_MMA_M64N128K16("f16");
  else
    WEFT_MMA_M64N128K16("bf16");
#else
  __trap();
#endif
}

#define WEFT_MMA_M64N64K16(AB) \
  asm volatile( \
      "{\n .reg .pred p;\n" \
      " setp.ne.b32 p, %34, 0;\n" \
      " wgmma.mma_async.sync.aligned.m64n64k16.f32." AB "." AB " {" \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
      "}, %32, %33, p, 1, 1, %36, %35;\n}\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransB), "n"(kTransA))
template <int kTransB, int kTransA = 0, bool kHalf = false>
__device__ __forceinline__ void mma_m64n64k16(float (&d)[32], uint64_t desc_a, uint64_t desc_b,
                                                   int scale_d) {
#if defined(WEFT_WGMMA_AVAILABLE)
  if constexpr (kHalf)
    WEFT_MMA_M64N64K16("f16");
  else
    WEFT_MMA_M64N64K16("bf16");
#else
  __trap();
#endif
}
#define WEFT_MMA_M64N32K16(AB) \
  asm volatile( \
      "{\n .reg .pred p;\n" \
      " setp.ne.b32 p, %18, 0;\n" \
      " wgmma.mma_async.sync.aligned.m64n32k16.f32." AB "." AB " {" \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15" \
      "}, %16, %17, p, 1, 1, %20, %19;\n}\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]) \
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransB), "n"(kTransA))
template <int kTransB, int kTransA = 0, bool kHalf = false>
__device__ __forceinline__ void mma_m64n32k16(float (&d)[16], uint64_t desc_a, uint64_t desc_b,
                                                  int scale_d) {
#if defined(WEFT_WGMMA_AVAILABLE)
  if constexpr (kHalf)
    WEFT_MMA_M64N32K16("f16");
  else
    WEFT_MMA_M64N32K16("bf16");
#else
  __trap();
#endif
}
// clang-format on

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

// ---- mma_async with A from registers: D(64 x N, fp32) = A(64 x 16, in registers) * B(16 x N) ----------
// A is the warpgroup's 64 x 16 bf16 / fp16 tile held as 4 x .b32 per thread (two each, the lower column in
// the lower half): a[0] = (row r, columns 2q, 2q+1), a[1] = (r + 8, 2q..), a[2] = (r, 2q + 8..), a[3] = (r +
// 8, 2q + 8..), with r = 16 w + lane / 4 and q = lane % 4: the accumulator layout of tile/fragment.cuh, so a
// 64 x N fp32 accumulator converted pairwise is the A operand of a following MMA (tile::pack_a). The A
// registers must not change until the MMA has completed (wait()).
// clang-format off
#define WEFT_MMA_RS_M64N64K16(AB) \
  asm volatile( \
      "{\n .reg .pred p;\n" \
      " setp.ne.b32 p, %37, 0;\n" \
      " wgmma.mma_async.sync.aligned.m64n64k16.f32." AB "." AB " {" \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
      "}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(kTransB))
template <int kTransB, bool kHalf = false>
__device__ __forceinline__ void mma_rs_m64n64k16(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b,
                                                     int scale_d) {
#if defined(WEFT_WGMMA_AVAILABLE)
  if constexpr (kHalf)
    WEFT_MMA_RS_M64N64K16("f16");
  else
    WEFT_MMA_RS_M64N64K16("bf16");
#else
  __trap();
#endif
}

#define WEFT_MMA_RS_M64N128K16(AB) \
  asm volatile( \
      "{\n .reg .pred p;\n" \
      " setp.ne.b32 p, %69, 0;\n" \
      " wgmma.mma_async.sync.aligned.m64n128k16.f32." AB "." AB " {" \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31," \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47," \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63" \
      "}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(kTransB))
template <int kTransB, bool kHalf = false>
__device__ __forceinline__ void mma_rs_m64n128k16(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b,
                                                     int scale_d) {
#if defined(WEFT_WGMMA_AVAILABLE)
  if constexpr (kHalf)
    WEFT_MMA_RS_M64N128K16("f16");
  else
    WEFT_MMA_RS_M64N128K16("bf16");
#else
  __trap();
#endif
}
// clang-format on

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

#undef WEFT_MMA_M64N256K16
#undef WEFT_MMA_M64N128K16
#undef WEFT_MMA_M64N64K16
#undef WEFT_MMA_M64N32K16
#undef WEFT_MMA_RS_M64N64K16
#undef WEFT_MMA_RS_M64N128K16
