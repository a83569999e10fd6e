// weft-bench moe: an expert-parallel MoE layer (dispatch, up-projection grouped GEMM, down-projection grouped
// GEMM into combine's input, combine) on the team, against the same layer on a team of one on GPU 0 (the
// single-GPU computation: dispatch there is the local permute). On W virtual ranks of one GPU the work is the
// same, so time(team) / time(one GPU) is the layer's expert-parallel overhead (issue 24's measure, goal
// <= 1.15). Tokens routed uniformly at random to top-k distinct experts; bf16; B in nn.Linear layout.
#include <cuda_runtime.h>

#include <algorithm>
#include <filesystem>
#include <memory>
#include <numeric>
#include <random>
#include <string>
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
  // The layer's phases (kAll: all four); each after the one before it has run once (combine reads the last
  // dispatch's handle).
  enum Phase { kDispatch, kUp, kDown, kCombine, kAll };
  MoeDispatched d;
  void run(Communicator& comm, Rank& rank, void* combine_in, cudaStream_t stream, Phase phase = kAll) {
    if (phase == kDispatch || phase == kAll)
      d = moe_dispatch(comm, rank, tokens.p, static_cast<const int32_t*>(experts.p), shape, ws.p,
                       moe_dispatch_workspace_bytes(rank.world(), shape), DType::kBF16, stream);
    GemmOptions counted;  // the low-latency dispatch's groups: only their filled rows (null otherwise)
    counted.group_rows = d.group_rows;
    if (phase == kUp || phase == kAll)
      grouped_gemm(d.rows, up_w.p, hidden_act.p, d.group_end, experts_here, d.capacity, inter, shape.hidden,
                   BLayout::kNK, DType::kBF16, stream, counted);
    if (phase == kDown || phase == kAll)
      grouped_gemm(hidden_act.p, down_w.p, combine_in, d.group_end, experts_here, d.capacity, shape.hidden,
                   inter, BLayout::kNK, DType::kBF16, stream, counted);
    if (phase == kCombine || phase == kAll)
      moe_combine(comm, rank, combine_in, d, static_cast<const float*>(weights.p), out.p, shape, DType::kBF16,
                  stream);
  }
  // The dispatch and the up GEMM in one (moe_dispatch_grouped_gemm).
  void run_fused_dispatch_up(Communicator& comm, Rank& rank, cudaStream_t stream) {
    d = moe_dispatch_grouped_gemm(comm, rank, tokens.p, static_cast<const int32_t*>(experts.p), shape, ws.p,
                                  moe_dispatch_workspace_bytes(rank.world(), shape), up_w.p, BLayout::kNK,
                                  inter, Activation::kNone, hidden_act.p, stream);
  }
  // The down GEMM and the combine in one (moe_grouped_gemm_combine), after the layer has run once.
  void run_fused_down_combine(Communicator& comm, Rank& rank, cudaStream_t stream) {
    moe_grouped_gemm_combine(comm, rank, hidden_act.p, down_w.p, BLayout::kNK, d.capacity, inter, d,
                             static_cast<const float*>(weights.p), out.p, shape, stream);
  }
};

