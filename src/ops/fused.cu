// Host side of the fused tensor-parallel ops: argument checks, the fused-or-sequential choice, workspace
// layout, tensor maps and launch (device code: weft/ops/fused.cuh).
#include <algorithm>
#include <string>

#include "cublas_gemm.hpp"
#include "op_args.hpp"
#include "weft/runtime/current_device.hpp"
#include "weft/runtime/kernel_preload.hpp"
#include "weft/ops/fused.cuh"
#include "weft/ops/fused.hpp"
#include "weft/tile/tma.cuh"

namespace weft {

const char* fused_path_name(FusedPath p) {
  return p == FusedPath::kFused ? "fused" : "sequential";
}

namespace {

using ops::ll_region_bytes;  // fused ops keep their data after the collectives' LL region

struct Call {
  Communicator& comm;
  Rank& rank;
  cudaStream_t stream;
  std::string where;
  bool capturing = false;
  detail::CurrentDeviceGuard keep_device;  // the op runs on the rank's GPU; the caller's device comes back
  Call(Communicator& c, Rank& r, cudaStream_t s, const char* op, int64_t m, int64_t n, int64_t k)
      : comm(c), rank(r), stream(s ? s : r.stream()) {
    WEFT_CUDA_CHECK(cudaSetDevice(r.device()));
    where = std::string("weft::") + op + "(M=" + std::to_string(m) + ", N=" + std::to_string(n) +
            ", K=" + std::to_string(k) + "): ";
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    WEFT_CUDA_CHECK(cudaStreamIsCapturing(stream, &st));
    capturing = st != cudaStreamCaptureStatusNone;
    WEFT_CHECK(m > 0 && n > 0 && k > 0, where + "M, N and K must be at least 1");
    WEFT_CHECK(m % r.world() == 0,
               where + "M must be divisible by the world size " + std::to_string(r.world()));
    WEFT_CHECK(k % 8 == 0 && n % 8 == 0,
               where + "K and N must be multiples of 8 (bf16 rows of 16-byte multiples, which TMA requires)");
  }
  void check_buffer(const void* p, const char* name, uint64_t bytes) const {
    ops::check_device_buffer(comm, rank, p, name, bytes, 16, where);
  }
  // The operands every fused op has: A (`a_rows` x K, named `a_name`), B (K x N either way), out
  // (`out_rows` x N), all bf16; then the GEMM's own shape, layout and device checks, with gemm's messages.
  void check_operands(const void* a, const char* a_name, int64_t a_rows, const void* b, const void* out,
                      int64_t out_rows, int64_t m, int64_t n, int64_t k, BLayout layout) const {
    check_buffer(a, a_name, a_rows * k * 2);
    check_buffer(b, "b", n * k * 2);
    check_buffer(out, "out", out_rows * n * 2);
    gemm_plan(m, n, k, layout, DType::kBF16);
  }
  char* workspace(uint64_t bytes) {
    return ops::workspace_of(comm, rank, ll_region_bytes(rank.world()) + bytes, capturing, where) +
           ll_region_bytes(rank.world());
  }
  // Fused or sequential; `why_not` is empty when the fused kernel can run, else the reason it cannot;
  // `pays_off`: kAuto's measured rule (fused_pays_off) says the fused kernel beats the sequential path.
  bool fused(const FusedOptions& o, int64_t m, const std::string& why_not, bool pays_off) const {
    WEFT_CHECK(o.mode != FusedOptions::Mode::kFused || why_not.empty(),
               where + "the fused kernel cannot run here: " + why_not + " (use Mode::kAuto to fall back)");
    if (o.mode == FusedOptions::Mode::kAuto)
      return why_not.empty() && rank.world() > 1 && m >= o.min_fused_m && pays_off;
    return o.mode == FusedOptions::Mode::kFused;
  }
  // The sequential path's GEMM: cuBLAS (never slower than the cuBLAS + NCCL baseline), weft::gemm where
  // cuBLAS cannot take the shape.
  void sequential_gemm(const void* a, const void* b, void* out, int64_t m, int64_t n, int64_t k,
                       BLayout layout) const {
    if (!ops::cublas_gemm_bf16(a, b, out, m, n, k, layout, stream, capturing, where))
      gemm(a, b, out, m, n, k, layout, DType::kBF16, stream);
  }
  // Grid of an LCSC op with `comm` communicator blocks: compute clusters fill the rest of the GPU.
  template <class Op>
  int compute_blocks(int comm_blocks, int units, const FusedOptions& o) const {
    int clusters = lcsc::Launcher<Op>::max_resident_clusters() - comm_blocks / Op::kClusterSize;
    if (o.max_compute_blocks > 0)
      clusters = std::min(clusters, std::max(1, o.max_compute_blocks / Op::kClusterSize));
    WEFT_CHECK(clusters >= 1, where + "no SMs left for the GEMM next to " + std::to_string(comm_blocks) +
                                  " communicator blocks");
    return std::min(clusters, units) * Op::kClusterSize;
  }
};

template <class Op, bool kKMajor>
void set_gemm_maps(typename Op::Params& p, const void* a, const void* b, int64_t m, int64_t n, int64_t k,
                   const void* c, CUtensorMapDataType c_type, uint32_t c_bytes, int64_t c_rows) {
  using Mainloop = typename Op::Mainloop;
  p.a = tma::make_map_2d({a, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, uint64_t(m), uint64_t(k), uint64_t(k) * 2},
                         Mainloop::kABoxRows, Mainloop::kABoxCols, "fused op: A");
  const uint64_t b_rows = kKMajor ? n : k, b_cols = kKMajor ? k : n;
  p.b = tma::make_map_2d({b, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, b_rows, b_cols, b_cols * 2},
                         Mainloop::kBBoxRows, Mainloop::kBBoxCols, "fused op: B");
  p.c = tma::make_map_2d({c, c_type, c_bytes, uint64_t(c_rows), uint64_t(n), uint64_t(n) * c_bytes},
                         Op::Epilogue::kBoxRows, Op::Epilogue::kBoxCols, "fused op: C");
  p.k_blocks = static_cast<int>((k + Op::kBK - 1) / Op::kBK);
  p.store_mode = lcsc::StoreMode::kStore;
}

template <class Op>
void set_schedule(lcsc::SchedulerParams& s, int64_t m, int64_t n) {
  s.tiles_m = static_cast<int>((m + Op::kBM - 1) / Op::kBM);
  s.tiles_n = static_cast<int>((n + Op::kBN - 1) / Op::kBN);
  s.cluster_m = Op::kClusterSize;
  s.group_m = 16;
}

template <bool kKMajor>
void launch_ag(Call& c, const void* a_shard, const void* b, void* out, char* gathered, int64_t m, int64_t n,
               int64_t k, int chunk_rows, int chunks, const FusedOptions& o) {
  using Op = ops::AgGemmOp<kKMajor, 1>;
  typename Op::Params p{};
  const int W = c.rank.world(), comm_blocks = o.comm_blocks > 0 ? (o.comm_blocks + 1) / 2 * 2 : 16;
  set_schedule<Op>(p.sched, m, n);
  set_gemm_maps<Op, kKMajor>(p, gathered, b, m, n, k, out, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, m);
  // Local rows first: start at the band of tile rows holding this rank's shard; then rank + 1's (which
  // rank + 1 pushes here right after its own copy), and so on.
  const int band_units = p.sched.group_m / Op::kClusterSize;
  const int first_unit_row = static_cast<int>(c.rank.rank() * (m / W) / Op::kBM) / Op::kClusterSize;
  p.sched.start_unit = first_unit_row / band_units * band_units * p.sched.tiles_n;
  p.sched.compute_blocks = c.compute_blocks<Op>(comm_blocks, p.sched.units(), o);
  p.sync = ops::FusedSync{c.rank.view(), p.sched.compute_blocks * Op::kConsumerWarpgroups + comm_blocks};
  p.a_local = tma::make_map_2d(
      {a_shard, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, uint64_t(m / W), uint64_t(k), uint64_t(k) * 2},
      Op::Mainloop::kABoxRows, Op::Mainloop::kABoxCols, "all_gather_matmul: A shard");
  p.a_shard = static_cast<const __nv_bfloat16*>(a_shard);
  p.gathered = reinterpret_cast<__nv_bfloat16*>(gathered);
  p.shard_rows = m / W;
  p.k = k;
  p.chunk_rows = chunk_rows;
  p.chunks = chunks;
  lcsc::Launcher<Op>::launch(p, p.sched.compute_blocks + comm_blocks, c.stream);
  WEFT_CUDA_CHECK(cudaGetLastError());
}

// The RS GEMM into every owner's fp32 accumulator (`acc`: this rank's [M/W, N] in the workspace), then the
// finalize kernel converts this rank's shard into `out` (bf16 [M/W, N]).
template <bool kKMajor>
void launch_rs(Call& c, const void* a, const void* b, void* out, float* acc, int64_t m, int64_t n, int64_t k,
               const FusedOptions& o) {
  using Op = ops::RsGemmOp<kKMajor, 1>;
  typename Op::Params p{};
  const int W = c.rank.world(), me = c.rank.rank(), comm_blocks = Op::kClusterSize;  // block 0 meets
  const int64_t rows = m / W;
  set_schedule<Op>(p.sched, m, n);
  set_gemm_maps<Op, kKMajor>(p, a, b, m, n, k, acc, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, rows);
  const char* my_heap = c.rank.heap_of(me);
  for (int r = 0; r < W; ++r)
    p.owner[r] =
        tma::make_map_2d({c.rank.heap_of(r) + (reinterpret_cast<char*>(acc) - my_heap),
                          CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, uint64_t(rows), uint64_t(n), uint64_t(n) * 4},
                         Op::Epilogue::kBoxRows, Op::Epilogue::kBoxCols, "matmul_reduce_scatter: owner");
  p.sched.start_unit =
      static_cast<int>(int64_t(me) * p.sched.units() / W);  // ranks start on different owners
  p.sched.compute_blocks = c.compute_blocks<Op>(comm_blocks, p.sched.units(), o);
  p.sync = ops::FusedSync{c.rank.view(), p.sched.compute_blocks * Op::kConsumerWarpgroups + comm_blocks};
  p.shard_rows = static_cast<int>(rows);
  WEFT_CUDA_CHECK(cudaMemsetAsync(acc, 0, rows * n * 4, c.stream));
  lcsc::Launcher<Op>::launch(p, p.sched.compute_blocks + comm_blocks, c.stream);
  WEFT_CUDA_CHECK(cudaGetLastError());
  int sms = 0;
  WEFT_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, c.rank.device()));
  const uint64_t n4 = uint64_t(rows) * n / 4;
  const int blocks =
      static_cast<int>(std::clamp<uint64_t>((n4 + 2047) / 2048, 1, std::min(sms, kCollectiveMaxBlocks)));
  detail::preload<&ops::rs_finalize_kernel>();
  ops::rs_finalize_kernel<<<blocks, 512, 0, c.stream>>>(c.rank.view(), reinterpret_cast<const float4*>(acc),
                                                        static_cast<uint2*>(out), n4);
  WEFT_CUDA_CHECK(cudaGetLastError());
}

