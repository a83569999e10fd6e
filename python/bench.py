"""weft vs torch.distributed (NCCL) vs torch symmetric-memory ops, from Python, one process per GPU:

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    PYTHONPATH=build/python torchrun --nproc_per_node=4 python/bench.py

Device time per call from CUDA events around many back-to-back calls (the slowest rank's median), and the
host time of one weft call (Python overhead: argument checks, pointer extraction, enqueue).
"""
import statistics
import time

import torch
import torch.distributed as dist

import weft


def timed(fn, iters, reps=5):
    """Median over reps of the device time per call (us), max over ranks."""
    fn()
    torch.cuda.synchronize()
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


def symm_mem_ops():
    """torch's symmetric-memory all-reduce, if this torch build has it (multicast stays off)."""
    try:
        import torch.distributed._symmetric_memory as symm_mem

        return symm_mem
    except Exception:
        return None


def main():
    comm = weft.init()
    rank, world = comm.rank, comm.world_size
    torch.cuda.set_device(comm.device)
    dist.init_process_group("nccl", device_id=torch.device("cuda", comm.device))
    group = dist.group.WORLD
    symm = symm_mem_ops()
    rows = []
    for nbytes in (8 << 10, 256 << 10, 1 << 20, 16 << 20, 256 << 20):
        n = nbytes // 2
        x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        sym = torch.from_dlpack(comm.empty((n,), "bf16"))
        sym_out = torch.from_dlpack(comm.empty((n,), "bf16"))
        sym.copy_(x)
        iters = 200 if nbytes <= (1 << 20) else 20
        row = {"size": nbytes}
        row["all_reduce nccl"] = timed(lambda: dist.all_reduce(x), iters)
        row["all_reduce weft"] = timed(lambda: weft.all_reduce(sym, out=sym_out), iters)
        if symm is not None:
            try:
                buf = symm.empty(n, device="cuda", dtype=torch.bfloat16)
                symm.rendezvous(buf, group.group_name)
                buf.copy_(x)
                row["all_reduce torch symm"] = timed(
                    lambda: torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group.group_name), iters)
            except Exception as e:  # not available in this build / without multicast
                row["all_reduce torch symm"] = f"n/a ({type(e).__name__})"
        gathered = torch.empty(n * world, device="cuda", dtype=torch.bfloat16)
        row["all_gather nccl"] = timed(lambda: dist.all_gather_into_tensor(gathered, x), iters)
        row["all_gather weft"] = timed(lambda: weft.all_gather(x, out=gathered), iters)
        scattered = torch.empty(n // world, device="cuda", dtype=torch.bfloat16)
        row["reduce_scatter nccl"] = timed(lambda: dist.reduce_scatter_tensor(scattered, x), iters)
        row["reduce_scatter weft"] = timed(lambda: weft.reduce_scatter(x, out=scattered), iters)
        a2a = torch.empty_like(x)
        row["all_to_all nccl"] = timed(lambda: dist.all_to_all_single(a2a, x), iters)
        row["all_to_all weft"] = timed(lambda: weft.all_to_all(x, out=a2a), iters)
        rows.append(row)
    # Host overhead of one weft call (tiny tensor: the GPU keeps up, the host is the limit).
    small, small_out = torch.randn(8, device="cuda", dtype=torch.bfloat16), torch.empty(8, device="cuda",
                                                                                        dtype=torch.bfloat16)
    for _ in range(100):
        weft.all_reduce(small, out=small_out)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(2000):
        weft.all_reduce(small, out=small_out)
    host_us = (time.perf_counter() - t0) * 1e6 / 2000
    torch.cuda.synchronize()
    if rank == 0:
        keys = [k for k in rows[0] if k != "size"]
        print(f"# weft vs torch.distributed, bf16, {world} GPUs, device us per call (slowest rank)")
        print("| size | " + " | ".join(keys) + " |")
        print("|---" * (len(keys) + 1) + "|")
        for r in rows:
            cells = [f"{r[k]:.1f}" if isinstance(r[k], float) else str(r[k]) for k in keys]
            print(f"| {r['size'] >> 10} KiB | " + " | ".join(cells) + " |")
        print(f"\nhost time per weft.all_reduce call (8 elements, torch tensors): {host_us:.1f} us")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
