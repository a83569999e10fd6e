// Thread-block clusters (SM-to-SM distributed shared memory inside one GPU): rank in the cluster, the
// cluster barrier, and mbarrier arrivals that complete locally or on a peer CTA of the cluster. This is
// what TMA multicast of a shared operand needs; it has nothing to do with NVLink multicast (never used).
#pragma once
#include <cstdint>

#include "weft/device/bulk_copy.cuh"

namespace weft::tile {

__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ uint32_t cluster_id_x() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(r));
  return r;
}

// Every thread of every CTA in the cluster arrives; wait returns once all have. Release/acquire at cluster
// scope: shared-memory writes and mbarrier operations before the arrive are visible after the wait.
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_sync() {
  cluster_arrive();
  cluster_wait();
}

// A plain arrival on a local mbarrier (bulk_copy.cuh has the expect-tx form).
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// Arrives on the mbarrier at the same shared-memory offset as `bar` in CTA `cta` of this cluster (which
// may be this CTA). Release at cluster scope: this thread's earlier reads of the stage are done.
__device__ __forceinline__ void mbarrier_arrive_cluster(uint64_t* bar, uint32_t cta) {
  asm volatile(
      "{\n .reg .b32 remote;\n mapa.shared::cluster.u32 remote, %0, %1;\n"
      " mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n}" ::"r"(smem_addr(bar)),
      "r"(cta)
      : "memory");
}

}  // namespace weft::tile
