"""GPU tests of weft's torch operators on a virtual team (W ranks on one GPU, one process, no launcher):

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    PYTHONPATH=build/python python3 python/tests/gpu_team.py [W ...]      # default W = 2 and 4

- every collective and TP matmul op: outputs and gradients (autograd) against plain torch in fp32 on the
  whole team's data, random inputs, several shapes and both weight layouts;
- the TP MLP block (all_gather_matmul, gelu, matmul_reduce_scatter): loss and gradients against plain torch
  on the gathered data; torch.compile(fullgraph=True) against eager (outputs and gradients); a CUDA graph
  per rank captured with torch.cuda.graph and replayed on new inputs;
- ring attention and flash attention under torch.compile(fullgraph=True) against eager;
- an MoE layer (dispatch, per-expert scaling on the GPU, combine): eager against the direct weighted sum,
  torch.compile(fullgraph=True) against eager;
- errors: the default stream on a virtual rank, bad operands through the torch path;
- plain eager calls skip torch's operator dispatch (and only they), with the operator's result.
Prints one line per case; exits non-zero on the first failure.
"""
import os
import sys

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")  # before CUDA starts (weft.virtual_team checks)

import torch
import torch.nn.functional as F

import weft

TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-5}
cases = 0


def check(name, got, want, tol):
    global cases
    got, want = got.float(), want.float()
    if got.shape != want.shape:
        raise AssertionError(f"{name}: shape {tuple(got.shape)}, want {tuple(want.shape)}")
    if torch.isnan(got).any():
        raise AssertionError(f"{name}: NaN in the result")
    err = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
    if not err <= tol:
        raise AssertionError(f"{name}: relative error {err:.3e} > {tol:.0e} (norms: got {got.norm().item():.4e}, "
                             f"want {want.norm().item():.4e})")
    cases += 1


def leaves(tensors, dtype=None):
    return [t.detach().clone().to(dtype or t.dtype).requires_grad_() for t in tensors]


def warm_run_backward(team, fn, ours, grads):
    """fn(comm, rank's inputs) on every rank once to warm up, then again from cleared gradients, and the
    backward of the outputs with `grads`; returns the outputs."""
    team.warmup(fn, ours)
    for ins in ours:
        for t in ins:
            t.grad = None
    outs = team.run(fn, ours)
    torch.autograd.backward(outs, grads)
    return outs


def against_torch(team, name, weft_fn, ref_fn, inputs, tol):
    """Runs weft_fn(comm, *rank_inputs) on every rank and ref_fn(list of every rank's fp32 inputs) -> list of
    per-rank outputs; compares outputs, then the gradients of sum_r <out_r, g_r> for random g."""
    ours = [leaves(ins) for ins in inputs]
    refs = [leaves(ins, torch.float32) for ins in inputs]
    team.warmup(lambda c, ins: weft_fn(c, *ins), ours)
    outs = team.run(lambda c, ins: weft_fn(c, *ins), ours)
    want = ref_fn(refs)
    for r in range(team.world_size):
        check(f"{name}: rank {r} output", outs[r], want[r], tol)
    grads = [torch.randn_like(o) for o in outs]
    torch.autograd.backward(outs, grads)
    torch.autograd.backward(want, [g.float() for g in grads])
    for r in range(team.world_size):
        for i, (a, b) in enumerate(zip(ours[r], refs[r])):
            check(f"{name}: rank {r} gradient of input {i}", a.grad, b.grad, tol)


def collectives(team, g):
    w = team.world_size
    for dtype in (torch.bfloat16, torch.float32):
        tol = TOL[dtype]

        def rand(*shape):
            return [torch.randn(*shape, device="cuda", dtype=dtype, generator=g) for _ in range(w)]

        for shape in ((1000,), (48, 40)):
            against_torch(team, f"all_reduce {dtype} {shape}", lambda c, x: weft.all_reduce(x, comm=c),
                          lambda xs: [sum(x[0] for x in xs)] * w, [(x,) for x in rand(*shape)], tol)
        for shape, dim in (((24, 40), 0), ((24, 40), 1), ((3, 5, 8), 2), ((7,), 0)):
            against_torch(team, f"all_gather dim {dim} {dtype} {shape}",
                          lambda c, x, d=dim: weft.all_gather(x, dim=d, comm=c),
                          lambda xs, d=dim: [torch.cat([x[0] for x in xs], d)] * w, [(x,) for x in rand(*shape)],
                          tol)
        for shape, dim in (((8 * w, 40), 0), ((6, 4 * w), 1), ((3, 5, 8 * w), 2)):
            against_torch(team, f"reduce_scatter dim {dim} {dtype} {shape}",
                          lambda c, x, d=dim: weft.reduce_scatter(x, dim=d, comm=c),
                          lambda xs, d=dim: list(sum(x[0] for x in xs).chunk(w, d)), [(x,) for x in rand(*shape)],
                          tol)
        against_torch(team, f"all_to_all {dtype}", lambda c, x: weft.all_to_all(x, comm=c),
                      lambda xs: [torch.cat([x[0].chunk(w)[r] for x in xs]) for r in range(w)],
                      [(x,) for x in rand(16 * w, 24)], tol)


