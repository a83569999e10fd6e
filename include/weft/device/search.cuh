// Searches of small sorted device arrays (an MoE layer's group ends), through the read-only cache.
#pragma once
#include <cstdint>

namespace weft {

#ifdef __CUDACC__  // (host code includes the headers that use it)
// The first index i in [0, n) with sorted[i] > value (n if none): ceil(log2(n + 1)) loads in a chain.
__device__ __forceinline__ int first_greater(const int32_t* sorted, int n, int value) {
  int i = 0;  // sorted[0, i) <= value
  for (int step = n > 0 ? 1 << (31 - __clz(n)) : 0; step > 0; step /= 2)
    if (i + step <= n && __ldg(sorted + i + step - 1) <= value) i += step;
  return i;
}
#endif

}  // namespace weft
