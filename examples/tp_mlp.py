"""A tensor-parallel (sequence-parallel) MLP block with weft, beside the same block in plain torch.distributed.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    PYTHONPATH=build/python torchrun --nproc_per_node=4 examples/tp_mlp.py [tokens hidden ffn]

Activations arrive sharded along tokens ([S/W, H] per rank). The up projection is column-parallel (each rank
holds [F/W, H] of W1), the down projection row-parallel (each rank holds [H, F/W] of W2):

    h = gelu(all_gather(x) @ W1_shard^T)        # [S, F/W]   weft.all_gather_matmul
    y = reduce_scatter(h @ W2_shard^T)          # [S/W, H]   weft.matmul_reduce_scatter
"""
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import weft


class TorchMLP:
    def __init__(self, w1, w2, tokens, world):
        self.w1, self.w2 = w1, w2
        self.x_full = torch.empty(tokens, w1.shape[1], device="cuda", dtype=w1.dtype)
        self.y = torch.empty(tokens // world, w2.shape[0], device="cuda", dtype=w1.dtype)

    def __call__(self, x):
        dist.all_gather_into_tensor(self.x_full, x)
        h = F.gelu(self.x_full @ self.w1.t(), approximate="tanh")
        dist.reduce_scatter_tensor(self.y, h @ self.w2.t())
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


def device_us(fn, iters=10, reps=7):
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


def main():
    tokens, hidden, ffn = (int(v) for v in sys.argv[1:4]) if len(sys.argv) >= 4 else (8192, 8192, 28672)
    comm = weft.init()
    rank, world = comm.rank, comm.world_size
    torch.cuda.set_device(comm.device)
    dist.init_process_group("nccl", device_id=torch.device("cuda", comm.device))
    g = torch.Generator(device="cuda").manual_seed(rank)
    w1 = torch.randn(ffn // world, hidden, device="cuda", dtype=torch.bfloat16, generator=g) / hidden**0.5
    w2 = torch.randn(hidden, ffn // world, device="cuda", dtype=torch.bfloat16, generator=g) / ffn**0.5
    x = torch.randn(tokens // world, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    ref, fast = TorchMLP(w1, w2, tokens, world), WeftMLP(comm, w1, w2, tokens, world)
    want, got = ref(x).float(), fast(x).float()
    err = torch.tensor([((got - want).norm() / want.norm()).item()], device="cuda")
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    fast.x.copy_(x)
    t_torch, t_weft = device_us(lambda: ref(x)), device_us(lambda: fast(fast.x))
    if rank == 0:
        print(f"TP MLP block, {world} GPUs, tokens {tokens}, hidden {hidden}, ffn {ffn}, bf16:")
        print(f"  torch.distributed + torch.matmul: {t_torch:8.1f} us")
        print(f"  weft fused ops:                   {t_weft:8.1f} us   ({t_torch / t_weft:.2f}x)")
        print(f"  max relative difference weft vs torch: {err.item():.1e}")
    dist.destroy_process_group()
    if err.item() > 2e-2 or err.isnan().item():
        sys.exit(1)


if __name__ == "__main__":
    main()
