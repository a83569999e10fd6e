#include "driver.hpp"

#include <cuda_runtime.h>

#include <string>

#include "weft/runtime/error.hpp"

namespace weft {

const DriverApi& driver() {
  static const DriverApi api = [] {
    DriverApi a;
    auto resolve = [](const char* name, void** fn) {
      cudaDriverEntryPointQueryResult status{};
      const cudaError_t e = cudaGetDriverEntryPointByVersion(name, fn, 12000, cudaEnableDefault, &status);
      if (e != cudaSuccess || status != cudaDriverEntryPointSuccess || *fn == nullptr)
        throw_error(std::string("weft: the CUDA driver does not provide ") + name + " (" +
                    cudaGetErrorString(e) + "); is the NVIDIA driver installed and new enough?");
    };
#define WEFT_DRIVER_RESOLVE(name) resolve(#name, reinterpret_cast<void**>(&a.name));
    WEFT_DRIVER_FUNCTIONS(WEFT_DRIVER_RESOLVE)
#undef WEFT_DRIVER_RESOLVE
    return a;
  }();
  return api;
}

std::string driver_error_text(int code) {
  const char* name = "?";
  const char* text = "?";
  try {
    driver().cuGetErrorName(static_cast<CUresult>(code), &name);
    driver().cuGetErrorString(static_cast<CUresult>(code), &text);
  } catch (...) {
  }
  return std::string(name) + " (" + text + ")";
}

}  // namespace weft
