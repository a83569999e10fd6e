"""GPU tests of weft's torch.distributed backend, one process per GPU:

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    PYTHONPATH=build/python torchrun --nproc_per_node=4 python/tests/gpu_backend.py

dist.init_process_group("weft"), then against an NCCL group of the same ranks made beside it: every collective
torch.distributed routes to the backend (odd sizes, empty all-to-all splits, bf16 / fp32 reductions, int64 and
uint8 moved as bytes, in-place results); what it refuses (product, send, CPU tensors), with the reason; torch's
own DDP and FSDP2 training a small model with the same losses and weights as on NCCL; at 4 ranks and more, a
2 x (W / 2) DeviceMesh whose dimensions' groups are weft sub-teams. Prints one line per rank; exits non-zero on
the first mismatch.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import weft

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_ops import check, run_per_rank  # noqa: E402

OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def both(fn, nccl):
    """fn(group) on the weft default group and on the NCCL group; their results."""
    return fn(None), fn(nccl)


def collectives(nccl, rank, world, g):
    cases = 0
    for dtype in (torch.bfloat16, torch.float32):
        for n in (1, 7, 4097, (1 << 20) + 3):
            x = torch.randn(n, device="cuda", dtype=dtype, generator=g)
            for op, rop in OPS.items():
                got, want = both(lambda grp: _done(x.clone(), lambda t: dist.all_reduce(t, op=rop, group=grp)), nccl)
                check(f"all_reduce {op} {dtype} {n}", got, want, exact=op in ("max", "min"))
                cases += 1
            out = lambda grp: _done(torch.empty(n * world, device="cuda", dtype=dtype),  # noqa: E731
                                    lambda o: dist.all_gather_into_tensor(o, x, group=grp))
            check(f"all_gather_into_tensor {dtype} {n}", *both(out, nccl), exact=True)
            big = torch.randn(n * world, device="cuda", dtype=dtype, generator=g)
            for op in ("sum", "avg"):
                rs = lambda grp: _done(torch.empty(n, device="cuda", dtype=dtype),  # noqa: E731
                                       lambda o: dist.reduce_scatter_tensor(o, big, op=OPS[op], group=grp))
                check(f"reduce_scatter_tensor {op} {dtype} {n}", *both(rs, nccl))
            cases += 3
    for dtype, n in ((torch.int64, 13), (torch.uint8, 10), (torch.int32, 1)):
        x = torch.randint(0, 100, (n,), device="cuda", generator=g).to(dtype) + rank
        out = lambda grp: _done(torch.empty(n * world, device="cuda", dtype=dtype),  # noqa: E731
                                lambda o: dist.all_gather_into_tensor(o, x, group=grp))
        check(f"all_gather_into_tensor {dtype} {n} (bytes)", *both(out, nccl), exact=True)
        lists = lambda grp: _done([torch.empty_like(x) for _ in range(world)],  # noqa: E731
                                  lambda outs: dist.all_gather(outs, x, group=grp))
        for q, (a, b) in enumerate(zip(*both(lists, nccl))):
            check(f"all_gather (list) {dtype} part {q}", a, b, exact=True)
        root = 1 % world
        bc = lambda grp: _done(x.clone(), lambda t: dist.broadcast(t, src=root, group=grp))  # noqa: E731
        check(f"broadcast {dtype} from {root}", *both(bc, nccl), exact=True)
        cases += 3
    return cases + rooted(nccl, rank, world, g) + all_to_all(nccl, rank, world, g)


def _done(result, call):
    """call(result), then result once the caller's stream may read it."""
    work = call(result)
    if work is not None:
        work.wait()
    return result


def rooted(nccl, rank, world, g):
    x = torch.randn(1000, 3, device="cuda", generator=g)
    root = world - 1
    red = lambda grp: _done(x.clone(), lambda t: dist.reduce(t, dst=root, op=dist.ReduceOp.SUM, group=grp))  # noqa
    got, want = both(red, nccl)
    if rank == root:
        check("reduce sum to the last rank", got, want)
    gat = lambda grp: _done([torch.empty_like(x) for _ in range(world)] if rank == 0 else None,  # noqa: E731
                            lambda outs: dist.gather(x, outs, dst=0, group=grp))
    got, want = both(gat, nccl)
    if rank == 0:
        for q in range(world):
            check(f"gather part {q}", got[q], want[q], exact=True)
    parts = [torch.randn(5, 7, device="cuda", generator=g) for _ in range(world)]
    sca = lambda grp: _done(torch.empty(5, 7, device="cuda"),  # noqa: E731
                            lambda o: dist.scatter(o, parts if rank == 0 else None, src=0, group=grp))
    check("scatter from rank 0", *both(sca, nccl), exact=True)
    dist.barrier()
    return 4


