"""GPU test of weft.grouped_mm (forward and autograd) against fp32 matmuls per group, one GPU:

    PYTHONPATH=build/python python3 python/tests/gpu_grouped_mm.py

Cases: empty groups, rows past the last group (zeros), partial K and N tiles, B as [E, K, N] and as the
transpose of stacked nn.Linear weights [E, N, K], bf16 and fp32 outputs; gradients dA and dB against fp32
autograd; the SwiGLU epilogue on interleaved weights (outputs, gradients); a CUDA-graph capture replayed on new inputs; bad arguments refused with WeftValueError /
WeftTypeError. NaN never passes.
"""
import sys

import torch

import weft


def rel(got, want):
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()


def reference(a, b, ends):
    """fp32 [rows, N]: a's rows of group e times b[e]; zeros past the last end."""
    out = a.new_zeros((a.shape[0], b.shape[2]), dtype=torch.float32)
    start = 0
    for e, end in enumerate(ends):
        out[start:end] = a[start:end].float() @ b[e].float()
        start = end
    return out


def operands(sizes, rows, k, n, nk, g):
    """(group ends on the host, a [rows, k], the weights' leaf w, b = w as [E, K, N]): nk, stacked nn.Linear
    weights [E, N, K] passed transposed."""
    ends = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)
    a = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
    shape = (len(sizes), n, k) if nk else (len(sizes), k, n)
    w = (torch.randn(shape, device="cuda", generator=g) / k ** 0.5).to(torch.bfloat16).requires_grad_(True)
    return ends, a, w, w.transpose(1, 2) if nk else w


def run_case(sizes, rows, k, n, nk, out_dtype, g):
    ends, a, w, b = operands(sizes, rows, k, n, nk, g)
    ends_dev = ends.cuda()
    out = weft.grouped_mm(a, b, ends_dev, out_dtype=out_dtype)
    ref = reference(a.detach(), b.detach(), ends.tolist())
    name = f"sizes {sizes} rows {rows} K {k} N {n} {'nk' if nk else 'kn'} {out_dtype}"
    if out.shape != (rows, n) or out.dtype != out_dtype:
        raise AssertionError(f"{name}: got {tuple(out.shape)} {out.dtype}")
    tol = 1e-2 if out_dtype == torch.bfloat16 else 2e-3
    err = rel(out, ref)
    if err > tol:
        raise AssertionError(f"{name}: output relative error {err:.3e} > {tol}")
    last = int(ends[-1])
    if last < rows and not torch.all(out[last:] == 0):
        raise AssertionError(f"{name}: rows past the last group's end are not zero")
    # Gradients against fp32 autograd on the same inputs.
    gout = torch.randn(rows, n, device="cuda", dtype=torch.float32, generator=g)
    (out.float() * gout).sum().backward()
    a32 = a.detach().float().requires_grad_(True)
    w32 = w.detach().float().requires_grad_(True)
    ref = reference(a32, w32.transpose(1, 2) if nk else w32, ends.tolist())
    (ref * gout).sum().backward()
    for gname, got, want in (("dA", a.grad, a32.grad), ("dB", w.grad, w32.grad)):
        err = rel(got, want)
        if err > 2e-2:
            raise AssertionError(f"{name}: {gname} relative error {err:.3e} > 2e-2")
    print(f"  ok  {name}")


def run_swiglu_case(sizes, rows, k, inter, nk, g):
    """activation="swiglu" on swiglu_interleave'd weights against silu(a gate) * (a up) in fp32, and its
    gradients (through the interleave, to the gate / up weights) against fp32 autograd."""
    ends, a, w, b = operands(sizes, rows, k, 2 * inter, nk, g)
    out = weft.grouped_mm(a, weft.swiglu_interleave(b), ends.cuda(), activation="swiglu")
    a32 = a.detach().float().requires_grad_(True)
    w32 = w.detach().float().requires_grad_(True)
    h = reference(a32, w32.transpose(1, 2) if nk else w32, ends.tolist())
    ref = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
    name = f"swiglu sizes {sizes} rows {rows} K {k} inter {inter} {'nk' if nk else 'kn'}"
    if out.shape != (rows, inter):
        raise AssertionError(f"{name}: got {tuple(out.shape)}")
    err = rel(out, ref)
    if err > 1e-2:
        raise AssertionError(f"{name}: output relative error {err:.3e} > 1e-2")
    gout = torch.randn(rows, inter, device="cuda", generator=g)
    (out.float() * gout).sum().backward()
    (ref * gout).sum().backward()
    for gname, got, want in (("dA", a.grad, a32.grad), ("dB", w.grad, w32.grad)):
        err = rel(got, want)
        if err > 2e-2:
            raise AssertionError(f"{name}: {gname} relative error {err:.3e} > 2e-2")
    print(f"  ok  {name}")