// kAuto's choice, from weft-bench fused on 4x H200 (bench/RESULTS.md, 2026-11-21): the fused all-gather
// GEMM beat cuBLAS + NCCL by 1.40-1.60x where communication outweighs the GEMM (M >= 8192 with N <= 2048 per
// rank) and lost or tied elsewhere (0.80-1.03x); the fused reduce-scatter GEMM lost everywhere (0.83-0.94x),
// so matmul_reduce_scatter and matmul_all_reduce run sequentially unless forced.
bool fused_pays_off(bool all_gather, int64_t m, int64_t n_per_rank) {
  return all_gather && m >= 8192 && n_per_rank <= 4096;
}

// The storer adds whole 64-row halves of a tile into one owner's shard: a half that straddled two shards
// would need a TMA box starting at a negative row of the second, which the hardware rejects (illegal
// instruction, seen on H200).
std::string rs_why_not(const Call& c, int64_t m) {
  const int64_t rows = m / c.rank.world();
  if (c.rank.world() > ops::kFusedMaxWorld) return "world size above " + std::to_string(ops::kFusedMaxWorld);
  if (rows % 64 != 0) return "M / world size = " + std::to_string(rows) + " is not a multiple of 64";
  if (rows > INT32_MAX) return "M / world size above 2^31";
  return {};
}

}  // namespace

