// WEFT_HD: a function both host and device code call (inline in a host-only build).
#pragma once

#if defined(__CUDACC__)
#define WEFT_HD __host__ __device__ __forceinline__
#else
#define WEFT_HD inline
#endif
