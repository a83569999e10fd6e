"""torch baselines for weft-bench grouped_gemm: torch._grouped_mm and a dense torch.mm of the same FLOPs at the
same MoE shapes (DeepSeek-V3: 32 experts x 1024 rows, K 7168 N 4096 and K 2048 N 7168; Mixtral-like: 2 x 8192
rows, K 4096, N 28672), bf16, each call timed alone with CUDA events, median of 30.

    python3 python/benchmarks/grouped_gemm.py
"""
import statistics

import torch


def time_ms(fn, iters=30):
    for _ in range(3):
        fn()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    ev[0].record()
    for i in range(iters):
        fn()
        ev[i + 1].record()
    torch.cuda.synchronize()
    return statistics.median(ev[i].elapsed_time(ev[i + 1]) for i in range(iters))


def main():
    torch.cuda.set_device(0)
    print("| experts | rows each | K | N | torch._grouped_mm ms | TFLOP/s | torch.mm dense TFLOP/s |")
    print("|---|---|---|---|---|---|---|")
    for e, rows, k, n in [(32, 1024, 7168, 4096), (32, 1024, 2048, 7168), (2, 8192, 4096, 28672)]:
        a = torch.randn(e * rows, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16)  # nn.Linear weights per expert
        offs = torch.arange(1, e + 1, device="cuda", dtype=torch.int32) * rows
        flops = 2.0 * e * rows * k * n
        try:
            ms = time_ms(lambda: torch._grouped_mm(a, w.transpose(-2, -1), offs=offs))
            grouped = f"{ms:.3f} | {flops / ms / 1e9:.1f}"
        except Exception as ex:  # not every torch build has it for this GPU
            grouped = f"n/a ({type(ex).__name__}: {str(ex)[:60]}) | -"
        w0 = w[0].t()
        dense_ms = time_ms(lambda: torch.mm(a, w0))
        print(f"| {e} | {rows} | {k} | {n} | {grouped} | {flops / dense_ms / 1e9:.1f} |", flush=True)


if __name__ == "__main__":
    main()
