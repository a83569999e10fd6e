// An LCSC op of your own, in the shape docs/DESIGN.md ("The op contract") describes: C = A . B computed on
// every rank and stored by TMA straight into the NEXT rank's `out` (a ring shift of the product), with a
// counter there that says when all of it has landed. It reuses weft's GEMM roles (scheduler, mainloop,
// epilogue) and adds two things: a parameter struct with the team and a granted flag, and a finish hook that
// publishes the warpgroup's stores to the next rank.
//
//   ./matmul_to_next                           single-process over all local GPUs
//   WEFT_RANKS_PER_GPU=2 CUDA_DEVICE_MAX_CONNECTIONS=32 ./matmul_to_next      two virtual ranks on one GPU
//   weft-launch -n 4 ./matmul_to_next           one process per GPU
#include <cuda_bf16.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "weft/comm/signal.cuh"
#include "weft/lcsc/launch.cuh"
#include "weft/ops/gemm.cuh"
#include "weft/runtime/communicator.hpp"
#include "weft/runtime/tensor_map.hpp"

// ---- the op: device code ----------------------------------------------------------------------------
struct MatmulToNext : weft::ops::GemmOp<__nv_bfloat16, /*B is [N,K]*/ true, /*cluster*/ 1> {
  using Base = weft::ops::GemmOp<__nv_bfloat16, true, 1>;
  struct Params : Base::Params {  // Base::Params::c maps the next rank's `out`
    weft::TeamView team;
    weft::Flags landed;  // landed[0] at rank r: warpgroups of rank r - 1 whose tiles have landed here
  };
  // After a consumer warpgroup's last tile: its TMA stores have completed (Base::finish waits for them);
  // order them before a release signal into the next rank's counter.
  __device__ static void finish(const Params& p, Base::Smem& s, int wg, Base::StoreState& es) {
    Base::finish(p, s, wg, es);
    if (weft::tile::thread_in_warpgroup() == 0) {
      weft::release_after_tma();
      weft::signal_add(p.team, p.team.flag(p.landed, 0), (p.team.rank + 1) % p.team.world, 1);
    }
  }
};

// Waits until `landed` reaches the finishers of `calls` calls of the previous rank.
__global__ void wait_landed(weft::TeamView team, weft::Flags landed, uint64_t want) {
  (void)weft::wait_ge(team, team.flag(landed, 0), want);  // a timeout is reported by synchronize()
}

// ---- the op: host side (plan, launch) ---------------------------------------------------------------
// Enqueues out@next = a . b on rank r's stream; returns the finishers the next rank must wait for.
int matmul_to_next(weft::Communicator& comm, weft::Rank& r, const void* a, const void* b, char* out, int m,
                   int n, int k) {
  using Op = MatmulToNext;
  using weft::tma::make_map_2d;
  const auto bf16 = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const int next = (r.rank() + 1) % r.world();
  Op::Params p{};
  p.a = make_map_2d({a, bf16, 2, uint64_t(m), uint64_t(k), uint64_t(k) * 2}, Op::Mainloop::kABoxRows,
                    Op::Mainloop::kABoxCols, "A");
  p.b = make_map_2d({b, bf16, 2, uint64_t(n), uint64_t(k), uint64_t(k) * 2}, Op::Mainloop::kBBoxRows,
                    Op::Mainloop::kBBoxCols, "B");
  p.c = make_map_2d({r.peer_ptr(out, next), bf16, 2, uint64_t(m), uint64_t(n), uint64_t(n) * 2},
                    Op::Epilogue::kBoxRows, Op::Epilogue::kBoxCols, "out of the next rank");
  p.k_blocks = (k + Op::kBK - 1) / Op::kBK;
  p.store_mode = weft::lcsc::StoreMode::kStore;
  p.sched.tiles_m = (m + Op::kBM - 1) / Op::kBM;
  p.sched.tiles_n = (n + Op::kBN - 1) / Op::kBN;
  p.sched.group_m = 16;
  // A persistent grid within the rank's SM budget (every rank's blocks must be resident together).
  const int resident = weft::lcsc::Launcher<Op>::max_resident_clusters();
  p.sched.compute_blocks = std::min(
      p.sched.units(), std::max(1, resident * std::min(r.sm_budget(), r.device_sms()) / r.device_sms()));
  p.team = r.view();
  p.landed = comm.resources(weft::ResourceRequest{"example: matmul_to_next landed", 1}).flags;
  weft::lcsc::Launcher<Op>::launch(p, p.sched.compute_blocks, r.stream());
  return p.sched.compute_blocks * Op::kConsumerWarpgroups;
}

// ---- a run on the team: rank r's A is filled with (r + 1) / 8, B with 1 / 8, so the product that rank r
// receives from rank r - 1 is (r_prev + 1) * K / 64 everywhere. ---------------------------------------
int main() {
  try {
    auto comm = weft::Communicator::create();
    const int m = 300, n = 264, k = 136;  // partial tiles on purpose
    weft::SymmetricBuffer out = comm->alloc(size_t(m) * n * 2);
    std::vector<void*> a(comm->num_local()), b(comm->num_local());
    std::vector<int> finishers(comm->num_local());
    for (int i = 0; i < comm->num_local(); ++i) {
      weft::Rank& r = comm->local(i);
      cudaSetDevice(r.device());
      std::vector<__nv_bfloat16> ha(size_t(m) * k, __float2bfloat16((r.rank() + 1) / 8.f)),
          hb(size_t(n) * k, __float2bfloat16(1 / 8.f));
      cudaMalloc(&a[i], ha.size() * 2);
      cudaMalloc(&b[i], hb.size() * 2);
      cudaMemcpy(a[i], ha.data(), ha.size() * 2, cudaMemcpyHostToDevice);
      cudaMemcpy(b[i], hb.data(), hb.size() * 2, cudaMemcpyHostToDevice);
    }
    comm->host_barrier();  // every rank's buffers exist before any peer stores into them
    for (int i = 0; i < comm->num_local(); ++i)
      finishers[i] = matmul_to_next(*comm, comm->local(i), a[i], b[i], out.local[i], m, n, k);
    // Every rank's grid is sized alike (same shape, same team-wide budget): rank r waits for rank r - 1's.
    const auto landed = comm->resources(std::string("example: matmul_to_next landed")).flags;
    for (int i = 0; i < comm->num_local(); ++i) {
      weft::Rank& r = comm->local(i);
      cudaSetDevice(r.device());
      wait_landed<<<1, 1, 0, r.stream()>>>(r.view(), landed, uint64_t(finishers[i]));
    }
    comm->synchronize();  // throws with a precise message if a wait timed out
    int bad = 0;
    for (int i = 0; i < comm->num_local(); ++i) {
      weft::Rank& r = comm->local(i);
      const int prev = (r.rank() + r.world() - 1) % r.world();
      std::vector<__nv_bfloat16> h(size_t(m) * n);
      cudaSetDevice(r.device());
      cudaMemcpy(h.data(), out.local[i], h.size() * 2, cudaMemcpyDeviceToHost);
      const float want = (prev + 1) * k / 64.f;
      int wrong = 0;
      for (const auto& x : h) wrong += std::fabs(__bfloat162float(x) - want) > 1e-2f * want;
      std::printf("rank %d: %s (from rank %d, %d of %zu elements wrong)\n", r.rank(),
                  wrong ? "WRONG" : "received its predecessor's product", prev, wrong, h.size());
      bad += wrong;
      cudaFree(a[i]);
      cudaFree(b[i]);
    }
    comm->free(out);
    return bad ? 1 : 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