def all_to_all(nccl, rank, world, g):
    x = torch.randn(world * 6, 3, device="cuda", generator=g)
    eq = lambda grp: _done(torch.empty_like(x), lambda o: dist.all_to_all_single(o, x, group=grp))  # noqa: E731
    check("all_to_all_single, equal splits", *both(eq, nccl), exact=True)
    # Splits every rank knows (rank r sends table[r][q] rows to q), some empty, the largest on the last rank.
    table = [[(3 * r + 5 * q + 1) % 4 + (world if (r, q) == (world - 1, world - 1) else 0) for q in range(world)]
             for r in range(world)]
    send, recv = table[rank], [table[r][rank] for r in range(world)]
    for dtype in (torch.bfloat16, torch.int64):
        x = torch.randn(sum(send), 5, device="cuda", generator=g).mul(100).to(dtype)
        var = lambda grp: _done(torch.empty(sum(recv), 5, device="cuda", dtype=dtype),  # noqa: E731
                                lambda o: dist.all_to_all_single(o, x, recv, send, group=grp))
        check(f"all_to_all_single, splits {send} / {recv}, {dtype}", *both(var, nccl), exact=True)
    return 3


def two_streams(nccl, rank, world, g):
    """An all-gather and a reduce-scatter issued on two streams at once (as FSDP2 does), each against NCCL: the
    backend runs weft's in issue order, so they neither race on the rank's workspace nor cross between ranks."""
    x = torch.randn(1 << 18, device="cuda", generator=g)
    big = torch.randn(world << 18, device="cuda", generator=g)
    results = []
    for grp in (None, nccl):
        a, b = torch.cuda.Stream(), torch.cuda.Stream()
        a.wait_stream(torch.cuda.current_stream())
        b.wait_stream(torch.cuda.current_stream())
        ag, rs = torch.empty(world << 18, device="cuda"), torch.empty(1 << 18, device="cuda")
        with torch.cuda.stream(a):
            w1 = dist.all_gather_into_tensor(ag, x, group=grp, async_op=True)
        with torch.cuda.stream(b):
            w2 = dist.reduce_scatter_tensor(rs, big, group=grp, async_op=True)
        w1.wait()
        w2.wait()
        torch.cuda.synchronize()
        results.append((ag, rs))
    check("all_gather_into_tensor beside a reduce-scatter on another stream", results[0][0], results[1][0], exact=True)
    check("reduce_scatter_tensor beside an all-gather on another stream", results[0][1], results[1][1])
    return 2


def graph_capture(nccl, rank, world, g):
    """all_reduce, all_gather_into_tensor and reduce_scatter_tensor on the weft group captured in one CUDA graph
    (after an eager warm-up on the capture's side stream: weft's workspaces cannot grow during capture),
    replayed on new data; against NCCL's eager results."""
    n = 4096 + 8
    x = torch.zeros(n, device="cuda")
    big = torch.zeros(n * world, device="cuda")
    gathered, scattered = torch.empty(n * world, device="cuda"), torch.empty(n, device="cuda")

    def step():
        dist.all_reduce(x)
        dist.all_gather_into_tensor(gathered, x)
        dist.reduce_scatter_tensor(scattered, big)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    cases = 0
    for rep in range(3):
        x_in = torch.randn(n, device="cuda", generator=g)
        big_in = torch.randn(n * world, device="cuda", generator=g)
        x.copy_(x_in)
        big.copy_(big_in)
        graph.replay()
        want = x_in.clone()
        dist.all_reduce(want, group=nccl)
        check(f"all_reduce in a CUDA graph (replay {rep})", x, want)
        want_gathered = torch.empty(n * world, device="cuda")
        dist.all_gather_into_tensor(want_gathered, x.clone(), group=nccl)
        check(f"all_gather_into_tensor in a CUDA graph (replay {rep})", gathered, want_gathered, exact=True)
        want_scattered = torch.empty(n, device="cuda")
        dist.reduce_scatter_tensor(want_scattered, big_in, group=nccl)
        check(f"reduce_scatter_tensor in a CUDA graph (replay {rep})", scattered, want_scattered)
        cases += 3
    return cases


