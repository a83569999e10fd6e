// weft-bench fused: the fused tensor-parallel ops against the sequential cuBLAS + NCCL path in the same run,
// bf16, B as an [N, K] weight. Per op and shape: sequential (cuBLAS then NCCL), compute alone (the cuBLAS
// GEMM), communication alone (the NCCL collective), weft (the fused op, which may itself fall back to its
// sequential path: the "weft path" column says so), and weft over the bound max(compute, communication).
// Shapes are global (N = K = 8192, N = 28672 / K = 8192): all_gather_matmul multiplies by an N/W column
// slice, matmul_reduce_scatter / all_reduce by a K/W slice. Times: CUDA graphs, slowest rank's median; the
// columns of a row are timed in turns (one replay of each, then the next round), so drift does not bias them;
// inputs rotate through copies larger than L2 together (rotating_sets), as a model's layers would.
#include <cublas_v2.h>
#include <nccl.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "bench.hpp"
#include "weft/ops/fused.hpp"
#include "weft/ops/gemm.hpp"

namespace weft::bench {
namespace {

#define FB_CUBLAS(expr) \
  WEFT_CHECK((expr) == CUBLAS_STATUS_SUCCESS, std::string("weft-bench fused: cuBLAS failed: ") + #expr)

enum class Op { kAG, kRS, kAR };
const char* op_name(Op o) {
  return o == Op::kAG ? "all_gather_matmul" : o == Op::kRS ? "matmul_reduce_scatter" : "matmul_all_reduce";
}

struct PerGpu {
  cublasHandle_t blas = nullptr;
  void* blas_ws = nullptr;
  char *out = nullptr, *tmp = nullptr;  // cudaMalloc: cuBLAS + NCCL side
  std::vector<char*> as, bs;            // the rotating copies of A and B (rotating_sets)
};

// A cuBLAS handle with a workspace per local rank, on that rank's bench stream, for the life of the object.
struct PerGpuBlas {
  Communicator& comm;
  std::vector<PerGpu> g;
  PerGpuBlas(Communicator& c, const std::vector<cudaStream_t>& streams) : comm(c), g(c.num_local()) {
    constexpr size_t kBlasWs = 64 << 20;
    for (int i = 0; i < c.num_local(); ++i) {
      WEFT_CUDA_CHECK(cudaSetDevice(c.local(i).device()));
      FB_CUBLAS(cublasCreate(&g[i].blas));
      FB_CUBLAS(cublasSetStream(g[i].blas, streams[i]));
      WEFT_CUDA_CHECK(cudaMalloc(&g[i].blas_ws, kBlasWs));
      FB_CUBLAS(cublasSetWorkspace(g[i].blas, g[i].blas_ws, kBlasWs));
    }
  }
  ~PerGpuBlas() {
    for (int i = 0; i < comm.num_local(); ++i) {
      cudaSetDevice(comm.local(i).device());
      cublasDestroy(g[i].blas);
      cudaFree(g[i].blas_ws);
    }
  }
  // A shape's buffers: `sets` rotating copies of A (a_bytes) and B (b_bytes) a rank, random (seeded by the
  // rank and the copy), each A's first weft_a_bytes also in a symmetric copy for weft's ops (returned); out
  // and tmp.
  std::vector<SymmetricBuffer> alloc_buffers(int sets, uint64_t a_bytes, uint64_t b_bytes,
                                             uint64_t weft_a_bytes, uint64_t out_bytes, uint64_t tmp_bytes,
                                             uint64_t seed, const std::vector<cudaStream_t>& streams) {
    std::vector<SymmetricBuffer> weft_a;
    for (int c = 0; c < sets; ++c) weft_a.push_back(comm.alloc(weft_a_bytes));
    for (int i = 0; i < comm.num_local(); ++i) {
      WEFT_CUDA_CHECK(cudaSetDevice(comm.local(i).device()));
      g[i].as.assign(sets, nullptr);
      g[i].bs.assign(sets, nullptr);
      const uint64_t rank_seed = seed + 2 * comm.local(i).rank();
      for (int c = 0; c < sets; ++c) {
        WEFT_CUDA_CHECK(cudaMalloc(&g[i].as[c], a_bytes));
        WEFT_CUDA_CHECK(cudaMalloc(&g[i].bs[c], b_bytes));
        fill_uniform_bf16(g[i].as[c], a_bytes / 2, rank_seed + 1000 * c, streams[i]);
        fill_uniform_bf16(g[i].bs[c], b_bytes / 2, rank_seed + 1 + 1000 * c, streams[i]);
        WEFT_CUDA_CHECK(cudaMemcpyAsync(weft_a[c].local[i], g[i].as[c], weft_a_bytes,
                                        cudaMemcpyDeviceToDevice, streams[i]));
      }
      WEFT_CUDA_CHECK(cudaMalloc(&g[i].out, out_bytes));
      WEFT_CUDA_CHECK(cudaMalloc(&g[i].tmp, tmp_bytes));
      WEFT_CUDA_CHECK(cudaStreamSynchronize(streams[i]));
    }
    return weft_a;
  }
  // A shape's buffers, freed (the symmetric copies: the caller's).
  void free_buffers() {
    for (int i = 0; i < comm.num_local(); ++i) {
      WEFT_CUDA_CHECK(cudaSetDevice(comm.local(i).device()));
      for (char* p : {g[i].out, g[i].tmp}) WEFT_CUDA_CHECK(cudaFree(p));
      for (char* p : g[i].as) WEFT_CUDA_CHECK(cudaFree(p));
      for (char* p : g[i].bs) WEFT_CUDA_CHECK(cudaFree(p));
      g[i] = PerGpu{g[i].blas, g[i].blas_ws};
    }
  }
};

// C [M,N] = A [M,K] . W^T with W [N,K], all row-major (column-major: C^T = W . A^T).
void cublas_gemm(cublasHandle_t h, const void* a, const void* w, void* c, int64_t m, int64_t n, int64_t k) {
  const float one = 1.f, zero = 0.f;
  FB_CUBLAS(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, int(n), int(m), int(k), &one, w, CUDA_R_16BF, int(k), a,
                         CUDA_R_16BF, int(k), &zero, c, CUDA_R_16BF, int(n), CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT));
}

void run_fused(Context& ctx) {
  WEFT_CHECK(ctx.team_size() >= 2, "fused needs at least 2 ranks");
  BenchTeam team(ctx);
  const bool nccl_on = team.has_nccl();  // virtual ranks: weft's collectives stand in (labelled)
  Communicator* comm = team.comm.get();
  const int W = team.world(), L = team.local();
  std::vector<ncclComm_t>& nccl = team.nccl;
  std::vector<cudaStream_t>& streams = team.streams;
  auto team_max = [&](double x) { return team.team_max(x); };
  PerGpuBlas blas(*comm, streams);
  std::vector<PerGpu>& g = blas.g;
  std::vector<Table> timelines;
  if (!ctx.timeline_dir.empty()) std::filesystem::create_directories(ctx.timeline_dir);
  std::vector<int64_t> ms = {1024, 2048, 4096, 8192, 16384, 32768};
  if (ctx.quick) ms = {2048, 8192};
  if (!ctx.fused_m.empty()) ms = ctx.fused_m;  // --fused-m
  const std::pair<int64_t, int64_t> nks[] = {{8192, 8192}, {28672, 8192}};
  Table t(
      fmt("fused tensor-parallel ops, bf16, %s: weft vs cuBLAS + NCCL %d.%d.%d", ctx.team_label().c_str(),
          NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH),
      {"op", "M", "N", "K", "sequential us", "compute us", "comm us", "weft us", "weft path", "speedup",
       "weft / bound", "weft gemm us", "fused us", "fused, added at owner us", "fused, staged progressive us",
       "fused, summed in epilogue us", "fused, copy-engine gather us", "pipelined us"},
      "sequential = cuBLAS GEMM + NCCL collective; compute = the cuBLAS GEMM alone; bound = max(compute "
      "alone, communication alone); weft path 'sequential' means the op chose its fallback (cuBLAS GEMM + "
      "weft collective) for this shape; weft's partials as Partials::kAuto sums them (in the epilogue for "
      "the all-reduce, and the reduce-scatter at 2 GPUs). weft gemm = weft::gemm alone on the compute "
      "shape; fused = the op with the fused kernel forced, partials staged (Partials::kStaged); fused, added "
      "at owner = the same with its partial tiles reduce-added into the owner's sum "
      "(FusedOptions::Partials::kAddedAtOwner; RS / AR); fused, staged "
      "progressive = staged, each half summed at its owner during the GEMM (Partials::kStagedProgressive; "
      "with --fused-progressive, else -); fused, summed in epilogue = every tile by every rank, the owner's "
      "last, its peers' partials added in its epilogue (Partials::kSummedInEpilogue; with "
      "--fused-epilogue-sum, else -); fused, copy-engine gather = AG's fused kernel fed by the copy engine "
      "(FusedOptions::Gather::kCopyEngine; AG, else -); "
      "pipelined = the "
      "op with the copy-engine pipeline "
      "forced (both: what kAuto's rule weighs). Inputs rotate through copies that together exceed 3 x L2." +
          std::string(nccl_on ? ""
                              : " Virtual ranks: no NCCL, comm and sequential use weft's collectives; the "
                                "pipeline is not captured into graphs there (pipelined: -)."));
  // --fused-ops ag,rs,ar (default: all) picks the ops, --fused-m (above) the M values; --pipeline-pieces
  // sets FusedOptions::pipeline_pieces for the weft and pipelined columns (tuning).
  FusedOptions weft_options;
  weft_options.pipeline_pieces = ctx.pipeline_pieces;
  weft_options.comm_blocks = ctx.ag_comm_blocks;
  weft_options.tile_n = ctx.ag_tile_n;
  weft_options.store_ring = ctx.rs_store_ring;
  auto wanted = [&](Op op) {
    return ctx.fused_ops.empty() || ctx.fused_ops.find(op == Op::kAG   ? "ag"
                                                       : op == Op::kRS ? "rs"
                                                                       : "ar") != std::string::npos;
  };
  for (Op op : {Op::kAG, Op::kRS, Op::kAR})
    if (wanted(op))
      for (auto [N, K] : nks)
        for (int64_t M : ms) {
          // Per-rank GEMM: AG [M, K] x [N/W, K]^T; RS / AR [M, K/W] x [N, K/W]^T.
          const int64_t gn = op == Op::kAG ? N / W : N, gk = op == Op::kAG ? K : K / W, rows = M / W;
          ctx.progress("fused: %s M=%lld N=%lld K=%lld", op_name(op), (long long)M, (long long)N,
                       (long long)K);
          const uint64_t a_bytes = M * gk * 2, out_bytes = (op == Op::kRS ? rows : M) * gn * 2,
                         b_bytes = gn * gk * 2, weft_a_bytes = op == Op::kAG ? rows * gk * 2 : a_bytes;
          // Rotating inputs: call k of every column takes copy k % sets of A and B (weft's A: its symmetric
          // copy), so no call finds its operands in L2 from the call before.
          const int sets = rotating_sets(a_bytes + b_bytes, comm->local(0).device());
          std::vector<SymmetricBuffer> was =
              blas.alloc_buffers(sets, a_bytes, b_bytes, weft_a_bytes, out_bytes, M * gn * 2, 100, streams);
          SymmetricBuffer wo = comm->alloc(out_bytes);
          auto A = [&](int i, int k) { return g[i].as[k % sets]; };
          auto B = [&](int i, int k) { return g[i].bs[k % sets]; };
          auto gemm_alone = [&](int i, int k) {
            cublas_gemm(g[i].blas, A(i, k), B(i, k), g[i].tmp, M, gn, gk);
          };
          auto comm_alone = [&](int i, int k) {
            if (!nccl_on) {  // virtual ranks: weft's collective, same buffers
              Rank& r = comm->local(i);
              if (op == Op::kAG)
                all_gather(*comm, r, A(i, k) + r.rank() * rows * gk * 2, A(i, k),
                           Shape2D{size_t(rows), size_t(gk)}, 0, DType::kBF16, streams[i]);
              else if (op == Op::kRS)
                reduce_scatter(*comm, r, g[i].tmp, g[i].out, Shape2D{size_t(rows), size_t(gn)}, 0,
                               DType::kBF16, ReduceOp::kSum, streams[i]);
              else
                all_reduce(*comm, r, g[i].tmp, g[i].out, size_t(M * gn), DType::kBF16, ReduceOp::kSum,
                           streams[i]);
              return;
            }
            if (op == Op::kAG)
              // In place: this rank's rows of A are its shard (random data), so the GEMM after the gather
              // multiplies real data (a never-written send buffer would feed it zeros, which run cooler).
              WEFT_NCCL_CHECK(ncclAllGather(A(i, k) + comm->local(i).rank() * rows * gk * 2, A(i, k),
                                            size_t(rows * gk), ncclBfloat16, nccl[i], streams[i]));
            else if (op == Op::kRS)
              WEFT_NCCL_CHECK(ncclReduceScatter(g[i].tmp, g[i].out, size_t(rows * gn), ncclBfloat16, ncclSum,
                                                nccl[i], streams[i]));
            else
              WEFT_NCCL_CHECK(ncclAllReduce(g[i].tmp, g[i].out, size_t(M * gn), ncclBfloat16, ncclSum,
                                            nccl[i], streams[i]));
          };
          FusedPath path = FusedPath::kFused;
          FusedOptions forced = weft_options;  // the staged kernel (weft: kAuto's partials)
          forced.mode = FusedOptions::Mode::kFused;
          forced.partials = FusedOptions::Partials::kStaged;
          auto weft_gemm_alone = [&](int i, int k) {
            gemm(A(i, k), B(i, k), g[i].tmp, M, gn, gk, BLayout::kNK, DType::kBF16, streams[i]);
          };
          auto call = [&](int i, int k, const FusedOptions& o) {
            void* const a = was[k % sets].local[i];
            char* const b = B(i, k);
            Rank& r = comm->local(i);
            const BLayout nk = BLayout::kNK;
            if (op == Op::kAG)
              return all_gather_matmul(*comm, r, a, b, wo.local[i], nullptr, M, gn, gk, nk, streams[i], o);
            if (op == Op::kRS)
              return matmul_reduce_scatter(*comm, r, a, b, wo.local[i], M, gn, gk, nk, streams[i], o);
            return matmul_all_reduce(*comm, r, a, b, wo.local[i], M, gn, gk, nk, streams[i], o);
          };
          auto weft_call = [&](int i, int k) { path = call(i, k, weft_options); };
          auto fused_call = [&](int i, int k) { call(i, k, forced); };
          // The fused kernel forced with one way of summing (RS / AR) or of gathering (AG).
          auto forced_with = [&](FusedOptions::Partials partials, FusedOptions::Gather gather) {
            FusedOptions o = forced;
            o.partials = partials;
            o.gather = gather;
            return [&call, o](int i, int k) { call(i, k, o); };
          };
          using Partials = FusedOptions::Partials;
          using Gather = FusedOptions::Gather;
          auto added_call = forced_with(Partials::kAddedAtOwner, Gather::kAuto);
          auto progressive_call = forced_with(Partials::kStagedProgressive, Gather::kAuto);
          auto summed_call = forced_with(Partials::kSummedInEpilogue, Gather::kAuto);
          auto copy_engine_call = forced_with(Partials::kStaged, Gather::kCopyEngine);
          const bool copy_engine_on = op == Op::kAG && nccl_on;  // not on virtual ranks
          FusedOptions pipelined = weft_options;
          pipelined.mode = FusedOptions::Mode::kPipelined;
          auto pipelined_call = [&](int i, int k) { call(i, k, pipelined); };
          auto on_all = [&](auto&& f, bool nccl_group) {
            return [&, nccl_group = nccl_group && nccl_on](int k) {
              if (nccl_group) WEFT_NCCL_CHECK(ncclGroupStart());
              for (int i = 0; i < L; ++i) {
                WEFT_CUDA_CHECK(cudaSetDevice(comm->local(i).device()));
                f(i, k);
              }
              if (nccl_group) WEFT_NCCL_CHECK(ncclGroupEnd());
            };
          };
          ctx.progress("fused: warm-up, weft's choice");
          on_all(weft_call, false)(0);  // grows the workspace before any capture
          comm->synchronize();
          const int iters = M <= 4096 ? 10 : 3, reps = ctx.quick ? 3 : 7;
          // Sequential: AG is the collective then the GEMM; RS / AR the GEMM then the collective. NCCL calls
          // of one thread for several GPUs go in a group (launched at ncclGroupEnd), so each stage is its own
          // pass.
          auto seq = [&](int k) {
            if (op == Op::kAG) on_all(comm_alone, true)(k);
            on_all(gemm_alone, false)(k);
            if (op != Op::kAG) on_all(comm_alone, true)(k);
          };
          // Every path's workspace grown before any capture; then all candidates timed in turns.
          ctx.progress("fused: warm-up, fused kernel");
          on_all(fused_call, false)(0);
          if (op != Op::kAG) on_all(added_call, false)(0);
          const bool progressive_on = op != Op::kAG && ctx.fused_progressive;
          if (progressive_on) on_all(progressive_call, false)(0);
          const bool summed_on = op != Op::kAG && ctx.fused_epilogue_sum;
          if (summed_on) on_all(summed_call, false)(0);
          if (copy_engine_on) on_all(copy_engine_call, false)(0);
          comm->synchronize();
          ctx.progress("fused: warm-up, pipeline");
          on_all(pipelined_call, false)(0);
          comm->synchronize();
          ctx.progress("fused: warm-up, communication alone");
          on_all(comm_alone, true)(0);  // weft's collective (virtual ranks) may grow the workspace too
          comm->synchronize();
          ctx.progress("fused: timing");
          std::vector<std::function<void(int)>> candidates = {seq,
                                                              on_all(gemm_alone, false),
                                                              on_all(comm_alone, true),
                                                              on_all(weft_call, false),
                                                              on_all(weft_gemm_alone, false),
                                                              on_all(fused_call, false),
                                                              on_all(pipelined_call, false)};
          if (op != Op::kAG) candidates.push_back(on_all(added_call, false));
          // The optional columns' places among the candidates (0: not timed).
          const size_t progressive_at = progressive_on ? candidates.size() : 0;
          if (progressive_on) candidates.push_back(on_all(progressive_call, false));
          const size_t summed_at = summed_on ? candidates.size() : 0;
          if (summed_on) candidates.push_back(on_all(summed_call, false));
          const size_t copy_engine_at = copy_engine_on ? candidates.size() : 0;
          if (copy_engine_on) candidates.push_back(on_all(copy_engine_call, false));
          std::vector<double> times;
          if (nccl_on) {
            times = time_graphs_alternating(*comm, streams, iters, reps, candidates);
          } else {  // virtual ranks: not figures; one at a time; the pipeline is not captured there
            for (size_t c = 0; c < candidates.size(); ++c)
              times.push_back(c == 6 ? 0 : time_graphs(*comm, streams, iters, reps, candidates[c]));
          }
          // AG: no added-at-owner, progressive or summed column (its 8th: the copy engine's gather).
          times.resize(10, 0.0);
          double t_all[10];
          for (int c = 0; c < 10; ++c) t_all[c] = team_max(times[c]);
          const double t_seq = t_all[0], t_gemm = t_all[1], t_comm = t_all[2], t_weft = t_all[3],
                       t_wgemm = t_all[4], t_forced = t_all[5], t_pipe = t_all[6],
                       t_added = op != Op::kAG ? t_all[7] : 0.0;
          const double t_progressive = progressive_at ? t_all[progressive_at] : 0.0,
                       t_summed = summed_at ? t_all[summed_at] : 0.0,
                       t_copy_engine = copy_engine_at ? t_all[copy_engine_at] : 0.0;
          t.add({op_name(op), std::to_string(M), std::to_string(N), std::to_string(K), fmt("%.1f", t_seq),
                 fmt("%.1f", t_gemm), fmt("%.1f", t_comm), fmt("%.1f", t_weft), fused_path_name(path),
                 fmt("%.2fx", t_seq / t_weft), fmt("%.2f", t_weft / std::max(t_gemm, t_comm)),
                 fmt("%.1f", t_wgemm), fmt("%.1f", t_forced),
                 t_added > 0 ? fmt("%.1f", t_added) : std::string("-"),
                 t_progressive > 0 ? fmt("%.1f", t_progressive) : std::string("-"),
                 t_summed > 0 ? fmt("%.1f", t_summed) : std::string("-"),
                 t_copy_engine > 0 ? fmt("%.1f", t_copy_engine) : std::string("-"),
                 t_pipe > 0 ? fmt("%.1f", t_pipe) : std::string("-")});
          if (!ctx.timeline_dir.empty()) {  // one call of each weft path, in-kernel timestamps
            auto record = [&](const std::function<void(int, int)>& f, const char* path_name) {
              timelines.push_back(record_timeline(
                  *comm, streams, [&] { on_all(f, false)(0); },
                  fmt("%s M=%lld N=%lld K=%lld, %s", op_name(op), (long long)M, (long long)N, (long long)K,
                      path_name),
                  ctx.timeline_dir + fmt("/%s_%lldx%lldx%lld_%s.csv", op_name(op), (long long)M, (long long)N,
                                         (long long)K, path_name)));
            };
            record(weft_call, fused_path_name(path));
            if (path != FusedPath::kFused) record(fused_call, "fused");
            if (path != FusedPath::kPipelined && nccl_on) record(pipelined_call, "pipelined");
            if (op != Op::kAG) record(added_call, "fused_added_at_owner");
            if (progressive_on) record(progressive_call, "fused_staged_progressive");
            if (summed_on) record(summed_call, "fused_summed_in_epilogue");
            if (copy_engine_on) record(copy_engine_call, "fused_copy_engine");
          }
          for (SymmetricBuffer& w : was) comm->free(w);
          comm->free(wo);
          blas.free_buffers();
        }
  ctx.add(std::move(t));
  for (Table& tl : timelines) ctx.add(std::move(tl));
}

// GEMM + all-reduce at decode sizes: the row-parallel layers of tensor-parallel inference (Llama-70B at 4
// GPUs: K per rank 2048 for the attention output, 7168 for the MLP down projection; N = 8192), M = the decode
// batch. Against cuBLAS + NCCL's all-reduce and cuBLAS + weft's all-reduce in the same run.
void run_decode(Context& ctx) {
  WEFT_CHECK(ctx.team_size() >= 2, "decode needs at least 2 ranks");
  BenchTeam team(ctx);
  const bool nccl_on = team.has_nccl();
  Communicator* comm = team.comm.get();
  const int L = team.local();
  std::vector<cudaStream_t>& streams = team.streams;
  PerGpuBlas blas(*comm, streams);
  std::vector<PerGpu>& g = blas.g;
  std::vector<int64_t> ms = {1, 4, 16, 64, 256};
  if (!ctx.fused_m.empty()) ms = ctx.fused_m;
  std::vector<Table> timelines;
  if (!ctx.timeline_dir.empty()) std::filesystem::create_directories(ctx.timeline_dir);
  Table t(
      fmt("matmul_all_reduce at decode sizes, bf16, %s: weft vs cuBLAS + NCCL %d.%d.%d and cuBLAS + weft "
          "all_reduce",
          ctx.team_label().c_str(), NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH),
      {"M", "N", "K/rank", "gemm us", "NCCL AR us", "weft AR us", "cuBLAS+NCCL us", "cuBLAS+weft AR us",
       "weft us", "weft path", "weft split-K us", "split-K, 128 x 256 tiles us", "weft / cuBLAS+NCCL",
       "split-K / cuBLAS+NCCL", "weft / cuBLAS+weft AR"},
      "Per rank: out [M, N] = sum over ranks of A [M, K/rank] . W^T, W [N, K/rank]. gemm = cuBLAS alone; "
      "the AR columns the all-reduce of [M, N] alone; weft = weft::matmul_all_reduce (kAuto); split-K = the "
      "same with FusedOptions::Partials::kSplitK (one kernel: K split over the SMs, partials summed at each "
      "column tile's owner; 128 x 128 items, and 128 x 256 ones with tile_n 256; the ratio column takes the "
      "faster). CUDA graphs "
      "of 20 calls, columns in turns, slowest rank's median; inputs rotated through copies past L2." +
          std::string(nccl_on ? "" : " Virtual ranks: no NCCL (-)."));
  const int64_t N = 8192;
  for (int64_t K : {2048, 7168})
    for (int64_t M : ms) {
      ctx.progress("decode: M=%lld N=%lld K=%lld", (long long)M, (long long)N, (long long)K);
      // Rotating inputs (as run_fused's): at K = 2048 a rank's weight (32 MiB) would otherwise stay in L2
      // from one call to the next, which a model's many layers never allow.
      const int sets = rotating_sets(uint64_t(M + N) * K * 2, comm->local(0).device());
      std::vector<SymmetricBuffer> was =
          blas.alloc_buffers(sets, M * K * 2, N * K * 2, M * K * 2, M * N * 2, M * N * 2, 300, streams);
      SymmetricBuffer wo = comm->alloc(M * N * 2);
      FusedPath path = FusedPath::kSequential;
      auto gemm_alone = [&](int i, int k) {
        cublas_gemm(g[i].blas, g[i].as[k % sets], g[i].bs[k % sets], g[i].tmp, M, N, K);
      };
      auto nccl_ar = [&](int i, int) {
        WEFT_NCCL_CHECK(ncclAllReduce(g[i].tmp, g[i].out, size_t(M * N), ncclBfloat16, ncclSum, team.nccl[i],
                                      streams[i]));
      };
      auto weft_ar = [&](int i, int) {
        all_reduce(*comm, comm->local(i), g[i].tmp, g[i].out, size_t(M * N), DType::kBF16, ReduceOp::kSum,
                   streams[i]);
      };
      auto weft_call = [&](int i, int k) {
        path = matmul_all_reduce(*comm, comm->local(i), was[k % sets].local[i], g[i].bs[k % sets],
                                 wo.local[i], M, N, K, BLayout::kNK, streams[i]);
      };
      const bool split_k_runs = M <= 256;  // Partials::kSplitK's largest M (else its columns say -)
      // Partials::kSplitK with 128 x tile_n items.
      auto split_k_call = [&](int tile_n) {
        FusedOptions o;
        o.partials = FusedOptions::Partials::kSplitK;
        o.tile_n = tile_n;
        return [&, o](int i, int k) {
          if (!split_k_runs) return;
          matmul_all_reduce(*comm, comm->local(i), was[k % sets].local[i], g[i].bs[k % sets], wo.local[i], M,
                            N, K, BLayout::kNK, streams[i], o);
        };
      };
      auto weft_split_k = split_k_call(128);
      auto weft_split_k_wide = split_k_call(256);
      auto on_all = [&](auto&& f, bool nccl_group) {
        return [&, nccl_group](int k) {
          if (nccl_group) WEFT_NCCL_CHECK(ncclGroupStart());
          for (int i = 0; i < L; ++i) {
            WEFT_CUDA_CHECK(cudaSetDevice(comm->local(i).device()));
            f(i, k);
          }
          if (nccl_group) WEFT_NCCL_CHECK(ncclGroupEnd());
        };
      };
      on_all(weft_call, false)(0);  // workspace grown before any capture
      on_all(weft_split_k, false)(0);
      on_all(weft_split_k_wide, false)(0);
      on_all(weft_ar, false)(0);
      comm->synchronize();
      std::vector<std::function<void(int)>> candidates = {on_all(gemm_alone, false),
                                                          on_all(weft_ar, false),
                                                          [&](int k) {
                                                            on_all(gemm_alone, false)(k);
                                                            on_all(weft_ar, false)(k);
                                                          },
                                                          on_all(weft_call, false),
                                                          on_all(weft_split_k, false),
                                                          on_all(weft_split_k_wide, false)};
      if (nccl_on) {
        candidates.push_back(on_all(nccl_ar, true));
        candidates.push_back([&](int k) {
          on_all(gemm_alone, false)(k);
          on_all(nccl_ar, true)(k);
        });
      }
      const int iters = 20, reps = ctx.quick ? 5 : 11;
      std::vector<double> times;
      if (nccl_on) {
        times = time_graphs_alternating(*comm, streams, iters, reps, candidates);
      } else {
        for (auto& c : candidates) times.push_back(time_graphs(*comm, streams, iters, reps, c));
      }
      for (double& x : times) x = team.team_max(x);
      const double t_gemm = times[0], t_war = times[1], t_gw = times[2], t_weft = times[3];
      const double t_sk = split_k_runs ? times[4] : 0, t_skw = split_k_runs ? times[5] : 0;
      const double t_sk_best = t_skw > 0 && t_skw < t_sk ? t_skw : t_sk;
      const double t_nar = nccl_on ? times[6] : 0, t_gn = nccl_on ? times[7] : 0;
      auto cell = [](double x) { return x > 0 ? fmt("%.1f", x) : std::string("-"); };
      t.add({std::to_string(M), std::to_string(N), std::to_string(K), cell(t_gemm), cell(t_nar), cell(t_war),
             cell(t_gn), cell(t_gw), cell(t_weft), fused_path_name(path), cell(t_sk), cell(t_skw),
             t_gn > 0 ? fmt("%.2f", t_weft / t_gn) : std::string("-"),
             t_gn > 0 && t_sk_best > 0 ? fmt("%.2f", t_sk_best / t_gn) : std::string("-"),
             fmt("%.2f", t_weft / t_gw)});
      if (!ctx.timeline_dir.empty()) {
        const std::string shape = fmt("%lldx%lldx%lld", (long long)M, (long long)N, (long long)K);
        auto record = [&](auto&& call, const char* name, const char* file) {
          timelines.push_back(record_timeline(
              *comm, streams, [&] { on_all(call, false)(0); },
              fmt("matmul_all_reduce M=%lld N=%lld K=%lld, %s", (long long)M, (long long)N, (long long)K,
                  name),
              ctx.timeline_dir + fmt("/decode_%s%s.csv", shape.c_str(), file)));
        };
        record(weft_call, fused_path_name(path), "");
        if (split_k_runs) {
          record(weft_split_k, "split-K", "_split_k");
          record(weft_split_k_wide, "split-K, 128 x 256 tiles", "_split_k_256");
        }
      }
      for (SymmetricBuffer& w : was) comm->free(w);
      comm->free(wo);
      blas.free_buffers();
    }
  ctx.add(std::move(t));
  for (Table& tl : timelines) ctx.add(std::move(tl));
}

ModeRegistrar reg_decode("decode",
                         "matmul_all_reduce at decode sizes (M 1..256) vs cuBLAS + NCCL and cuBLAS + weft AR",
                         run_decode, 2, true);

ModeRegistrar reg("fused", "all_gather_matmul / matmul_reduce_scatter / matmul_all_reduce vs cuBLAS + NCCL",
                  run_fused, 2, true);

}  // namespace
}  // namespace weft::bench
