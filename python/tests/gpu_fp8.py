"""GPU test of weft.scaled_mm, weft.grouped_scaled_mm and weft.quantize_fp8, one GPU:

    PYTHONPATH=build/python python3 python/tests/gpu_fp8.py

scaled_mm against torch._scaled_mm on the same FP8 operands (per-tensor and per-row / column scales) and
against an fp32 matmul of the dequantized operands (every scaling, including DeepSeek-V3's blocks, whose
scale layout here, row-major, is not torch._scaled_mm's), partial tiles, bf16 and fp32 out; quantize_fp8's scales against torch's amax and its
values within e4m3's rounding bound; bad arguments refused with WeftValueError / WeftTypeError. NaN never
passes.
"""
import sys

import torch

import weft

E4M3 = torch.float8_e4m3fn
failures = []


def rel(got, want):
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()


def check(what, value, limit):
    ok = value <= limit
    print(f"  {'ok  ' if ok else 'FAIL'} {what}: {value:.2e} (limit {limit:.0e})")
    if not ok:
        failures.append(what)


def dequantize(q, scales, scaling, operand):
    """fp32 [rows, cols] = q times its scales, as scaled_mm applies them."""
    x = q.float()
    rows, cols = x.shape
    if scaling == "tensor":
        return x * scales.reshape(())
    if scaling == "rowcol":
        return x * scales.reshape(rows, 1)
    s = scales.repeat_interleave(128, dim=1)[:, :cols]
    if operand == "b":
        s = s.repeat_interleave(128, dim=0)[:rows]
    return x * s


