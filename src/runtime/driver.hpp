// The CUDA driver API functions weft calls, resolved at run time through the runtime's entry-point query
// instead of linking libcuda. A binary then starts on a machine without a driver (CI) and can say "no GPU"
// cleanly instead of failing in the dynamic loader.
#pragma once
#include <cuda.h>

namespace weft {

#define WEFT_DRIVER_FUNCTIONS(X)                                                                             \
  X(cuInit)                                                                                                  \
  X(cuDeviceGet)                                                                                             \
  X(cuDeviceGetAttribute)                                                                                    \
  X(cuMemGetAllocationGranularity) X(cuMemAddressReserve) X(cuMemAddressFree) X(cuMemCreate) X(cuMemRelease) \
      X(cuMemMap) X(cuMemUnmap) X(cuMemSetAccess) X(cuMemExportToShareableHandle)                            \
          X(cuMemImportFromShareableHandle) X(cuGetErrorName) X(cuGetErrorString) X(cuStreamWaitValue32)     \
              X(cuStreamWriteValue32)

struct DriverApi {
#define WEFT_DRIVER_MEMBER(name) decltype(&::name) name = nullptr;
  WEFT_DRIVER_FUNCTIONS(WEFT_DRIVER_MEMBER)
#undef WEFT_DRIVER_MEMBER
};

// Resolves every function once (thread-safe); throws weft::Error naming a missing one.
const DriverApi& driver();

}  // namespace weft
