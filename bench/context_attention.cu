// weft-bench context_attention: sequence-parallel attention (weft::context_attention_* over all-gathered
// K / V, weft::ring_attention_*, weft::ulysses_attention_*, weft::hybrid_attention_* at every Ulysses size
// U with 1 < U < W dividing W) on the team, against weft's single-GPU
// attention over the whole sequence on GPU 0. On W virtual ranks of one GPU the team does the same attention
// work as the single call, so time(team) / time(single GPU) is the method's scheduling, data-movement and
// load-balance overhead (the issue's ratio); on W real GPUs the ideal is time(single GPU) / W. One document
// of S tokens, sharded in ring attention's layout (zigzag when causal); 16 heads of 128 (8 K / V heads for
// GQA).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bench.hpp"
#include "weft/ops/attention.hpp"
#include "weft/ops/context_attention.hpp"

namespace weft::bench {
namespace {

// One rank's tensors for a shape.
struct RankData {
  DeviceBuffer q, k, v, out, lse, dout, dq, dk, dv, ws;
  size_t ws_bytes;
  RankData(int64_t n, int64_t H, int64_t KV, int64_t D, size_t ws_bytes)
      : q(n * H * D * 2),
        k(n * KV * D * 2),
        v(n * KV * D * 2),
        out(n * H * D * 2),
        lse(n * H * 4),
        dout(n * H * D * 2),
        dq(n * H * D * 2),
        dk(n * KV * D * 2),
        dv(n * KV * D * 2),
        ws(ws_bytes),
        ws_bytes(ws_bytes) {}
};

// Single-GPU attention over the whole sequence, on local rank 0's GPU.
struct Single {
  AttentionShape shape;
  AttentionOptions o;
  RankData d;
  Single(int64_t S, int64_t H, int64_t KV, int64_t D, bool causal, cudaStream_t stream)
      : shape{1, S, S, H, KV, D},
        o{.causal = causal},
        d(S, H, KV, D, flash_attention_backward_workspace_bytes(shape, o)) {
    fill_uniform_bf16(d.q.p, S * H * D, 1, stream);
    fill_uniform_bf16(d.k.p, S * KV * D, 2, stream);
    fill_uniform_bf16(d.v.p, S * KV * D, 3, stream);
    fill_uniform_bf16(d.dout.p, S * H * D, 4, stream);
  }
  void forward(cudaStream_t stream) {
    flash_attention_forward(d.q.p, d.k.p, d.v.p, d.out.p, static_cast<float*>(d.lse.p), shape, DType::kBF16,
                            stream, o);
  }
  void backward(cudaStream_t stream) {
    flash_attention_backward(d.q.p, d.k.p, d.v.p, d.out.p, d.dout.p, static_cast<float*>(d.lse.p), d.dq.p,
                             d.dk.p, d.dv.p, d.ws.p, d.ws_bytes, shape, DType::kBF16, stream, o);
  }
};

void run_context_attention(Context& ctx) {
  BenchTeam team(ctx);
  Communicator& comm = *team.comm;
  const int W = team.world(), L = team.local();
  Table t(
      fmt("sequence-parallel attention on %s, bf16, H %lld / KV %lld, D 128", ctx.team_label().c_str(),
          (long long)(ctx.cp_heads > 0 ? ctx.cp_heads : 16),
          (long long)(ctx.cp_heads > 0 ? ctx.cp_kv_heads : 8)),
      {"method", "S", "causal", "single fwd ms", "team fwd ms", "fwd ratio", "single bwd ms", "team bwd ms",
       "bwd ratio"},
      ctx.virtual_ranks()
          ? "ratio = team time / single-GPU time over the same sequence (virtual ranks: the same work on one "
            "GPU, so the ratio is the method's overhead; goal <= 1.10). Team times: per-rank CUDA graphs "
            "launched together, the slowest rank's median."
          : "ratio = team time / (single-GPU time / W): 1.0 is perfect scaling.");
  std::vector<int64_t> seqs = {16384, 32768, 65536};
  if (ctx.quick) seqs = {32768};
  if (!ctx.cp_seqs.empty()) seqs = ctx.cp_seqs;
  const int64_t H = ctx.cp_heads > 0 ? ctx.cp_heads : 16, KV = ctx.cp_heads > 0 ? ctx.cp_kv_heads : 8,
                D = 128;
  std::vector<Table> timelines;
  if (!ctx.timeline_dir.empty()) std::filesystem::create_directories(ctx.timeline_dir);
  const int iters = ctx.quick ? 5 : 10;
  // ring-no-copy: the ring kernels with every push only signalling (WEFT_RING_NO_COPY=1: wrong results, only
  // with --cp-methods): their time is the ring's without data movement, the difference its exposed cost.
  enum class M { kAllGather, kRing, kRingNoCopy, kUlysses, kHybrid };
  std::vector<std::pair<M, int>> methods = {
      {M::kAllGather, 0}, {M::kRing, 0}, {M::kRingNoCopy, 0}, {M::kUlysses, 0}};
  for (int U = 2; U < W; ++U)
    if (W % U == 0) methods.push_back({M::kHybrid, U});
  for (auto [method, U] : methods)
    for (bool causal : {false, true})
      for (int64_t S : seqs) {
        const bool ulysses = method == M::kUlysses, no_copy = method == M::kRingNoCopy;
        const bool hybrid = method == M::kHybrid, ring = method == M::kRing || no_copy;
        const char* kind = hybrid    ? "hybrid"
                           : ulysses ? "ulysses"
                           : no_copy ? "ring-no-copy"
                           : ring    ? "ring"
                                     : "all-gather";
        const std::string name = hybrid ? fmt("hybrid U=%d", U) : std::string(kind);
        if (no_copy
                ? ("," + ctx.cp_methods + ",").find(",ring-no-copy,") == std::string::npos
                : !ctx.cp_methods.empty() &&
                      ("," + ctx.cp_methods + ",").find(std::string(",") + kind + ",") == std::string::npos)
          continue;
        // Read by each call's host plan, so the captured graphs below carry it; unset when this cell ends,
        // however it ends.
        struct NoCopyFlag {
          bool set;
          explicit NoCopyFlag(bool on) : set(on) {
            if (set) setenv("WEFT_RING_NO_COPY", "1", 1);
          }
          ~NoCopyFlag() {
            if (set) unsetenv("WEFT_RING_NO_COPY");
          }
        } no_copy_flag(no_copy);
        WEFT_CUDA_CHECK(cudaSetDevice(comm.local(0).device()));
        Single single(S, H, KV, D, causal, team.streams[0]);
        const std::vector<int64_t> docs = {S};
        AttentionOptions o;
        o.causal = causal;
        const size_t ws_bytes =
            hybrid    ? std::max(hybrid_attention_workspace_bytes(W, U, docs, causal, H, KV, D),
                                 hybrid_attention_backward_workspace_bytes(W, U, docs, causal, H, KV, D))
            : ulysses ? ulysses_attention_backward_workspace_bytes(W, docs, causal, H, KV, D)
                      : std::max({context_attention_backward_workspace_bytes(W, docs, causal, H, KV, D),
                                  context_attention_workspace_bytes(W, docs, causal, KV, D),
                                  ring_attention_workspace_bytes(W, docs, causal, KV, D),
                                  ring_attention_backward_workspace_bytes(W, docs, causal, H, KV, D)});
        std::vector<std::unique_ptr<RankData>> data;
        for (int i = 0; i < L; ++i) {
          Rank& r = comm.local(i);
          WEFT_CUDA_CHECK(cudaSetDevice(r.device()));
          const int64_t n = context_attention_local_rows(W, r.rank(), docs, causal);
          data.push_back(std::make_unique<RankData>(n, H, KV, D, ws_bytes));
          fill_uniform_bf16(data[i]->q.p, n * H * D, 10 + r.rank(), team.streams[i]);
          fill_uniform_bf16(data[i]->k.p, n * KV * D, 30 + r.rank(), team.streams[i]);
          fill_uniform_bf16(data[i]->v.p, n * KV * D, 50 + r.rank(), team.streams[i]);
          fill_uniform_bf16(data[i]->dout.p, n * H * D, 70 + r.rank(), team.streams[i]);
        }
        auto forward = [&](int) {
          for (int i = 0; i < L; ++i) {
            Rank& r = comm.local(i);
            WEFT_CUDA_CHECK(cudaSetDevice(r.device()));
            RankData& d = *data[i];
            if (hybrid) {
              hybrid_attention_forward(comm, r, d.q.p, d.k.p, d.v.p, d.out.p, static_cast<float*>(d.lse.p),
                                       docs, H, KV, D, U, d.ws.p, d.ws_bytes, DType::kBF16, team.streams[i],
                                       o);
              continue;
            }
            (ulysses ? ulysses_attention_forward
             : ring  ? ring_attention_forward
                     : context_attention_forward)(comm, r, d.q.p, d.k.p, d.v.p, d.out.p,
                                                 static_cast<float*>(d.lse.p), docs, H, KV, D, d.ws.p,
                                                 d.ws_bytes, DType::kBF16, team.streams[i], o);
          }
        };
        auto backward = [&](int) {
          for (int i = 0; i < L; ++i) {
            Rank& r = comm.local(i);
            WEFT_CUDA_CHECK(cudaSetDevice(r.device()));
            RankData& d = *data[i];
            if (hybrid) {
              hybrid_attention_backward(comm, r, d.q.p, d.k.p, d.v.p, d.out.p, d.dout.p,
                                        static_cast<float*>(d.lse.p), d.dq.p, d.dk.p, d.dv.p, docs, H, KV, D,
                                        U, d.ws.p, d.ws_bytes, DType::kBF16, team.streams[i], o);
              continue;
            }
            (ulysses ? ulysses_attention_backward
             : ring  ? ring_attention_backward
                     : context_attention_backward)(
                comm, r, d.q.p, d.k.p, d.v.p, d.out.p, d.dout.p, static_cast<float*>(d.lse.p), d.dq.p, d.dk.p,
                d.dv.p, docs, H, KV, D, d.ws.p, d.ws_bytes, DType::kBF16, team.streams[i], o);
          }
        };
        forward(0);  // sizes the communicator's workspace areas before capture
        backward(0);
        comm.synchronize();
        // The single call on local rank 0's stream, in turn with the team's calls (drift hits both alike).
        auto on_rank0 = [&](void (Single::*pass)(cudaStream_t)) {
          return [&, pass](int) {
            WEFT_CUDA_CHECK(cudaSetDevice(comm.local(0).device()));
            (single.*pass)(team.streams[0]);
          };
        };
        const std::vector<double> fwd_us =
            time_graphs_alternating(comm, team.streams, 1, iters, {on_rank0(&Single::forward), forward});
        const double single_fwd = team.team_max(fwd_us[0]) / 1000.0, fwd = team.team_max(fwd_us[1]) / 1000.0;
        const double per = ctx.virtual_ranks() ? 1.0 : 1.0 / W;
        const std::vector<double> bwd_us =
            time_graphs_alternating(comm, team.streams, 1, iters, {on_rank0(&Single::backward), backward});
        const double single_bwd = team.team_max(bwd_us[0]) / 1000.0, bwd = team.team_max(bwd_us[1]) / 1000.0;
        t.add({name, std::to_string(S), causal ? "yes" : "no", fmt("%.3f", single_fwd), fmt("%.3f", fwd),
               fmt("%.3f", fwd / (single_fwd * per)), fmt("%.3f", single_bwd), fmt("%.3f", bwd),
               fmt("%.3f", bwd / (single_bwd * per))});
        ctx.progress("context_attention %s S=%lld causal=%d: fwd %.3f / %.3f ms, bwd %.3f / %.3f ms",
                     name.c_str(), (long long)S, int(causal), fwd, single_fwd, bwd, single_bwd);
        if (!ctx.timeline_dir.empty() && (ring || ulysses || hybrid))  // the kernels that record phases
          for (int pass = 0; pass < 2; ++pass) {
            const std::string file = fmt("/context_attention_%s_%lld_%s_%s.csv", kind, (long long)S,
                                         causal ? "causal" : "full", pass == 0 ? "fwd" : "bwd");
            timelines.push_back(record_timeline(
                comm, team.streams, [&] { pass == 0 ? forward(0) : backward(0); },
                fmt("context_attention %s S=%lld H %lld / KV %lld%s, %s", name.c_str(), (long long)S,
                    (long long)H, (long long)KV, causal ? " causal" : "", pass == 0 ? "forward" : "backward"),
                ctx.timeline_dir + file));
          }
      }
  ctx.add(std::move(t));
  for (Table& tl : timelines) ctx.add(std::move(tl));
}

ModeRegistrar reg("context_attention",
                  "sequence-parallel attention (all-gather K / V, ring, Ulysses, their hybrid) vs single-GPU "
                  "attention; on virtual "
                  "ranks the overhead ratio",
                  &run_context_attention, 2, true);

}  // namespace
}  // namespace weft::bench
