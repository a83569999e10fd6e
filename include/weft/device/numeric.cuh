// Element types and reductions on 16-byte packs: what the collectives' inner loops are made of.
// A pack is 16 bytes (8 bf16 / 8 fp16 / 4 fp32); arithmetic always happens in fp32.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace weft {

enum class Elem { kBF16, kFP16, kFP32 };
enum class Reduce { kSum, kMax, kMin };

template <Elem E>
struct ElemTraits;
template <>
struct ElemTraits<Elem::kBF16> {
  using T = __nv_bfloat16;
  static __device__ __forceinline__ float to_float(T x) { return __bfloat162float(x); }
  static __device__ __forceinline__ T from_float(float x) { return __float2bfloat16_rn(x); }
};
template <>
struct ElemTraits<Elem::kFP16> {
  using T = __half;
  static __device__ __forceinline__ float to_float(T x) { return __half2float(x); }
  static __device__ __forceinline__ T from_float(float x) { return __float2half_rn(x); }
};
template <>
struct ElemTraits<Elem::kFP32> {
  using T = float;
  static __device__ __forceinline__ float to_float(T x) { return x; }
  static __device__ __forceinline__ T from_float(float x) { return x; }
};

// Two adjacent bf16 / fp16 elements as floats (p 4-byte aligned).
__device__ __forceinline__ float2 to_float2(const __nv_bfloat16* p) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
}
__device__ __forceinline__ float2 to_float2(const __half* p) {
  return __half22float2(*reinterpret_cast<const __half2*>(p));
}

template <Reduce R>
__device__ __forceinline__ float combine(float a, float b) {
  if constexpr (R == Reduce::kSum)
    return a + b;
  else if constexpr (R == Reduce::kMax)
    return fmaxf(a, b);
  else
    return fminf(a, b);
}

// A 16-byte pack unpacked to fp32 lanes.
template <Elem E>
struct Pack {
  using T = typename ElemTraits<E>::T;
  static constexpr int kLanes = 16 / sizeof(T);
  float v[kLanes];

  __device__ __forceinline__ static Pack load(const uint4& raw) {
    Pack p;
    const T* x = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < kLanes; ++i) p.v[i] = ElemTraits<E>::to_float(x[i]);
    return p;
  }
  __device__ __forceinline__ uint4 store() const {
    uint4 raw;
    T* x = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < kLanes; ++i) x[i] = ElemTraits<E>::from_float(v[i]);
    return raw;
  }
  template <Reduce R>
  __device__ __forceinline__ void combine_with(const Pack& o) {
#pragma unroll
    for (int i = 0; i < kLanes; ++i) v[i] = combine<R>(v[i], o.v[i]);
  }
};

}  // namespace weft
