"""A tensor-parallel (sequence-parallel) MLP block with weft, beside the same block in plain torch.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    PYTHONPATH=build/python torchrun --nproc_per_node=4 examples/tp_mlp.py [tokens hidden ffn]
    PYTHONPATH=build/python python3 examples/tp_mlp.py --ranks 4 [tokens hidden ffn]    # one GPU

Activations arrive sharded along tokens ([S/W, H] per rank). The up projection is column-parallel (each rank
holds [F/W, H] of W1), the down projection row-parallel (each rank holds [H, F/W] of W2):

    h = gelu(all_gather(x) @ W1_shard^T)        # [S, F/W]   weft.all_gather_matmul
    y = reduce_scatter(h @ W2_shard^T)          # [S/W, H]   weft.matmul_reduce_scatter

Training: a few SGD steps of the block on a regression loss, with autograd through weft's ops; the loss and
the gradients are compared at every step with plain torch (fp32) on the gathered data, and under torchrun
also with the block built from torch.distributed's differentiable collectives. Under torchrun it then times
the forward against torch.distributed + torch.matmul. With --ranks W the team is W virtual ranks of one GPU
(correctness only: virtual ranks share the GPU, so no timing).
"""
import statistics
import sys

import torch
import torch.nn.functional as F

import weft

# Against fp32, weft's bf16 block may differ by TOL, or by up to BF16_SLACK times what torch's own bf16 block
# differs at the same step (bf16 rounding alone reaches 3e-2 to 6e-2 here, growing over the SGD steps).
# Against torch's bf16 block (same inputs, same precision): TOL.
STEPS, LR, TOL, BF16_SLACK = 4, 0.5, 5e-2, 1.25


def against_fp32(err, torch_bf16_err):
    """err over what it may be against fp32 (<= 1 passes)."""
    return err / max(TOL, BF16_SLACK * torch_bf16_err)


def weft_block(comm, x, w1, w2):
    """The block with weft's fused ops (differentiable). w1, w2: fp32 master weights, computed with in bf16."""
    w1, w2 = w1.to(torch.bfloat16), w2.to(torch.bfloat16)
    h = F.gelu(weft.all_gather_matmul(x, w1.t(), comm=comm), approximate="tanh")
    return weft.matmul_reduce_scatter(h, w2.t(), comm=comm)


def gathered_block(xs, w1s, w2s):
    """The same block in plain torch on the whole team's data: every rank's output rows."""
    y = F.gelu(torch.cat(xs) @ torch.cat(w1s).t(), approximate="tanh") @ torch.cat(w2s, 1).t()
    return list(y.chunk(len(xs)))


def loss_of(ys, targets, tokens):
    """The team's loss: mean squared error over all tokens (each rank's rows against its targets)."""
    return sum(F.mse_loss(y.float(), t.float(), reduction="sum") for y, t in zip(ys, targets)) / (
        tokens * ys[0].shape[1])


def worse(worst, *errors):
    """The largest error over its limit so far; NaN sticks."""
    for e in (worst, *errors):
        if e != e:
            return float("nan")
    return max(worst, *errors)


def rel(a, b):
    a, b = a.float(), b.float()
    if torch.isnan(a).any():
        return float("nan")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def sgd(params):
    with torch.no_grad():
        for p in params:
            p -= LR * p.grad
            p.grad = None


