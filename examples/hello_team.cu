// The smallest weft program: every rank writes a greeting into every peer's copy of a symmetric buffer,
// the team meets in a barrier inside the same kernel, and each rank checks what it received.
//
//   ./hello_team                      single-process over all local GPUs
//   weft-launch -n 4 ./hello_team     one process per GPU (torchrun / mpirun work the same way)
#include <cstdio>

#include "weft/comm/barrier.cuh"
#include "weft/runtime/communicator.hpp"

__global__ void greet(weft::TeamView team, int* slots, int* wrong) {
  // slots[r] on every rank is written by rank r.
  for (int p = threadIdx.x; p < team.world; p += blockDim.x)
    *team.peer_ptr(slots + team.rank, p) = 1000 + team.rank;
  if (!weft::barrier_block(team)) return;  // false only on timeout/abort; the host reports why
  for (int r = threadIdx.x; r < team.world; r += blockDim.x)
    if (slots[r] != 1000 + r) atomicAdd(wrong, 1);
}

int main() {
  try {
    auto comm = weft::Communicator::create();  // single-process, or one rank per process under a launcher
    weft::SymmetricBuffer buf = comm->alloc(sizeof(int) * (comm->world() + 1));
    for (int i = 0; i < comm->num_local(); ++i) {
      weft::Rank& r = comm->local(i);
      cudaSetDevice(r.device());
      cudaMemsetAsync(buf.local[i], 0, buf.bytes, r.stream());
    }
    comm->synchronize();
    comm->host_barrier();  // every rank zeroed its copy before anyone writes into it
    for (int i = 0; i < comm->num_local(); ++i) {
      weft::Rank& r = comm->local(i);
      cudaSetDevice(r.device());
      int* slots = reinterpret_cast<int*>(buf.local[i]);
      greet<<<1, 32, 0, r.stream()>>>(r.view(), slots, slots + comm->world());
    }
    comm->synchronize();  // throws with a precise message if any rank's wait failed
    int bad = 0;
    for (int i = 0; i < comm->num_local(); ++i) {
      int wrong = 0;
      cudaSetDevice(comm->local(i).device());
      cudaMemcpy(&wrong, reinterpret_cast<int*>(buf.local[i]) + comm->world(), sizeof(int),
                 cudaMemcpyDeviceToHost);
      std::printf("rank %d: %s\n", comm->local(i).rank(),
                  wrong ? "WRONG greetings" : "greeted by every rank");
      bad += wrong;
    }
    comm->free(buf);
    return bad ? 1 : 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
