// Kernels the host runtime launches itself (src/runtime/kernels.cu), for the runtime and the op launchers.
#pragma once
#include <cuda_runtime.h>

#include "weft/team_view.hpp"

namespace weft {

// A one-block kernel on `stream` that meets the team in barrier slot `slot`: every rank's work before it on
// its stream has finished when any rank's work after it starts. A failed wait is recorded; synchronize()
// reports it.
void launch_team_barrier(const TeamView& view, int slot, cudaStream_t stream);

}  // namespace weft