FusedPath all_gather_matmul(Communicator& comm, Rank& rank, const void* a_shard, const void* b, void* out,
                            void* gathered_a, int64_t m, int64_t n, int64_t k, BLayout layout,
                            cudaStream_t stream, const FusedOptions& o) {
  Call c(comm, rank, stream, "all_gather_matmul", m, n, k);
  const int W = rank.world();
  const int64_t rows = m / W;
  c.check_operands(a_shard, "a_shard", rows, b, out, m, m, n, k, layout);
  if (gathered_a) c.check_buffer(gathered_a, "gathered_a", m * k * 2);
  WEFT_CHECK(o.comm_blocks >= 0 && o.comm_blocks <= 32, c.where + "options.comm_blocks must be 0..32");
  // Chunks of whole 128-row blocks, at most kFusedFlags flags in all.
  const int64_t blocks = (rows + 127) / 128, per_shard = std::max<int64_t>(1, ops::kFusedFlags / W);
  const int64_t chunk_rows = 128 * ((blocks + per_shard - 1) / per_shard),
                chunks = (rows + chunk_rows - 1) / chunk_rows;
  const bool sym_gathered = gathered_a && comm.in_heap(rank, gathered_a, m * k * 2);
  const bool fits = W * chunks <= ops::kFusedFlags && chunk_rows <= INT32_MAX;
  if (!c.fused(o, m, fits ? std::string() : "more A chunks than flags", fused_pays_off(true, m, n))) {
    char* g = gathered_a ? static_cast<char*>(gathered_a) : c.workspace(m * k * 2);
    // The all-gather waits for peers that this thread launches later when it drives several ranks: load
    // cuBLAS's kernel for this shape before it (cublas_gemm_preload says why).
    if (comm.num_local() > 1)
      ops::cublas_gemm_preload(g, b, out, m, n, k, layout, c.stream, c.capturing, c.where);
    all_gather(comm, rank, a_shard, g, Shape2D{size_t(rows), size_t(k)}, 0, DType::kBF16, c.stream);
    c.sequential_gemm(g, b, out, m, n, k, layout);
    return FusedPath::kSequential;
  }
  char* g = sym_gathered ? static_cast<char*>(gathered_a) : c.workspace(m * k * 2);
  if (layout == BLayout::kNK)
    launch_ag<true>(c, a_shard, b, out, g, m, n, k, int(chunk_rows), int(chunks), o);
  else
    launch_ag<false>(c, a_shard, b, out, g, m, n, k, int(chunk_rows), int(chunks), o);
  if (gathered_a && !sym_gathered)
    WEFT_CUDA_CHECK(cudaMemcpyAsync(gathered_a, g, m * k * 2, cudaMemcpyDeviceToDevice, c.stream));
  return FusedPath::kFused;
}

