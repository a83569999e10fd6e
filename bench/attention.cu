// weft-bench attention: weft's flash attention forward and backward on GPU 0, TFLOP/s with the usual
// convention (forward 4 B H S^2 D, halved for causal; backward 2.5 times the forward's) over the shapes of
// the attention issue: B S = 16k tokens at S = 1k..16k, head dims 128 (16 heads) and 64 (32 heads), causal
// and not, and GQA 32:8. Each call is timed with its own events; the median of the iterations counts. The
// torch SDPA baselines (cuDNN, flash) are timed by python/benchmarks/attention.py on the same machine.
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "bench.hpp"
#include "weft/ops/attention.hpp"

namespace weft::bench {
namespace {

void run_attention(Context& ctx) {
  WEFT_CUDA_CHECK(cudaSetDevice(0));
  cudaDeviceProp prop{};
  WEFT_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t stream = nullptr;
  WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Table t(fmt("flash attention forward and backward, bf16, GPU 0 (%s, %d SMs)", prop.name,
              prop.multiProcessorCount),
          {"B", "S", "H / KV", "D", "causal", "fwd ms", "fwd TFLOP/s", "fwd 128-row ms", "fwd 192-row ms",
           "bwd ms", "bwd TFLOP/s", "deterministic bwd ms", "det. / bwd"},
          "TFLOP/s = 4 B H S^2 D / time (halved for causal; backward 2.5x); median of the iterations, each "
          "timed alone. 'fwd 128-row' / '192-row' (D = 64): the forward with its query block forced "
          "(AttentionOptions::query_rows; 'fwd ms' takes the call's choice). The backward call includes its "
          "three launches (prepare, kernel, dQ conversion); 'deterministic': the same call with "
          "AttentionOptions::deterministic (bit-reproducible dQ).");
  std::vector<Table> timelines;
  std::vector<int64_t> seqs = {1024, 2048, 4096, 8192, 16384};
  if (ctx.quick) seqs = {2048, 8192};
  struct Heads {
    int64_t h, kv, d;
  };
  const Heads heads[] = {{16, 16, 128}, {32, 32, 64}, {32, 8, 128}};
  for (const Heads& hd : heads)
    for (bool causal : {false, true})
      for (int64_t s : seqs) {
        const int64_t b = 16384 / s;
        const AttentionShape shape{b, s, s, hd.h, hd.kv, hd.d};
        DeviceBuffer q(b * s * hd.h * hd.d * 2), k(b * s * hd.kv * hd.d * 2), v(b * s * hd.kv * hd.d * 2),
            o(b * s * hd.h * hd.d * 2), lse(b * hd.h * s * 4), dout(b * s * hd.h * hd.d * 2),
            dq(b * s * hd.h * hd.d * 2), dk(b * s * hd.kv * hd.d * 2), dv(b * s * hd.kv * hd.d * 2),
            ws(flash_attention_backward_workspace_bytes(shape, AttentionOptions{.deterministic = true}));
        const size_t ws_bytes = ws.bytes;
        fill_uniform_bf16(q.p, b * s * hd.h * hd.d, 1, stream);
        fill_uniform_bf16(k.p, b * s * hd.kv * hd.d, 2, stream);
        fill_uniform_bf16(v.p, b * s * hd.kv * hd.d, 3, stream);
        fill_uniform_bf16(dout.p, b * s * hd.h * hd.d, 4, stream);
        AttentionOptions opt;
        opt.causal = causal;
        auto forward = [&] {
          flash_attention_forward(q.p, k.p, v.p, o.p, static_cast<float*>(lse.p), shape, DType::kBF16, stream,
                                  opt);
        };
        auto forward_rows = [&](int rows) {
          if (hd.d != 64) return std::string("-");
          AttentionOptions forced = opt;
          forced.query_rows = rows;
          return fmt("%.3f", median_call_ms(
                                 [&] {
                                   flash_attention_forward(q.p, k.p, v.p, o.p, static_cast<float*>(lse.p),
                                                           shape, DType::kBF16, stream, forced);
                                 },
                                 ctx.quick ? 10 : 30, stream));
        };
        AttentionOptions det = opt;
        det.deterministic = true;
        auto backward = [&] {
          flash_attention_backward(q.p, k.p, v.p, o.p, dout.p, static_cast<float*>(lse.p), dq.p, dk.p, dv.p,
                                   ws.p, ws_bytes, shape, DType::kBF16, stream, opt);
        };
        auto backward_det = [&] {
          flash_attention_backward(q.p, k.p, v.p, o.p, dout.p, static_cast<float*>(lse.p), dq.p, dk.p, dv.p,
                                   ws.p, ws_bytes, shape, DType::kBF16, stream, det);
        };
        const double flops = 4.0 * b * hd.h * double(s) * s * hd.d * (causal ? 0.5 : 1.0);
        const int iters = ctx.quick ? 10 : 30;
        const float med = median_call_ms(forward, iters, stream);
        const std::string rows_128 = forward_rows(128), rows_192 = forward_rows(192);
        const float bwd = median_call_ms(backward, iters, stream);
        const float bwd_det = median_call_ms(backward_det, iters, stream);
        t.add({std::to_string(b), std::to_string(s), fmt("%lld / %lld", (long long)hd.h, (long long)hd.kv),
               std::to_string(hd.d), causal ? "yes" : "no", fmt("%.3f", med),
               fmt("%.1f", flops / (med * 1e9)), rows_128, rows_192, fmt("%.3f", bwd),
               fmt("%.1f", 2.5 * flops / (bwd * 1e9)), fmt("%.3f", bwd_det), fmt("%.2f", bwd_det / bwd)});
        ctx.progress("attention: S=%lld D=%lld causal=%d: forward %.3f ms, backward %.3f ms", (long long)s,
                     (long long)hd.d, int(causal), med, bwd);
        if (!ctx.timeline_dir.empty() && causal && (s == 1024 || s == 8192))
          for (const char* pass : {"fwd", "bwd", "bwd_det"}) {
            const std::string name = fmt("attention_%s_%lld_%lld_%lld_%lld", pass, (long long)b, (long long)s,
                                         (long long)hd.h, (long long)hd.d);
            timelines.push_back(record_timeline_one_gpu(
                [&](TimelineBuffer* tl) {
                  AttentionOptions with = pass[3] == '_' ? det : opt;
                  with.timeline = tl;
                  if (pass[0] == 'f')
                    flash_attention_forward(q.p, k.p, v.p, o.p, static_cast<float*>(lse.p), shape,
                                            DType::kBF16, stream, with);
                  else
                    flash_attention_backward(q.p, k.p, v.p, o.p, dout.p, static_cast<float*>(lse.p), dq.p,
                                             dk.p, dv.p, ws.p, ws_bytes, shape, DType::kBF16, stream, with);
                },
                stream,
                fmt("%s, B=%lld S=%lld H=%lld/%lld D=%lld causal", pass, (long long)b, (long long)s,
                    (long long)hd.h, (long long)hd.kv, (long long)hd.d),
                ctx.timeline_dir + "/" + name + ".csv"));
          }
      }
  ctx.add(std::move(t));
  for (Table& tl : timelines) ctx.add(std::move(tl));
  cudaStreamDestroy(stream);
}

ModeRegistrar reg(
    "attention",
    "weft flash attention forward and backward on GPU 0, TFLOP/s (B S = 16k tokens, S = 1k..16k)",
    &run_attention, 1);

}  // namespace
}  // namespace weft::bench
