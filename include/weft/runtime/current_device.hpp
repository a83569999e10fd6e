// Restores the calling thread's current CUDA device at scope exit: host calls that visit other GPUs (every
// local rank, or the rank an op runs for) must not leave the caller on another device.
#pragma once
#include <cuda_runtime.h>

namespace weft::detail {

struct CurrentDeviceGuard {
  int device = 0;
  CurrentDeviceGuard() { cudaGetDevice(&device); }
  ~CurrentDeviceGuard() { cudaSetDevice(device); }
  CurrentDeviceGuard(const CurrentDeviceGuard&) = delete;
  CurrentDeviceGuard& operator=(const CurrentDeviceGuard&) = delete;
};

}  // namespace weft::detail
