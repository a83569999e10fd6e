// Eager loading of weft's kernels.
//
// With CUDA's lazy loading (the default since CUDA 12), a kernel's code is loaded at its first launch, and
// loading may wait for the device to go idle. weft's kernels spin until their peers' kernels run: if one GPU
// runs such a kernel while the host thread that drives all GPUs (single-process mode) blocks in the loading
// of the next kernel for that GPU, the peers' kernels are never launched and the job hangs until the
// device-wait timeout. So every launcher names its kernels with preload<&kernel>(), which registers them at
// program start, and the Communicator loads all of them on each of its GPUs before any op runs.
#pragma once

namespace weft::detail {

// Adds a kernel (its host-side handle) to the list loaded by preload_registered_kernels(); returns true.
bool register_kernel(const void* kernel);
// Loads every registered kernel into the current device's context (cudaFuncGetAttributes).
void preload_registered_kernels();

template <auto kKernel>
struct KernelRegistration {
  static inline const bool registered = register_kernel(reinterpret_cast<const void*>(kKernel));
};

// Use before launching kKernel: the odr-use registers it during static initialization.
template <auto kKernel>
inline void preload() {
  (void)KernelRegistration<kKernel>::registered;
}

}  // namespace weft::detail
