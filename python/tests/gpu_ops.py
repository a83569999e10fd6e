"""GPU tests of the Python package against torch.distributed (NCCL), one process per GPU:

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    PYTHONPATH=build/python torchrun --nproc_per_node=4 python/tests/gpu_ops.py

Every op, every dtype, torch tensors and weft's symmetric tensors (through DLPack), odd sizes, inner
dimensions, out=, and a CUDA-graph capture with symmetric inputs. Prints one line per rank and exits
non-zero on the first mismatch.
"""
import os
import sys

import torch
import torch.distributed as dist

import weft

TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def check(name, got, want, exact=False):
    if torch.isnan(got).any():
        raise AssertionError(f"{name}: NaN in the output")
    if exact:
        if not torch.equal(got, want):
            bad = (got.flatten() != want.flatten()).nonzero().flatten()
            i = bad[0].item()
            raise AssertionError(f"{name}: {bad.numel()} of {want.numel()} elements differ from "
                                 f"torch.distributed, first at flat index {i}: got {got.flatten()[i].item()}, "
                                 f"want {want.flatten()[i].item()}")
        return
    err = ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()
    if err > TOL[got.dtype]:
        raise AssertionError(f"{name}: relative error {err:.3e}")


def main():
    # weft.init() after torch.distributed's default group: the team's ranks are the group's, and the rendezvous
    # is authenticated by a secret shared through the group's store. (The other torchrun tests call weft.init()
    # first: tp_mlp.py, train_transformer.py.)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    comm = weft.init()
    rank, world = comm.rank, comm.world_size
    if (rank, world, comm.device) != (dist.get_rank(), dist.get_world_size(), local):
        raise AssertionError(f"weft.init() after init_process_group: rank {rank} of {world} on cuda:{comm.device}, "
                             f"torch's rank {dist.get_rank()} of {dist.get_world_size()} on cuda:{local}")
    if not os.environ.get("WEFT_JOB_SECRET") and comm.job_secret_from != "torch store":
        raise AssertionError(f"weft.init() after init_process_group took its job secret from "
                             f"{comm.job_secret_from!r}, not the default group's store")
    if rank == 0:
        print(f"[rank 0] job secret from: {comm.job_secret_from} (TORCHELASTIC_USE_AGENT_STORE="
              f"{os.environ.get('TORCHELASTIC_USE_AGENT_STORE')})", flush=True)
    g = torch.Generator(device="cuda").manual_seed(1234 + rank)
    cases = 0
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for n in (1, 7, 1000, 65536 + 3, 3 << 20):
            x = torch.randn(n, device="cuda", dtype=dtype, generator=g)
            for op, rop in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX), ("min", dist.ReduceOp.MIN)):
                want = x.clone()
                dist.all_reduce(want, op=rop)
                check(f"all_reduce {op} {dtype} {n}", weft.all_reduce(x, op=op), want, exact=op != "sum")
                cases += 1
        for shape, dim in (((64, 33), 0), ((64, 33), 1), ((3, 5, 8), 2), ((1000,), 0)):
            x = torch.randn(shape, device="cuda", dtype=dtype, generator=g)
            parts = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(parts, x)
            check(f"all_gather dim {dim} {dtype} {shape}", weft.all_gather(x, dim=dim), torch.cat(parts, dim), True)
            big = torch.randn(*shape[:dim], shape[dim] * world, *shape[dim + 1:], device="cuda", dtype=dtype,
                              generator=g)
            # NCCL scatters dim 0: move the scattered dim to the front and back again.
            front = big.movedim(dim, 0).contiguous()
            want = torch.empty((front.shape[0] // world, *front.shape[1:]), device="cuda", dtype=dtype)
            dist.reduce_scatter_tensor(want, front, op=dist.ReduceOp.SUM)
            check(f"reduce_scatter dim {dim} {dtype} {shape}", weft.reduce_scatter(big, dim=dim), want.movedim(0, dim))
            cases += 2
        x = torch.randn(world * 1001, device="cuda", dtype=dtype, generator=g)
        want = torch.empty_like(x)
        dist.all_to_all_single(want, x)
        check(f"all_to_all {dtype}", weft.all_to_all(x), want, True)
        cases += 1
        # Rooted collectives against torch.distributed's (every root).
        for root in range(world):
            x = torch.randn(world * 37, 5, device="cuda", dtype=dtype, generator=g)
            want = x.clone()
            dist.broadcast(want, src=root)
            check(f"broadcast root {root} {dtype}", weft.broadcast(x, root=root), want, True)
            full = x.clone()
            dist.broadcast(full, src=root)  # the root's x, known everywhere: the scatter's reference
            check(f"scatter root {root} {dtype}", weft.scatter(x, root=root), full.chunk(world)[rank], True)
            parts = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(parts, x)
            got = weft.gather(x, root=root)
            if rank == root:
                check(f"gather root {root} {dtype}", got, torch.cat(parts), True)
            elif got is not None:
                raise AssertionError(f"gather root {root}: rank {rank} got a tensor, want None")
            want = x.clone()
            dist.reduce(want, dst=root)
            got = weft.reduce(x, root=root)
            if rank == root:
                check(f"reduce root {root} {dtype}", got, want)
            cases += 4
        # Variable splits against all_to_all_single with split sizes (the sizes on the GPU for weft).
        sc = torch.Generator().manual_seed(7)  # the same on every rank: the whole count matrix
        counts = torch.randint(0, 40, (world, world), generator=sc)
        counts[0, world - 1] = 0
        send = counts[rank].tolist()
        recv = counts[:, rank].tolist()
        x = torch.randn(sum(send), 24, device="cuda", dtype=dtype, generator=g)
        want = torch.empty(sum(recv), 24, device="cuda", dtype=dtype)
        dist.all_to_all_single(want, x, output_split_sizes=recv, input_split_sizes=send)
        out, got_counts = weft.all_to_all_v(x, counts[rank].cuda(), int(counts.sum(0).max()) + 3)
        check(f"all_to_all_v {dtype}", out[:sum(recv)], want, True)
        if got_counts.tolist() != recv:
            raise AssertionError(f"all_to_all_v recv_counts {got_counts.tolist()}, want {recv}")
        cases += 1
    # Process groups as sub-teams (comm=group): the pairs of a (W / 2) x 2 mesh and its columns.
    if world >= 4 and world % 2 == 0:
        pairs = [dist.new_group([2 * i, 2 * i + 1]) for i in range(world // 2)]
        columns = [dist.new_group(list(range(j, world, 2))) for j in range(2)]
        for name, group in (("pair", pairs[rank // 2]), ("column", columns[rank % 2])):
            cases += check_group_collectives(name, group, g)
            cases += check_group_ops(name, group, g)
    # Fused matmul ops against torch.distributed + a fp32 torch matmul (weights in nn.Linear layout [N, K],
    # passed as w.t(); also as a contiguous [K, N]).
    for m_shard, n, k in ((128, 256, 256), (256, 264, 136), (200, 128, 64)):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k**0.5
        a = torch.randn(m_shard, k, device="cuda", dtype=torch.bfloat16, generator=g)
        parts = [torch.empty_like(a) for _ in range(world)]
        dist.all_gather(parts, a)
        want = torch.cat(parts).float() @ w.float().t()
        check(f"all_gather_matmul {m_shard}x{n}x{k}", weft.all_gather_matmul(a, w.t()), want.to(torch.bfloat16))
        a_full = torch.randn(m_shard * world, k, device="cuda", dtype=torch.bfloat16, generator=g)
        total = a_full.float() @ w.float().t()
        dist.all_reduce(total)
        check(f"matmul_all_reduce {m_shard}x{n}x{k}", weft.matmul_all_reduce(a_full, w.t()),
              total.to(torch.bfloat16))
        mine = total[rank * m_shard:(rank + 1) * m_shard].to(torch.bfloat16)
        check(f"matmul_reduce_scatter {m_shard}x{n}x{k}", weft.matmul_reduce_scatter(a_full, w.t().contiguous()),
              mine)
        cases += 3
    # Sequence-parallel attention: every rank builds the same whole sequence, attends its ring shard with
    # each method, and compares output and gradients with single-GPU weft.flash_attention over the whole
    # sequence, sharded alike (the same kernel: agreement to rounding).
    ag = torch.Generator(device="cuda").manual_seed(99)  # the same on every rank
    methods = [("all_gather", None), ("ring", None), ("ulysses", None)]
    methods += [("hybrid", u) for u in range(2, world) if world % u == 0]
    for method, u in methods:
        for causal, seq, heads, kv_heads, dim, docs in ((True, 1000, 2 * world, world, 128, None),
                                                        (False, 777, 2 * world, 1, 64, None),
                                                        (True, 1300, 2 * world, 2 * world, 64, [0, 300, 301, 1300])):
            q = torch.randn(1, seq, heads, dim, device="cuda", dtype=torch.bfloat16, generator=ag)
            k = torch.randn(1, seq, kv_heads, dim, device="cuda", dtype=torch.bfloat16, generator=ag)
            v = torch.randn(1, seq, kv_heads, dim, device="cuda", dtype=torch.bfloat16, generator=ag)
            dout = torch.randn(1, seq, heads, dim, device="cuda", dtype=torch.bfloat16, generator=ag)
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            if docs is None:
                ref = weft.flash_attention(*leaves, causal=causal)
                shard = lambda x: weft.ring_shard(x, world, rank, causal=causal, dim=1)
            else:
                cu = torch.tensor(docs, dtype=torch.int32, device="cuda")
                longest = max(b - a for a, b in zip(docs, docs[1:]))
                ref = weft.flash_attention_varlen(*(x[0] for x in leaves), cu, cu, longest, longest,
                                                  causal=causal).unsqueeze(0)
                shard = lambda x: weft.ring_shard(x[0], world, rank, causal=causal, dim=0, cu_seqlens=docs)
            ref.backward(dout)
            mine = [shard(x).clone().requires_grad_() for x in (q, k, v)]
            if docs is None:
                out = weft.context_attention(*mine, causal=causal, method=method, seq_len=seq, ulysses_size=u)
            else:
                out = weft.context_attention(*mine, causal=causal, method=method, cu_seqlens=docs, ulysses_size=u)
            out.backward(shard(dout))
            label = f"context_attention {method}{u or ''} causal={causal} seq={seq} H={heads}/{kv_heads} D={dim}" + \
                (" packed" if docs else "")
            check(label, out, shard(ref.detach()))
            for name, got, leaf in zip(("dq", "dk", "dv"), mine, leaves):
                check(f"{label} {name}", got.grad, shard(leaf.grad))
            cases += 4
    # MoE: dispatch, each expert scaling its rows (1 + e / 4), combine; against the direct weighted sum.
    for experts_per_rank, top_k, hidden in ((1, 1, 64), (4, 2, 264), (2, 8, 512)):
        num_experts = experts_per_rank * world
        tokens, max_tokens = 200 + 17 * rank, 200 + 17 * world
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
        ids = torch.randint(-1, num_experts, (tokens, top_k), device="cuda", generator=g, dtype=torch.int32)
        weights = torch.rand(tokens, top_k, device="cuda", generator=g)
        # The last shape under torch.no_grad(): the dispatch leaves its padding rows as they are (inference).
        with torch.set_grad_enabled(hidden != 512):
            d = weft.moe_dispatch(x, ids, num_experts, max_tokens=max_tokens)
        y = weft.moe_combine_input(d)
        begin = 0
        for local, end in enumerate(d.group_end.tolist()):
            scale = 1 + (rank * experts_per_rank + local) / 4
            y[begin:end] = (d.rows[begin:end].float() * scale).to(torch.bfloat16)
            begin = end
        out = weft.moe_combine(y, d, weights)
        scale = 1 + ids.clamp(min=0).float() / 4
        want = torch.zeros(tokens, hidden, device="cuda")
        for j in range(top_k):
            routed = (x.float() * scale[:, j:j + 1]).to(torch.bfloat16).float()
            want += torch.where(ids[:, j:j + 1] >= 0, weights[:, j:j + 1] * routed, torch.zeros_like(routed))
        check(f"moe dispatch + combine E={num_experts} top_k={top_k} hidden={hidden}", out, want.to(torch.bfloat16))
        cases += 1
    cases += check_moe_dispatch_fp8(rank, world, g)
    # weft.moe_layer with the exact counts read back (one process per rank: the read-back's synchronisation
    # waits only for this rank's own work) against the worst-case rows (checked against fp32 torch on virtual
    # teams, python/tests/gpu_team.py): outputs and every gradient.
    per, top_k, hidden, inter = 2, 2, 256, 128
    num_experts = per * world
    tokens = 100 + 37 * rank
    max_tokens = 100 + 37 * (world - 1)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    ids = torch.randint(-1, num_experts, (tokens, top_k), device="cuda", generator=g, dtype=torch.int32)
    weights = torch.rand(tokens, top_k, device="cuda", generator=g)
    w_up = (torch.randn(per, hidden, 2 * inter, device="cuda", generator=g) / hidden ** 0.5).to(torch.bfloat16)
    w_down = (torch.randn(per, inter, hidden, device="cuda", generator=g) / inter ** 0.5).to(torch.bfloat16)
    dout = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    results = []
    for exact in (False, True):
        ins = [t.detach().clone().requires_grad_() for t in (x, weights, w_up, w_down)]
        out = weft.moe_layer(ins[0], ids, ins[1], ins[2], ins[3], num_experts, max_tokens=max_tokens, exact=exact)
        out.backward(dout)
        results.append([out] + [t.grad for t in ins])
    for name, got, want in zip(("output", "d tokens", "d weights", "d w_up", "d w_down"), results[1], results[0]):
        check(f"moe_layer exact counts: {name}", got, want.to(got.dtype))
        cases += 1
    # The low-latency dispatch (inference) against the dispatch of record on the same layer (a token names an
    # expert at most once there); both SwiGLU forms.
    ids_once = ids.clone()
    ids_once[:, 1] = torch.where(ids_once[:, 1] == ids_once[:, 0], -1, ids_once[:, 1])
    with torch.no_grad():
        for interleaved in (False, True):
            up = weft.swiglu_interleave(w_up) if interleaved else w_up
            ll = weft.moe_layer(x, ids_once, weights, up, w_down, num_experts, max_tokens=max_tokens,
                                swiglu_interleaved=interleaved, low_latency=True)
            rec = weft.moe_layer(x, ids_once, weights, up, w_down, num_experts, max_tokens=max_tokens,
                                 swiglu_interleaved=interleaved)
            check(f"moe_layer low latency{' (SwiGLU epilogue)' if interleaved else ''} against the dispatch of record",
                  ll, rec)
            cases += 1
    # The dispatch fused with the first GEMM (inference) against the unfused layer, both SwiGLU forms, the
    # weights also as a transposed view of stacked [E, N, K] (nn.Linear's) weights; under grad mode refused.
    with torch.no_grad():
        for interleaved, nk in ((False, False), (True, False), (True, True)):
            up = weft.swiglu_interleave(w_up) if interleaved else w_up
            if nk:
                up = up.transpose(1, 2).contiguous().transpose(1, 2)
            fused = weft.moe_layer(x, ids, weights, up, w_down, num_experts, max_tokens=max_tokens,
                                   swiglu_interleaved=interleaved, fused_dispatch=True)
            rec = weft.moe_layer(x, ids, weights, up, w_down, num_experts, max_tokens=max_tokens,
                                 swiglu_interleaved=interleaved, fused_dispatch=False)
            label = (" (SwiGLU epilogue)" if interleaved else "") + (", [E, N, K] weights" if nk else "")
            check(f"moe_layer fused dispatch{label} against the unfused layer", fused, rec)
            cases += 1
    try:
        weft.moe_layer(x, ids, weights.clone().requires_grad_(), w_up, w_down, num_experts, max_tokens=max_tokens,
                       fused_dispatch=True)
        raise AssertionError("moe_layer(fused_dispatch=True) with a weight that needs a gradient was not refused")
    except weft.WeftValueError as e:
        assert "torch.no_grad" in str(e), e
    cases += 1
    # The default without gradients at max_tokens >= 2048 takes the fused down GEMM + combine (inter <= 4096),
    # and from 4 ranks with at most 32 experts the fused dispatch too: against the unfused layer.
    big = 2048
    xb = torch.randn(big, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    ids_big = torch.randint(-1, num_experts, (big, top_k), device="cuda", generator=g, dtype=torch.int32)
    weights_big = torch.rand(big, top_k, device="cuda", generator=g)
    with torch.no_grad():
        picked = weft.moe_layer(xb, ids_big, weights_big, w_up, w_down, num_experts, max_tokens=big)
        unfused = weft.moe_layer(xb, ids_big, weights_big, w_up, w_down, num_experts, max_tokens=big,
                                 fused_combine=False, fused_dispatch=False)
    check("moe_layer's default at max_tokens 2048 (the fused combine; at 4 ranks the fused dispatch) against the "
          "unfused layer", picked, unfused)
    cases += 1
    # Symmetric tensors through DLPack, out=, and a captured graph.
    n = 1 << 20
    sym_in = torch.from_dlpack(comm.empty((n,), "bf16"))
    sym_out = torch.from_dlpack(comm.empty((n,), "bf16"))
    sym_in.copy_(torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g))
    comm.barrier()
    weft.all_reduce(sym_in, out=sym_out)  # sizes the workspace before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weft.all_reduce(sym_in, out=sym_out)
    for _ in range(3):
        sym_in.copy_(torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g))
        comm.barrier()
        graph.replay()
        want = sym_in.clone()
        dist.all_reduce(want)
        check("all_reduce in a CUDA graph (symmetric)", sym_out, want)
        cases += 1
    cases += check_flash_decode(rank, world)
    cases += check_all_gather_scaled_matmul(rank, world)
    torch.cuda.synchronize()
    print(f"[rank {rank}] python gpu tests: {cases} passed, 0 failed", flush=True)
    dist.destroy_process_group()


def check_group_collectives(name, group, g):
    """Every collective over a process group (comm=group) against torch.distributed over the same group: roots
    are the group's ranks (torch's group_src / group_dst). Returns the cases run."""
    gw, gr = dist.get_world_size(group), dist.get_rank(group)
    x = torch.randn(1000, 8, device="cuda", dtype=torch.bfloat16, generator=g)
    want = x.clone()
    dist.all_reduce(want, group=group)
    check(f"all_reduce over a {name} group", weft.all_reduce(x, comm=group), want)
    parts = [torch.empty_like(x) for _ in range(gw)]
    dist.all_gather(parts, x, group=group)
    check(f"all_gather over a {name} group", weft.all_gather(x, comm=group), torch.cat(parts), True)
    x = torch.randn(gw * 8, 40, device="cuda", dtype=torch.bfloat16, generator=g)
    want = torch.empty(8, 40, device="cuda", dtype=torch.bfloat16)
    dist.reduce_scatter_tensor(want, x, group=group)
    check(f"reduce_scatter over a {name} group", weft.reduce_scatter(x, comm=group), want)
    x = torch.randn(gw * 6, 24, device="cuda", dtype=torch.bfloat16, generator=g)
    want = torch.empty_like(x)
    dist.all_to_all_single(want, x, group=group)
    check(f"all_to_all over a {name} group", weft.all_to_all(x, comm=group), want, True)
    counts = torch.randint(0, 30, (gw, gw), generator=torch.Generator().manual_seed(17))  # alike on every rank
    counts[0, gw - 1] = 0
    send, recv = counts[gr].tolist(), counts[:, gr].tolist()
    x = torch.randn(sum(send), 24, device="cuda", dtype=torch.bfloat16, generator=g)
    want = torch.empty(sum(recv), 24, device="cuda", dtype=torch.bfloat16)
    dist.all_to_all_single(want, x, output_split_sizes=recv, input_split_sizes=send, group=group)
    out, got = weft.all_to_all_v(x, counts[gr].cuda(), int(counts.sum(0).max()) + 3, comm=group)
    check(f"all_to_all_v over a {name} group", out[:sum(recv)], want, True)
    if got.tolist() != recv:
        raise AssertionError(f"all_to_all_v over a {name} group: recv_counts {got.tolist()}, want {recv}")
    x = torch.randn(gw * 37, 5, device="cuda", dtype=torch.bfloat16, generator=g)
    root = gw - 1
    want = x.clone()
    dist.broadcast(want, group=group, group_src=root)
    check(f"broadcast over a {name} group", weft.broadcast(x, root=root, comm=group), want, True)
    check(f"scatter over a {name} group", weft.scatter(x, root=root, comm=group), want.chunk(gw)[gr], True)
    parts = [torch.empty_like(x) for _ in range(gw)]
    dist.all_gather(parts, x, group=group)
    got = weft.gather(x, root=0, comm=group)
    if gr == 0:
        check(f"gather over a {name} group", got, torch.cat(parts), True)
    # reduce: a small size (the all-reduce path) and one of the owned kernel (1 MiB and up).
    for n in (999, (1 << 19) + 24):
        x = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g)
        want = x.clone()
        dist.reduce(want, group=group, group_dst=root)
        got = weft.reduce(x, root=root, comm=group)
        if gr == root:
            check(f"reduce of {n} over a {name} group", got, want)
    return 12


def check_group_ops(name, group, g):
    """The TP matmul ops, ring attention, flash_decode and the MoE dispatch / combine over a process group, against
    torch over the same group (or a single-GPU reference every rank of the group builds alike). Returns the cases
    run."""
    gw, gr = dist.get_world_size(group), dist.get_rank(group)
    cases = 0
    m_shard, n, k = 136, 264, 136
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k**0.5
    a = torch.randn(m_shard, k, device="cuda", dtype=torch.bfloat16, generator=g)
    parts = [torch.empty_like(a) for _ in range(gw)]
    dist.all_gather(parts, a, group=group)
    want = (torch.cat(parts).float() @ w.float().t()).to(torch.bfloat16)
    check(f"all_gather_matmul over a {name} group", weft.all_gather_matmul(a, w.t(), comm=group), want)
    a_full = torch.randn(m_shard * gw, k, device="cuda", dtype=torch.bfloat16, generator=g)
    total = a_full.float() @ w.float().t()
    dist.all_reduce(total, group=group)
    check(f"matmul_all_reduce over a {name} group", weft.matmul_all_reduce(a_full, w.t(), comm=group),
          total.to(torch.bfloat16))
    check(f"matmul_reduce_scatter over a {name} group", weft.matmul_reduce_scatter(a_full, w.t(), comm=group),
          total[gr * m_shard:(gr + 1) * m_shard].to(torch.bfloat16))
    cases += 3
    # Ring attention over the group: the group's ranks build the same sequence (a seed per group).
    ag = torch.Generator(device="cuda").manual_seed(500 + dist.get_global_rank(group, 0))
    seq, heads, kv_heads, dim = 1000, 2 * gw, gw, 128
    q, kk, v, dout = (torch.randn(1, seq, h, dim, device="cuda", dtype=torch.bfloat16, generator=ag)
                      for h in (heads, kv_heads, kv_heads, heads))
    leaves = [t.clone().requires_grad_() for t in (q, kk, v)]
    ref = weft.flash_attention(*leaves, causal=True)
    ref.backward(dout)
    shard = lambda t: weft.ring_shard(t, gw, gr, causal=True, dim=1)  # noqa: E731
    mine = [shard(t).clone().requires_grad_() for t in (q, kk, v)]
    out = weft.ring_attention(*mine, causal=True, seq_len=seq, comm=group)
    out.backward(shard(dout))
    check(f"ring_attention over a {name} group", out, shard(ref.detach()))
    for grad_name, got, leaf in zip(("dq", "dk", "dv"), mine, leaves):
        check(f"ring_attention over a {name} group: {grad_name}", got.grad, shard(leaf.grad))
    cases += 4
    cases += check_flash_decode(gr, gw, comm=group)
    # MoE dispatch, each expert scaling its rows (1 + e / 4), combine, over the group's experts.
    experts_per_rank, top_k, hidden = 2, 2, 264
    num_experts = experts_per_rank * gw
    tokens, max_tokens = 150 + 11 * gr, 150 + 11 * gw
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    ids = torch.randint(-1, num_experts, (tokens, top_k), device="cuda", generator=g, dtype=torch.int32)
    weights = torch.rand(tokens, top_k, device="cuda", generator=g)
    d = weft.moe_dispatch(x, ids, num_experts, max_tokens=max_tokens, comm=group)
    y = weft.moe_combine_input(d)
    begin = 0
    for local, end in enumerate(d.group_end.tolist()):
        y[begin:end] = (d.rows[begin:end].float() * (1 + (gr * experts_per_rank + local) / 4)).to(torch.bfloat16)
        begin = end
    scale = 1 + ids.clamp(min=0).float() / 4
    want = torch.zeros(tokens, hidden, device="cuda")
    for j in range(top_k):
        routed = (x.float() * scale[:, j:j + 1]).to(torch.bfloat16).float()
        want += torch.where(ids[:, j:j + 1] >= 0, weights[:, j:j + 1] * routed, torch.zeros_like(routed))
    check(f"moe dispatch + combine over a {name} group", weft.moe_combine(y, d, weights), want.to(torch.bfloat16))
    return cases + 1


def check_moe_dispatch_fp8(rank, world, g):
    """weft.moe_dispatch_fp8 against weft.moe_dispatch on the same routing: the FP8 rows and scales are
    quantize_fp8's of the bf16 rows (bit for bit); grouped_scaled_mm on them in place gives the bits it gives on
    contiguous copies; combine takes the FP8 handle as the bf16 one. Returns the cases run."""
    per, top_k, hidden, n = 2, 2, 256, 128
    num_experts = per * world
    tokens, max_tokens = 150 + 11 * rank, 150 + 11 * (world - 1)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    ids = torch.randint(-1, num_experts, (tokens, top_k), device="cuda", generator=g, dtype=torch.int32)
    weights = torch.rand(tokens, top_k, device="cuda", generator=g)
    d = weft.moe_dispatch(x, ids, num_experts, max_tokens=max_tokens)
    rows = d.rows.clone()  # before the next dispatch reuses the team's area
    y = weft.moe_combine_input(d)
    y.copy_(rows)
    want = weft.moe_combine(y, d, weights)
    d8 = weft.moe_dispatch_fp8(x, ids, num_experts, max_tokens=max_tokens)
    q, s = weft.quantize_fp8(rows, "block", "a")
    # The routed rows: inside the groups (past the last one the area holds earlier calls' rows) and not padding
    # (zeros).
    inside = torch.arange(rows.shape[0], device="cuda") < d.group_end[-1]
    real = inside & (rows.float().abs().amax(1) > 0)
    check("moe_dispatch_fp8 values", d8.rows.view(torch.uint8)[real], q.view(torch.uint8)[real], exact=True)
    check("moe_dispatch_fp8 scales", d8.scales[real], s[real], exact=True)
    w = (torch.randn(per * n, hidden, device="cuda", generator=g) / 16).to(torch.bfloat16)
    qw, sw = weft.quantize_fp8(w, "block", "b")
    qw, sw = qw.view(per, n, hidden), sw.view(per, n // 128, -1)
    in_place = weft.grouped_scaled_mm(d8.rows, qw, d8.group_end, d8.scales, sw)
    dense = weft.grouped_scaled_mm(d8.rows.contiguous(), qw, d8.group_end, d8.scales.contiguous(), sw)
    check("grouped_scaled_mm on moe_dispatch_fp8's rows", in_place[real], dense[real], exact=True)
    y = weft.moe_combine_input(d8)
    y.copy_(rows)  # the experts' outputs: the bf16 rows themselves
    check("moe_combine after moe_dispatch_fp8", weft.moe_combine(y, d8, weights), want, exact=True)
    return 4 + check_moe_dispatch_fp8_low_latency(x, ids, weights, num_experts, max_tokens, qw, sw)


def check_moe_dispatch_fp8_low_latency(x, ids, weights, num_experts, max_tokens, qw, sw):
    """weft.moe_dispatch_fp8(low_latency=True): its rows dequantized and combined (identity experts) give the
    bits of the bf16 low-latency dispatch and combine of the tokens quantized and dequantized alike (rows land
    where atomics put them, so the combine is the check); grouped_scaled_mm with group_rows on the rows in place
    gives the counted rows' bits of the same call over every row of contiguous copies."""
    def dequant(q, s):
        return (q.float() * s.repeat_interleave(128, dim=1)[:, :q.shape[1]]).to(torch.bfloat16)

    with torch.no_grad():
        qx, sx = weft.quantize_fp8(x, "block", "a")
        xd = dequant(qx, sx)
        d = weft.moe_dispatch(xd, ids, num_experts, max_tokens=max_tokens, low_latency=True)
        y = weft.moe_combine_input(d)
        y.copy_(d.rows)
        want = weft.moe_combine(y, d, weights)
        d8 = weft.moe_dispatch_fp8(x, ids, num_experts, max_tokens=max_tokens, low_latency=True)
        counts = d8.group_rows.tolist()
        group = d8.rows.shape[0] // len(counts)
        live = torch.zeros(d8.rows.shape[0], dtype=torch.bool, device="cuda")
        for e, c in enumerate(counts):
            live[e * group:e * group + c] = True
        counted = weft.grouped_scaled_mm(d8.rows, qw, d8.group_end, d8.scales, sw, group_rows=d8.group_rows)
        every = weft.grouped_scaled_mm(d8.rows.contiguous(), qw, d8.group_end, d8.scales.contiguous(), sw)
        check("grouped_scaled_mm with group_rows on the low-latency FP8 rows", counted[live], every[live],
              exact=True)
        y8 = weft.moe_combine_input(d8)
        y8[live] = dequant(d8.rows[live], d8.scales[live])
        check("moe_combine after moe_dispatch_fp8(low_latency=True)", weft.moe_combine(y8, d8, weights), want,
              exact=True)
    return 2


def check_all_gather_scaled_matmul(rank, world):
    """weft's FP8 team ops against NCCL collectives and fp32 products of the dequantized operands (each 1 x 128
    group / 128 x 128 block, or each row, times its scale): all_gather_scaled_matmul against NCCL's all_gather of
    the FP8 shard and its scales; the reduce forms against each rank's product all-reduced by NCCL in fp32."""
    g = torch.Generator(device="cuda").manual_seed(77 + rank)

    def dequant(q, s, scaling, operand, rows, cols):
        if scaling == "rowcol":
            return q.float() * (s if operand == "a" else s.t())
        if operand == "a":
            return q.float() * s.repeat_interleave(128, dim=1)[:, :cols]
        return q.float() * s.repeat_interleave(128, dim=0)[:rows].repeat_interleave(128, dim=1)[:, :cols]

    cases = 0
    for m_shard, n, k in ((128, 256, 256), (200, 272, 272)):
        x = torch.randn(m_shard, k, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k**0.5
        for scaling in ("rowcol", "block"):
            qa, sa = weft.quantize_fp8(x, scaling, "a")
            qw, sw = weft.quantize_fp8(w, scaling, "b")
            w_f = dequant(qw, sw, scaling, "b", n, k)
            got = weft.all_gather_scaled_matmul(qa, qw.t(), sa, sw)
            parts = [torch.empty_like(qa.view(torch.uint8)) for _ in range(world)]
            dist.all_gather(parts, qa.view(torch.uint8))
            scale_parts = [torch.empty_like(sa) for _ in range(world)]
            dist.all_gather(scale_parts, sa)
            qa_all, sa_all = torch.cat(parts).view(qa.dtype), torch.cat(scale_parts)
            want = dequant(qa_all, sa_all, scaling, "a", m_shard * world, k) @ w_f.t()
            check(f"all_gather_scaled_matmul {scaling} {m_shard}x{n}x{k}", got, want.to(torch.bfloat16))
            # The reduce forms: this rank's whole a (its K-slice's partial product), summed over ranks.
            x_full = torch.randn(m_shard * world, k, device="cuda", dtype=torch.bfloat16, generator=g)
            qx, sx = weft.quantize_fp8(x_full, scaling, "a")
            part = dequant(qx, sx, scaling, "a", m_shard * world, k) @ w_f.t()
            dist.all_reduce(part)
            check(f"scaled_matmul_all_reduce {scaling} {m_shard}x{n}x{k}",
                  weft.scaled_matmul_all_reduce(qx, qw.t(), sx, sw), part.to(torch.bfloat16))
            mine = part[rank * m_shard:(rank + 1) * m_shard].to(torch.bfloat16)
            check(f"scaled_matmul_reduce_scatter {scaling} {m_shard}x{n}x{k}",
                  weft.scaled_matmul_reduce_scatter(qx, qw.t(), sx, sw), mine)
            cases += 3
    return cases


def check_flash_decode(rank, world, comm=None):
    """weft.flash_decode over a cache split over the ranks (sequence 0 on the last rank only, sequence 1 evenly)
    against torch SDPA on the whole cache, which every rank builds alike; causal among 2 new tokens, GQA 4:1;
    contiguous and paged. rank / world: of `comm` (a process group, or None: the whole team). Returns the
    cases run."""
    g = torch.Generator(device="cuda").manual_seed(99)  # the same on every rank
    batch, q_len, heads, kv_heads, dim = 2, 2, 8, 2, 128
    lengths = [3, 777]
    q = torch.randn(batch, q_len, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    ks = [torch.randn(n, kv_heads, dim, device="cuda", dtype=torch.bfloat16, generator=g) for n in lengths]
    vs = [torch.randn(n, kv_heads, dim, device="cuda", dtype=torch.bfloat16, generator=g) for n in lengths]
    parts = []  # per sequence, rank r's part [cut[r], cut[r + 1])
    for b, n in enumerate(lengths):
        parts.append([0] * world + [n] if b == 0 else [(n * r) // world for r in range(world + 1)])
    first = [parts[b][rank] for b in range(batch)]
    count = [parts[b][rank + 1] - parts[b][rank] for b in range(batch)]
    max_local = max(max(p[r + 1] - p[r] for r in range(world)) for p in parts)
    # The reference: each query attends the keys up to its own position (the last q_len positions).
    want = torch.empty_like(q)
    for b, n in enumerate(lengths):
        k = ks[b].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)  # [heads, n, dim]
        v = vs[b].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        mask = torch.arange(n, device="cuda")[None, :] <= (n - q_len + torch.arange(q_len, device="cuda"))[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(q[b].transpose(0, 1).float(), k.float(), v.float(),
                                                             attn_mask=mask)
        want[b] = o.transpose(0, 1).to(torch.bfloat16)
    seqlens = torch.tensor(count, dtype=torch.int32, device="cuda")
    offsets = torch.tensor(first, dtype=torch.int32, device="cuda")
    total = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    cases = 0
    # Contiguous.
    kc = torch.zeros(batch, max_local, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    for b in range(batch):
        kc[b, :count[b]] = ks[b][first[b]:first[b] + count[b]]
        vc[b, :count[b]] = vs[b][first[b]:first[b] + count[b]]
    check("flash_decode (contiguous cache split over the ranks)",
          weft.flash_decode(q, kc, vc, seqlens, cache_offsets=offsets, seq_total=total, comm=comm), want)
    cases += 1
    # Paged: blocks of 16 in reverse order.
    bs = 16
    max_blocks = -(-max_local // bs)
    table = torch.arange(batch * max_blocks, dtype=torch.int32, device="cuda").flip(0).reshape(batch, max_blocks)
    kp = torch.zeros(batch * max_blocks, bs, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    vp = torch.zeros_like(kp)
    for b in range(batch):
        for t in range(count[b]):
            blk = table[b, t // bs].item()
            kp[blk, t % bs] = ks[b][first[b] + t]
            vp[blk, t % bs] = vs[b][first[b] + t]
    check("flash_decode (paged cache split over the ranks)",
          weft.flash_decode(q, kp, vp, seqlens, block_table=table, cache_offsets=offsets, seq_total=total,
                            comm=comm), want)
    cases += 1
    # The result on one rank only (out_rank), each rank in turn, between calls of every rank's result: the others
    # get None, and the calls alternating the two modes keep their inboxes apart.
    for root in range(world):
        got = weft.flash_decode(q, kc, vc, seqlens, cache_offsets=offsets, seq_total=total, out_rank=root,
                                return_lse=True, comm=comm)
        if rank == root:
            check(f"flash_decode (out_rank={root})", got[0], want)
        elif got != (None, None):
            raise AssertionError(f"flash_decode (out_rank={root}) on rank {rank}: {got!r}, not (None, None)")
        check(f"flash_decode (every rank, after out_rank={root})",
              weft.flash_decode(q, kp, vp, seqlens, block_table=table, cache_offsets=offsets, seq_total=total,
                                comm=comm), want)
        cases += 2
    try:
        weft.flash_decode(q, kc, vc, seqlens, cache_offsets=offsets, seq_total=total, out_rank=world, comm=comm)
        raise AssertionError("flash_decode with out_rank past the team was not refused")
    except weft.WeftValueError as e:
        if "out_rank" not in str(e):
            raise AssertionError(f"flash_decode's out_rank refusal: {e}")
    return cases


def run_per_rank(main):
    """main(), and on its first failure a clear line for this rank, then a non-zero exit (torchrun's own report
    follows)."""
    try:
        main()
    except Exception as e:
        print(f"[rank {os.environ.get('RANK', '?')}] FAILED: {e}", flush=True)
        sys.exit(1)


if __name__ == "__main__":
    run_per_rank(main)
