"""FP8 tensor-parallel ops, one process per GPU: weft against torch in the same run.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    PYTHONPATH=build/python torchrun --nproc_per_node=4 python/benchmarks/fp8_tp.py [--quick]

e4m3 operands with row-wise scales (weft.quantize_fp8 "rowcol": A [M, 1], the weight [1, N]), bf16 out; global
shapes (M, N, K) split as tensor parallelism splits them:
- all_gather_scaled_matmul: a [M / W, K] shard, weight [N / W, K]. torch seq: NCCL all_gather of the FP8 shard
  and of its scales, then torch._scaled_mm (cuBLAS); torch symm fused: torch.ops.symm_mem.
  fused_all_gather_scaled_matmul; weft.all_gather_scaled_matmul.
- scaled_matmul_reduce_scatter: a [M, K / W], weight [N, K / W]. torch seq: torch._scaled_mm then NCCL
  reduce_scatter_tensor; torch symm fused: torch.ops.symm_mem.fused_scaled_matmul_reduce_scatter;
  weft.scaled_matmul_reduce_scatter.
- scaled_matmul_all_reduce: as the reduce-scatter, NCCL all_reduce after torch._scaled_mm (torch has no fused op).
Device us per call (CUDA events, median, max over ranks), candidates measured in turns; weft's relative error
against torch seq's result.
"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import enable_symm, print_table, rel_err, start, timed_alternating, try_symm  # noqa: E402

import weft  # noqa: E402


def quantized(rows, cols, operand, g):
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16, generator=g)
    if operand == "b":
        x = x / cols**0.5
    return weft.quantize_fp8(x, "rowcol", operand)


def bench_all_gather(world, group_name, m, n, k, iters, g):
    qa, sa = quantized(m // world, k, "a", g)
    qw, sw = quantized(n // world, k, "b", g)
    gathered = torch.empty(m, k, device="cuda", dtype=torch.uint8)
    scales = torch.empty(m, 1, device="cuda", dtype=torch.float32)

    def seq():
        dist.all_gather_into_tensor(gathered, qa.view(torch.uint8))
        dist.all_gather_into_tensor(scales, sa)
        return torch._scaled_mm(gathered.view(qa.dtype), qw.t(), scale_a=scales, scale_b=sw,
                                out_dtype=torch.bfloat16)

    err = rel_err(weft.all_gather_scaled_matmul(qa, qw.t(), sa, sw), seq())
    fused = try_symm(lambda: torch.ops.symm_mem.fused_all_gather_scaled_matmul(
        qa, [qw.t()], sa, [sw], 0, group_name, [None], [None], [torch.bfloat16], [False]))
    t = timed_alternating({"seq": seq, "fused": fused,
                           "weft": lambda: weft.all_gather_scaled_matmul(qa, qw.t(), sa, sw)}, iters)
    return {"op": "all_gather_scaled_matmul", "M": m, "N": n, "K": k, "torch seq us": t["seq"],
            "torch symm fused us": t["fused"] if fused else "n/a", "weft us": t["weft"], "weft rel err": f"{err:.1e}"}


def bench_reduce(world, group_name, m, n, k, iters, g, all_reduce):
    qa, sa = quantized(m, k // world, "a", g)
    qw, sw = quantized(n, k // world, "b", g)
    rs_out = torch.empty(m // world, n, device="cuda", dtype=torch.bfloat16)

    def seq():
        p = torch._scaled_mm(qa, qw.t(), scale_a=sa, scale_b=sw, out_dtype=torch.bfloat16)
        if all_reduce:
            dist.all_reduce(p)
            return p
        dist.reduce_scatter_tensor(rs_out, p)
        return rs_out

    op = weft.scaled_matmul_all_reduce if all_reduce else weft.scaled_matmul_reduce_scatter
    err = rel_err(op(qa, qw.t(), sa, sw), seq().clone())
    fused = None
    if not all_reduce:
        fused = try_symm(lambda: torch.ops.symm_mem.fused_scaled_matmul_reduce_scatter(
            qa, qw.t(), sa, sw, "sum", 0, 0, group_name, [m, n], out_dtype=torch.bfloat16))
    t = timed_alternating({"seq": seq, "fused": fused, "weft": lambda: op(qa, qw.t(), sa, sw)}, iters)
    name = "scaled_matmul_all_reduce" if all_reduce else "scaled_matmul_reduce_scatter"
    return {"op": name, "M": m, "N": n, "K": k, "torch seq us": t["seq"],
            "torch symm fused us": (t["fused"] if fused else "n/a") if not all_reduce else "n/a (no such op)",
            "weft us": t["weft"], "weft rel err": f"{err:.1e}"}


def main():
    quick = "--quick" in sys.argv
    _, rank, world = start("weft FP8 tensor-parallel bench")
    group_name = dist.group.WORLD.group_name
    enable_symm(group_name)
    g = torch.Generator(device="cuda").manual_seed(300 + rank)
    rows = []
    for n, k in ((8192, 8192), (28672, 8192)):
        for m in ((2048, 8192) if quick else (2048, 4096, 8192, 16384)):
            iters = 10 if m <= 4096 else 3
            rows.append(bench_all_gather(world, group_name, m, n, k, iters, g))
            rows.append(bench_reduce(world, group_name, m, n, k, iters, g, all_reduce=False))
            rows.append(bench_reduce(world, group_name, m, n, k, iters, g, all_reduce=True))
            torch.cuda.empty_cache()
    for r in rows:
        t = r["torch symm fused us"]
        best = min(r["torch seq us"], t) if isinstance(t, float) else r["torch seq us"]
        r["weft vs best torch"] = f"{best / r['weft us']:.2f}x"
    print_table(f"FP8 tensor-parallel ops (e4m3, row-wise scales, bf16 out), {world} GPUs: device us per call "
                "(slowest rank)", rows)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