def train_virtual(world, tokens, hidden, ffn):
    """The team is `world` virtual ranks of this GPU; the reference sees every rank's data directly."""
    team = weft.virtual_team(world)
    g = torch.Generator(device="cuda").manual_seed(0)

    def shards(*shape, scale=1.0):
        return [torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g) * scale for _ in range(world)]

    xs, targets = shards(tokens // world, hidden), shards(tokens // world, hidden)
    w1s = [w.float().requires_grad_() for w in shards(ffn // world, hidden, scale=hidden**-0.5)]
    w2s = [w.float().requires_grad_() for w in shards(hidden, ffn // world, scale=ffn**-0.5)]
    ref1 = [w.detach().clone().requires_grad_() for w in w1s]
    ref2 = [w.detach().clone().requires_grad_() for w in w2s]
    bf1 = [w.detach().clone().requires_grad_() for w in w1s]  # plain torch in bf16, for scale
    bf2 = [w.detach().clone().requires_grad_() for w in w2s]
    team.warmup(weft_block, xs, w1s, w2s)
    print(f"TP MLP block training, {world} virtual ranks of one GPU, tokens {tokens}, hidden {hidden}, ffn {ffn}")
    print("gradient errors: largest over ranks of |g - g_fp32| / |g_fp32|; torch bf16 = the block in plain torch "
          "with bf16 compute")
    print("| step | loss (weft) | loss (torch, fp32) | W1 grad err, weft | W2 grad err, weft | W1, torch bf16 | "
          "W2, torch bf16 |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    bf16 = lambda ws: [w.to(torch.bfloat16) for w in ws]
    worst = 0.0
    for step in range(STEPS):
        loss = loss_of(team.run(weft_block, xs, w1s, w2s), targets, tokens)
        loss.backward()
        want = loss_of(gathered_block([x.float() for x in xs], ref1, ref2), targets, tokens)
        want.backward()
        loss_of(gathered_block(xs, bf16(bf1), bf16(bf2)), targets, tokens).backward()
        errs = [max(rel(a.grad, b.grad) for a, b in zip(ws, refs))
                for ws, refs in ((w1s, ref1), (w2s, ref2), (bf1, ref1), (bf2, ref2))]
        el = rel(loss.detach().reshape(1), want.detach().reshape(1))
        print(f"| {step} | {loss.item():.6f} | {want.item():.6f} | " + " | ".join(f"{e:.2e}" for e in errs) + " |")
        worst = worse(worst, against_fp32(errs[0], errs[2]), against_fp32(errs[1], errs[3]), el / TOL)
        for ws in (w1s + w2s, ref1 + ref2, bf1 + bf2):
            sgd(ws)
    return worst


def train_distributed(comm, dist, tokens, hidden, ffn):
    """One process per GPU: against torch.distributed's differentiable collectives (same bf16 weights) and
    against plain torch in fp32 on the gathered data."""
    from torch.distributed.nn import functional as dnn
    rank, world = comm.rank, comm.world_size
    g = torch.Generator(device="cuda").manual_seed(100 + rank)
    x = torch.randn(tokens // world, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    target = torch.randn(tokens // world, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    w1 = (torch.randn(ffn // world, hidden, device="cuda", dtype=torch.bfloat16, generator=g) / hidden**0.5)
    w2 = (torch.randn(hidden, ffn // world, device="cuda", dtype=torch.bfloat16, generator=g) / ffn**0.5)
    # fp32 master weights (this rank's shards); weft's and torch.distributed's blocks compute in bf16.
    ours = [w.float().requires_grad_() for w in (w1, w2)]
    theirs = [w.float().requires_grad_() for w in (w1, w2)]
    full = [w.float().requires_grad_() for w in (w1, w2)]

    def gather(t, dim=0):
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts, dim)

    xs_all, targets_all = gather(x), gather(target)

    def dist_block(x, w1, w2):
        w1, w2 = w1.to(torch.bfloat16), w2.to(torch.bfloat16)
        h = F.gelu(torch.cat(dnn.all_gather(x)) @ w1.t(), approximate="tanh")
        out = torch.empty(x.shape[0], w2.shape[0], device="cuda", dtype=x.dtype)
        return dnn.reduce_scatter(out, list((h @ w2.t()).chunk(world)))

    def team_loss(y):  # the same team loss on every rank: the sum over ranks of each rank's part
        part = F.mse_loss(y.float(), target.float(), reduction="sum") / (tokens * hidden)
        total = part.detach().clone()
        dist.all_reduce(total)
        return part, total

    worst = 0.0
    if rank == 0:
        print(f"TP MLP block training, {world} GPUs, tokens {tokens}, hidden {hidden}, ffn {ffn}")
        print("| step | loss (weft) | loss (torch.distributed) | loss (torch, fp32) | grad rel. err vs "
              "torch.distributed | vs fp32 | torch.distributed's vs fp32 |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
    for step in range(STEPS):
        part, loss = team_loss(weft_block(comm, x, *ours))
        part.backward()
        dpart, dloss = team_loss(dist_block(x, *theirs))
        dpart.backward()
        # fp32 reference: the gathered weights (autograd through the gather of this rank's shards).
        w1_all = torch.cat(dnn.all_gather(full[0]))
        w2_all = torch.cat(dnn.all_gather(full[1].t().contiguous())).t()
        y_all = F.gelu(xs_all.float() @ w1_all.t(), approximate="tanh") @ w2_all.t()
        ref = F.mse_loss(y_all, targets_all.float(), reduction="sum") / (tokens * hidden)
        (ref / world).backward()  # every rank computes the whole loss; the gathers' backward sums the ranks
        errs = torch.tensor([max(rel(a.grad, b.grad) for a, b in zip(ours, theirs)),
                             max(rel(a.grad, b.grad) for a, b in zip(ours, full)),
                             max(rel(a.grad, b.grad) for a, b in zip(theirs, full))], device="cuda")
        dist.all_reduce(errs, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(f"| {step} | {loss.item():.6f} | {dloss.item():.6f} | {ref.item():.6f} | {errs[0].item():.2e} | "
                  f"{errs[1].item():.2e} | {errs[2].item():.2e} |")
        e = errs.tolist()
        worst = worse(worst, e[0] / TOL, against_fp32(e[1], e[2]),
                      rel(loss.reshape(1), ref.detach().reshape(1)) / TOL)
        for ws in (ours, theirs, full):
            sgd(ws)
    return worst


class TorchMLP:
    def __init__(self, dist, w1, w2, tokens, world):
        self.dist, self.w1, self.w2 = dist, w1, w2
        self.x_full = torch.empty(tokens, w1.shape[1], device="cuda", dtype=w1.dtype)
        self.y = torch.empty(tokens // world, w2.shape[0], device="cuda", dtype=w1.dtype)

    def __call__(self, x):
        self.dist.all_gather_into_tensor(self.x_full, x)
        h = F.gelu(self.x_full @ self.w1.t(), approximate="tanh")
        self.dist.reduce_scatter_tensor(self.y, h @ self.w2.t())
        return self.y


class WeftMLP:
    """Symmetric buffers for the two inputs of the communicating matmuls, so neither call copies."""

    def __init__(self, comm, w1, w2, tokens, world):
        self.w1, self.w2 = w1, w2
        self.x = torch.from_dlpack(comm.empty((tokens // world, w1.shape[1]), "bf16"))
        self.h = torch.from_dlpack(comm.empty((tokens, w1.shape[0]), "bf16"))
        self.up = torch.empty(tokens, w1.shape[0], device="cuda", dtype=w1.dtype)
        self.y = torch.empty(tokens // world, w2.shape[0], device="cuda", dtype=w1.dtype)

    def __call__(self, x):
        if x.data_ptr() != self.x.data_ptr():
            self.x.copy_(x)
        weft.all_gather_matmul(self.x, self.w1.t(), out=self.up)
        torch.ops.aten.gelu.out(self.up, approximate="tanh", out=self.h)
        return weft.matmul_reduce_scatter(self.h, self.w2.t(), out=self.y)


def device_us(dist, fn, iters=10, reps=7):
    fn()
    torch.cuda.synchronize()
    dist.barrier()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3 / iters)
    t = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def main_distributed(tokens, hidden, ffn):
    import torch.distributed as dist
    comm = weft.init()
    rank, world = comm.rank, comm.world_size
    torch.cuda.set_device(comm.device)
    dist.init_process_group("nccl", device_id=torch.device("cuda", comm.device))
    worst = train_distributed(comm, dist, tokens, hidden, ffn)
    g = torch.Generator(device="cuda").manual_seed(rank)
    w1 = torch.randn(ffn // world, hidden, device="cuda", dtype=torch.bfloat16, generator=g) / hidden**0.5
    w2 = torch.randn(hidden, ffn // world, device="cuda", dtype=torch.bfloat16, generator=g) / ffn**0.5
    x = torch.randn(tokens // world, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    ref, fast = TorchMLP(dist, w1, w2, tokens, world), WeftMLP(comm, w1, w2, tokens, world)
    want, got = ref(x).float(), fast(x).float()
    err = torch.tensor([rel(got, want)], device="cuda")
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    fast.x.copy_(x)
    t_torch, t_weft = device_us(dist, lambda: ref(x)), device_us(dist, lambda: fast(fast.x))
    if rank == 0:
        print(f"TP MLP block forward, {world} GPUs, tokens {tokens}, hidden {hidden}, ffn {ffn}, bf16:")
        print(f"  torch.distributed + torch.matmul: {t_torch:8.1f} us")
        print(f"  weft fused ops:                   {t_weft:8.1f} us   ({t_torch / t_weft:.2f}x)")
        print(f"  max relative difference weft vs torch: {err.item():.1e}")
        print(f"  training: worst difference in loss / gradients over its limit: {worst:.2f} (passes <= 1)")
    dist.destroy_process_group()
    return worse(err.item() / TOL, worst)


def main():
    args = sys.argv[1:]
    ranks = None
    if args[:1] == ["--ranks"]:
        ranks, args = int(args[1]), args[2:]
    if ranks is not None:
        tokens, hidden, ffn = (int(v) for v in args[:3]) if len(args) >= 3 else (1024 * ranks, 1024, 1024 * ranks)
        worst = train_virtual(ranks, tokens, hidden, ffn)
        print(f"worst difference in loss / gradients over its limit: {worst:.2f} (passes <= 1)")
    else:
        tokens, hidden, ffn = (int(v) for v in args[:3]) if len(args) >= 3 else (8192, 8192, 28672)
        worst = main_distributed(tokens, hidden, ffn)
    if not worst <= 1.0:
        print("FAILED: weft's block differs from torch's", flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
