"""GPU test of weft.flash_attention and flash_attention_varlen (forward and autograd backward, bf16 and fp16)
against an fp32 reference, one GPU:

    PYTHONPATH=build/python python3 python/tests/gpu_attention.py

For every case the reference is torch's math attention in fp32 on the same bf16 inputs (with an explicit
bottom-right causal mask); weft passes when the relative error (Frobenius norm) of its output and of its
three gradients is at most twice that of torch SDPA in the inputs' type on the same inputs (and below 2e-2), NaN never.
Also: wrong shapes, dtypes and devices are refused with WeftValueError / WeftTypeError.
"""
import sys

import torch
import torch.nn.functional as F

import weft


def reference(q, k, v, causal, scale, dtype):
    """SDPA in [batch, heads, seq, dim] on q, k, v cast to dtype; outputs in [batch, seq, heads, dim]."""
    sq, sk = q.shape[1], k.shape[1]
    mask = None
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        mask = j <= i + (sk - sq)
    qt, kt, vt = (x.detach().to(dtype).transpose(1, 2).requires_grad_(True) for x in (q, k, v))
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=k.shape[2] != q.shape[2])
    return out, (qt, kt, vt)


def rel(got, want):
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()


def run_case(b, sq, sk, h, kvh, d, causal, scale, g, dt=torch.bfloat16):
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dt, generator=g).requires_grad_(True)
    k = torch.randn(b, sk, kvh, d, device="cuda", dtype=dt, generator=g).requires_grad_(True)
    v = torch.randn(b, sk, kvh, d, device="cuda", dtype=dt, generator=g).requires_grad_(True)
    dout = torch.randn(b, sq, h, d, device="cuda", dtype=dt, generator=g)
    s = scale if scale is not None else d ** -0.5
    # Rows that see no key (causal, seq_q > seq_k: the first seq_q - seq_k) get 0 from weft, NaN from SDPA:
    # they are checked to be 0, the references run on the other rows (the mask keeps its form on them).
    first = max(0, sq - sk) if causal else 0

    out = weft.flash_attention(q, k, v, causal=causal, softmax_scale=scale)
    out.backward(dout)
    ours = [out.detach()[:, first:], q.grad[:, first:], k.grad, v.grad]
    zero_rows = [out.detach()[:, :first], q.grad[:, :first]]
    want_out, want_in = reference(q[:, first:], k, v, causal, s, torch.float32)
    want_out.backward(dout[:, first:].float().transpose(1, 2))
    want = [want_out.detach().transpose(1, 2)] + [x.grad.transpose(1, 2) for x in want_in]
    sdpa_out, sdpa_in = reference(q[:, first:], k, v, causal, s, dt)
    sdpa_out.backward(dout[:, first:].transpose(1, 2))
    sdpa = [sdpa_out.detach().transpose(1, 2)] + [x.grad.transpose(1, 2) for x in sdpa_in]

    fp16 = " fp16" if dt == torch.float16 else ""
    line = f"B={b} Sq={sq} Sk={sk} H={h}/{kvh} D={d}{' causal' if causal else ''}{fp16}:"
    failures = []
    if any(z.numel() and (z != 0).any() for z in zero_rows):
        failures.append("rows that see no key are not 0")
    for name, o, w, t in zip(("out", "dq", "dk", "dv"), ours, want, sdpa):
        e, te = rel(o, w), rel(t, w)
        line += f" {name} {e:.2e} (sdpa {te:.2e})"
        if not (e <= 2 * te + 1e-6 and e <= 2e-2):
            failures.append(f"{name}: relative error {e:.3e}, SDPA's {te:.3e}")
    print(line, flush=True)
    return failures


def run_varlen_case(lengths, h, kvh, d, causal, g, dt=torch.bfloat16):
    """weft.flash_attention_varlen on a packed batch against the references run per sequence."""
    lq = [a for a, _ in lengths]
    lk = [b for _, b in lengths]
    cu_q = torch.tensor([0] + list(torch.tensor(lq).cumsum(0)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(torch.tensor(lk).cumsum(0)), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lq), h, d, device="cuda", dtype=dt, generator=g).requires_grad_(True)
    k = torch.randn(sum(lk), kvh, d, device="cuda", dtype=dt, generator=g).requires_grad_(True)
    v = torch.randn(sum(lk), kvh, d, device="cuda", dtype=dt, generator=g).requires_grad_(True)
    dout = torch.randn(sum(lq), h, d, device="cuda", dtype=dt, generator=g)
    out, lse = weft.flash_attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal, return_lse=True)
    out.backward(dout)
    ours = [out.detach(), q.grad, k.grad, v.grad]
    want, sdpa = [[], [], [], []], [[], [], [], []]
    s = d ** -0.5
    for b in range(len(lengths)):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        for dtype, dest in ((torch.float32, want), (dt, sdpa)):
            o, ins = reference(q[None, qs], k[None, ks], v[None, ks], causal, s, dtype)
            o.backward(dout[None, qs].to(dtype).transpose(1, 2))
            for i, x in enumerate([o.detach()] + [x.grad for x in ins]):
                dest[i].append(x.transpose(1, 2)[0])
    fp16 = " fp16" if dt == torch.float16 else ""
    line = f"varlen {lengths} H={h}/{kvh} D={d}{' causal' if causal else ''}{fp16}:"
    failures = []
    for name, o, w, t in zip(("out", "dq", "dk", "dv"), ours, want, sdpa):
        e, te = rel(o, torch.cat(w)), rel(torch.cat(t), torch.cat(w))
        line += f" {name} {e:.2e} (sdpa {te:.2e})"
        if not (e <= 2 * te + 1e-6 and e <= 2e-2):
            failures.append(f"{name}: relative error {e:.3e}, SDPA's {te:.3e}")
    if tuple(lse.shape) != (h, sum(lq)) or not torch.isfinite(lse).all():
        failures.append(f"lse: shape {tuple(lse.shape)} (want {(h, sum(lq))}) or not finite")
    print(line, flush=True)
    return failures