def expect_error(kind, fn, part):
    try:
        fn()
    except kind as e:
        if part not in str(e):
            raise AssertionError(f"expected '{part}' in the message, got: {e}")
        return
    raise AssertionError(f"expected {kind.__name__} ('{part}')")


def main():
    torch.cuda.set_device(0)
    g = torch.Generator(device="cuda").manual_seed(7)
    for sizes, rows, k, n, nk, dt in [
        ([128, 0, 384, 256], 1024, 256, 200, False, torch.bfloat16),  # empty group, 256 rows past the end
        ([128, 0, 384, 256], 1024, 256, 200, True, torch.bfloat16),
        ([256, 128], 384, 136, 264, True, torch.float32),  # partial K and N tiles, fp32 out
        ([0, 0, 512], 512, 512, 512, False, torch.bfloat16),
        ([1024] * 8, 8192, 1024, 2048, True, torch.bfloat16),
    ]:
        run_case(sizes, rows, k, n, nk, dt, g)

    for sizes, rows, k, inter, nk in [([128, 0, 256], 512, 256, 128, False), ([256, 384], 768, 264, 256, True),
                                      ([1024] * 4, 4096, 1024, 512, True)]:
        run_swiglu_case(sizes, rows, k, inter, nk, g)

    # A CUDA graph of the forward, replayed on new inputs (validation is skipped under capture).
    a = torch.randn(512, 128, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(2, 128, 64, device="cuda", dtype=torch.bfloat16)
    ends = torch.tensor([256, 384], dtype=torch.int32, device="cuda")
    weft.grouped_mm(a, b, ends)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = weft.grouped_mm(a, b, ends)
    for _ in range(2):
        a.copy_(torch.randn_like(a))
        graph.replay()
        torch.cuda.synchronize()
        err = rel(out, reference(a, b, [256, 384]))
        if err > 1e-2:
            raise AssertionError(f"graph replay: relative error {err:.3e}")
    print("  ok  CUDA graph capture and replay")

    x = torch.zeros(256, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.zeros(2, 64, 64, device="cuda", dtype=torch.bfloat16)
    e2 = torch.tensor([128, 256], dtype=torch.int32, device="cuda")
    expect_error(weft.WeftValueError, lambda: weft.grouped_mm(x, w, torch.tensor([100, 256], dtype=torch.int32,
                                                                                     device="cuda")),
                 "multiples of 128")
    expect_error(weft.WeftValueError, lambda: weft.grouped_mm(x, w, torch.tensor([128, 384], dtype=torch.int32,
                                                                                     device="cuda")), "up to rows")
    expect_error(weft.WeftValueError, lambda: weft.grouped_mm(x[:200], w, e2), "multiple of 128")
    expect_error(weft.WeftTypeError, lambda: weft.grouped_mm(x.float(), w, e2), "bf16")
    expect_error(weft.WeftTypeError, lambda: weft.grouped_mm(x, w, e2.long()), "int32")
    expect_error(weft.WeftValueError, lambda: weft.grouped_mm(x, w[:1], e2), "E = group_end")
    expect_error(weft.WeftValueError, lambda: weft.grouped_mm(x, w[:, :, :60], e2), "multiples of 8")
    expect_error(weft.WeftValueError, lambda: weft.grouped_mm(x, w, e2, activation="swiglu"), "multiple of 256")
    print("  ok  argument errors")
    print("gpu_grouped_mm: all cases pass")


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        print(f"FAIL: {e}")
        sys.exit(1)
