// The calling thread's current CUDA device: a guard that restores it at scope exit (host calls that visit
// other GPUs, every local rank or the rank an op runs for, must not leave the caller on another device), and
// a cache of values computed once per device.
#pragma once
#include <cuda_runtime.h>

#include <map>
#include <mutex>

#include "weft/runtime/error.hpp"

namespace weft::detail {

struct CurrentDeviceGuard {
  int device = 0;
  CurrentDeviceGuard() { cudaGetDevice(&device); }
  ~CurrentDeviceGuard() { cudaSetDevice(device); }
  CurrentDeviceGuard(const CurrentDeviceGuard&) = delete;
  CurrentDeviceGuard& operator=(const CurrentDeviceGuard&) = delete;
};

// `make(device)` for the current device, computed on the first call for that device and cached (attribute
// and occupancy queries are host calls that would otherwise sit on every launch path). One cache per
// `make` type, so per call site (a lambda); thread-safe. `make` may throw; nothing is cached then.
template <class Make>
auto once_per_device(Make&& make) -> decltype(make(0)) {
  using T = decltype(make(0));
  static std::mutex mu;
  static std::map<int, T> cached;
  int device = 0;
  WEFT_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = cached.find(device); it != cached.end()) return it->second;
  return cached.emplace(device, make(device)).first->second;
}

}  // namespace weft::detail