FusedPath matmul_reduce_scatter(Communicator& comm, Rank& rank, const void* a, const void* b, void* out,
                                int64_t m, int64_t n, int64_t k, BLayout layout, cudaStream_t stream,
                                const FusedOptions& o) {
  Call c(comm, rank, stream, "matmul_reduce_scatter", m, n, k);
  const int64_t rows = m / rank.world();
  c.check_operands(a, "a", m, b, out, rows, m, n, k, layout);
  if (!c.fused(o, m, rs_why_not(c, m), fused_pays_off(false, m, n))) {
    char* tmp = c.workspace(m * n * 2);  // symmetric: reduce_scatter reads it in place
    c.sequential_gemm(a, b, tmp, m, n, k, layout);
    reduce_scatter(comm, rank, tmp, out, Shape2D{size_t(rows), size_t(n)}, 0, DType::kBF16, ReduceOp::kSum,
                   c.stream);
    return FusedPath::kSequential;
  }
  float* acc = reinterpret_cast<float*>(c.workspace(rows * n * 4));
  if (layout == BLayout::kNK)
    launch_rs<true>(c, a, b, out, acc, m, n, k, o);
  else
    launch_rs<false>(c, a, b, out, acc, m, n, k, o);
  return FusedPath::kFused;
}

FusedPath matmul_all_reduce(Communicator& comm, Rank& rank, const void* a, const void* b, void* out,
                            int64_t m, int64_t n, int64_t k, BLayout layout, cudaStream_t stream,
                            const FusedOptions& o) {
  Call c(comm, rank, stream, "matmul_all_reduce", m, n, k);
  const int W = rank.world();
  const int64_t rows = m / W;
  c.check_operands(a, "a", m, b, out, m, m, n, k, layout);
  if (!c.fused(o, m, rs_why_not(c, m), fused_pays_off(false, m, n))) {
    c.sequential_gemm(a, b, out, m, n, k, layout);
    all_reduce(comm, rank, out, out, size_t(m) * n, DType::kBF16, ReduceOp::kSum, c.stream);
    return FusedPath::kSequential;
  }
  // First version: the fused reduce-scatter into this rank's rows of out, then an in-place all-gather.
  char* mine = static_cast<char*>(out) + rows * n * 2 * rank.rank();
  // Workspace for the all-gather too (non-symmetric out stages there): growing it between the two kernels
  // would synchronize the devices while this rank's kernel waits for peers not yet launched.
  c.workspace(comm.in_heap(rank, out, m * n * 2) ? 0 : m * n * 2);
  float* acc = reinterpret_cast<float*>(c.workspace(rows * n * 4));
  if (layout == BLayout::kNK)
    launch_rs<true>(c, a, b, mine, acc, m, n, k, o);
  else
    launch_rs<false>(c, a, b, mine, acc, m, n, k, o);
  all_gather(comm, rank, mine, out, Shape2D{size_t(rows), size_t(n)}, 0, DType::kBF16, c.stream);
  return FusedPath::kFused;
}

}  // namespace weft
