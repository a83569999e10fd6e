// Call epochs: a kernel's signals carry the number of its call, so flags only grow and a late reader never
// mistakes the previous call's value for this one's. The count lives in two words of the signal pad:
// state[0] calls completed, state[1] finishers of the current call.
//   epoch()          this call's number (completed + 1); read it before finished().
//   finished(n)      one thread per finisher, n finishers per call: the last clears the count and publishes
//                    the epoch, so the next call (stream-ordered after this kernel) reads epoch + 1, and gets
//                    true (the others false). The fence orders the finisher's earlier work before that
//                    publication.
#pragma once
#include <cstdint>

namespace weft {

struct CallEpoch {
  uint64_t* state;
  __device__ __forceinline__ uint64_t epoch() const {
    return *reinterpret_cast<volatile uint64_t*>(state) + 1;
  }
  __device__ __forceinline__ bool finished(uint64_t finishers) const {
    const uint64_t e = epoch();
    __threadfence();
    if (atomicAdd(reinterpret_cast<unsigned long long*>(state + 1), 1ull) + 1 != finishers) return false;
    state[1] = 0;
    *reinterpret_cast<volatile uint64_t*>(state) = e;
    return true;
  }
};

}  // namespace weft