def main():
    g = torch.Generator(device="cuda").manual_seed(7)
    for m, n, k in ((128, 128, 128), (200, 136, 144), (1000, 1000, 1040), (64, 512, 4096), (1, 16, 16)):
        x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).to(torch.bfloat16)
        want_bf16 = x.float() @ w.float().t()
        for scaling in ("tensor", "rowcol", "block"):
            qa, sa = weft.quantize_fp8(x, scaling, "a")
            qb, sb = weft.quantize_fp8(w, scaling, "b")
            deq = dequantize(qa, sa, scaling, "a") @ dequantize(qb, sb, scaling, "b").t()
            for out_dtype in (torch.bfloat16, torch.float32):
                got = weft.scaled_mm(qa, qb.t(), sa, sb, out_dtype=out_dtype)
                check(f"{m}x{n}x{k} {scaling} -> {out_dtype}: vs fp32 of the dequantized operands", rel(got, deq),
                      1e-2 if out_dtype == torch.bfloat16 else 2e-3)
            check(f"{m}x{n}x{k} {scaling}: vs the bf16 inputs' product (quantization error)",
                  rel(weft.scaled_mm(qa, qb.t(), sa, sb, out_dtype=torch.float32), want_bf16), 0.08)
            if scaling != "block" and n % 16 == 0:  # torch._scaled_mm's own rules (K and N multiples of 16)
                torch_sb = sb if scaling == "tensor" else sb.reshape(1, n)
                ref = torch._scaled_mm(qa, qb.t(), scale_a=sa.reshape(()) if scaling == "tensor" else sa,
                                       scale_b=torch_sb.reshape(()) if scaling == "tensor" else torch_sb,
                                       out_dtype=torch.bfloat16)
                check(f"{m}x{n}x{k} {scaling}: vs torch._scaled_mm", rel(weft.scaled_mm(qa, qb.t(), sa, sb), ref),
                      1e-2)
            # quantize_fp8: amax / 448 per group, values within e4m3's rounding.
            if scaling == "block":
                amax = x.float().abs().reshape(m, -1, 128).amax(-1) if k % 128 == 0 else None
                if amax is not None:
                    check(f"{m}x{k} block scales vs amax / 448", rel(sa, amax.clamp_min(1e-12) / 448), 1e-6)
            err = (dequantize(qa, sa, scaling, "a") - x.float()).abs()
            bound = x.float().abs() * 0.0626 + sa.max() * 2 ** -10
            check(f"{m}x{k} {scaling} quantization within e4m3's rounding (excess)", (err - bound).clamp_min(0).max().item(),
                  0)

    # The operator: torch.compile traces weft.scaled_mm without a graph break (its fake implementation), and the
    # compiled call gives the eager call's bits; a CUDA graph replays it.
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(384, 512, device="cuda", dtype=torch.bfloat16)
    qx, sx = weft.quantize_fp8(x, "block", "a")
    qw, sw = weft.quantize_fp8(w, "block", "b")
    eager = weft.scaled_mm(qx, qw.t(), sx, sw)
    compiled = torch.compile(lambda a, b, sa, sb: weft.scaled_mm(a, b, sa, sb), fullgraph=True)(qx, qw.t(), sx, sw)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = weft.scaled_mm(qx, qw.t(), sx, sw)
    graph.replay()
    torch.cuda.synchronize()
    for name, got in (("torch.compile", compiled), ("CUDA graph", replayed)):
        same = torch.equal(got, eager)
        print(f"  {'ok  ' if same else 'FAIL'} scaled_mm under {name}: {'the eager bits' if same else 'differs'}")
        if not same:
            failures.append(f"scaled_mm under {name}")

    # Block scales of A M-major (strides (1, ld): torch._scaled_mm's layout for them) give the contiguous ones'
    # bits, also with a stride past M (the rows between hold NaN, never to be read); a row-strided scale_a is
    # refused.
    for m, n, k in ((300, 256, 1040), (1, 16, 256), (129, 264, 4096)):
        x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).to(torch.bfloat16)
        qa, sa = weft.quantize_fp8(x, "block", "a")
        qb, sb = weft.quantize_fp8(w, "block", "b")
        want = weft.scaled_mm(qa, qb.t(), sa, sb)
        padded = torch.full((sa.shape[1], m + 5), float("nan"), device="cuda")
        padded[:, :m] = sa.t()
        for name, s in (("M-major", sa.t().contiguous().t()), ("M-major, stride M + 5", padded[:, :m].t())):
            same = torch.equal(weft.scaled_mm(qa, qb.t(), s, sb), want) and not want.isnan().any().item()
            print(f"  {'ok  ' if same else 'FAIL'} {m}x{n}x{k} block scales of A {name}: "
                  f"{'the contiguous ones bits' if same else 'differs'}")
            if not same:
                failures.append(f"{m}x{n}x{k} scale_a {name}")
        # quantize_fp8's m_major: the same values, strides (1, M rounded up to 4), the same product bits.
        qm, sm = weft.quantize_fp8(x, "block", "a", m_major=True)
        ld = -(-m // 4) * 4
        same = (torch.equal(qm.view(torch.uint8), qa.view(torch.uint8)) and torch.equal(sm, sa)
                and (m == 1 or sm.stride() == (1, ld)) and torch.equal(weft.scaled_mm(qm, qb.t(), sm, sb), want))
        print(f"  {'ok  ' if same else 'FAIL'} {m}x{n}x{k} quantize_fp8(m_major=True): strides {sm.stride()}, "
              f"{'the contiguous ones values and product' if same else 'differs'}")
        if not same:
            failures.append(f"{m}x{n}x{k} quantize_fp8 m_major")
        if m == 1:
            continue  # (one row: any stride is contiguous)
        wide = torch.ones(m, sa.shape[1] + 3, device="cuda")
        try:
            weft.scaled_mm(qa, qb.t(), wide[:, :sa.shape[1]], sb)
            failures.append(f"{m}x{n}x{k}: a row-strided scale_a was taken")
        except weft.WeftTypeError as e:
            if "M-major" not in str(e):
                failures.append(f"{m}x{n}x{k}: the row-strided scale_a's message does not name the M-major layout")

    # grouped_scaled_mm (an MoE's experts on FP8 rows) against scaled_mm on each group's rows: the same bits.
    # Groups of 128, 0 and 256 rows in a capacity of 512; the rows past the last end are left unwritten.
    ends = [128, 128, 384]
    x = torch.randn(512, 400, device="cuda", generator=g).to(torch.bfloat16)
    ws = (torch.randn(3, 256, 400, device="cuda", generator=g) / 20).to(torch.bfloat16)
    qx, sx = weft.quantize_fp8(x, "block", "a")
    qw, sw = weft.quantize_fp8(ws.reshape(3 * 256, 400), "block", "b")
    qw, sw = qw.reshape(3, 256, 400), sw.reshape(3, 2, -1)
    group_end = torch.tensor(ends, dtype=torch.int32, device="cuda")
    for out_dtype in (torch.bfloat16, torch.float32):
        got = weft.grouped_scaled_mm(qx, qw, group_end, sx, sw, out_dtype=out_dtype)
        same = True
        for e, (begin, end) in enumerate(zip([0] + ends[:-1], ends)):
            if end > begin:
                want = weft.scaled_mm(qx[begin:end], qw[e].t(), sx[begin:end], sw[e], out_dtype=out_dtype)
                same &= torch.equal(got[begin:end], want)
        print(f"  {'ok  ' if same else 'FAIL'} grouped_scaled_mm -> {out_dtype}: scaled_mm's bits on every group")
        if not same:
            failures.append(f"grouped_scaled_mm {out_dtype}")
        # A's scales M-major (quantize_fp8's m_major, and strides past the rows with NaN between: rows + 8 staged,
        # rows + 3 read by the consumers): the same bits.
        _, sxm = weft.quantize_fp8(x, "block", "a", m_major=True)
        padded = {}
        for extra in (8, 3):
            padded[extra] = torch.full((sx.shape[1], 512 + extra), float("nan"), device="cuda")
            padded[extra][:, :512] = sx.t()
        for name, s in (("m_major=True", sxm), ("M-major, stride rows + 8", padded[8][:, :512].t()),
                        ("M-major, stride rows + 3", padded[3][:, :512].t())):
            rows = weft.grouped_scaled_mm(qx, qw, group_end, s, sw, out_dtype=out_dtype)[:ends[-1]]
            same = torch.equal(rows, got[:ends[-1]]) and not rows.isnan().any().item()
            print(f"  {'ok  ' if same else 'FAIL'} grouped_scaled_mm -> {out_dtype}, scale_a {name}: the row-major "
                  f"scales' bits")
            if not same:
                failures.append(f"grouped_scaled_mm {out_dtype} scale_a {name}")

    # group_rows (a low-latency dispatch's fixed groups, partly filled): groups of 256 rows counting 0, 1, 130
    # and 256; the counted rows get the bits of the same call without group_rows.
    spans, counts = [256, 512, 768, 1024], [0, 1, 130, 256]
    xr = torch.randn(1024, 400, device="cuda", generator=g).to(torch.bfloat16)
    wr = (torch.randn(4, 256, 400, device="cuda", generator=g) / 20).to(torch.bfloat16)
    qxr, sxr = weft.quantize_fp8(xr, "block", "a")
    qwr, swr = weft.quantize_fp8(wr.reshape(4 * 256, 400), "block", "b")
    qwr, swr = qwr.reshape(4, 256, 400), swr.reshape(4, 2, -1)
    ends_r = torch.tensor(spans, dtype=torch.int32, device="cuda")
    counted = torch.tensor(counts, dtype=torch.int32, device="cuda")
    full = weft.grouped_scaled_mm(qxr, qwr, ends_r, sxr, swr)
    part = weft.grouped_scaled_mm(qxr, qwr, ends_r, sxr, swr, group_rows=counted)
    same = all(torch.equal(part[e * 256:e * 256 + c], full[e * 256:e * 256 + c]) for e, c in enumerate(counts))
    print(f"  {'ok  ' if same else 'FAIL'} grouped_scaled_mm with group_rows: the counted rows' bits")
    if not same:
        failures.append("grouped_scaled_mm group_rows")

    # quantize_fp8 with an activation (one pass, fp32 activation): within e4m3's rounding of torch's fp32
    # activation; M-major scales the same bits; with group_rows only the counted rows, with the full call's bits.
    F = torch.nn.functional
    xa = torch.randn(300, 2 * 260, device="cuda", generator=g).to(torch.bfloat16)
    acts = {"swiglu": lambda t: F.silu(t[:, :260]) * t[:, 260:], "silu": F.silu, "gelu": F.gelu, "relu": F.relu}
    for name, fn in acts.items():
        src = xa if name == "swiglu" else xa[:, :260].contiguous()
        q, s = weft.quantize_fp8(src, "block", "a", activation=name)
        check(f"quantize_fp8(activation={name!r}) vs torch's fp32 activation",
              rel(dequantize(q, s, "block", "a"), fn(src.float())), 0.04)
        qm, sm = weft.quantize_fp8(src, "block", "a", m_major=True, activation=name)
        same = torch.equal(qm.view(torch.uint8), q.view(torch.uint8)) and torch.equal(sm, s)
        print(f"  {'ok  ' if same else 'FAIL'} quantize_fp8(activation={name!r}, m_major=True): the same values "
              f"and scales")
        if not same:
            failures.append(f"quantize_fp8 activation {name} m_major")
    ends = torch.tensor([128, 128, 300], dtype=torch.int32, device="cuda")
    counts = torch.tensor([5, 0, 100], dtype=torch.int32, device="cuda")
    q, s = weft.quantize_fp8(xa, "block", "a", activation="swiglu")
    qc, sc = weft.quantize_fp8(xa, "block", "a", activation="swiglu", group_end=ends, group_rows=counts)
    rows = torch.cat([torch.arange(0, 5), torch.arange(128, 228)]).cuda()
    same = torch.equal(qc[rows].view(torch.uint8), q[rows].view(torch.uint8)) and torch.equal(sc[rows], s[rows])
    print(f"  {'ok  ' if same else 'FAIL'} quantize_fp8(activation='swiglu', group_rows): the counted rows' bits")
    if not same:
        failures.append("quantize_fp8 activation group_rows")

    # Refusals.
    qa = torch.zeros(64, 64, device="cuda", dtype=E4M3)
    s1 = torch.ones(1, device="cuda")
    k24 = torch.zeros(64, 24, device="cuda", dtype=E4M3)
    cases = [
        (weft.WeftTypeError, lambda: weft.scaled_mm(qa.to(torch.bfloat16), qa.t(), s1, s1)),
        (weft.WeftValueError, lambda: weft.scaled_mm(qa, qa, s1, s1)),  # b not a transposed weight
        (weft.WeftValueError, lambda: weft.scaled_mm(k24, k24.t(), s1, s1)),  # K = 24
        (weft.WeftValueError, lambda: weft.scaled_mm(qa, qa.t(), torch.ones(3, 3, device="cuda"), s1)),
        (weft.WeftTypeError, lambda: weft.quantize_fp8(torch.zeros(4, 4, device="cuda"))),
        (weft.WeftValueError, lambda: weft.quantize_fp8(torch.zeros(4, 4, device="cuda", dtype=torch.bfloat16),
                                                        "columns")),
        (weft.WeftValueError, lambda: weft.grouped_scaled_mm(qx[:500], qw, group_end, sx[:500], sw)),  # rows 500
    ]
    for i, (kind, f) in enumerate(cases):
        try:
            f()
            failures.append(f"refusal {i}: nothing raised")
            print(f"  FAIL refusal {i}: nothing raised")
        except kind as e:
            print(f"  ok   refusal {i}: {e}")
            if i == 2 and "K = 24" not in str(e):
                failures.append("refusal 2: not the K check")
    torch.cuda.synchronize()
    print(f"gpu_fp8: {'FAILED ' + ', '.join(failures) if failures else 'all passed'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