def tp_matmuls(team, g):
    w = team.world_size
    for m, k, n in ((128, 256, 384), (40, 136, 200)):
        def rand(*shape, scale=1.0):
            return [torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g) * scale for _ in range(w)]

        a_rows, a_all = rand(m, k), rand(m * w, k)
        weights = rand(n, k, scale=k**-0.5)  # [N, K], passed as weight.t()
        kn = rand(k, n, scale=k**-0.5)  # [K, N] contiguous
        shape = f"M/W {m} K {k} N {n}"
        against_torch(team, f"all_gather_matmul (weight.t()) {shape}",
                      lambda c, a, wt: weft.all_gather_matmul(a, wt.t(), comm=c),
                      lambda xs: [torch.cat([x[0] for x in xs]) @ x[1].t() for x in xs],
                      list(zip(a_rows, weights)), TOL[torch.bfloat16])
        against_torch(team, f"all_gather_matmul ([K, N]) {shape}",
                      lambda c, a, b: weft.all_gather_matmul(a, b, comm=c),
                      lambda xs: [torch.cat([x[0] for x in xs]) @ x[1] for x in xs],
                      list(zip(a_rows, kn)), TOL[torch.bfloat16])
        against_torch(team, f"matmul_reduce_scatter (weight.t()) {shape}",
                      lambda c, a, wt: weft.matmul_reduce_scatter(a, wt.t(), comm=c),
                      lambda xs: list(sum(x[0] @ x[1].t() for x in xs).chunk(w)),
                      list(zip(a_all, weights)), TOL[torch.bfloat16])
        against_torch(team, f"matmul_reduce_scatter ([K, N]) {shape}",
                      lambda c, a, b: weft.matmul_reduce_scatter(a, b, comm=c),
                      lambda xs: list(sum(x[0] @ x[1] for x in xs).chunk(w)),
                      list(zip(a_all, kn)), TOL[torch.bfloat16])
        against_torch(team, f"matmul_all_reduce (weight.t()) {shape}",
                      lambda c, a, wt: weft.matmul_all_reduce(a, wt.t(), comm=c),
                      lambda xs: [sum(x[0] @ x[1].t() for x in xs)] * w,
                      list(zip(a_all, weights)), TOL[torch.bfloat16])


def mlp(comm, x, w1, w2):
    """The sequence-parallel TP MLP block of examples/tp_mlp.py: x [S/W, H], w1 [F/W, H], w2 [H, F/W]."""
    h = F.gelu(weft.all_gather_matmul(x, w1.t(), comm=comm), approximate="tanh")
    return weft.matmul_reduce_scatter(h, w2.t(), comm=comm)


def mlp_reference(xs, w1s, w2s):
    """The same block on the gathered data in plain torch: every rank's output rows."""
    y = F.gelu(torch.cat(xs) @ torch.cat(w1s).t(), approximate="tanh") @ torch.cat(w2s, 1).t()
    return list(y.chunk(len(xs)))


