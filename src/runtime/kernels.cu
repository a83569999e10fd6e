// Kernels the host runtime launches itself (declared in kernels.hpp).
#include "kernels.hpp"
#include "weft/comm/barrier.cuh"
#include "weft/runtime/error.hpp"
#include "weft/runtime/kernel_preload.hpp"

namespace weft {

namespace {
__global__ void team_barrier_kernel(TeamView team, int slot) {
  (void)barrier_block(team, slot);  // a failed wait is recorded; synchronize() reports it
}
}  // namespace

void launch_team_barrier(const TeamView& view, int slot, cudaStream_t stream) {
  detail::preload<&team_barrier_kernel>();
  team_barrier_kernel<<<1, 32, 0, stream>>>(view, slot);
  WEFT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace weft
