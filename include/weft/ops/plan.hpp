// weft::Plan: what an op call would do, without doing it. Every op has a plan function that takes the
// call's own arguments and returns one (gemm_plan, all_reduce_plan, ..., all_gather_matmul_plan); the call
// runs through the same code (it plans, then launches), so the two never disagree. A plan answers:
//   can the op run here   the plan function returns, or throws the weft::Error the call would throw (shape,
//                         dtype, alignment, device, world size, SM budget, a forced path that cannot run);
//   workspace             the Communicator workspace the call uses, per area: a call grows an area that is
//                         smaller, which is refused while capturing a CUDA graph (reserve_workspace first);
//   launch                the path taken and the grid of its main kernel.
// Host-only header.
#pragma once
#include <cstdint>
#include <map>
#include <string>

namespace weft {

struct Plan {
  std::string op;       // "gemm", "all_reduce", "all_gather_matmul", ...
  std::string path;     // what runs: "one-shot", "two-shot push", "fused", "pipelined", "sequential", ...
  std::string why_not;  // the op's first choice where it cannot run here, and why; "" otherwise
  std::map<std::string, uint64_t> workspace;  // bytes per workspace area ("": the shared one) the call uses
  int blocks = 0;       // the main kernel's grid, communicator blocks included (0: no weft kernel)
  int comm_blocks = 0;  // communicator blocks in it
  int cluster = 0;      // CTAs per cluster
  int smem_bytes = 0;   // dynamic shared memory per block
  struct Tiles {        // ops that run weft's tiled GEMM: output tile, k step, stages, band, tile count
    int m = 0, n = 0, k = 0, stages = 0, group_m = 0;
    int64_t count = 0;
  } tiles;
  int64_t chunk_rows = 0, chunks = 0;  // all_gather_matmul's fused kernel: A rows per flag, chunks per shard

  uint64_t workspace_bytes(const std::string& area = {}) const {
    auto it = workspace.find(area);
    return it == workspace.end() ? 0 : it->second;
  }
};

// One line for logs: "all_reduce: two-shot push, 64 blocks, workspace 8 MiB".
std::string describe(const Plan& plan);

}  // namespace weft
