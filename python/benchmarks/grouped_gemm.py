"""weft.grouped_mm against torch._grouped_mm and a dense torch.mm of the same FLOPs at MoE shapes
(DeepSeek-V3: 32 experts x 1024 rows, K 7168 N 4096 and K 2048 N 7168; Mixtral-like: 2 x 8192 rows, K 4096,
N 28672), bf16, B as stacked nn.Linear weights ([E, N, K], passed transposed) and as [E, K, N].

The three run in turn, round after round (10 rounds of 10 timed calls each, CUDA events per call), so the
GPU's clock and temperature drift hits them alike; a cell is the median over all its calls. Without the
weft module (PYTHONPATH=build/python) only the torch columns are printed.

Then the first expert GEMM with SwiGLU: weft's SwiGLU epilogue against the GEMM followed by torch's
silu(gate) * up (weft's and torch._grouped_mm's), in turns the same way.

Then FP8 (e4m3, bf16 out; B as stacked nn.Linear weights): weft.grouped_scaled_mm with DeepSeek-V3's block
scales (A 1 x 128, B 128 x 128; weft.quantize_fp8's, A's row-major and M-major) against torch._scaled_grouped_mm (per-row scales, the
scaling it takes on Hopper), torch._scaled_mm per expert with block scales (torch's 1 x 128 / 128 x 128
blockwise form, where this torch runs it), weft.scaled_mm per expert likewise, and weft's bf16 grouped_mm of
the same problem; a baseline this torch refuses prints its error instead of a time. --fp8: this table only.

    PYTHONPATH=build/python python3 python/benchmarks/grouped_gemm.py [--fp8]
"""
import statistics
import sys

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


def first_that_runs(candidates):
    """(fn, None) for the first of `candidates` (name, fn) that runs, else (None, the errors)."""
    errors = []
    for name, fn in candidates:
        try:
            fn()
            torch.cuda.synchronize()
            return fn, None
        except (RuntimeError, TypeError, ValueError, AttributeError) as e:  # (AttributeError: no such op)
            errors.append(f"{name}: {str(e).splitlines()[0][:120]}")
    return None, "; ".join(errors)


def fp8_table():
    # DeepSeek-V3's expert GEMMs (32 local experts x 1024 rows: up K 7168 N 4096, down K 2048 N 7168) and a
    # Mixtral-like one (2 x 8192 rows, K 4096, N 28672).
    print()
    print("| experts x rows | K | N | weft block ms | weft block TFLOP/s | weft block, A's scales M-major TFLOP/s | "
          "torch._scaled_grouped_mm per-row TFLOP/s | torch._scaled_mm block, per expert TFLOP/s | "
          "weft.scaled_mm block, per expert TFLOP/s | weft bf16 grouped_mm TFLOP/s | weft M-major / torch grouped | "
          "weft M-major / torch per expert |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    notes = []
    for e, rows, k, n in [(32, 1024, 7168, 4096), (32, 1024, 2048, 7168), (2, 8192, 4096, 28672)]:
        flops = 2.0 * e * rows * k * n
        x = torch.randn(e * rows, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(e * n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        offs = torch.arange(1, e + 1, device="cuda", dtype=torch.int32) * rows
        qa, sa = weft.quantize_fp8(x, "block", "a")
        qm, sm = weft.quantize_fp8(x, "block", "a", m_major=True)  # torch._scaled_mm's layout for A's blocks
        qw, sw = weft.quantize_fp8(w, "block", "b")
        qw3, sw3 = qw.view(e, n, k), sw.view(e, n // 128, -1)
        ra, rsa = weft.quantize_fp8(x, "rowcol", "a")
        rw, rsw = weft.quantize_fp8(w, "rowcol", "b")
        rw3, rsw3 = rw.view(e, n, k), rsw.view(e, n)
        b_bf = w.view(e, n, k).transpose(-2, -1)
        # Per expert, A's scales M-major over the expert's rows alone (torch._scaled_mm's 1 x 128 form).
        sm_e = [sa[i * rows:(i + 1) * rows].t().contiguous().t() for i in range(e)]
        fns = [lambda: weft.grouped_scaled_mm(qa, qw3, offs, sa, sw3),
               lambda: weft.grouped_scaled_mm(qm, qw3, offs, sm, sw3),
               lambda: weft.grouped_mm(x, b_bf, offs, validate=False)]
        grouped, why = first_that_runs([
            ("torch._scaled_grouped_mm", lambda: torch._scaled_grouped_mm(
                ra, rw3.transpose(-2, -1), rsa.view(-1), rsw3, offs=offs, out_dtype=torch.bfloat16))])
        if why:
            notes.append(f"{e} x {rows}, K {k}, N {n}: torch._scaled_grouped_mm did not run ({why})")
        per_expert, why = first_that_runs([
            (f"torch._scaled_mm blockwise, scale_b {form}", lambda form=form: [
                torch._scaled_mm(qm[i * rows:(i + 1) * rows], qw3[i].t(), scale_a=sm_e[i],
                                 scale_b=sw3[i].t() if form == "(K/128, N/128) view" else sw3[i].t().contiguous(),
                                 out_dtype=torch.bfloat16) for i in range(e)])
            for form in ("(K/128, N/128) view", "(K/128, N/128) contiguous")])
        if why:
            notes.append(f"{e} x {rows}, K {k}, N {n}: torch._scaled_mm with block scales did not run ({why})")
        weft_per_expert = lambda: [weft.scaled_mm(qm[i * rows:(i + 1) * rows], qw3[i].t(), sm_e[i], sw3[i])
                                   for i in range(e)]
        fns += [f for f in (grouped, per_expert) if f is not None] + [weft_per_expert]
        ms = alternating(fns)
        tf = [flops / t / 1e9 for t in ms]
        col = iter(tf[3:])
        torch_grouped = next(col) if grouped else None
        torch_expert = next(col) if per_expert else None
        weft_expert = next(col)
        cell = lambda v: f"{v:.1f}" if v is not None else "n/a"
        ratio = lambda v: f"{tf[1] / v:.3f}" if v is not None else "-"
        print(f"| {e} x {rows} | {k} | {n} | {ms[0]:.3f} | {tf[0]:.1f} | {tf[1]:.1f} | {cell(torch_grouped)} | "
              f"{cell(torch_expert)} | {weft_expert:.1f} | {tf[2]:.1f} | {ratio(torch_grouped)} | "
              f"{ratio(torch_expert)} |", flush=True)
    for note in notes:
        print(f"- {note}")


def main():
    torch.cuda.set_device(0)
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    if "--fp8" in sys.argv[1:]:
        if weft is None:
            sys.exit("--fp8 needs the weft module (PYTHONPATH=build/python)")
        fp8_table()
        return
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
    fp8_table()


if __name__ == "__main__":
    main()