def expect_error(kind, fn, part):
    try:
        fn()
    except kind as e:
        if part not in str(e):
            raise AssertionError(f"expected an error naming {part!r}, got {e}")
        return
    raise AssertionError(f"expected {kind.__name__} naming {part!r}, nothing raised")


def main():
    torch.cuda.set_device(0)
    g = torch.Generator(device="cuda").manual_seed(1234)
    cases = [
        (2, 1000, 1000, 8, 2, 128, True, None),
        (2, 1000, 1000, 8, 8, 128, False, None),
        (1, 17, 1000, 8, 1, 64, True, None),
        (2, 513, 513, 4, 4, 64, False, 0.3),
        (1, 300, 129, 4, 2, 64, True, None),
        (1, 1, 64, 2, 1, 128, False, None),
        (1, 600, 300, 4, 4, 128, True, None),
        (1, 4099, 4099, 2, 1, 128, True, None),
    ]
    failures = []
    for c in cases:
        failures += [f"{c}: {f}" for f in run_case(*c, g)]
    varlen_cases = [
        ([(1, 1), (17, 17), (1000, 1000), (300, 300), (513, 513)], 8, 2, 128, True),
        ([(1, 5), (17, 200), (1000, 64), (129, 129)], 4, 4, 64, False),
        ([(4096, 4096), (1, 1), (2000, 2000)], 4, 1, 64, True),
        ([(64, 64), (127, 127), (3000, 3000)], 2, 2, 128, False),
    ]
    for c in varlen_cases:
        failures += [f"varlen {c}: {f}" for f in run_varlen_case(*c, g)]
    # fp16 inputs, dense and packed.
    for c in [(2, 1000, 1000, 8, 2, 128, True, None), (1, 300, 129, 4, 2, 64, False, None)]:
        failures += [f"fp16 {c}: {f}" for f in run_case(*c, g, torch.float16)]
    failures += [f"fp16 varlen: {f}" for f in run_varlen_case([(1, 1), (700, 700), (65, 65)], 4, 2, 64, True, g,
                                                               torch.float16)]
    # deterministic=True: the same gradients, bit for bit, in two runs.
    grads = []
    for _ in range(2):
        q, k, v = (torch.randn(2, 700, h, 128, device="cuda", dtype=torch.bfloat16,
                               generator=torch.Generator(device="cuda").manual_seed(7 + i)).requires_grad_(True)
                   for i, h in enumerate((8, 2, 2)))
        weft.flash_attention(q, k, v, causal=True, deterministic=True).sum().backward()
        grads.append([q.grad, k.grad, v.grad])
    if not all(torch.equal(a, b) for a, b in zip(*grads)):
        failures.append("deterministic=True: two backward runs differ")
    print("deterministic backward: two runs " + ("differ" if failures and "deterministic" in failures[-1]
                                                  else "bit-identical"), flush=True)
    cu = torch.tensor([0, 16], dtype=torch.int32, device="cuda")
    y = torch.zeros(16, 2, 128, device="cuda", dtype=torch.bfloat16)
    expect_error(weft.WeftValueError, lambda: weft.flash_attention_varlen(y, y, y, cu.long(), cu, 16, 16), "int32")
    expect_error(weft.WeftValueError, lambda: weft.flash_attention_varlen(y, y, y, cu, cu[:1], 16, 16),
                 "batch + 1")
    expect_error(weft.WeftValueError, lambda: weft.flash_attention_varlen(y, y, y, cu, cu, 17, 16), "max_seqlen")
    expect_error(weft.WeftValueError, lambda: weft.flash_attention_varlen(y[None], y, y, cu, cu, 16, 16), "3-d")
    x = torch.zeros(1, 16, 2, 128, device="cuda", dtype=torch.bfloat16)
    expect_error(weft.WeftValueError, lambda: weft.flash_attention(x, x, x[:, :, :1, :64]), "one shape")
    expect_error(weft.WeftValueError, lambda: weft.flash_attention(x[..., :96], x[..., :96], x[..., :96]),
                 "dim must be 64 or 128")
    expect_error(weft.WeftTypeError, lambda: weft.flash_attention(x.float(), x.float(), x.float()), "bf16")
    expect_error(weft.WeftValueError, lambda: weft.flash_attention(x.cpu(), x.cpu(), x.cpu()), "CUDA")
    expect_error(weft.WeftValueError, lambda: weft.flash_attention(x, x[:, :, :1].repeat(1, 1, 3, 1)[:, :, :3],
                                                                    x[:, :, :1].repeat(1, 1, 3, 1)[:, :, :3]),
                 "multiple of kv_heads")
    # Ring attention's shard / unshard helpers: a round trip, zigzag and packed documents.
    seq = torch.randn(2, 37, 3, 8, device="cuda")
    for world in (2, 3, 8):
        for causal in (False, True):
            for cu in (None, [0, 5, 5, 30, 37]):
                shards = [weft.ring_shard(seq, world, r, causal, dim=1, cu_seqlens=cu) for r in range(world)]
                back = weft.ring_unshard(shards, causal, dim=1, cu_seqlens=cu)
                if not torch.equal(back, seq):
                    failures.append(f"ring_shard / ring_unshard round trip, world {world}, causal {causal}, "
                                    f"cu_seqlens {cu}")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        sys.exit(1)
    print("weft.flash_attention, flash_attention_varlen: all cases passed")


if __name__ == "__main__":
    main()
