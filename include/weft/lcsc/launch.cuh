// Host side of the LCSC kernel (lcsc/kernel.cuh): launch configuration, the resident-cluster count of an
// op on the current GPU, and the launch itself. Include from .cu files that launch LCSC ops.
#pragma once
#include <cuda_runtime.h>

#include <string>

#include "weft/lcsc/kernel.cuh"
#include "weft/runtime/current_device.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/kernel_preload.hpp"

namespace weft::lcsc {

template <class Op>
struct Launcher {
  static_assert(kSmemBytes<Op> <= kMaxSmemBytes, "the op's shared memory exceeds 227 KiB per block");

  // The launch configuration of `blocks` blocks in clusters of Op::kClusterSize (`attr` holds the cluster
  // shape; the config points at it).
  static cudaLaunchConfig_t config(int blocks, cudaStream_t stream, cudaLaunchAttribute& attr) {
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = Op::kClusterSize;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(static_cast<unsigned>(blocks));
    cfg.blockDim = dim3(kThreads<Op>);
    cfg.dynamicSmemBytes = kSmemBytes<Op>;
    cfg.stream = stream;
    cfg.attrs = &attr;
    cfg.numAttrs = Op::kClusterSize > 1 ? 1 : 0;
    return cfg;
  }

  // Sets the kernel's shared-memory limit on the current device (once) and returns how many clusters of
  // Op::kClusterSize blocks can be resident at once: the size of a persistent grid that never waits.
  static int max_resident_clusters() {
    return detail::once_per_device([](int dev) {
      const auto kernel = persistent_kernel<Op>;
      WEFT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(kSmemBytes<Op>)));
      int sms = 0;
      WEFT_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
      int n = 0;
      if constexpr (Op::kClusterSize == 1) {
        WEFT_CUDA_CHECK(
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads<Op>, kSmemBytes<Op>));
        n *= sms;
      } else {
        cudaLaunchAttribute attr;
        const cudaLaunchConfig_t cfg = config(sms / Op::kClusterSize * Op::kClusterSize, nullptr, attr);
        WEFT_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&n, kernel, &cfg));
      }
      WEFT_CHECK(n > 0, "the LCSC kernel does not fit on this GPU (" + std::to_string(kSmemBytes<Op>) +
                            " bytes of shared memory, " + std::to_string(kThreads<Op>) +
                            " threads per block)");
      return n;
    });
  }

  // Launches `blocks` blocks (a multiple of Op::kClusterSize; p.sched.compute_blocks of them compute).
  static void launch(const typename Op::Params& p, int blocks, cudaStream_t stream) {
    if (blocks <= 0) return;
    detail::preload<&persistent_kernel<Op>>();
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = config(blocks, stream, attr);
    WEFT_CUDA_CHECK(cudaLaunchKernelEx(&cfg, persistent_kernel<Op>, p));
  }
};

}  // namespace weft::lcsc