def refusals(rank, world):
    x = torch.ones(4, device="cuda")
    cases = [("product", lambda: dist.all_reduce(x, op=dist.ReduceOp.PRODUCT), "is not supported"),
             ("send", lambda: dist.send(x, dst=(rank + 1) % world), "point-to-point"),
             ("CPU tensor", lambda: dist.all_reduce(torch.ones(4)), "this rank's GPU")]
    for name, call, reason in cases:
        try:
            call()
        except Exception as e:  # raised through torch's C++ dispatch: the type may change, the reason not
            if reason not in str(e):
                raise AssertionError(f"refusal of {name}: expected '{reason}', got '{e}'")
            continue
        raise AssertionError(f"refusal of {name}: the call was not refused")
    return len(cases)


def model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)).cuda()


def train(m, rank, steps=5):
    """SGD on this rank's batches; this rank's loss of each step."""
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator(device="cuda").manual_seed(77 + rank)
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 64, device="cuda", generator=g)
        y = torch.randint(0, 10, (32,), device="cuda", generator=g)
        loss = nn.functional.cross_entropy(m(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def same_training(name, weft_model, nccl_model, rank):
    lw, ln = train(weft_model, rank), train(nccl_model, rank)
    check(f"{name}: losses of 5 steps", lw, ln)
    for (n, a), b in zip(weft_model.named_parameters(), nccl_model.parameters()):
        a = a.full_tensor() if hasattr(a, "full_tensor") else a
        b = b.full_tensor() if hasattr(b, "full_tensor") else b
        check(f"{name}: {n} after 5 steps", a.detach(), b.detach())
    return lw[-1].item()


def ddp_and_fsdp(nccl, rank):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.nn.parallel import DistributedDataParallel as DDP
    d = same_training("DDP", DDP(model(5), process_group=None), DDP(model(5), process_group=nccl), rank)
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    meshes = [DeviceMesh.from_group(grp, "cuda") for grp in (dist.group.WORLD, nccl)]
    fw, fn = model(6), model(6)
    for m, mesh in ((fw, meshes[0]), (fn, meshes[1])):
        for layer in m:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
    f = same_training("FSDP2", fw, fn, rank)
    return d, f


def mesh_dimensions(rank, world, g):
    """A 2 x (W / 2) DeviceMesh on the weft default group: each dimension's group is a weft sub-team; an
    all_reduce over it against NCCL groups of the same ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cuda", (2, world // 2), mesh_dim_names=("dp", "tp"))
    cases = 0
    for dim in ("dp", "tp"):
        ranks_of = [list(map(int, row)) for row in (mesh.mesh if dim == "tp" else mesh.mesh.t())]
        mine = [dist.new_group(r, backend="nccl") for r in ranks_of]  # collective: every rank makes each
        nccl = next(grp for grp, r in zip(mine, ranks_of) if rank in r)
        x = torch.randn(4099, device="cuda", generator=g)
        got = _done(x.clone(), lambda t: dist.all_reduce(t, group=mesh.get_group(dim)))
        want = _done(x.clone(), lambda t: dist.all_reduce(t, group=nccl))
        check(f"all_reduce over mesh dimension {dim}", got, want)
        if dist.get_backend(mesh.get_group(dim)) != "weft":
            raise AssertionError(f"mesh dimension {dim}: backend {dist.get_backend(mesh.get_group(dim))}")
        cases += 1
    return cases


def main():
    dist.init_process_group("weft")
    rank, world = dist.get_rank(), dist.get_world_size()
    if dist.get_backend() != "weft" or weft._default is None or weft._default.rank != rank:
        raise AssertionError(f"init_process_group('weft'): backend {dist.get_backend()}, weft team {weft._default}")
    nccl = dist.new_group(backend="nccl")
    g = torch.Generator(device="cuda").manual_seed(1234 + rank)
    cases = collectives(nccl, rank, world, g) + two_streams(nccl, rank, world, g) + refusals(rank, world)
    cases += graph_capture(nccl, rank, world, g)
    d, f = ddp_and_fsdp(nccl, rank)
    if world >= 4 and world % 2 == 0:
        cases += mesh_dimensions(rank, world, g)
    torch.cuda.synchronize()
    dist.barrier()
    print(f"[rank {rank}] weft backend: {cases} collective cases, DDP (final loss {d:.4f}) and FSDP2 ({f:.4f}) "
          "as on NCCL: passed", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    run_per_rank(main)
