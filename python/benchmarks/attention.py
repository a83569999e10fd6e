"""torch SDPA baselines for weft-bench attention: the same shapes (B S = 16k tokens, S = 1k..16k; D 128 with
16 heads, D 64 with 32 heads, GQA 32:8 at D 128; causal and not), bf16, timed per call with CUDA events
(median), with the cuDNN and the flash backends, forward and backward (torch.autograd.grad of the output
with a random gradient, the graph kept between calls). TFLOP/s = 4 B H S^2 D / time, halved for causal,
backward 2.5 times the forward's.

    python3 python/benchmarks/attention.py [--quick]
"""
import argparse
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def time_ms(fn, iters):
    for _ in range(3):
        fn()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    events[0].record()
    for i in range(iters):
        fn()
        events[i + 1].record()
    torch.cuda.synchronize()
    return statistics.median(events[i].elapsed_time(events[i + 1]) for i in range(iters))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    seqs = [2048, 8192] if args.quick else [1024, 2048, 4096, 8192, 16384]
    print("| B | S | H / KV | D | causal | backend | fwd ms | fwd TFLOP/s | bwd ms | bwd TFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    iters = 10 if args.quick else 30
    for h, kv, d in [(16, 16, 128), (32, 32, 64), (32, 8, 128)]:
        for causal in [False, True]:
            for s in seqs:
                b = 16384 // s
                q = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                k = torch.randn(b, kv, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                v = torch.randn(b, kv, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                dout = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
                flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
                row = f"| {b} | {s} | {h} / {kv} | {d} | {'yes' if causal else 'no'} |"
                for name, backend in [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)]:
                    try:
                        with sdpa_kernel(backend):
                            def forward():
                                return F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                      enable_gqa=kv != h)
                            with torch.no_grad():
                                fwd = time_ms(forward, iters)
                            out = forward()
                            bwd = time_ms(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), iters)
                            del out
                        print(f"{row} {name} | {fwd:.3f} | {flops / fwd / 1e9:.1f} | {bwd:.3f} | "
                              f"{2.5 * flops / bwd / 1e9:.1f} |", flush=True)
                    except RuntimeError as e:
                        print(f"{row} {name} | - | unavailable: {str(e).splitlines()[0][:60]} | - | - |", flush=True)

if __name__ == "__main__":
    main()
