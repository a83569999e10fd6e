"""Sequence-parallel attention on real GPUs, one process per GPU: weft's ring and Ulysses attention against
torch baselines and the ideal (single-GPU attention over the whole sequence / W).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    PYTHONPATH=build/python torchrun --nproc_per_node=W python/benchmarks/context_parallel.py [--quick]
        [--methods "weft ring,torch ring"]

Shapes: Llama3-8B-like (batch 1, 32 query / 8 K/V heads, head dim 128, causal) and 16 heads (16 K/V) of 128,
non-causal; 2k, 4k, 8k, 16k, 32k tokens per GPU (--quick: 2k, 8k); forward, and forward + backward. Then packed
documents (the common long-context training setup): lengths drawn log-uniform in 128..32k (the same on every
rank), packed to the same token counts, the Llama3-8B-like heads, causal within each document (--no-varlen:
skipped); its methods: weft's (cu_seqlens), torch ulysses with SDPA per document, and the ideal from
weft.flash_attention_varlen (torch's SDPA has no varlen form; torch ring: no packed form here).
- ideal: the faster of weft.flash_attention and torch's cuDNN SDPA over the whole sequence on one GPU, / W;
- weft ring / weft ulysses: weft.ring_attention / weft.ulysses_attention (ring layout: zigzag when causal);
  weft hybridU: weft.hybrid_attention with Ulysses size U (each 1 < U < W dividing W);
- torch ring: one NCCL send / receive of the K / V block per step (batch_isend_irecv) beside cuDNN SDPA on the
  block in hand, partial outputs merged in fp32 by their log-sum-exp (zigzag layout when causal, as
  ring-flash-attn); backward: cuDNN's backward per block with the merged output and LSE, dK / dV travelling
  the ring in fp32 one step behind the K / V;
- torch ulysses: all_to_all_single from sequence- to head-sharded (torch.distributed.nn, differentiable),
  SDPA (cuDNN preferred), all_to_all_single back.
Columns: time (max over ranks of per-rank medians, CUDA events, methods measured in turns round after round),
% of ideal (ideal / time), time over ideal (an upper bound on the exposed communication: the compute of a
rank's share is the ideal), for weft ring the exposed communication (its time minus the same kernels' with
every push only signalling, WEFT_RING_NO_COPY=1, timed in the same rounds), peak memory (torch's peak allocation over the call plus weft's workspace), max
|error| of the output (and of dQ / dK / dV for forward + backward) against the single-GPU result.
"""
import math
import os
import random
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import print_table, start, team_max, timed_alternating  # noqa: E402

import weft  # noqa: E402

aten = torch.ops.aten


# ---- one block of attention with its LSE, and its backward (torch's cuDNN kernels; [B, H, S, D]) ----------
class Sdpa:
    """cuDNN attention when it runs here (checked once against the math backend), else torch's flash."""

    def __init__(self):
        self.backend = "cudnn"
        q = torch.randn(1, 2, 256, 128, device="cuda", dtype=torch.bfloat16)
        try:
            out, lse, ctx = self.forward(q, q, q, True, 0.1)
            dq, _, _ = self.backward(torch.ones_like(out), q, q, q, out, lse, ctx, True, 0.1)
            want = F.scaled_dot_product_attention(q.float(), q.float(), q.float(), is_causal=True, scale=0.1)
            if not (out.float() - want).abs().max().item() < 2e-2 or not torch.isfinite(dq).all():
                raise RuntimeError("cuDNN attention differs from the math backend")
        except Exception:  # noqa: BLE001  (whatever stops cuDNN here: use flash)
            self.backend = "flash"

    def forward(self, q, k, v, causal, scale):
        if self.backend == "cudnn":
            r = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
        else:
            r = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return r[0], r[1], r

    def backward(self, dout, q, k, v, out, lse, r, causal, scale):
        if self.backend == "cudnn":
            return aten._scaled_dot_product_cudnn_attention_backward(
                dout, q, k, v, out, lse, r[6], r[7], None, r[2], r[3], r[4], r[5], 0.0, causal, scale=scale)
        return aten._scaled_dot_product_flash_attention_backward(dout, q, k, v, out, lse, r[2], r[3], r[4], r[5],
                                                                 0.0, causal, r[6], r[7], scale=scale)


