"""GPU tests of a job spanning nodes from Python, one process per GPU, nodes real or fake (WEFT_NODE_SIZE=k: nodes
of k ranks on one host; NCCL forced onto sockets so the legs between them take the network path):

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 NCCL_P2P_DISABLE=1 \\
    NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 WEFT_NODE_SIZE=2 PYTHONPATH=build/python \\
    torchrun --nproc_per_node=4 python/tests/gpu_multinode.py [ops | backend]

ops (default): weft.init_multi_node()'s all_reduce / all_gather / reduce_scatter / broadcast / all_to_all against
NCCL's over every rank (dist.init_process_group("nccl")), bf16 and fp32, odd sizes, in place, and its
all_gather_matmul / matmul_reduce_scatter against torch's fp32 products, its MoE dispatch + combine against
torch; weft.init() refused with the way out.
backend: dist.init_process_group("weft") on the job: the same collectives through
torch.distributed against an NCCL group of every rank, what it refuses, and DDP training with the same losses as on
NCCL. One line per rank; non-zero exit on the first mismatch.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import weft

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_ops import check, run_per_rank  # noqa: E402


def magnitudes(x, scatter=False, group=None):
    """sum |x| over ranks (scatter: this rank's slice of it, as reduce_scatter sums), in fp32, by NCCL."""
    a = x.float().abs()
    if not scatter:
        dist.all_reduce(a, group=group)
        return a
    out = torch.empty(a.numel() // dist.get_world_size(group), device=a.device)
    dist.reduce_scatter_tensor(out, a, group=group)
    return out


def check_sum(name, got, want, magnitude):
    """A sum against NCCL's, within the dtype's tolerance of the magnitudes summed (magnitudes()): two orders of
    summation differ by rounding of their partial sums, whatever the sum itself is."""
    if torch.isnan(got).any():
        raise AssertionError(f"{name}: NaN in the output")
    err = ((got.float() - want.float()).norm() / magnitude.norm().clamp_min(1e-30)).item()
    if err > (1e-2 if got.dtype == torch.bfloat16 else 1e-6):
        raise AssertionError(f"{name}: error {err:.3e} of the magnitudes summed")


def ops_against_nccl(team, g):
    rank, world, cases = team.rank, team.world_size, 0
    for dtype in (torch.bfloat16, torch.float32):
        for n in (1, 7, 4096 + 5, (1 << 20) + 3):
            x = torch.randn(n, device="cuda", dtype=dtype, generator=g)
            for op, rop in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX)):
                want = x.clone()
                dist.all_reduce(want, op=rop)
                inplace = x.clone()
                team.all_reduce(inplace, op, out=inplace)
                for name, got in ((f"all_reduce {op} {dtype} {n}", team.all_reduce(x, op)),
                                  (f"all_reduce {op} {dtype} {n} in place", inplace)):
                    check(name, got, want, exact=True) if op == "max" else check_sum(name, got, want, magnitudes(x))
            want = torch.empty(n * world, device="cuda", dtype=dtype)
            dist.all_gather_into_tensor(want, x)
            check(f"all_gather {dtype} {n}", team.all_gather(x), want, exact=True)
            big = torch.randn(n * world, device="cuda", dtype=dtype, generator=g)
            want = torch.empty(n, device="cuda", dtype=dtype)
            dist.reduce_scatter_tensor(want, big)
            check_sum(f"reduce_scatter {dtype} {n}", team.reduce_scatter(big), want, magnitudes(big, True))
            root = world - 1
            want = x.clone()
            dist.broadcast(want, src=root)
            check(f"broadcast {dtype} {n} from {root}", team.broadcast(x, root=root), want, exact=True)
            want = torch.empty_like(big)
            dist.all_to_all_single(want, big)
            check(f"all_to_all {dtype} {n} per rank", team.all_to_all(big), want, exact=True)
            cases += 7
    # The tensor-parallel GEMMs across nodes against torch's fp32 products of the same bf16 inputs.
    for m in (64, 200):
        a = torch.randn(m, 256, device="cuda", dtype=torch.bfloat16, generator=g)
        torch.manual_seed(5)  # the [N, K] weight, the same on every rank
        w = torch.randn(264, 256, device="cuda", dtype=torch.bfloat16)
        every = torch.empty(m * world, 256, device="cuda", dtype=torch.bfloat16)
        dist.all_gather_into_tensor(every, a)
        gathered = torch.empty_like(every)
        got = team.all_gather_matmul(a, w.t(), gathered_a=gathered)
        check(f"all_gather_matmul m {m} (gathered a)", gathered, every, exact=True)
        check(f"all_gather_matmul m {m}", got, every.float() @ w.t().float())
        a = torch.randn(m * world, 256, device="cuda", dtype=torch.bfloat16, generator=g)
        b = torch.randn(256, 264, device="cuda", dtype=torch.bfloat16, generator=g)  # this rank's shard
        want = (a.float() @ b.float())
        dist.all_reduce(want)
        check(f"matmul_reduce_scatter m {m}", team.matmul_reduce_scatter(a, b), want[rank * m:(rank + 1) * m])
        cases += 2
    # MoE across nodes against torch: expert e scales its rows by (e + 1) / 8; each rank its own token count.
    per, k = 4, 3
    tokens, most = 50 + 7 * rank, 50 + 7 * (world - 1)
    x = torch.randn(tokens, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    ids = torch.randint(-1, per * world, (tokens, k), device="cuda", generator=g)  # -1: dropped
    w = torch.rand(tokens, k, device="cuda", generator=g)
    d = team.moe_dispatch(x, ids, w, per * world, max_tokens=most, align=8)
    expert_out = team.moe_combine_input(d)
    begin = 0
    for e, end in enumerate(d.group_end.tolist()):
        expert_out[begin:end] = d.rows[begin:end] * ((rank * per + e + 1) / 8)
        begin = end
    factor = torch.where(ids >= 0, (ids + 1).float() / 8, torch.zeros_like(w))
    check("moe dispatch + combine across nodes", team.moe_combine(expert_out, d),
                (w * factor).sum(1, keepdim=True) * x.float())
    cases += 1
    team.synchronize()
    return cases


def ops_mode(rank):
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    try:
        weft.init()
        raise AssertionError("weft.init() on a job spanning nodes was not refused")
    except weft.WeftError as e:
        if "init_multi_node" not in str(e):
            raise AssertionError(f"weft.init()'s refusal does not name init_multi_node: {e}")
    team = weft.init_multi_node()
    if team.nodes < 2 or team.rank != rank or team.node.world_size != team.node_size:
        raise AssertionError(f"init_multi_node: {team.nodes} nodes of {team.node_size}, rank {team.rank}, node team "
                             f"of {team.node.world_size}")
    cases = ops_against_nccl(team, torch.Generator(device="cuda").manual_seed(99 + rank))
    return f"{cases} collective cases against NCCL ({team.nodes} nodes of {team.node_size})"


def backend_mode(rank):
    dist.init_process_group("weft")
    world = dist.get_world_size()
    nccl = dist.new_group(backend="nccl")
    g = torch.Generator(device="cuda").manual_seed(7 + rank)
    x = torch.randn(4099, device="cuda", generator=g)
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX):
        a, b = x.clone(), x.clone()
        dist.all_reduce(a, op=op)
        dist.all_reduce(b, op=op, group=nccl)
        if op == dist.ReduceOp.MAX:
            check(f"backend all_reduce {op}", a, b, exact=True)
        else:
            check_sum(f"backend all_reduce {op}", a, b,
                      magnitudes(x, group=nccl) / (world if op == dist.ReduceOp.AVG else 1))
    a, b = torch.empty(4099 * world, device="cuda"), torch.empty(4099 * world, device="cuda")
    dist.all_gather_into_tensor(a, x)
    dist.all_gather_into_tensor(b, x, group=nccl)
    check("backend all_gather_into_tensor", a, b, exact=True)
    big = torch.randn(world * 1000, device="cuda", generator=g)
    a, b = torch.empty(1000, device="cuda"), torch.empty(1000, device="cuda")
    dist.reduce_scatter_tensor(a, big)
    dist.reduce_scatter_tensor(b, big, group=nccl)
    check_sum("backend reduce_scatter_tensor", a, b, magnitudes(big, True, nccl))
    ints = torch.arange(10, device="cuda", dtype=torch.int64) * (rank + 1)
    dist.broadcast(ints, src=world - 1)
    check("backend broadcast int64", ints, torch.arange(10, device="cuda", dtype=torch.int64) * world, exact=True)
    x = torch.randn(world * 1001, device="cuda", generator=g)
    a, b = torch.empty_like(x), torch.empty_like(x)
    dist.all_to_all_single(a, x)
    dist.all_to_all_single(b, x, group=nccl)
    check("backend all_to_all_single (equal splits)", a, b, exact=True)
    try:
        sizes = [2] * (world - 1) + [0]
        dist.all_to_all_single(torch.empty(sum(sizes), device="cuda"), torch.ones(sum(sizes), device="cuda"),
                               sizes, sizes)
        raise AssertionError("all_to_all_single with unequal splits on a job spanning nodes was not refused")
    except Exception as e:  # through torch's dispatch: the reason survives
        if "not built for a job spanning nodes" not in str(e):
            raise AssertionError(f"all_to_all_single's refusal: {e}")
    dist.barrier()
    from torch.nn.parallel import DistributedDataParallel as DDP

    def train(process_group):
        torch.manual_seed(5)
        m = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)).cuda(), process_group=process_group)
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        data = torch.Generator(device="cuda").manual_seed(77 + rank)
        losses = []
        for _ in range(5):
            xb = torch.randn(32, 64, device="cuda", generator=data)
            loss = nn.functional.cross_entropy(m(xb), torch.randint(0, 10, (32,), device="cuda", generator=data))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return torch.stack(losses)

    check("DDP losses, weft against NCCL", train(None), train(nccl))
    return "collectives through torch.distributed and DDP as on NCCL"


def main():
    rank = int(os.environ.get("RANK", "0"))
    mode = sys.argv[1] if len(sys.argv) > 1 else "ops"
    what = backend_mode(rank) if mode == "backend" else ops_mode(rank)
    torch.cuda.synchronize()
    print(f"[rank {rank}] weft multi-node ({mode}): {what}: passed", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    run_per_rank(main)