// The layer's dispatch and up GEMM in FP8 (moe_dispatch_fp8: the tokens quantized with 1 x 128 block scales
// and packed with them; grouped_gemm_fp8 on the packed rows in place, the experts' weights quantized once);
// with the layer's shape in low-latency mode, the low-latency FP8 dispatch and the GEMM over filled rows.
struct Fp8Head {
  DeviceBuffer ws, qw, sw, act;
  Fp8Head(const Layer& l, int world, cudaStream_t s)
      : ws(moe_dispatch_fp8_workspace_bytes(world, l.shape)),
        qw(size_t(l.experts_here) * l.inter * l.shape.hidden),
        sw(size_t(l.experts_here) * ((l.inter + 127) / 128) * ((l.shape.hidden + 127) / 128) * 4),
        act(size_t(moe_capacity(world, l.shape)) * l.inter * 2) {
    quantize_fp8(l.up_w.p, DType::kBF16, qw.p, Fp8Type::kE4M3, static_cast<float*>(sw.p),
                 int64_t(l.experts_here) * l.inter, l.shape.hidden, Fp8Scaling::kBlock, Fp8Operand::kB, s);
  }
  void run(Communicator& comm, Rank& rank, const Layer& l, cudaStream_t s) {
    const MoeDispatchedFp8 d =
        moe_dispatch_fp8(comm, rank, l.tokens.p, static_cast<const int32_t*>(l.experts.p), l.shape, ws.p,
                         ws.bytes, DType::kBF16, s);
    GemmOptions o;
    o.lda = d.row_bytes;
    o.group_rows = d.dispatched.group_rows;  // a low-latency dispatch's groups: their filled rows only
    grouped_gemm_fp8(d.values, qw.p, act.p, d.dispatched.group_end, l.experts_here, d.dispatched.capacity,
                     l.inter, l.shape.hidden, Fp8Type::kE4M3, d.block_scales(static_cast<const float*>(sw.p)),
                     DType::kBF16, s, o);
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

// The low-latency floor, us (as python/benchmarks/moe.py's): the most bytes a rank moves over NVLink at its
// peak egress (450 GB/s: 18 links of 25 GB/s) plus one signal round trip (3 us, bench/RESULTS.md's latency
// table). The dispatch pushes a token once per remote rank of its experts; the combine pulls one row per
// remote slot. Rank r routes tokens [r per_rank, (r + 1) per_rank) of `routing`.
struct LowLatencyFloor {
  double dispatch_us, combine_us;
};
LowLatencyFloor low_latency_floor(const std::vector<int32_t>& routing, int W, int64_t per_rank, int experts,
                                  int top_k, int64_t hidden) {
  constexpr double kLinkBytesPerUs = 450e3, kRoundTripUs = 3.0;
  int64_t pushed = 0, pulled = 0;  // rows, the most over ranks
  std::vector<char> reached(W);
  for (int r = 0; r < W; ++r) {
    int64_t rows_pushed = 0, rows_pulled = 0;
    for (int64_t t = r * per_rank; t < (r + 1) * per_rank; ++t) {
      std::fill(reached.begin(), reached.end(), 0);
      for (int j = 0; j < top_k; ++j) {
        const int dest = routing[t * top_k + j] / (experts / W);
        if (dest == r) continue;
        ++rows_pulled;
        rows_pushed += !reached[dest];
        reached[dest] = 1;
      }
    }
    pushed = std::max(pushed, rows_pushed);
    pulled = std::max(pulled, rows_pulled);
  }
  const double row_bytes = double(hidden) * 2;
  return {pushed * row_bytes / kLinkBytesPerUs + kRoundTripUs,
          pulled * row_bytes / kLinkBytesPerUs + kRoundTripUs};
}

// A row of the FP8 table: `bf16_head` (the layers' dispatch + up GEMM in bf16) and the same in FP8 (Fp8Head
// on each layer's shape: the dispatch of record, or the low-latency one), in turn; `head` the case's columns,
// `dispatch` which dispatch.
std::vector<std::string> fp8_row(BenchTeam& team, std::vector<std::unique_ptr<Layer>>& layers,
                                 const std::function<void(int)>& bf16_head, int iters,
                                 std::vector<std::string> head, const char* dispatch) {
  Communicator& comm = *team.comm;
  const int L = team.local();
  std::vector<std::unique_ptr<Fp8Head>> fp8;
  for (int i = 0; i < L; ++i) {
    WEFT_CUDA_CHECK(cudaSetDevice(comm.local(i).device()));
    fp8.push_back(std::make_unique<Fp8Head>(*layers[i], team.world(), team.streams[i]));
  }
  const auto fp8_head = [&](int) {
    for (int i = 0; i < L; ++i) {
      WEFT_CUDA_CHECK(cudaSetDevice(comm.local(i).device()));
      fp8[i]->run(comm, comm.local(i), *layers[i], team.streams[i]);
    }
  };
  fp8_head(0);  // sizes the dispatch area for the packed rows before capture
  comm.synchronize();
  const std::vector<double> us = time_graphs_alternating(comm, team.streams, 1, iters, {bf16_head, fp8_head});
  const double bf16_ms = team.team_max(us[0]) / 1000.0, fp8_ms = team.team_max(us[1]) / 1000.0;
  head.insert(head.end(),
              {dispatch, fmt("%.3f", bf16_ms), fmt("%.3f", fp8_ms), fmt("%.3f", bf16_ms / fp8_ms)});
  return head;
}

void run_moe(Context& ctx) {
  BenchTeam team(ctx);
  Communicator& comm = *team.comm;
  const int W = team.world(), L = team.local();
  Options one;
  one.devices = {comm.local(0).device()};
  one.ranks_per_gpu = 1;
  std::unique_ptr<Communicator> single = Communicator::create_single_process(one);
  Table t(fmt("MoE layer (dispatch, grouped GEMM up, grouped GEMM down, combine) on %s, bf16",
              ctx.team_label().c_str()),
          {"tokens", "experts", "top-k", "hidden", "inter", "one GPU ms", "team ms", "ratio",
           "TFLOP/s (one GPU)", "in the layer, ms (one GPU / team): dispatch", "up GEMM", "down GEMM",
           "combine", "team dispatch ms, padding not zeroed"},
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
  Table f(fmt("MoE down GEMM + combine on %s, bf16: unfused (grouped_gemm into combine's input, moe_combine) "
              "vs fused (moe_grouped_gemm_combine: the GEMM's epilogue sends each row to its token's rank)",
              ctx.team_label().c_str()),
          {"tokens", "experts", "top-k", "hidden", "inter", "unfused ms", "fused ms", "unfused / fused"},
          "The same ranks, in turn (per-rank CUDA graphs launched together, the slowest rank's median).");
  Table h(
      fmt("MoE dispatch + up GEMM on %s, bf16: unfused (moe_dispatch, grouped_gemm) vs fused "
          "(moe_dispatch_grouped_gemm: each 128-row tile's GEMM starts once its rows have landed)",
          ctx.team_label().c_str()),
      {"tokens", "experts", "top-k", "hidden", "inter", "unfused ms", "fused ms", "unfused / fused"},
      "The same ranks, in turn (per-rank CUDA graphs launched together, the slowest rank's median). The "
      "fused kernel waits for peers, so it runs on the rank's SM budget; the unfused GEMM takes every SM.");
  Table e(
      fmt("MoE dispatch + up GEMM on %s: bf16 (moe_dispatch, grouped_gemm) vs FP8 (moe_dispatch_fp8: "
          "e4m3 tokens with 1 x 128 scales, 0.52 of the bytes at hidden 7168; grouped_gemm_fp8 on them)",
          ctx.team_label().c_str()),
      {"tokens", "experts", "top-k", "hidden", "inter", "dispatch", "bf16 ms", "FP8 ms", "bf16 / FP8"},
      "The same ranks, in turn (per-rank CUDA graphs launched together, the slowest rank's median); the FP8 "
      "time includes the quantization of the tokens. dispatch: the dispatch of record, or the low-latency "
      "one (MoeShape::low_latency, cases of at most 256 tokens a rank; the GEMMs over the filled rows).");
  Table ll(
      fmt("MoE layer at decode sizes on %s, bf16: the dispatch of record vs the low-latency one "
          "(MoeShape::low_latency: fixed-capacity groups, a row taken by an atomic, one end wait; the "
          "expert GEMMs over the filled rows only)",
          ctx.team_label().c_str()),
      {"tokens", "experts", "top-k", "hidden", "inter", "ms (record / low latency): dispatch", "up GEMM",
       "down GEMM", "combine", "layer", "layer / low-latency layer",
       "low-latency floor us: dispatch / combine", "low latency / floor: dispatch / combine"},
      "Cases of at most 256 tokens a rank. The same ranks, in turn (per-rank CUDA graphs launched "
      "together, the slowest rank's median); the dispatch of record leaves its padding as it is. The floor: "
      "the most bytes a rank moves over NVLink at 450 GB/s (the dispatch: a token once per remote rank of "
      "its experts; the combine's pull: a row per remote slot) plus one 3 us round trip.");
  // The first case is decode-sized: 128 tokens per rank, DeepSeek-V3-like routing (256 experts, top-8).
  // DeepSeek-V3-like prefill (4096 tokens a rank, 256 experts) is the layer of bench/RESULTS.md's MoE table.
  std::vector<Case> cases = {{128 * int64_t(W), 256, 8, 7168, 2048},
                             {4096 * int64_t(W), 256, 8, 7168, 2048},
                             {4096, 32, 8, 7168, 2048},
                             {16384, 32, 8, 7168, 2048},
                             {8192, 8, 2, 4096, 14336}};
  if (ctx.quick) cases = {{128 * int64_t(W), 256, 8, 7168, 2048}, {8192, 32, 8, 7168, 2048}};
  std::vector<Table> timelines;
  if (!ctx.timeline_dir.empty()) std::filesystem::create_directories(ctx.timeline_dir);
  const int iters = ctx.quick ? 5 : 10;
  for (const Case& c : cases) {
    if (c.experts % W != 0 || c.tokens % W != 0) continue;
    const int64_t per_rank = c.tokens / W;
    const std::vector<std::string> case_columns = {std::to_string(c.tokens), std::to_string(c.experts),
                                                   std::to_string(c.top_k), std::to_string(c.hidden),
                                                   std::to_string(c.inter)};
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
    const auto team_phase = [&](int phase) {
      for (int i = 0; i < L; ++i) {
        WEFT_CUDA_CHECK(cudaSetDevice(comm.local(i).device()));
        layers[i]->run(comm, comm.local(i), inputs[i], team.streams[i], Layer::Phase(phase));
      }
    };
    const auto one_phase = [&](int phase) {
      WEFT_CUDA_CHECK(cudaSetDevice(single->local(0).device()));
      one_gpu.run(*single, single->local(0), one_input, team.streams[0], Layer::Phase(phase));
    };
    team_phase(Layer::kAll);  // sizes the workspace areas before capture
    one_phase(Layer::kAll);
    comm.synchronize();
    WEFT_CUDA_CHECK(cudaStreamSynchronize(team.streams[0]));
    // The layer in its four phases, with events between them in each rank's graph: the layer's time and where
    // it goes (a team phase includes waiting for the slowest rank at dispatch's and combine's meetings).
    // The team's layer for inference: the dispatch leaves its padding rows as they are
    // (MoeShape::zero_padding; the graphs keep the shape they were captured with).
    const auto inference_phase = [&](int phase) {
      for (auto& l : layers) l->shape.zero_padding = false;
      team_phase(phase);
      for (auto& l : layers) l->shape.zero_padding = true;
    };
    const std::vector<std::vector<double>> us = time_phases_alternating(
        comm, team.streams, Layer::kAll, iters, {one_phase, team_phase, inference_phase});
    const double one_ms = team.team_max(us[0][Layer::kAll]) / 1000.0,
                 team_ms = team.team_max(us[1][Layer::kAll]) / 1000.0;
    std::vector<std::string> phase_cells;
    for (int p = 0; p < Layer::kAll; ++p)
      phase_cells.push_back(
          fmt("%.3f / %.3f", team.team_max(us[0][p]) / 1000.0, team.team_max(us[1][p]) / 1000.0));
    const double flops = 2.0 * c.tokens * c.top_k * c.hidden * c.inter * 2;
    const double per = ctx.virtual_ranks() ? 1.0 : 1.0 / W;
    t.add({std::to_string(c.tokens), std::to_string(c.experts), std::to_string(c.top_k),
           std::to_string(c.hidden), std::to_string(c.inter), fmt("%.3f", one_ms), fmt("%.3f", team_ms),
           fmt("%.3f", team_ms / (one_ms * per)), fmt("%.1f", flops / (one_ms * 1e9)), phase_cells[0],
           phase_cells[1], phase_cells[2], phase_cells[3],
           fmt("%.3f", team.team_max(us[2][Layer::kDispatch]) / 1000.0)});
    ctx.progress("moe tokens=%lld E=%d k=%d: one GPU %.3f ms, team %.3f ms", (long long)c.tokens, c.experts,
                 c.top_k, one_ms, team_ms);
    if (!ctx.timeline_dir.empty())  // one layer call, in-kernel timestamps (TimelinePhase::kMoe: MoeStep)
      timelines.push_back(record_timeline(
          comm, team.streams, [&] { team_phase(Layer::kAll); },
          fmt("moe layer tokens=%lld E=%d k=%d hidden=%lld", (long long)c.tokens, c.experts, c.top_k,
              (long long)c.hidden),
          ctx.timeline_dir + fmt("/moe_%lld_%d_%d.csv", (long long)c.tokens, c.experts, c.top_k)));
    // The layer's first two phases (from kDispatch) or last two (from kDown) on every rank, unfused or fused.
    const auto team_pair = [&](Layer::Phase first, bool fused) {
      return [&, first, fused](int) {
        for (int i = 0; i < L; ++i) {
          WEFT_CUDA_CHECK(cudaSetDevice(comm.local(i).device()));
          Layer& l = *layers[i];
          if (fused && first == Layer::kDispatch)
            l.run_fused_dispatch_up(comm, comm.local(i), team.streams[i]);
          else if (fused)
            l.run_fused_down_combine(comm, comm.local(i), team.streams[i]);
          else
            for (int p = first; p <= first + 1; ++p)
              l.run(comm, comm.local(i), inputs[i], team.streams[i], Layer::Phase(p));
        }
      };
    };
    const auto team_head = [&](bool fused) { return team_pair(Layer::kDispatch, fused); };
    const auto team_tail = [&](bool fused) { return team_pair(Layer::kDown, fused); };
    team_head(true)(0);  // sizes the walk area before capture
    comm.synchronize();
    const std::vector<double> head_us =
        time_graphs_alternating(comm, team.streams, 1, iters, {team_head(false), team_head(true)});
    const double head_unfused = team.team_max(head_us[0]) / 1000.0,
                 head_fused = team.team_max(head_us[1]) / 1000.0;
    h.add({std::to_string(c.tokens), std::to_string(c.experts), std::to_string(c.top_k),
           std::to_string(c.hidden), std::to_string(c.inter), fmt("%.3f", head_unfused),
           fmt("%.3f", head_fused), fmt("%.3f", head_unfused / head_fused)});
    team_tail(true)(0);  // sizes the staging area before capture
    comm.synchronize();
    const std::vector<double> tail_us =
        time_graphs_alternating(comm, team.streams, 1, iters, {team_tail(false), team_tail(true)});
    const double unfused = team.team_max(tail_us[0]) / 1000.0, fused = team.team_max(tail_us[1]) / 1000.0;
    f.add({std::to_string(c.tokens), std::to_string(c.experts), std::to_string(c.top_k),
           std::to_string(c.hidden), std::to_string(c.inter), fmt("%.3f", unfused), fmt("%.3f", fused),
           fmt("%.3f", unfused / fused)});
    if (per_rank <= 256) {  // the low-latency dispatch: its own layers (groups of another capacity)
      std::vector<std::unique_ptr<Layer>> lls;
      std::vector<void*> ll_inputs;
      for (int i = 0; i < L; ++i) {
        Rank& r = comm.local(i);
        WEFT_CUDA_CHECK(cudaSetDevice(r.device()));
        MoeShape s = layers[i]->shape;
        s.low_latency = true;
        const std::vector<int32_t> mine(all.begin() + r.rank() * per_rank * c.top_k,
                                        all.begin() + (r.rank() + 1) * per_rank * c.top_k);
        lls.push_back(std::make_unique<Layer>(s, W, c.inter, mine, 100 + r.rank(), team.streams[i]));
        ll_inputs.push_back(moe_combine_input(comm, r, s, DType::kBF16));
        // The combine input's area grew to the low-latency capacity: the others' pointer into it moved.
        inputs[i] = moe_combine_input(comm, r, layers[i]->shape, DType::kBF16);
      }
      const auto ll_phase = [&](int phase) {
        for (int i = 0; i < L; ++i) {
          WEFT_CUDA_CHECK(cudaSetDevice(comm.local(i).device()));
          lls[i]->run(comm, comm.local(i), ll_inputs[i], team.streams[i], Layer::Phase(phase));
        }
      };
      ll_phase(Layer::kAll);  // sizes its areas before capture (the combine input grows to its capacity)
      team_phase(Layer::kAll);
      comm.synchronize();
      const std::vector<std::vector<double>> ll_us =
          time_phases_alternating(comm, team.streams, Layer::kAll, iters, {inference_phase, ll_phase});
      if (!ctx.timeline_dir.empty())  // one layer call (MoeStep::kLowLatency*)
        timelines.push_back(record_timeline(
            comm, team.streams, [&] { ll_phase(Layer::kAll); },
            fmt("moe layer, low-latency dispatch, tokens=%lld E=%d k=%d hidden=%lld", (long long)c.tokens,
                c.experts, c.top_k, (long long)c.hidden),
            ctx.timeline_dir + fmt("/moe_ll_%lld_%d_%d.csv", (long long)c.tokens, c.experts, c.top_k)));
      const LowLatencyFloor ll_floor = low_latency_floor(all, W, per_rank, c.experts, c.top_k, c.hidden);
      const auto pair = [&](int phase) {  // "record / low latency", ms
        return fmt("%.3f / %.3f", team.team_max(ll_us[0][phase]) / 1000.0,
                   team.team_max(ll_us[1][phase]) / 1000.0);
      };
      ll.add({std::to_string(c.tokens), std::to_string(c.experts), std::to_string(c.top_k),
              std::to_string(c.hidden), std::to_string(c.inter), pair(Layer::kDispatch), pair(Layer::kUp),
              pair(Layer::kDown), pair(Layer::kCombine), pair(Layer::kAll),
              fmt("%.3f", team.team_max(ll_us[0][Layer::kAll]) / team.team_max(ll_us[1][Layer::kAll])),
              fmt("%.1f / %.1f", ll_floor.dispatch_us, ll_floor.combine_us),
              fmt("%.2f / %.2f", team.team_max(ll_us[1][Layer::kDispatch]) / ll_floor.dispatch_us,
                  team.team_max(ll_us[1][Layer::kCombine]) / ll_floor.combine_us)});
      const auto ll_head = [&](int) {  // the low-latency layers' dispatch and up GEMM
        for (int i = 0; i < L; ++i) {
          WEFT_CUDA_CHECK(cudaSetDevice(comm.local(i).device()));
          lls[i]->run(comm, comm.local(i), ll_inputs[i], team.streams[i], Layer::kDispatch);
          lls[i]->run(comm, comm.local(i), ll_inputs[i], team.streams[i], Layer::kUp);
        }
      };
      e.add(fp8_row(team, lls, ll_head, iters, case_columns, "low latency"));
    }
    e.add(fp8_row(team, layers, team_head(false), iters, case_columns, "record"));
  }
  ctx.add(std::move(t));
  ctx.add(std::move(h));
  ctx.add(std::move(f));
  ctx.add(std::move(e));
  ctx.add(std::move(ll));
  for (Table& tl : timelines) ctx.add(std::move(tl));
}

ModeRegistrar reg("moe", "MoE layer (dispatch, grouped GEMMs, combine) vs the same layer on one GPU",
                  &run_moe, 2, true);

}  // namespace
}  // namespace weft::bench
