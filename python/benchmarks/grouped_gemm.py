"""weft.grouped_mm against torch._grouped_mm and a dense torch.mm of the same FLOPs at MoE shapes
(DeepSeek-V3: 32 experts x 1024 rows, K 7168 N 4096 and K 2048 N 7168; Mixtral-like: 2 x 8192 rows, K 4096,
N 28672), bf16, B as stacked nn.Linear weights ([E, N, K], passed transposed) and as [E, K, N].

The three run in turn, round after round (10 rounds of 10 timed calls each, CUDA events per call), so the
GPU's clock and temperature drift hits them alike; a cell is the median over all its calls. Without the
weft module (PYTHONPATH=build/python) only the torch columns are printed.

Then the first expert GEMM with SwiGLU: weft's SwiGLU epilogue against the GEMM followed by torch's
silu(gate) * up (weft's and torch._grouped_mm's), in turns the same way.

    PYTHONPATH=build/python python3 python/benchmarks/grouped_gemm.py
"""
import statistics

import torch

try:
    import weft
except ImportError:
    weft = None


def time_calls(fn, n):
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    ev[0].record()
    for i in range(n):
        fn()
        ev[i + 1].record()
    torch.cuda.synchronize()
    return [ev[i].elapsed_time(ev[i + 1]) for i in range(n)]


def alternating(fns, rounds=10, per_round=10):
    for fn in fns:
        for _ in range(3):
            fn()
    times = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            times[i] += time_calls(fn, per_round)
    return [statistics.median(t) for t in times]


def main():
    torch.cuda.set_device(0)
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    print("| experts x rows | K | N | B | weft ms | weft TFLOP/s | torch._grouped_mm TFLOP/s | weft / torch | "
          "torch.mm dense TFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for e, rows, k, n in [(32, 1024, 7168, 4096), (32, 1024, 2048, 7168), (2, 8192, 4096, 28672)]:
        a = torch.randn(e * rows, k, device="cuda", dtype=torch.bfloat16)
        offs = torch.arange(1, e + 1, device="cuda", dtype=torch.int32) * rows
        flops = 2.0 * e * rows * k * n
        for layout in ("nk", "kn"):
            if layout == "nk":  # nn.Linear weights per expert, [E, N, K], used as [E, K, N]
                b = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16).transpose(-2, -1)
            else:
                b = torch.randn(e, k, n, device="cuda", dtype=torch.bfloat16)
            b0 = b[0]
            fns = [lambda: torch._grouped_mm(a, b, offs=offs), lambda: torch.mm(a, b0)]
            if weft is not None:
                fns.append(lambda: weft.grouped_mm(a, b, offs, validate=False))
            ms = alternating(fns)
            torch_tf, dense_tf = flops / ms[0] / 1e9, flops / ms[1] / 1e9
            if weft is not None:
                w = f"{ms[2]:.3f} | {flops / ms[2] / 1e9:.1f}"
                ratio = f"{ms[0] / ms[2]:.3f}"
            else:
                w, ratio = "- | -", "-"
            print(f"| {e} x {rows} | {k} | {n} | {layout} | {w} | {torch_tf:.1f} | {ratio} | {dense_tf:.1f} |",
                  flush=True)

    if weft is None:
        return
    # The first expert GEMM with SwiGLU (DeepSeek-V3: 32 x 1024 rows, K 7168, gate + up 2 x 2048; Mixtral-like:
    # 2 x 8192 rows, K 4096, 2 x 14336): the epilogue's SwiGLU against the GEMM and then silu(gate) * up as
    # torch ops, for weft and torch._grouped_mm alike. Weights as stacked nn.Linear [E, 2 I, K].
    F = torch.nn.functional
    print()
    print("| experts x rows | K | 2 x I | weft fused ms | weft + torch SwiGLU ms | torch._grouped_mm + SwiGLU ms | "
          "fused / weft unfused | fused / torch |")
    print("|---|---|---|---|---|---|---|---|")
    for e, rows, k, inter in [(32, 1024, 7168, 2048), (2, 8192, 4096, 14336)]:
        a = torch.randn(e * rows, k, device="cuda", dtype=torch.bfloat16)
        offs = torch.arange(1, e + 1, device="cuda", dtype=torch.int32) * rows
        b = torch.randn(e, 2 * inter, k, device="cuda", dtype=torch.bfloat16).transpose(-2, -1)
        bi = weft.swiglu_interleave(b)

        def unfused(h):
            return F.silu(h[:, :inter]) * h[:, inter:]

        ms = alternating([lambda: weft.grouped_mm(a, bi, offs, validate=False, activation="swiglu"),
                          lambda: unfused(weft.grouped_mm(a, b, offs, validate=False)),
                          lambda: unfused(torch._grouped_mm(a, b, offs=offs))])
        print(f"| {e} x {rows} | {k} | 2 x {inter} | {ms[0]:.3f} | {ms[1]:.3f} | {ms[2]:.3f} | {ms[1] / ms[0]:.3f} | "
              f"{ms[2] / ms[0]:.3f} |", flush=True)


if __name__ == "__main__":
    main()
