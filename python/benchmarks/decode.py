"""Distributed flash-decode, one process per GPU: weft.flash_decode against torch baselines in the same run.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    PYTHONPATH=build/python torchrun --nproc_per_node=W python/benchmarks/decode.py [--quick]

Each sequence's KV cache (bf16, head dim 128, q_len 1) is split evenly over the W ranks.
- weft: weft.flash_decode over the rank's part, partials merged on every rank inside the kernel;
- torch SDPA (one GPU): the whole cache on one GPU, torch's flash kernel with the group's query heads as rows
  (q_len 1: every row sees every key), timed on every GPU at once (each holds the whole cache), the slowest:
  the single-GPU reference;
- torch split + NCCL: each rank's flash kernel over its part with its log-sum-exp, an NCCL all_gather of the
  partial outputs and LSEs, and their merge (softmax of the LSEs over ranks): the bulk-synchronous way.
Floor: the KV bytes a rank reads over the GPU's device-to-device copy rate (read + write), measured here.
Every method reads copies of its cache in turn, together past 3 x L2 (a model's layers each read their own
cache): a timed callable makes one call on each copy and its time is divided by their count.
Columns: time in us (max over ranks of per-rank medians, CUDA events, methods measured in turns), each method
replayed from a CUDA graph (as decoding runs: the kernels' time) and called eagerly (back-to-back calls: the
larger of the host's time per call and the kernels'); floor / the graph time; max |error| of weft's output
against the one-GPU result.
"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import graphed, print_table, rotating_sets, start, team_max, timed, timed_alternating  # noqa: E402

import weft  # noqa: E402

aten = torch.ops.aten


def copy_rate():
    """Bytes per second of read + write traffic of a 1 GiB device-to-device copy on this GPU."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    us = timed(lambda: b.copy_(a), 5)
    return 2 * a.numel() / (us * 1e-6)


def every_copy(fn, sets):
    """One call of fn(c) for each copy c (the last call's result)."""
    def run():
        for c in range(sets):
            r = fn(c)
        return r
    return run


def flash_rows(q_rows, k, v, scale):
    """Attention of q_rows [B, KV, G, D] over k, v [B, KV, n, D] (every row sees every key): out, lse."""
    r = aten._scaled_dot_product_flash_attention(q_rows, k, v, 0.0, False, False, scale=scale)
    return r[0], r[1]  # [B, KV, G, D], [B, KV, G] fp32


def main():
    quick = "--quick" in sys.argv
    comm, rank, world = start("flash_decode")
    rate = copy_rate()
    cases = [(1, 8192, 64, 8), (1, 131072, 64, 8), (16, 8192, 64, 8), (64, 8192, 32, 8), (8, 32768, 32, 8)]
    if quick:
        cases = [(1, 32768, 64, 8), (16, 8192, 64, 8)]
    rows = []
    for batch, seq, heads, kv_heads in cases:
        dim, group = 128, heads // kv_heads
        local = -(-seq // world)
        g = torch.Generator(device="cuda").manual_seed(5)  # the same on every rank: the whole cache
        q = torch.randn(batch, 1, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g)
        k_all = torch.randn(batch, seq, kv_heads, dim, device="cuda", dtype=torch.bfloat16, generator=g)
        v_all = torch.randn(k_all.shape, device="cuda", dtype=torch.bfloat16, generator=g)
        first, count = min(seq, rank * local), min(seq, (rank + 1) * local) - min(seq, rank * local)
        k = torch.zeros(batch, local, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        v = torch.zeros_like(k)
        k[:, :count] = k_all[:, first:first + count]
        v[:, :count] = v_all[:, first:first + count]
        seqlens = torch.full((batch,), count, dtype=torch.int32, device="cuda")
        offsets = torch.full((batch,), first, dtype=torch.int32, device="cuda")
        total = torch.full((batch,), seq, dtype=torch.int32, device="cuda")
        scale = dim ** -0.5
        # [B, KV, G, D] rows and [B, KV, n, D] K / V for torch's kernel.
        q_rows = q.reshape(batch, kv_heads, group, dim)
        sets = rotating_sets(k.numel() * 4)
        ks, vs = [k] + [k.clone() for _ in range(sets - 1)], [v] + [v.clone() for _ in range(sets - 1)]
        k_parts = [x[:, :count].transpose(1, 2) for x in ks]
        v_parts = [x[:, :count].transpose(1, 2) for x in vs]
        whole_sets = rotating_sets(k_all.numel() * 4)
        k_wholes = [k_all.transpose(1, 2)] + [k_all.transpose(1, 2).clone() for _ in range(whole_sets - 1)]
        v_wholes = [v_all.transpose(1, 2)] + [v_all.transpose(1, 2).clone() for _ in range(whole_sets - 1)]

        def run_weft(c=0):
            return weft.flash_decode(q, ks[c], vs[c], seqlens, cache_offsets=offsets, seq_total=total, causal=False)

        def run_torch_split(c=0):
            out, lse = flash_rows(q_rows, k_parts[c], v_parts[c], scale)
            outs = torch.empty((world,) + out.shape, device="cuda", dtype=out.dtype)
            lses = torch.empty((world,) + lse.shape, device="cuda", dtype=lse.dtype)
            dist.all_gather_into_tensor(outs, out)
            dist.all_gather_into_tensor(lses, lse)
            w = torch.softmax(lses, dim=0)  # [W, B, KV, G]
            return (outs.float() * w[..., None]).sum(0).to(torch.bfloat16)

        weft_all, split_all = every_copy(run_weft, sets), every_copy(run_torch_split, sets)
        times = timed_alternating({"weft": weft_all, "torch split + NCCL": split_all,
                                   "weft, graph": graphed(weft_all), "torch split + NCCL, graph": graphed(split_all)},
                                  iters=20)
        times = {name: (t / sets if t else t) for name, t in times.items()}
        one = timed(every_copy(lambda c: flash_rows(q_rows, k_wholes[c], v_wholes[c], scale), whole_sets),
                    20) / whole_sets
        want = flash_rows(q_rows, k_wholes[0], v_wholes[0], scale)[0].reshape(batch, 1, heads, dim)
        err = (run_weft().float() - want.float()).abs().max().item()
        floor = batch * local * kv_heads * dim * 2 * 2 / rate * 1e6
        kernel = times["weft, graph"] or times["weft"]
        rows.append({"batch": batch, "tokens": seq, "heads": f"{heads}/{kv_heads}", "GPUs": world,
                     "weft us, graph": times["weft, graph"], "weft us, eager": times["weft"],
                     "torch split + NCCL us, graph": times["torch split + NCCL, graph"],
                     "torch split + NCCL us, eager": times["torch split + NCCL"],
                     "torch SDPA one GPU us": one, "floor us": floor,
                     "floor / weft (graph)": f"{100 * floor / kernel:.0f}%", "max |err|": f"{team_max(err):.2e}"})
    print_table(f"flash_decode, bf16, D 128, q_len 1, {world} GPUs (floor: KV bytes / {rate / 1e9:.0f} GB/s)", rows)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