def tp_mlp_block(team, g):
    w = team.world_size
    tokens, hidden, ffn = 256 * w, 512, 256 * w

    def rand(*shape, scale=1.0):
        return [torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g) * scale for _ in range(w)]

    xs, w1s, w2s = rand(tokens // w, hidden), rand(ffn // w, hidden, scale=hidden**-0.5), rand(
        hidden, ffn // w, scale=ffn**-0.5)
    targets = rand(tokens // w, hidden)
    tol = TOL[torch.bfloat16]

    def loss_of(ys):  # the team's loss: the sum of every rank's (on its own rows)
        return sum(F.mse_loss(y.float(), t.float(), reduction="sum") for y, t in zip(ys, targets))

    # Eager, against plain torch on the gathered data: loss and gradients.
    ours = [leaves(t) for t in (xs, w1s, w2s)]
    refs = [leaves(t, torch.float32) for t in (xs, w1s, w2s)]
    team.warmup(mlp, *ours)
    ys = team.run(mlp, *ours)
    loss = loss_of(ys)
    loss.backward()
    want = loss_of(mlp_reference(*refs))
    want.backward()
    check("TP MLP block: loss", loss.detach().reshape(1), want.detach().reshape(1), tol)
    for name, a, b in (("x", ours[0], refs[0]), ("w1", ours[1], refs[1]), ("w2", ours[2], refs[2])):
        for r in range(w):
            check(f"TP MLP block: rank {r} gradient of {name}", a[r].grad, b[r].grad, tol)

    # torch.compile(fullgraph=True) against eager: outputs and gradients.
    compiled = torch.compile(mlp, fullgraph=True)
    mine = [leaves(t) for t in (xs, w1s, w2s)]
    team.warmup(compiled, *mine)  # compiles every rank's graph and loads its kernels
    ys_c = team.run(compiled, *mine)
    loss_c = loss_of(ys_c)
    loss_c.backward()
    for r in range(w):
        check(f"TP MLP block compiled: rank {r} output", ys_c[r], ys[r], tol)
    for name, a, b in (("x", mine[0], ours[0]), ("w1", mine[1], ours[1]), ("w2", mine[2], ours[2])):
        for r in range(w):
            check(f"TP MLP block compiled: rank {r} gradient of {name}", a[r].grad, b[r].grad, tol)

    # A CUDA graph per rank (torch.cuda.graph on the rank's stream), replayed on new inputs.
    static = [x.clone() for x in xs]
    outs, graphs = [None] * w, []
    with torch.no_grad():
        team.run(mlp, static, w1s, w2s)  # sizes the workspaces before capture
        torch.cuda.synchronize()
        for r, c in enumerate(team):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=team.streams[r]):
                outs[r] = mlp(c, static[r], w1s[r], w2s[r])
            graphs.append(graph)
        for step in range(3):
            fresh = rand(tokens // w, hidden)
            for s, f in zip(static, fresh):
                s.copy_(f)
            current = torch.cuda.current_stream()
            for r in range(w):
                team.streams[r].wait_stream(current)
                with torch.cuda.stream(team.streams[r]):
                    graphs[r].replay()
            for s in team.streams:
                current.wait_stream(s)
            want = mlp_reference(fresh, w1s, w2s)
            for r in range(w):
                check(f"TP MLP block CUDA graph replay {step}: rank {r}", outs[r], want[r], tol)


def ring_attention_compiled(team, g):
    w = team.world_size
    seq, heads, dim = 512 * w, 4, 128
    whole = [torch.randn(1, seq, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]
    shards = [[weft.ring_shard(t, w, r, causal=True) for t in whole] for r in range(w)]

    def layer(comm, q, k, v):
        return weft.ring_attention(q, k, v, causal=True, comm=comm)

    compiled = torch.compile(layer, fullgraph=True)
    eager_in, comp_in = [leaves(s) for s in shards], [leaves(s) for s in shards]
    team.warmup(lambda c, ins: layer(c, *ins), eager_in)
    team.warmup(lambda c, ins: compiled(c, *ins), comp_in)
    eager = team.run(lambda c, ins: layer(c, *ins), eager_in)
    comp = team.run(lambda c, ins: compiled(c, *ins), comp_in)
    grads = [torch.randn_like(o) for o in eager]
    torch.autograd.backward(eager, grads)
    torch.autograd.backward(comp, grads)
    for r in range(w):
        check(f"ring attention compiled: rank {r} output", comp[r], eager[r], 1e-3)
        for i, name in enumerate("qkv"):
            check(f"ring attention compiled: rank {r} d{name}", comp_in[r][i].grad, eager_in[r][i].grad, 1e-2)


def causal_reference(g, seq, heads, kv_heads, dim):
    """Whole-sequence q, k, v and dO (bf16) and single-GPU causal weft.flash_attention over them, backward
    run: (whole, dout, the reference's leaves with their gradients, its output)."""
    whole = [torch.randn(1, seq, h, dim, device="cuda", dtype=torch.bfloat16, generator=g)
             for h in (heads, kv_heads, kv_heads)]
    dout = torch.randn(1, seq, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    ref_in = leaves(whole)
    ref = weft.flash_attention(*ref_in, causal=True)
    ref.backward(dout)
    return whole, dout, ref_in, ref


def check_sharded_attention(team, name, layer, shard, whole, dout, ref_in, ref):
    """layer(comm, q, k, v) on every rank's shard (shard(t, r)) against the single-GPU reference (causal_reference):
    output and gradients, each rank's rows."""
    w = team.world_size
    ins = [leaves([shard(t, r) for t in whole]) for r in range(w)]
    team.warmup(lambda c, xs: layer(c, *xs), [leaves(x) for x in ins])
    outs = team.run(lambda c, xs: layer(c, *xs), ins)
    torch.autograd.backward(outs, [shard(dout, r) for r in range(w)])
    for r in range(w):
        check(f"{name}: rank {r} output", outs[r], shard(ref.detach(), r), 1e-2)
        for i, x in enumerate("qkv"):
            check(f"{name}: rank {r} d{x}", ins[r][i].grad, shard(ref_in[i].grad, r), 2e-2)


def hybrid_attention_autograd(team, g):
    """weft.hybrid_attention at every Ulysses size 1 < U < W dividing W (W = 4: U = 2), causal, K / V heads
    shared by the group: output and gradients against single-GPU weft.flash_attention, sharded alike."""
    w = team.world_size
    for u in [u for u in range(2, w) if w % u == 0]:
        seq = 384 * w + 5
        whole, dout, ref_in, ref = causal_reference(g, seq, 2 * u, 1, 128)
        shard = lambda t, r: weft.ring_shard(t, w, r, causal=True)
        layer = lambda c, q, k, v: weft.hybrid_attention(q, k, v, u, causal=True, seq_len=seq, comm=c)
        check_sharded_attention(team, f"hybrid attention U={u}", layer, shard, whole, dout, ref_in, ref)


def contiguous_shards_attention(team, g):
    """Causal context attention over contiguous shards (rank r holds the r-th slice, contiguous=True) with every
    method: output and gradients against single-GPU weft.flash_attention, sharded alike."""
    w = team.world_size
    seq = 300 * w + 7
    whole, dout, ref_in, ref = causal_reference(g, seq, 2 * w, w, 64)
    shard = lambda t, r: weft.ring_shard(t, w, r, causal=True, contiguous=True)
    if [shard(torch.arange(seq, device="cuda")[None, :], r)[0, 0].item() for r in range(w)] != \
            [r * (seq // w) + min(r, seq % w) for r in range(w)]:
        raise AssertionError("ring_shard(contiguous=True) does not hold consecutive slices")
    for method in ("all_gather", "ring", "ulysses"):
        layer = lambda c, q, k, v: weft.context_attention(q, k, v, causal=True, method=method, seq_len=seq, comm=c,
                                                          contiguous=True)
        check_sharded_attention(team, f"{method} contiguous shards", layer, shard, whole, dout, ref_in, ref)


def moe_layer(comm, x, ids, weights, num_experts, max_tokens):
    """Dispatch, each expert scaling its rows by 1 + e / 4 (expert of a row from group_end, on the GPU), combine."""
    d = weft.moe_dispatch(x, ids, num_experts, max_tokens=max_tokens, comm=comm)
    rows = torch.arange(d.rows.shape[0], device=x.device, dtype=torch.int32)
    local = torch.searchsorted(d.group_end, rows, right=True)
    expert = comm.rank * (num_experts // comm.world_size) + local
    y = (d.rows.float() * (1 + expert.float() / 4)[:, None]).to(x.dtype)
    return weft.moe_combine(y, d, weights)


def moe_compiled(team, g):
    w = team.world_size
    compiled = torch.compile(moe_layer, fullgraph=True)
    for experts_per_rank, top_k, hidden in ((1, 1, 64), (2, 4, 264)):
        num_experts = experts_per_rank * w
        tokens = [200 + 17 * r for r in range(w)]
        max_tokens = max(tokens)
        xs = [torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16, generator=g) for t in tokens]
        ids = [torch.randint(-1, num_experts, (t, top_k), device="cuda", generator=g, dtype=torch.int32)
               for t in tokens]
        weights = [torch.rand(t, top_k, device="cuda", generator=g) for t in tokens]
        args = (xs, ids, weights, [num_experts] * w, [max_tokens] * w)
        team.warmup(moe_layer, *args)
        eager = team.run(moe_layer, *args)
        team.warmup(compiled, *args)
        comp = team.run(compiled, *args)
        for r in range(w):
            scale = 1 + ids[r].clamp(min=0).float() / 4
            want = torch.zeros(tokens[r], hidden, device="cuda")
            for j in range(top_k):
                routed = (xs[r].float() * scale[:, j:j + 1]).to(torch.bfloat16).float()
                want += torch.where(ids[r][:, j:j + 1] >= 0, weights[r][:, j:j + 1] * routed, torch.zeros_like(routed))
            label = f"MoE layer E={num_experts} top_k={top_k} hidden={hidden}: rank {r}"
            check(f"{label} eager", eager[r], want, TOL[torch.bfloat16])
            check(f"{label} compiled vs eager", comp[r], eager[r], 1e-6)


def moe_autograd(team, g):
    """Gradients of the tokens and the routing weights through dispatch, a differentiable expert function and
    combine (the dispatch's backward: a combine with weights 1; the combine's: weft.moe_combine_backward)
    against plain torch autograd in fp32 on each rank's own tokens."""
    w = team.world_size
    for experts_per_rank, top_k, hidden in ((1, 2, 64), (2, 8, 136)):
        num_experts = experts_per_rank * w
        tokens = [150 + 23 * r for r in range(w)]
        max_tokens = max(tokens)
        xs = [torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16, generator=g) for t in tokens]
        ids = [torch.randint(-1, num_experts, (t, top_k), device="cuda", generator=g, dtype=torch.int32)
               for t in tokens]
        weights = [torch.rand(t, top_k, device="cuda", generator=g) for t in tokens]
        ours_x, ours_w = leaves(xs), leaves(weights)
        args = (ours_x, ids, ours_w, [num_experts] * w, [max_tokens] * w)
        team.warmup(moe_layer, *args)
        for t in ours_x + ours_w:
            t.grad = None
        outs = team.run(moe_layer, *args)
        grads = [torch.randn_like(o) for o in outs]
        torch.autograd.backward(outs, grads)
        for r in range(w):
            x32, w32 = leaves([xs[r]], torch.float32)[0], leaves([weights[r]])[0]
            scale = 1 + ids[r].clamp(min=0).float() / 4
            want = torch.zeros(tokens[r], hidden, device="cuda")
            for j in range(top_k):
                routed = x32 * scale[:, j:j + 1]
                want = want + torch.where(ids[r][:, j:j + 1] >= 0, w32[:, j:j + 1] * routed, torch.zeros_like(routed))
            want.backward(grads[r].float())
            label = f"MoE autograd E={num_experts} top_k={top_k} hidden={hidden}: rank {r}"
            check(f"{label} output", outs[r], want, TOL[torch.bfloat16])
            check(f"{label} d tokens", ours_x[r].grad, x32.grad, TOL[torch.bfloat16])
            check(f"{label} d weights", ours_w[r].grad, w32.grad, TOL[torch.bfloat16])


def moe_layer_training(team, g):
    """weft.moe_layer (dispatch, grouped GEMMs, SwiGLU, combine) against plain torch in fp32 over the whole team's
    tokens and experts: outputs, and the gradients of the tokens, the routing weights and every rank's expert
    weights."""
    w = team.world_size
    per, top_k, hidden, inter = 2, 2, 256, 128
    num_experts = per * w
    tokens = [160 + 40 * r for r in range(w)]
    max_tokens = max(tokens)
    xs = [torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16, generator=g) for t in tokens]
    ids = [torch.randint(-1, num_experts, (t, top_k), device="cuda", generator=g, dtype=torch.int32) for t in tokens]
    weights = [torch.rand(t, top_k, device="cuda", generator=g) for t in tokens]
    ups = [(torch.randn(per, hidden, 2 * inter, device="cuda", generator=g) / hidden ** 0.5).to(torch.bfloat16)
           for _ in range(w)]
    downs = [(torch.randn(per, inter, hidden, device="cuda", generator=g) / inter ** 0.5).to(torch.bfloat16)
             for _ in range(w)]
    grads = [torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16, generator=g) for t in tokens]
    runs = {}
    # SwiGLU as torch ops on the first GEMM's output, and in its epilogue (weights interleaved inside the
    # step, so their gradient reaches the same leaves). Exact counts: python/tests/gpu_ops.py (one process
    # per rank).
    # The third run also fuses the second GEMM with the combine.
    for fused in (0, 1, 2):
        ours = [leaves([xs[r], weights[r], ups[r], downs[r]]) for r in range(w)]
        layer = lambda c, ins: weft.moe_layer(ins[0], ids[c.rank], ins[1],
                                              weft.swiglu_interleave(ins[2]) if fused else ins[2], ins[3],
                                              num_experts, max_tokens=max_tokens, comm=c, swiglu_interleaved=fused > 0,
                                              fused_combine=fused == 2)
        runs[fused] = (warm_run_backward(team, layer, ours, grads), ours)
    refs = [leaves([xs[r], weights[r], ups[r], downs[r]], torch.float32) for r in range(w)]
    up_all = torch.cat([refs[r][2] for r in range(w)])  # [E, hidden, 2 inter], global expert order
    down_all = torch.cat([refs[r][3] for r in range(w)])
    loss = 0
    wants = []
    for r in range(w):
        wants.append(moe_reference(refs[r][0], ids[r], refs[r][1], up_all, down_all))
        loss = loss + (wants[r] * grads[r].float()).sum()
    loss.backward()
    for fused, (outs, ours) in runs.items():
        label = f"MoE layer W={w}" + ("", " SwiGLU epilogue", " SwiGLU epilogue, fused combine")[fused]
        for r in range(w):
            check(f"{label}: rank {r} output", outs[r], wants[r], 3e-2)
            for i, name in enumerate(("tokens", "routing weights", "w_up", "w_down")):
                check(f"{label}: rank {r} d {name}", ours[r][i].grad, refs[r][i].grad, 3e-2)


def routed_tokens(g, tokens, hidden, top_k, num_experts):
    """Per rank: tokens[r] bf16 rows, their top_k expert ids (some -1: no expert; a token names an expert at
    most once, top_k 2) and routing weights."""
    xs = [torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16, generator=g) for t in tokens]
    ids = [torch.randint(-1, num_experts, (t, top_k), device="cuda", generator=g, dtype=torch.int32) for t in tokens]
    for r, t in enumerate(tokens):
        if t:
            ids[r][:, 1] = torch.where(ids[r][:, 1] == ids[r][:, 0], -1, ids[r][:, 1])
    weights = [torch.rand(t, top_k, device="cuda", generator=g) for t in tokens]
    return xs, ids, weights


def moe_low_latency(team, g):
    """weft.moe_layer with the low-latency dispatch, and with the dispatch fused with the first GEMM
    (inference, under torch.no_grad()) against plain torch in fp32 over the whole team's tokens and experts,
    both SwiGLU forms; each group's received rows against the slots
    routed to it; a gradient through it refused."""
    global cases
    w = team.world_size
    per, top_k, hidden, inter = 2, 2, 256, 128
    num_experts = per * w
    tokens = [40 + 24 * r for r in range(w)]
    tokens[-1] = 0  # a rank with no token
    max_tokens = max(tokens)
    xs, ids, weights = routed_tokens(g, tokens, hidden, top_k, num_experts)
    ups = [(torch.randn(per, hidden, 2 * inter, device="cuda", generator=g) / hidden ** 0.5).to(torch.bfloat16)
           for _ in range(w)]
    downs = [(torch.randn(per, inter, hidden, device="cuda", generator=g) / inter ** 0.5).to(torch.bfloat16)
             for _ in range(w)]
    up_all = torch.cat(ups).float()
    down_all = torch.cat(downs).float()
    wants = [moe_reference(xs[r].float(), ids[r], weights[r], up_all, down_all) for r in range(w)]
    with torch.no_grad():
        # The low-latency dispatch, and the dispatch and the first GEMM in one kernel; both SwiGLU forms each.
        for mode, kw in (("low latency", {"low_latency": True}), ("fused dispatch", {"fused_dispatch": True})):
            for interleaved in (False, True):
                layer = lambda c, x, i, wt, up, down: weft.moe_layer(  # noqa: E731
                    x, i, wt, weft.swiglu_interleave(up) if interleaved else up, down, num_experts,
                    max_tokens=max_tokens, comm=c, swiglu_interleaved=interleaved, **kw)
                args = (xs, ids, weights, ups, downs)
                team.warmup(layer, *args)
                outs = team.run(layer, *args)
                for r in range(w):
                    check(f"MoE layer, {mode}, W={w}{' SwiGLU epilogue' if interleaved else ''}: rank {r}",
                          outs[r], wants[r], 3e-2)
        d = team.run(lambda c, x, i: weft.moe_dispatch(x, i, num_experts, max_tokens=max_tokens, comm=c,
                                                       low_latency=True), xs, ids)
        team.synchronize()
        for r in range(w):
            want = torch.zeros(per, dtype=torch.int64)
            for s in range(w):
                for e in ids[s].flatten().tolist():
                    if e >= 0 and e // per == r:
                        want[e % per] += 1
            got = d[r].group_rows.cpu().long()
            if not torch.equal(got, want):
                raise AssertionError(f"low-latency dispatch W={w}: rank {r} group_rows {got.tolist()}, want "
                                     f"{want.tolist()}")
            cases += 1
    x = xs[0].clone().requires_grad_()
    try:
        weft.moe_dispatch(x, ids[0], num_experts, max_tokens=max_tokens, comm=team[0], low_latency=True)
        raise AssertionError("a low-latency dispatch of a tensor that needs a gradient was not refused")
    except weft.WeftValueError as e:
        assert "torch.no_grad" in str(e), e
    cases += 1


def moe_fp8_layer(team, g):
    """weft.moe_layer_fp8 (FP8 dispatch, block-scaled FP8 expert GEMMs, bf16 combine; inference) against plain
    torch in fp32 on the dequantized FP8 weights (what remains is the activations' FP8 rounding), with the normal
    and the low-latency dispatch; a rank with no token; a gradient refused."""
    global cases
    w = team.world_size
    per, top_k, hidden, inter = 2, 2, 256, 128
    num_experts = per * w
    tokens = [48 + 16 * r for r in range(w)]
    tokens[0] = 0
    max_tokens = max(tokens)
    xs, ids, weights = routed_tokens(g, tokens, hidden, top_k, num_experts)

    def quantized(shape, fan_in):  # per rank: FP8 [per, N, K] weights, their block scales, and the dequantized
        qs, ss, deq = [], [], []
        for _ in range(w):
            wt = (torch.randn(per, *shape, device="cuda", generator=g) / fan_in ** 0.5).to(torch.bfloat16)
            q, s = zip(*(weft.quantize_fp8(wt[e].contiguous(), "block", "b") for e in range(per)))
            q, s = torch.stack(q), torch.stack(s)
            full = s.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :shape[0], :shape[1]]
            qs.append(q), ss.append(s), deq.append(q.float() * full)
        return qs, ss, deq

    ups, up_scales, up_deq = quantized((2 * inter, hidden), hidden)
    downs, down_scales, down_deq = quantized((hidden, inter), inter)
    # moe_reference takes [E, K, N] weights
    up_all = torch.cat(up_deq).transpose(1, 2)
    down_all = torch.cat(down_deq).transpose(1, 2)
    wants = [moe_reference(xs[r].float(), ids[r], weights[r], up_all, down_all) for r in range(w)]
    with torch.no_grad():
        for low_latency in (False, True):
            layer = lambda c, x, i, wt, up, su, down, sd: weft.moe_layer_fp8(  # noqa: E731
                x, i, wt, up, su, down, sd, num_experts, max_tokens=max_tokens, comm=c, low_latency=low_latency)
            args = (xs, ids, weights, ups, up_scales, downs, down_scales)
            team.warmup(layer, *args)
            outs = team.run(layer, *args)
            for r in range(w):
                # two FP8 roundings of the activations (x, then the SwiGLU output): ~3% each, ~5-6% through SwiGLU;
                # a wrong scale or row is off by O(1)
                check(f"FP8 MoE layer{' (low latency)' if low_latency else ''}, W={w}: rank {r}", outs[r], wants[r],
                      1e-1)
    # Refused before the dispatch (a team collective), each with its reason: a gradient, an align the grouped
    # FP8 GEMM's tiles do not take, fp16 tokens, scales of the wrong shape.
    args = (ids[1], weights[1], ups[1], up_scales[1], downs[1], down_scales[1], num_experts)
    refusals = [
        (weft.WeftValueError, "torch.no_grad", (xs[1].clone().requires_grad_(),) + args, {}),
        (weft.WeftValueError, "align", (xs[1],) + args, {"align": 64}),
        (weft.WeftTypeError, "bf16", (xs[1].half(),) + args, {}),
        (weft.WeftValueError, "w_up_scales", (xs[1], ids[1], weights[1], ups[1], up_scales[1][:, :1], downs[1],
                                              down_scales[1], num_experts), {}),
    ]
    for kind, says, call_args, kw in refusals:
        try:
            weft.moe_layer_fp8(*call_args, max_tokens=max_tokens, comm=team[1], **kw)
            raise AssertionError(f"weft.moe_layer_fp8 did not refuse ({says})")
        except kind as e:
            assert says in str(e), e
        cases += 1


def moe_reference(x, ids, wt, up_all, down_all):
    """An MoE layer in plain torch on one rank's tokens x [T, hidden]: each token's top-k experts (ids [T, k],
    -1 none) of every expert's weights up_all [E, hidden, 2 inter] (gate, then up) and down_all [E, inter,
    hidden], SwiGLU, weighted by wt [T, k]."""
    inter = down_all.shape[1]
    want = torch.zeros(x.shape[0], down_all.shape[2], device="cuda")
    for j in range(ids.shape[1]):
        e = ids[:, j].long()
        h = torch.bmm(x[:, None, :], up_all[e.clamp(min=0)])[:, 0]
        a = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        y = torch.bmm(a[:, None, :], down_all[e.clamp(min=0)])[:, 0]
        want = want + torch.where((e >= 0)[:, None], wt[:, j:j + 1] * y, torch.zeros_like(y))
    return want


def moe_layers_stacked_training(team, g):
    """Two weft.moe_layer calls in a row on one team (a model's MoE layers), then one backward: each layer's
    backward must use its own dispatch's groups, though the second dispatch rewrote the team's dispatch area.
    The routings differ (the second piles onto rank 0's experts), so their group ends do too. Gradients of the
    tokens, both layers' routing weights and expert weights against plain torch in fp32."""
    w = team.world_size
    per, top_k, hidden, inter = 2, 2, 256, 128
    num_experts = per * w
    tokens = [192 + 32 * r for r in range(w)]
    xs = [torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16, generator=g) for t in tokens]
    ids1 = [torch.randint(0, num_experts, (t, top_k), device="cuda", generator=g, dtype=torch.int32) for t in tokens]
    ids2 = [torch.randint(0, per, (t, top_k), device="cuda", generator=g, dtype=torch.int32) for t in tokens]
    for ids in ids2:  # a quarter of the second layer's slots go anywhere
        spread = torch.rand(ids.shape, device="cuda", generator=g) < 0.25
        ids[spread] = torch.randint(0, num_experts, (int(spread.sum()),), device="cuda", generator=g,
                                    dtype=torch.int32)
    weight = lambda t: torch.rand(t, top_k, device="cuda", generator=g)
    wts1, wts2 = [weight(t) for t in tokens], [weight(t) for t in tokens]
    expert = lambda k, n: (torch.randn(per, k, n, device="cuda", generator=g) / k ** 0.5).to(torch.bfloat16)
    ups1, ups2 = [expert(hidden, 2 * inter) for _ in range(w)], [expert(hidden, 2 * inter) for _ in range(w)]
    downs1, downs2 = [expert(inter, hidden) for _ in range(w)], [expert(inter, hidden) for _ in range(w)]
    grads = [torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16, generator=g) for t in tokens]
    inputs = [[xs[r], wts1[r], ups1[r], downs1[r], wts2[r], ups2[r], downs2[r]] for r in range(w)]
    ours = [leaves(ins) for ins in inputs]

    def two_layers(c, ins):
        h = weft.moe_layer(ins[0], ids1[c.rank], ins[1], ins[2], ins[3], num_experts, max_tokens=max(tokens),
                           comm=c)
        return weft.moe_layer(h, ids2[c.rank], ins[4], ins[5], ins[6], num_experts, max_tokens=max(tokens), comm=c)

    outs = warm_run_backward(team, two_layers, ours, grads)
    refs = [leaves(ins, torch.float32) for ins in inputs]
    every = lambda i: torch.cat([refs[r][i] for r in range(w)])  # an expert weight, global expert order
    loss = 0
    wants = []
    for r in range(w):
        h = moe_reference(refs[r][0], ids1[r], refs[r][1], every(2), every(3))
        wants.append(moe_reference(h, ids2[r], refs[r][4], every(5), every(6)))
        loss = loss + (wants[r] * grads[r].float()).sum()
    loss.backward()
    names = ("tokens", "layer 1 routing weights", "layer 1 w_up", "layer 1 w_down", "layer 2 routing weights",
             "layer 2 w_up", "layer 2 w_down")
    for r in range(w):
        check(f"two MoE layers W={w}: rank {r} output", outs[r], wants[r], 3e-2)
        for i, name in enumerate(names):
            check(f"two MoE layers W={w}: rank {r} d {name}", ours[r][i].grad, refs[r][i].grad, 3e-2)


