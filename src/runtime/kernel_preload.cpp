#include "weft/runtime/kernel_preload.hpp"

#include <cuda_runtime.h>

#include <mutex>
#include <vector>

#include "weft/runtime/error.hpp"

namespace weft::detail {
namespace {
struct Registry {
  std::mutex mu;
  std::vector<const void*> kernels;
};
Registry& registry() {  // constructed on first use: registrations run during static initialization
  static Registry r;
  return r;
}
}  // namespace

bool register_kernel(const void* kernel) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.kernels.push_back(kernel);
  return true;
}

void preload_registered_kernels() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  for (const void* k : r.kernels) {
    cudaFuncAttributes a{};
    WEFT_CUDA_CHECK(cudaFuncGetAttributes(&a, k));
  }
}

}  // namespace weft::detail
