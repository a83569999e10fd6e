// A job spanning nodes: every rank adds its rank number into one vector over the whole job, weft's kernels
// inside each node and NCCL between nodes (weft::MultiNodeTeam, weft::hierarchical_all_reduce).
//
//   on each node I of N:  WEFT_JOB_SECRET=<the same on every node> \
//                         weft-launch -n 8 --nnodes N --node-rank I --master node0:29500 ./hello_nodes
//   on one host, as two fake nodes of 2 GPUs:  WEFT_NODE_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \
//                         weft-launch -n 4 ./hello_nodes
#include <cuda_runtime.h>

#include <cstdio>
#include <vector>

#include "weft/ops/hierarchical.hpp"
#include "weft/runtime/multi_node.hpp"

int main() {
  try {
    auto team = weft::MultiNodeTeam::create();  // the job's rendezvous, the node's team, NCCL between nodes
    const size_t n = 1 << 20;
    std::vector<float> mine(n, float(team->rank()));
    float* x = nullptr;
    cudaSetDevice(team->node_rank().device());
    cudaMalloc(&x, n * sizeof(float));
    cudaMemcpy(x, mine.data(), n * sizeof(float), cudaMemcpyHostToDevice);
    weft::hierarchical_all_reduce(*team, x, x, n, weft::DType::kFP32);  // in place, on the rank's stream
    cudaStreamSynchronize(team->node_rank().stream());
    team->check_alive();  // throws with the reason if a rank of any node was lost
    cudaMemcpy(mine.data(), x, n * sizeof(float), cudaMemcpyDeviceToHost);
    const float want = float(team->world()) * (team->world() - 1) / 2;
    size_t wrong = 0;
    for (float v : mine) wrong += v != want;
    std::printf("rank %d (node %d of %d, %d ranks each): %s\n", team->rank(), team->node(), team->nodes(),
                team->node_size(), wrong ? "WRONG sum" : "the sum of every rank of every node");
    cudaFree(x);
    return wrong ? 1 : 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