def heads_of(x, heads):
    """K / V [B, KV, n, D] repeated to the query heads (GQA) for kernels that need one K / V head per query."""
    kv = x.shape[1]
    return x if kv == heads else x.repeat_interleave(heads // kv, dim=1)


def kv_heads_of(dx, kv):
    """A gradient over repeated K / V heads summed back to the KV heads (fp32)."""
    b, h, n, d = dx.shape
    return dx.float().view(b, kv, h // kv, n, d).sum(2)


class TorchRing:
    """Ring attention from torch pieces: K / V blocks travel the ring (NCCL P2P) while SDPA runs on the block in
    hand. Inputs [B, n, H, D] in ring_shard's layout (zigzag when causal)."""

    def __init__(self, sdpa, rank, world, causal, scale):
        self.sdpa, self.rank, self.world, self.causal, self.scale = sdpa, rank, world, causal, scale
        self.next, self.prev = (rank + 1) % world, (rank - 1) % world

    def exchange(self, send, recv):
        if self.world == 1:
            return []
        ops = [dist.P2POp(dist.isend, send, self.next), dist.P2POp(dist.irecv, recv, self.prev)]
        return dist.batch_isend_irecv(ops)

    def blocks(self, step, n):
        """(query rows, key rows, causal) of step `step`: the block from rank (rank - step) mod W."""
        full = slice(0, n)
        if not self.causal:
            return full, full, False
        if step == 0:
            return full, full, True
        src = (self.rank - step) % self.world
        half = n // 2
        if src < self.rank:  # its first part precedes both of ours; its second follows both
            return full, slice(0, half), False
        return slice(half, n), full, False  # both its parts precede our second and follow our first

    def forward(self, q, k, v):
        """q [B, n, H, D], k / v [B, n, KV, D] -> out [B, n, H, D] bf16, lse [B, H, n] fp32, and each step's
        kernel state (what its backward takes besides the tensors: RNG state, lengths, the LSE's layout)."""
        b, n, h, d = q.shape
        qt = q.transpose(1, 2).contiguous()
        kv = torch.stack((k.transpose(1, 2), v.transpose(1, 2))).contiguous()  # [2, B, KV, n, D]
        out = torch.zeros(b, h, n, d, device=q.device, dtype=torch.float32)
        lse = torch.full((b, h, n), -math.inf, device=q.device, dtype=torch.float32)
        nxt = torch.empty_like(kv)
        states = []
        for step in range(self.world):
            reqs = self.exchange(kv, nxt) if step < self.world - 1 else []
            rows, cols, causal = self.blocks(step, n)
            o, l, state = self.sdpa.forward(qt[:, :, rows].contiguous(), heads_of(kv[0][:, :, cols], h).contiguous(),
                                        heads_of(kv[1][:, :, cols], h).contiguous(), causal, self.scale)
            states.append((state, l.dim()))
            l = l.view(b, h, -1).float()
            new = torch.logaddexp(lse[:, :, rows], l)
            out[:, :, rows] = out[:, :, rows] * torch.exp(lse[:, :, rows] - new).unsqueeze(-1) + \
                o.float() * torch.exp(l - new).unsqueeze(-1)
            lse[:, :, rows] = new
            for r in reqs:
                r.wait()
            kv, nxt = nxt, kv
        return out.to(q.dtype).transpose(1, 2), lse, states

    def backward(self, dout, q, k, v, out, lse, states):
        """dQ, dK, dV ([B, n, heads, D] like q, k, v) of forward's output."""
        b, n, h, d = q.shape
        kvh = k.shape[2]
        qt, dot, ot = (x.transpose(1, 2).contiguous() for x in (q, dout, out))
        kv = torch.stack((k.transpose(1, 2), v.transpose(1, 2))).contiguous()
        nxt = torch.empty_like(kv)
        dq = torch.zeros(b, h, n, d, device=q.device, dtype=torch.float32)
        dkv_recv = torch.empty(2, b, kvh, n, d, device=q.device, dtype=torch.float32)
        pending = []
        for step in range(self.world):
            reqs = self.exchange(kv, nxt) if step < self.world - 1 else []
            rows, cols, causal = self.blocks(step, n)
            kb, vb = heads_of(kv[0][:, :, cols], h), heads_of(kv[1][:, :, cols], h)
            qb = qt[:, :, rows]
            lb = lse[:, :, rows].contiguous()
            state, lse_dim = states[step]
            if lse_dim == 4:  # the kernel's LSE layout: [B, H, n, 1]
                lb = lb.unsqueeze(-1)
            gq, gk, gv = self.sdpa.backward(dot[:, :, rows].contiguous(), qb.contiguous(), kb.contiguous(),
                                            vb.contiguous(), ot[:, :, rows].contiguous(), lb, state, causal,
                                            self.scale)
            dq[:, :, rows] += gq.float()
            part = torch.zeros(2, b, kvh, n, d, device=q.device, dtype=torch.float32)
            part[0][:, :, cols] = kv_heads_of(gk, kvh)
            part[1][:, :, cols] = kv_heads_of(gv, kvh)
            for r_ in pending:
                r_.wait()
            if step > 0:
                part += dkv_recv
            # The block's dK / dV so far go on to the next rank, which works on this block next step; the one
            # after the last step reaches the block's owner.
            nxt_dkv = torch.empty_like(dkv_recv)
            sent = part  # noqa: F841  (alive until the send is waited on)
            pending = self.exchange(part, nxt_dkv) if self.world > 1 else []
            dkv_recv = nxt_dkv if self.world > 1 else part
            for r_ in reqs:
                r_.wait()
            kv, nxt = nxt, kv
        for r_ in pending:
            r_.wait()
        dk, dv = dkv_recv[0], dkv_recv[1]
        return (dq.to(q.dtype).transpose(1, 2), dk.to(k.dtype).transpose(1, 2), dv.to(v.dtype).transpose(1, 2))


def to_heads(x, world):
    """Ulysses' first all-to-all (differentiable): [B, n, X, D] contiguous shards of the sequence -> [B, W n, X / W, D]
    (fewer K / V heads than ranks: replicated first)."""
    from torch.distributed.nn.functional import all_to_all_single
    b, n, hx, d = x.shape
    if hx % world:
        x = x.repeat_interleave(world // math.gcd(world, hx), dim=2)
        hx = x.shape[2]
    send = x.reshape(b, n, world, hx // world, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = all_to_all_single(torch.empty_like(send), send)
    return recv.permute(1, 0, 2, 3, 4).reshape(b, world * n, hx // world, d)


def to_sequence(o, world):
    """Ulysses' second all-to-all: [B, S, H / W, D] -> this rank's contiguous rows [B, S / W, H, D]."""
    from torch.distributed.nn.functional import all_to_all_single
    b, s, hw, d = o.shape
    n = s // world
    send = o.reshape(b, world, n, hw, d).permute(1, 0, 2, 3, 4).contiguous()  # [W, B, n, H / W, D]
    recv = all_to_all_single(torch.empty_like(send), send)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, n, world * hw, d)


def torch_ulysses(q, k, v, causal, world):
    """[B, n, H, D] contiguous shards of the sequence -> all-to-all -> SDPA over [B, S, H / W, D] -> back."""
    qh, kh, vh = to_heads(q, world), to_heads(k, world), to_heads(v, world)
    o = F.scaled_dot_product_attention(qh.transpose(1, 2), kh.transpose(1, 2), vh.transpose(1, 2), is_causal=causal,
                                       enable_gqa=kh.shape[2] != qh.shape[2]).transpose(1, 2)
    return to_sequence(o, world)


def torch_ulysses_varlen(q, k, v, docs, world):
    """Packed documents: [n, H, D] contiguous shards of the packed sequence -> all-to-all -> causal SDPA per
    document (offsets `docs`) -> back."""
    qh, kh, vh = (to_heads(x.unsqueeze(0), world)[0].transpose(0, 1) for x in (q, k, v))  # [X / W, S, D]
    gqa = kh.shape[0] != qh.shape[0]
    parts = [F.scaled_dot_product_attention(qh[None, :, b:e], kh[None, :, b:e], vh[None, :, b:e], is_causal=True,
                                            enable_gqa=gqa)[0] for b, e in zip(docs[:-1], docs[1:])]
    return to_sequence(torch.cat(parts, dim=1).transpose(0, 1).unsqueeze(0), world)[0]


def timed_calls(methods, inputs, leaves):
    """(fwd(m), fwd_bwd(m)): method m's forward (no grad) and forward + backward on its inputs, as callables to
    time, SDPA preferring cuDNN inside."""
    def fwd(m):
        _, f = methods[m]
        q, k, v, _ = inputs[m]

        def run():
            with torch.no_grad(), sdpa_preferring_cudnn():
                f(q, k, v)
        return run

    def fwd_bwd(m):
        _, f = methods[m]
        q, k, v = leaves[m]
        do = inputs[m][3]

        def run():
            with sdpa_preferring_cudnn():
                torch.autograd.grad(f(q, k, v), (q, k, v), do)
        return run
    return fwd, fwd_bwd


def sdpa_preferring_cudnn():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    try:
        return sdpa_kernel(order, set_priority=True)
    except TypeError:
        return sdpa_kernel(order)


class TorchRingFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring):
        out, lse, ctx.states = ring.forward(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return (*ctx.ring.backward(dout, q, k, v, out, lse, ctx.states), None)


def main():
    quick = "--quick" in sys.argv
    only = sys.argv[sys.argv.index("--methods") + 1].split(",") if "--methods" in sys.argv else None
    comm, rank, world = start("sequence-parallel attention")
    sdpa = Sdpa()
    if rank == 0:
        print(f"torch ring's blocks: {sdpa.backend}", flush=True)
    per_gpu = [2048, 8192] if quick else [2048, 4096, 8192, 16384, 32768]
    shapes = [("Llama3-8B-like, 32 / 8 heads, causal", 32, 8, True), ("16 / 16 heads, non-causal", 16, 16, False)]
    for label, h, kvh, causal in shapes:
        rows_out = []
        for n in per_gpu:
            rows_out += bench_shape(sdpa, comm, rank, world, n, h, kvh, causal, only)
        print_table(f"{label}, head dim 128, bf16, {world} GPUs: % of ideal = (single-GPU time / W) / time",
                    rows_out)
    if "--no-varlen" not in sys.argv:
        rows_out = []
        for n in per_gpu:
            rows_out += bench_varlen(rank, world, n, 32, 8, only)
        print_table(f"packed documents (128..32k tokens), 32 / 8 heads, causal, head dim 128, bf16, {world} GPUs: "
                    "% of ideal = (weft's single-GPU varlen time / W) / time", rows_out)
    dist.destroy_process_group()


def documents(total, seed):
    """Offsets [0, l0, l0 + l1, ..., total] of documents of lengths log-uniform in 128..32k (the last one cut
    to fill `total`): the same on every rank."""
    rng, offsets = random.Random(seed), [0]
    while offsets[-1] < total:
        offsets.append(min(total, offsets[-1] + int(2 ** rng.uniform(7, 15))))
    return offsets


def bench_varlen(rank, world, n, h, kvh, only):
    """The packed-documents case: every method's forward and forward + backward against the ideal."""
    d = 128
    s = n * world
    docs = documents(s, 4321 + n)
    longest = max(e - b for b, e in zip(docs[:-1], docs[1:]))
    cu = torch.tensor(docs, dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(99 + n)
    full = [torch.randn(s, x, d, device="cuda", dtype=torch.bfloat16, generator=g) for x in (h, kvh, kvh, h)]
    Q, K, V, DO = full
    Qr, Kr, Vr = (x.clone().requires_grad_() for x in (Q, K, V))

    def single(q, k, v):
        return weft.flash_attention_varlen(q, k, v, cu, cu, longest, longest, causal=True)

    ref_out = single(Qr, Kr, Vr)
    ref_grads = torch.autograd.grad(ref_out, (Qr, Kr, Vr), DO)
    zig = torch.tensor(weft.ring_shard_indices(world, rank, True, cu_seqlens=docs), device="cuda")
    cont = torch.arange(rank * n, (rank + 1) * n, device="cuda")
    methods = {
        "weft ring": (zig, lambda q, k, v: weft.ring_attention(q, k, v, causal=True, cu_seqlens=docs)),
        "weft ulysses": (zig, lambda q, k, v: weft.ulysses_attention(q, k, v, causal=True, cu_seqlens=docs)),
        "torch ulysses": (cont, lambda q, k, v: torch_ulysses_varlen(q, k, v, docs, world)),
    }
    if h % world or (kvh % world and world % kvh):
        del methods["weft ulysses"]
    for u in range(2, world):
        if world % u == 0 and h % u == 0 and not (kvh % u and u % kvh):
            methods[f"weft hybrid{u}"] = (zig, lambda q, k, v, u=u: weft.hybrid_attention(q, k, v, u, causal=True,
                                                                                          cu_seqlens=docs))
    methods = {m: x for m, x in methods.items() if only is None or m in only}
    inputs = {m: [x.index_select(0, idx).contiguous() for x in full] for m, (idx, _) in methods.items()}
    leaves = {m: [x.clone().requires_grad_() for x in inputs[m][:3]] for m in methods}
    errors = {}
    for m, (idx, f) in methods.items():
        q, k, v = leaves[m]
        out = f(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), inputs[m][3])
        e_out = (out.float() - ref_out.index_select(0, idx).float()).abs().max().item()
        e_grad = max((gx.float() - rx.index_select(0, idx).float()).abs().max().item()
                     for gx, rx in zip(grads, ref_grads))
        errors[m] = (team_max(e_out), team_max(e_grad))

    fwd, fwd_bwd = timed_calls(methods, inputs, leaves)
    iters, rounds = (3, 2) if s >= 32768 else (10, 3)
    fwd_ms = timed_alternating({"single": lambda: single(Q, K, V), **{m: fwd(m) for m in methods}}, iters,
                               rounds=rounds, reps=3)
    bwd_ms = timed_alternating({"single": lambda: torch.autograd.grad(single(Qr, Kr, Vr), (Qr, Kr, Vr), DO),
                                **{m: fwd_bwd(m) for m in methods}}, iters, rounds=rounds, reps=3)
    ideal_f, ideal_b = fwd_ms["single"] / 1e3 / world, bwd_ms["single"] / 1e3 / world
    rows = []
    for m in methods:
        tf, tb = fwd_ms[m] / 1e3, bwd_ms[m] / 1e3
        rows.append({"tokens / GPU": n, "documents": len(docs) - 1, "method": m, "fwd ms": f"{tf:.3f}",
                     "fwd % ideal": f"{100 * ideal_f / tf:.1f}", "fwd+bwd ms": f"{tb:.3f}",
                     "fwd+bwd % ideal": f"{100 * ideal_b / tb:.1f}", "max err out": f"{errors[m][0]:.2e}",
                     "max err dq/dk/dv": f"{errors[m][1]:.2e}"})
    rows.append({"tokens / GPU": n, "documents": len(docs) - 1, "method": "ideal (weft varlen single / W)",
                 "fwd ms": f"{ideal_f:.3f}", "fwd+bwd ms": f"{ideal_b:.3f}"})
    if rank == 0:
        print(f"  packed documents, {n} tokens / GPU done", flush=True)
    return rows


def bench_shape(sdpa, comm, rank, world, n, h, kvh, causal, only):
    d, b = 128, 1
    s = n * world
    scale = 1.0 / math.sqrt(d)
    g = torch.Generator(device="cuda").manual_seed(1234 + n)
    full = [torch.randn(b, s, x, d, device="cuda", dtype=torch.bfloat16, generator=g) for x in (h, kvh, kvh, h)]
    Q, K, V, DO = full
    # The single-GPU result and its gradients (weft's kernel, checked by the suite against fp32 and SDPA).
    Qr, Kr, Vr = (x.clone().requires_grad_() for x in (Q, K, V))
    ref_out = weft.flash_attention(Qr, Kr, Vr, causal=causal)
    ref_grads = torch.autograd.grad(ref_out, (Qr, Kr, Vr), DO)
    zig = torch.tensor(weft.ring_shard_indices(world, rank, causal, seq_len=s), device="cuda")
    cont = torch.arange(rank * n, (rank + 1) * n, device="cuda")

    def shard(x, idx):
        return x.index_select(1, idx).contiguous()

    ring = TorchRing(sdpa, rank, world, causal, scale)
    methods = {  # name -> (rows of the sequence it holds, forward(q, k, v) -> out)
        "weft ring": (zig, lambda q, k, v: weft.ring_attention(q, k, v, causal=causal)),
        "weft ulysses": (zig, lambda q, k, v: weft.ulysses_attention(q, k, v, causal=causal)),
        "torch ring": (zig, lambda q, k, v: TorchRingFn.apply(q, k, v, ring)),
        "torch ulysses": (cont, lambda q, k, v: torch_ulysses(q, k, v, causal, world)),
    }
    if h % world or (kvh % world and world % kvh):
        del methods["weft ulysses"]
    for u in range(2, world):  # the hybrid at every Ulysses size between the two
        if world % u == 0 and h % u == 0 and not (kvh % u and u % kvh):
            methods[f"weft hybrid{u}"] = (zig, lambda q, k, v, u=u: weft.hybrid_attention(q, k, v, u, causal=causal))
    methods = {m: x for m, x in methods.items() if only is None or m in only}
    inputs = {m: [shard(x, idx) for x in full] for m, (idx, _) in methods.items()}
    leaves = {m: [x.clone().requires_grad_() for x in inputs[m][:3]] for m in methods}

    def single_weft_fwd():
        weft.flash_attention(Q, K, V, causal=causal)

    def single_cudnn_fwd():
        with sdpa_preferring_cudnn():
            F.scaled_dot_product_attention(Q.transpose(1, 2), K.transpose(1, 2), V.transpose(1, 2), is_causal=causal,
                                           enable_gqa=h != kvh)

    def single_weft_bwd():
        torch.autograd.grad(weft.flash_attention(Qr, Kr, Vr, causal=causal), (Qr, Kr, Vr), DO)

    def single_cudnn_bwd():
        with sdpa_preferring_cudnn():
            o = F.scaled_dot_product_attention(Qr.transpose(1, 2), Kr.transpose(1, 2), Vr.transpose(1, 2),
                                               is_causal=causal, enable_gqa=h != kvh)
            torch.autograd.grad(o, (Qr, Kr, Vr), DO.transpose(1, 2))

    fwd, fwd_bwd = timed_calls(methods, inputs, leaves)

    # Errors (and a first call of each, outside the timing) against the single-GPU result's rows.
    errors, peaks = {}, {}
    for m, (idx, f) in methods.items():
        q, k, v = leaves[m]
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with sdpa_preferring_cudnn():
            out = f(q, k, v)
            grads = torch.autograd.grad(out, (q, k, v), inputs[m][3])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        if m.startswith("weft"):
            method = m.split()[1].replace("hybrid", "hybrid:")
            peak += max(weft._weft.context_attention_workspace_bytes(method, world, [s], causal, h, kvh, d, bw)
                        for bw in (False, True))
        peaks[m] = team_max(peak / 2**30)
        e_out = (out.float() - shard(ref_out, idx).float()).abs().max().item()
        e_grad = max((gx.float() - shard(rx, idx).float()).abs().max().item() for gx, rx in zip(grads, ref_grads))
        errors[m] = (team_max(e_out), team_max(e_grad))
        del out, grads

    def no_copy(run):  # the ring kernels without data movement (wrong results: timing only)
        def wrapped():
            os.environ["WEFT_RING_NO_COPY"] = "1"
            try:
                run()
            finally:
                del os.environ["WEFT_RING_NO_COPY"]
        return wrapped

    ring_no_copy = "weft ring" in methods
    iters, rounds = (3, 2) if n * world >= 32768 else (10, 3)
    fwd_ms = timed_alternating({"single weft": single_weft_fwd, "single cudnn": single_cudnn_fwd,
                                **{m: fwd(m) for m in methods},
                                **({"no copy": no_copy(fwd("weft ring"))} if ring_no_copy else {})},
                               iters, rounds=rounds, reps=3)
    bwd_ms = timed_alternating({"single weft": single_weft_bwd, "single cudnn": single_cudnn_bwd,
                                **{m: fwd_bwd(m) for m in methods},
                                **({"no copy": no_copy(fwd_bwd("weft ring"))} if ring_no_copy else {})},
                               iters, rounds=rounds, reps=3)
    fwd_ms = {k: x / 1e3 for k, x in fwd_ms.items()}
    bwd_ms = {k: x / 1e3 for k, x in bwd_ms.items()}
    ideal_f = min(fwd_ms["single weft"], fwd_ms["single cudnn"]) / world
    ideal_b = min(bwd_ms["single weft"], bwd_ms["single cudnn"]) / world
    rows = []
    for m in methods:
        tf, tb = fwd_ms[m], bwd_ms[m]
        rows.append({"tokens / GPU": n, "method": m, "fwd ms": f"{tf:.3f}", "fwd % ideal": f"{100 * ideal_f / tf:.1f}",
                     "fwd over ideal ms": f"{tf - ideal_f:.3f}", "fwd+bwd ms": f"{tb:.3f}",
                     "fwd+bwd % ideal": f"{100 * ideal_b / tb:.1f}", "fwd+bwd over ideal ms": f"{tb - ideal_b:.3f}",
                     "exposed comm fwd / fwd+bwd ms":
                         f"{tf - fwd_ms['no copy']:.3f} / {tb - bwd_ms['no copy']:.3f}" if m == "weft ring" else "",
                     "peak GiB": f"{peaks[m]:.2f}", "max err out": f"{errors[m][0]:.2e}",
                     "max err dq/dk/dv": f"{errors[m][1]:.2e}"})
    rows.append({"tokens / GPU": n, "method": "ideal (single / W)", "fwd ms": f"{ideal_f:.3f}",
                 "fwd+bwd ms": f"{ideal_b:.3f}",
                 "fwd % ideal": f"single: weft {fwd_ms['single weft']:.2f}, cuDNN {fwd_ms['single cudnn']:.2f} ms",
                 "fwd+bwd % ideal": f"single: weft {bwd_ms['single weft']:.2f}, cuDNN {bwd_ms['single cudnn']:.2f} ms"})
    if rank == 0:
        print(f"  {n} tokens / GPU done", flush=True)
    return rows


if __name__ == "__main__":
    main()