def moe_exact_counts(team):
    """exact=True refused on a virtual team before anything is queued (python/tests/gpu_ops.py runs it with one
    process per rank)."""
    x = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
    ids = torch.zeros(8, 1, device="cuda", dtype=torch.int32)
    try:
        team.run(lambda c: weft.moe_dispatch(x, ids, team.world_size, comm=c, exact=True))
        raise AssertionError("exact=True on a virtual team was not refused")
    except weft.WeftValueError as e:
        assert "one process per rank" in str(e), e
    team.synchronize()


def flash_attention_compiled(g):
    q, k, v = (torch.randn(2, 1000, 4, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    fn = lambda q, k, v: weft.flash_attention(q, k, v, causal=True)
    compiled = torch.compile(fn, fullgraph=True)
    a, b = leaves((q, k, v)), leaves((q, k, v))
    out_e, out_c = fn(*a), compiled(*b)
    grad = torch.randn_like(out_e)
    out_e.backward(grad)
    out_c.backward(grad)
    check("flash attention compiled: output", out_c, out_e, 1e-3)
    for i, name in enumerate("qkv"):
        check(f"flash attention compiled: d{name}", b[i].grad, a[i].grad, 1e-2)


def errors(team):
    global cases
    x = torch.randn(64, device="cuda")
    try:
        weft.all_reduce(x, comm=team[0])  # the default stream: refused before anything is queued
        raise AssertionError("all_reduce on the default stream of a virtual rank was not refused")
    except weft.WeftError as e:
        assert "stream of its own" in str(e), e
    a = torch.randn(64, 48, device="cuda", dtype=torch.bfloat16)
    for fn, args, kind, fragment in (
            (weft.all_gather_matmul, (a, torch.randn(40, 64, device="cuda", dtype=torch.bfloat16)), ValueError,
             "inner dimensions"),
            (weft.matmul_all_reduce, (a.float(), torch.randn(48, 64, device="cuda")), TypeError, "bf16"),
            (weft.reduce_scatter, (torch.randn(team.world_size * 3 + 1, device="cuda"),), ValueError,
             "not divisible"),
            (weft.all_gather, (torch.randn(4, 4, device="cuda").t(),), ValueError, "contiguous")):
        try:
            team.run(lambda c: fn(*args, comm=c))
            raise AssertionError(f"{fn.__name__} accepted bad operands")
        except kind as e:
            assert fragment in str(e), e
            assert isinstance(e, weft.WeftError), type(e)
    cases += 5


def eager_fast_path(team, g):
    """Plain eager calls run the operator's implementation directly (weft._torch_ops._plain_eager); anything that
    needs torch's operator (autograd to record, a dispatch or function mode, a subclass, a CPU tensor) goes
    through it. Both give the same result."""
    global cases
    from weft import _torch_ops as ops
    x = torch.randn(256, device="cuda", dtype=torch.bfloat16, generator=g)
    assert ops._plain_eager((x, "sum", 0)), "a plain CUDA tensor did not take the fast path"
    needs_grad = x.clone().requires_grad_()
    assert not ops._plain_eager((needs_grad,)), "a tensor that needs a gradient took the fast path"
    with torch.no_grad():
        assert ops._plain_eager((needs_grad,)), "no_grad: the fast path was not taken"
    assert not ops._plain_eager((x.cpu(),)), "a CPU tensor took the fast path"
    assert not ops._plain_eager(([x, torch.nn.Parameter(x.float())],)), "a Parameter needing a gradient, in a list, took the fast path"
    with torch.device("cuda"):
        assert not ops._plain_eager((x,)), "a torch function mode was active and the fast path was taken"
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        assert not ops._plain_eager((x,)), "a dispatch mode was active and the fast path was taken"
    xs = [torch.randn(1000, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(team.world_size)]
    op = ops._all_reduce
    through_op = team.run(lambda c: op._op(xs[c.rank], "sum", c._id))
    real = op._op

    def refuse(*args):
        raise AssertionError("a plain eager call went through torch's operator")
    op._op = refuse
    try:
        direct = team.run(lambda c: weft.all_reduce(xs[c.rank], comm=c))
    finally:
        op._op = real
    for r in range(team.world_size):
        check(f"all_reduce, fast path against the operator: rank {r}", direct[r], through_op[r], 0.0)
    cases += 7


_team = None


def main():
    global _team
    worlds = [int(v) for v in sys.argv[1:]] or [2, 4]
    for w in worlds:
        team = _team = weft.virtual_team(w)
        g = torch.Generator(device="cuda").manual_seed(1000 + w)
        before = cases
        for step in (eager_fast_path, collectives, tp_matmuls, tp_mlp_block, ring_attention_compiled, hybrid_attention_autograd,
                     contiguous_shards_attention,
                     moe_compiled, moe_autograd, moe_layer_training, moe_layers_stacked_training, moe_low_latency,
                     moe_fp8_layer):
            step(team, g)
            team.synchronize()
            print(f"W = {w}: {step.__name__} passed", flush=True)
        errors(team)
        moe_exact_counts(team)
        print(f"W = {w}: {cases - before} cases passed", flush=True)
    flash_attention_compiled(torch.Generator(device="cuda").manual_seed(7))
    print(f"python team tests: {cases} passed, 0 failed", flush=True)


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # one clear line, then a non-zero exit
        import traceback
        traceback.print_exc()
        print(f"FAILED: {type(e).__name__}: {e}", flush=True)
        try:
            if _team is not None:
                _team.synchronize()
        except Exception as device_error:
            print(f"device errors: {device_error}", flush=True)
        sys.exit(1)
