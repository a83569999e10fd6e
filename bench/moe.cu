// weft-bench moe: an expert-parallel MoE layer (dispatch, up-projection grouped GEMM, down-projection grouped
// GEMM into combine's input, combine) on the team, against the same layer on a team of one on GPU 0 (the
// single-GPU computation: dispatch there is the local permute). On W virtual ranks of one GPU the work is the
// same, so time(team) / time(one GPU) is the layer's expert-parallel overhead (issue 24's measure, goal
// <= 1.15). Tokens routed uniformly at random to top-k distinct experts; bf16; B in nn.Linear layout.
#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "bench.hpp"
#include "weft/ops/gemm.hpp"
#include "weft/ops/moe.hpp"

namespace weft::bench {
namespace {

// One rank's layer: its tokens, routing, weights of its experts, scratch.
struct Layer {
  MoeShape shape;
  int experts_here;
  int64_t inter;
  DeviceBuffer tokens, experts, weights, up_w, down_w, hidden_act, out, ws;
  Layer(const MoeShape& s, int world, int64_t inter_size, const std::vector<int32_t>& routing, uint64_t seed,
        cudaStream_t stream)
      : shape(s),
        experts_here(s.num_experts / world),
        inter(inter_size),
        tokens(s.tokens * s.hidden * 2),
        experts(routing.size() * 4),
        weights(routing.size() * 4),
        up_w(size_t(experts_here) * inter_size * s.hidden * 2),
        down_w(size_t(experts_here) * s.hidden * inter_size * 2),
        hidden_act(size_t(moe_capacity(world, s)) * inter_size * 2),
        out(s.tokens * s.hidden * 2),
        ws(moe_dispatch_workspace_bytes(world, s)) {
    fill_uniform_bf16(tokens.p, s.tokens * s.hidden, seed, stream);
    fill_uniform_bf16(up_w.p, size_t(experts_here) * inter_size * s.hidden, seed + 1, stream);
    fill_uniform_bf16(down_w.p, size_t(experts_here) * s.hidden * inter_size, seed + 2, stream);
    WEFT_CUDA_CHECK(
        cudaMemcpyAsync(experts.p, routing.data(), routing.size() * 4, cudaMemcpyHostToDevice, stream));
    std::vector<float> w(routing.size(), 1.f / s.top_k);
    WEFT_CUDA_CHECK(cudaMemcpyAsync(weights.p, w.data(), w.size() * 4, cudaMemcpyHostToDevice, stream));
    WEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  // The layer's phases; each after the one before it has run once (combine reads the last dispatch's handle).
  enum Phase { kDispatch, kUp, kDown, kCombine, kAll };
  MoeDispatched d;
  void run(Communicator& comm, Rank& rank, void* combine_in, cudaStream_t stream, Phase phase = kAll) {
    if (phase == kDispatch || phase == kAll)
      d = moe_dispatch(comm, rank, tokens.p, static_cast<const int32_t*>(experts.p), shape, ws.p,
                       moe_dispatch_workspace_bytes(rank.world(), shape), DType::kBF16, stream);
    if (phase == kUp || phase == kAll)
      grouped_gemm(d.rows, up_w.p, hidden_act.p, d.group_end, experts_here, d.capacity, inter, shape.hidden,
                   BLayout::kNK, DType::kBF16, stream);
    if (phase == kDown || phase == kAll)
      grouped_gemm(hidden_act.p, down_w.p, combine_in, d.group_end, experts_here, d.capacity, shape.hidden,
                   inter, BLayout::kNK, DType::kBF16, stream);
    if (phase == kCombine || phase == kAll)
      moe_combine(comm, rank, combine_in, d, static_cast<const float*>(weights.p), out.p, shape, DType::kBF16,
                  stream);
  }
};

std::vector<int32_t> route(int64_t tokens, int experts, int top_k, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::vector<int32_t> r;
  std::vector<int32_t> pick(experts);
  for (int64_t t = 0; t < tokens; ++t) {
    std::iota(pick.begin(), pick.end(), 0);
    for (int j = 0; j < top_k; ++j) {  // top_k distinct experts
      std::swap(pick[j], pick[j + g() % (experts - j)]);
      r.push_back(pick[j]);
    }
  }
  return r;
}

void run_moe(Context& ctx) {
  BenchTeam team(ctx);
  Communicator& comm = *team.comm;
  const int W = team.world(), L = team.local();
  Options one;
  one.devices = {comm.local(0).device()};
  one.ranks_per_gpu = 1;
  std::unique_ptr<Communicator> single = Communicator::create_single_process(one);
  Table t(
      fmt("MoE layer (dispatch, grouped GEMM up, grouped GEMM down, combine) on %s, bf16",
          ctx.team_label().c_str()),
      {"tokens", "experts", "top-k", "hidden", "inter", "one GPU ms", "team ms", "ratio", "TFLOP/s (one GPU)",
       "in the layer, ms (one GPU / team): dispatch", "up GEMM", "down GEMM", "combine"},
      ctx.virtual_ranks() ? "ratio = team time / the same layer on a team of one (virtual ranks: the "
                            "same work on one GPU, so the "
                            "ratio is the expert-parallel overhead; goal <= 1.15). Per-rank CUDA graphs "
                            "launched together, the "
                            "slowest rank's median, in turn with the one-GPU layer's graph."
                          : "ratio = team time / (one-GPU time / W).");
  struct Case {
    int64_t tokens;  // over the team
    int experts, top_k;
    int64_t hidden, inter;
  };
  std::vector<Case> cases = {
      {4096, 32, 8, 7168, 2048}, {16384, 32, 8, 7168, 2048}, {8192, 8, 2, 4096, 14336}};
  if (ctx.quick) cases = {{8192, 32, 8, 7168, 2048}};
  const int iters = ctx.quick ? 5 : 10;
  for (const Case& c : cases) {
    if (c.experts % W != 0 || c.tokens % W != 0) continue;
    const int64_t per_rank = c.tokens / W;
    const std::vector<int32_t> all = route(c.tokens, c.experts, c.top_k, 77);
    // The team: rank r routes tokens [r per_rank, (r + 1) per_rank).
    std::vector<std::unique_ptr<Layer>> layers;
    std::vector<void*> inputs;
    for (int i = 0; i < L; ++i) {
      Rank& r = comm.local(i);
      WEFT_CUDA_CHECK(cudaSetDevice(r.device()));
      const MoeShape s{per_rank, per_rank, c.hidden, c.experts, c.top_k, 128};
      const std::vector<int32_t> mine(all.begin() + r.rank() * per_rank * c.top_k,
                                      all.begin() + (r.rank() + 1) * per_rank * c.top_k);
      layers.push_back(std::make_unique<Layer>(s, W, c.inter, mine, 100 + r.rank(), team.streams[i]));
      inputs.push_back(moe_combine_input(comm, r, s, DType::kBF16));
    }
    WEFT_CUDA_CHECK(cudaSetDevice(single->local(0).device()));
    const MoeShape s1{c.tokens, c.tokens, c.hidden, c.experts, c.top_k, 128};
    Layer one_gpu(s1, 1, c.inter, all, 5, team.streams[0]);
    void* one_input = moe_combine_input(*single, single->local(0), s1, DType::kBF16);
    const auto team_phase = [&](Layer::Phase phase) {
      return [&, phase](int) {
        for (int i = 0; i < L; ++i) {
          WEFT_CUDA_CHECK(cudaSetDevice(comm.local(i).device()));
          layers[i]->run(comm, comm.local(i), inputs[i], team.streams[i], phase);
        }
      };
    };
    const auto one_phase = [&](Layer::Phase phase) {
      return [&, phase](int) {
        WEFT_CUDA_CHECK(cudaSetDevice(single->local(0).device()));
        one_gpu.run(*single, single->local(0), one_input, team.streams[0], phase);
      };
    };
    team_phase(Layer::kAll)(0);  // sizes the workspace areas before capture
    one_phase(Layer::kAll)(0);
    comm.synchronize();
    WEFT_CUDA_CHECK(cudaStreamSynchronize(team.streams[0]));
    const std::vector<double> us = time_graphs_alternating(comm, team.streams, 1, iters,
                                                           {one_phase(Layer::kAll), team_phase(Layer::kAll)});
    const double one_ms = team.team_max(us[0]) / 1000.0, team_ms = team.team_max(us[1]) / 1000.0;
    // Where the layer's time goes: events between its phases inside each rank's graph (the team's phases
    // include waiting for the slowest rank at dispatch's and combine's meetings).
    std::vector<std::string> phase_cells;
    {
      constexpr int kMarks = 5;  // before dispatch, after dispatch, up, down, combine
      std::vector<std::vector<cudaEvent_t>> ev(L + 1, std::vector<cudaEvent_t>(kMarks));
      std::vector<cudaGraphExec_t> exec(L + 1);
      const auto instrumented = [&](int g, cudaStream_t st, const std::function<void(Layer::Phase)>& run) {
        for (cudaEvent_t& e : ev[g]) WEFT_CUDA_CHECK(cudaEventCreate(&e));
        WEFT_CUDA_CHECK(
            cudaEventRecordWithFlags(ev[g][0], st, cudaEventRecordExternal));  // a node of the graph
        int m = 1;
        for (Layer::Phase phase : {Layer::kDispatch, Layer::kUp, Layer::kDown, Layer::kCombine}) {
          run(phase);
          WEFT_CUDA_CHECK(cudaEventRecordWithFlags(ev[g][m++], st, cudaEventRecordExternal));
        }
      };
      // The team's graphs (captured together: the ops meet across ranks), then the one-GPU layer's.
      for (int i = 0; i < L; ++i) {
        WEFT_CUDA_CHECK(cudaSetDevice(comm.local(i).device()));
        WEFT_CUDA_CHECK(cudaStreamBeginCapture(team.streams[i], cudaStreamCaptureModeRelaxed));
      }
      for (int i = 0; i < L; ++i) {
        WEFT_CUDA_CHECK(cudaSetDevice(comm.local(i).device()));
        instrumented(i, team.streams[i], [&](Layer::Phase phase) {
          layers[i]->run(comm, comm.local(i), inputs[i], team.streams[i], phase);
        });
      }
      for (int i = 0; i < L; ++i) {
        cudaGraph_t g;
        WEFT_CUDA_CHECK(cudaSetDevice(comm.local(i).device()));
        WEFT_CUDA_CHECK(cudaStreamEndCapture(team.streams[i], &g));
        WEFT_CUDA_CHECK(cudaGraphInstantiate(&exec[i], g, 0));
        WEFT_CUDA_CHECK(cudaGraphDestroy(g));
      }
      WEFT_CUDA_CHECK(cudaSetDevice(single->local(0).device()));
      {
        cudaGraph_t g;
        WEFT_CUDA_CHECK(cudaStreamBeginCapture(team.streams[0], cudaStreamCaptureModeRelaxed));
        instrumented(L, team.streams[0], [&](Layer::Phase phase) {
          one_gpu.run(*single, single->local(0), one_input, team.streams[0], phase);
        });
        WEFT_CUDA_CHECK(cudaStreamEndCapture(team.streams[0], &g));
        WEFT_CUDA_CHECK(cudaGraphInstantiate(&exec[L], g, 0));
        WEFT_CUDA_CHECK(cudaGraphDestroy(g));
      }
      // ms[g][phase][rep]; the team's launches together, the one-GPU layer's in turn.
      std::vector<std::vector<std::vector<float>>> ms(L + 1, std::vector<std::vector<float>>(kMarks - 1));
      for (int rep = -1; rep < iters; ++rep)
        for (bool team_turn : {false, true}) {
          const int first = team_turn ? 0 : L, last = team_turn ? L : L + 1;
          for (int g = first; g < last; ++g) {
            WEFT_CUDA_CHECK(cudaSetDevice(g < L ? comm.local(g).device() : single->local(0).device()));
            WEFT_CUDA_CHECK(cudaGraphLaunch(exec[g], team.streams[g < L ? g : 0]));
          }
          for (int g = first; g < last; ++g) {
            WEFT_CUDA_CHECK(cudaSetDevice(g < L ? comm.local(g).device() : single->local(0).device()));
            WEFT_CUDA_CHECK(cudaEventSynchronize(ev[g][kMarks - 1]));
            for (int m = 0; m + 1 < kMarks && rep >= 0; ++m) {
              float t = 0;
              WEFT_CUDA_CHECK(cudaEventElapsedTime(&t, ev[g][m], ev[g][m + 1]));
              ms[g][m].push_back(t);
            }
          }
        }
      comm.check_device_errors();
      for (int m = 0; m + 1 < kMarks; ++m) {
        double worst = 0;
        for (int i = 0; i < L; ++i) worst = std::max(worst, double(median(ms[i][m])));
        phase_cells.push_back(fmt("%.3f / %.3f", median(ms[L][m]), team.team_max(worst)));
      }
      for (int g = 0; g <= L; ++g) {
        cudaGraphExecDestroy(exec[g]);
        for (cudaEvent_t e : ev[g]) cudaEventDestroy(e);
      }
    }
    const double flops = 2.0 * c.tokens * c.top_k * c.hidden * c.inter * 2;
    const double per = ctx.virtual_ranks() ? 1.0 : 1.0 / W;
    t.add({std::to_string(c.tokens), std::to_string(c.experts), std::to_string(c.top_k),
           std::to_string(c.hidden), std::to_string(c.inter), fmt("%.3f", one_ms), fmt("%.3f", team_ms),
           fmt("%.3f", team_ms / (one_ms * per)), fmt("%.1f", flops / (one_ms * 1e9)), phase_cells[0],
           phase_cells[1], phase_cells[2], phase_cells[3]});
    ctx.progress("moe tokens=%lld E=%d k=%d: one GPU %.3f ms, team %.3f ms", (long long)c.tokens, c.experts,
                 c.top_k, one_ms, team_ms);
  }
  ctx.add(std::move(t));
}

ModeRegistrar reg("moe", "MoE layer (dispatch, grouped GEMMs, combine) vs the same layer on one GPU",
                  &run_moe, 2, true);

}  // namespace
}  // namespace weft::bench
