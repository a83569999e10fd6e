"""Where a sequence-parallel call's time goes at small sizes: the host's or the GPU's. For each method the time
per call three ways, one process per GPU:

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    PYTHONPATH=build/python torchrun --nproc_per_node=W python/benchmarks/host_vs_gpu.py [TOKENS_PER_GPU...]

- eager: CUDA events around back-to-back calls, as context_parallel.py times them (host and GPU overlapped);
- host: the host's time to issue one call (perf_counter, calls issued behind a sleeping GPU, so no issue waits
  for the GPU);
- GPU: the events' time of the same calls, issued while the GPU slept (torch.cuda._sleep): the GPU runs them
  back to back, host gaps removed. "GPU / eager" near 1: the GPU is the limit; well under 1: the host is.
Forward (no grad) and forward + backward (autograd), Llama3-8B-like heads (32 / 8, head dim 128, causal), bf16,
batch 1; tokens per GPU from the arguments (default 2048 8192). Max over ranks of per-rank medians. --kernels:
also each method's GPU activities of one forward + backward call, in order, with the idle time between them
(torch.profiler).
"""
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import print_table, start, team_max, timed  # noqa: E402
from context_parallel import sdpa_preferring_cudnn, torch_ulysses  # noqa: E402

import weft  # noqa: E402


def us_per_sleep_cycle():
    """The GPU's time per cycle of torch.cuda._sleep (its clock), from events around a long sleep."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(int(2e7))
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / 2e7


def behind_sleep(fn, per_cycle, calls=20, reps=5):
    """(host us, GPU us) per call: `calls` calls issued while the GPU sleeps for twice the time their issue
    took the first time (so the GPU starts them only once all are queued), median over reps."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    issue_us = (time.perf_counter() - t0) * 1e6
    torch.cuda.synchronize()
    cycles = int((2 * issue_us + 500) / per_cycle)
    host, gpu = [], []
    for _ in range(reps):
        dist.barrier()  # the ranks' sleeps start together (their calls wait for each other)
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        start_ev, stop_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start_ev.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        host.append((time.perf_counter() - t0) * 1e6 / calls)
        awake = start_ev.query()  # the sleep over before the last call was issued: host gaps in the GPU time
        stop_ev.record()
        stop_ev.synchronize()
        gpu.append(start_ev.elapsed_time(stop_ev) * 1e3 / calls if not awake else float("nan"))
    return team_max(statistics.median(host)), team_max(statistics.median(gpu))


def kernel_list(fn, title, rank):
    """--kernels: one call under torch.profiler (after a warm-up call), every rank alike; rank 0 prints its GPU
    activities in order (start from the first, length, the idle time before it, name) and the call's busy time
    against its span: where a call's GPU time goes kernel by kernel, and how much of it is waiting for the
    host."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    dist.barrier()
    if rank != 0:
        return
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    if not events:
        print(f"## {title}: no GPU activity recorded", flush=True)
        return
    t0, end, busy = events[0].time_range.start, events[0].time_range.start, 0.0
    print(f"## {title}: GPU activities of one call (rank 0), us", flush=True)
    print("| start | length | idle before | activity |\n|---|---|---|---|")
    for e in events:
        length = e.time_range.elapsed_us()
        idle = max(0.0, e.time_range.start - end)
        print(f"| {e.time_range.start - t0:.1f} | {length:.1f} | {idle:.1f} | {e.name[:100]} |")
        busy += length
        end = max(end, e.time_range.end)
    print(f"busy {busy:.1f} us of a {end - t0:.1f} us span\n", flush=True)


def main():
    comm, rank, world = start("host vs GPU time per call, sequence-parallel attention")
    kernels = "--kernels" in sys.argv[1:]
    per_gpu = [int(a) for a in sys.argv[1:] if a != "--kernels"] or [2048, 8192]
    per_cycle = us_per_sleep_cycle()
    h, kvh, d, causal = 32, 8, 128, True
    rows = []
    for n in per_gpu:
        s = n * world
        g = torch.Generator(device="cuda").manual_seed(77 + n)
        zig = torch.tensor(weft.ring_shard_indices(world, rank, causal, seq_len=s), device="cuda")
        cont = torch.arange(rank * n, (rank + 1) * n, device="cuda")
        full = [torch.randn(1, s, x, d, device="cuda", dtype=torch.bfloat16, generator=g) for x in (h, kvh, kvh, h)]
        methods = {
            "weft ring": (zig, lambda q, k, v: weft.ring_attention(q, k, v, causal=causal)),
            "weft ulysses": (zig, lambda q, k, v: weft.ulysses_attention(q, k, v, causal=causal)),
            "torch ulysses": (cont, lambda q, k, v: torch_ulysses(q, k, v, causal, world)),
            "single weft, whole sequence": (None, None),
        }
        for name, (idx, f) in methods.items():
            if f is None:  # the whole sequence on one GPU (every rank alike), for scale
                q, k, v, do = full
                f = lambda q, k, v: weft.flash_attention(q, k, v, causal=causal)  # noqa: E731
            else:
                q, k, v, do = (x.index_select(1, idx).contiguous() for x in full)
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]

            def fwd(f=f, q=q, k=k, v=v):
                with torch.no_grad(), sdpa_preferring_cudnn():
                    f(q, k, v)

            def fwd_bwd(f=f, leaves=leaves, do=do):
                with sdpa_preferring_cudnn():
                    torch.autograd.grad(f(*leaves), leaves, do)

            if kernels and f is not None:
                kernel_list(fwd_bwd, f"{name}, {n} tokens / GPU, fwd+bwd", rank)
            for label, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
                eager = timed(fn, 20)
                host, gpu = behind_sleep(fn, per_cycle)
                rows.append({"tokens / GPU": n, "method": name, "pass": label, "eager us": f"{eager:.1f}",
                             "host us": f"{host:.1f}", "GPU us": f"{gpu:.1f}", "GPU / eager": f"{gpu / eager:.2f}"})
        if rank == 0:
            print(f"  {n} tokens / GPU done", flush=True)
    print_table(f"per call, Llama3-8B-like (32 / 8 heads, head dim 128, causal), bf16, {world} GPUs", rows)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
