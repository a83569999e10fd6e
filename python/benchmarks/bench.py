"""weft vs torch.distributed (NCCL) vs torch symmetric-memory ops, from Python, one process per GPU:

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    PYTHONPATH=build/python torchrun --nproc_per_node=4 python/benchmarks/bench.py [--quick]

Three tables (rank 0 prints markdown):
- collectives: device us per call of torch.distributed, weft, and torch's symmetric-memory all-reduce;
- tensor-parallel matmul ops (bf16, weights in nn.Linear layout): torch.distributed + torch.matmul in sequence,
  torch's symmetric-memory fused ops (torch.ops.symm_mem.fused_all_gather_matmul / fused_matmul_reduce_scatter),
  and weft; plus weft's relative error against the sequential torch result on the same inputs; the operands
  rotate through copies that together exceed 3 x L2 (a weight does not stay in L2 between calls);
- host time per weft call from Python (checks, pointer extraction, enqueue), per op, also as a multiple of a
  plain torch launch timed beside it (the host's speed drifts within a run).
Device times: CUDA events around back-to-back calls, median of reps, max over ranks; the matmul ops'
candidates are measured alternately, round after round (median over rounds), as the GPUs' speed drifts.
"""
import statistics
import sys
import time
import types

import torch
import torch.distributed as dist

import weft


def team_max(x):
    t = torch.tensor([x], device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def timed(fn, iters, reps=5):
    """Median over reps of the device time per call (us), max over ranks."""
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
    return team_max(statistics.median(times))


def timed_alternating(fns, iters, rounds=3, reps=3):
    """Like timed, for several callables measured in turn, round after round; each one's result is the median
    over rounds. The GPUs' speed drifts during long heavy runs (up to ~40% for one call within a process on
    4 x H200), so callables compared with each other are measured side by side, never one after the other."""
    names = [k for k, f in fns.items() if f is not None]
    per_round = {k: [] for k in names}
    for _ in range(rounds):
        for k in names:
            per_round[k].append(timed(fns[k], iters, reps))
    return {k: (statistics.median(per_round[k]) if k in per_round else None) for k in fns}


def graphed(fn, warmup=2):
    """fn captured once in a CUDA graph (after `warmup` eager calls on a side stream, as torch's capture wants):
    returns the graph's replay, a callable timed like fn without its host time per call. None where the
    capture fails (printed)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    captured = 1.0
    try:
        with torch.cuda.graph(graph):
            fn()
    except Exception as e:  # a baseline that cannot be captured gets no graph column, not a failed run
        print(f"  (no CUDA graph: {type(e).__name__}: {e})", flush=True)
        captured = 0.0
    # Every rank times the graph or none does (a rank timing alone would wait for ever at the barriers).
    flag = torch.tensor([captured], device="cuda")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return graph.replay if flag.item() == 1.0 else None


def host_us(fn, calls=200, reps=7):
    """Host time of one call (us): `calls` back-to-back calls, fewer than the launch queue holds, so the host
    never waits for the GPU; median over reps, max over ranks."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) * 1e6 / calls)
    torch.cuda.synchronize()
    return team_max(statistics.median(times))


def rel_err(got, want):
    if torch.isnan(got).any():
        return float("nan")
    return team_max(((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item())


def try_symm(fn):
    """torch symmetric-memory op, or None where this torch build (without multicast) cannot run it."""
    try:
        fn()
        torch.cuda.synchronize()
        return fn
    except Exception as e:  # noqa: BLE001: any failure means "not available here"
        print(f"[rank {dist.get_rank()}] torch symm-mem op unavailable: {type(e).__name__}: {e}"[:300],
              file=sys.stderr)
        return None


def fmt(x):
    if x is None:
        return "-"
    return f"{x:.1f}" if isinstance(x, float) else str(x)


def print_table(title, rows):
    if dist.get_rank() != 0 or not rows:
        return
    keys = list(rows[0])
    print(f"\n## {title}")
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(fmt(r.get(k, "")) for k in keys) + " |")
    sys.stdout.flush()


def bench_collectives(comm, world, group_name, symm, quick):
    rows = []
    for nbytes in (8 << 10, 1 << 20) if quick else (8 << 10, 256 << 10, 1 << 20, 16 << 20, 256 << 20):
        n = nbytes // 2
        iters = 200 if nbytes <= (1 << 20) else 20
        x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        sym = torch.from_dlpack(comm.empty((n,), "bf16"))
        sym_out = torch.from_dlpack(comm.empty((n,), "bf16"))
        sym.copy_(x)
        row = {"size": f"{nbytes >> 10} KiB"}
        row["all_reduce nccl"] = timed(lambda: dist.all_reduce(x), iters)
        row["all_reduce weft"] = timed(lambda: weft.all_reduce(sym, out=sym_out), iters)
        one_shot = None
        if symm is not None:
            buf = symm.empty(n, device="cuda", dtype=torch.bfloat16)
            symm.rendezvous(buf, group_name)
            buf.copy_(x)
            one_shot = try_symm(lambda: torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group_name))
        row["all_reduce torch symm one-shot"] = timed(one_shot, iters) if one_shot else "n/a"
        gathered = torch.empty(n * world, device="cuda", dtype=torch.bfloat16)
        row["all_gather nccl"] = timed(lambda: dist.all_gather_into_tensor(gathered, x), iters)
        row["all_gather weft"] = timed(lambda: weft.all_gather(sym, out=gathered), iters)
        scattered = torch.empty(n // world, device="cuda", dtype=torch.bfloat16)
        row["reduce_scatter nccl"] = timed(lambda: dist.reduce_scatter_tensor(scattered, x), iters)
        row["reduce_scatter weft"] = timed(lambda: weft.reduce_scatter(sym, out=scattered), iters)
        a2a = torch.empty_like(x)
        row["all_to_all nccl"] = timed(lambda: dist.all_to_all_single(a2a, x), iters)
        row["all_to_all weft"] = timed(lambda: weft.all_to_all(sym, out=a2a), iters)
        rows.append(row)
        del sym, sym_out
    print_table(f"collectives, bf16, {world} GPUs: device us per call (slowest rank)", rows)


def rotating_sets(bytes_per_copy):
    """How many copies of bytes_per_copy together exceed three times the L2 cache (1 to 8), as weft-bench's
    rotating_sets: a call reading copy k % n finds nothing in L2 from the call before (a model's layers each
    read their own weights and caches)."""
    l2 = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 50 << 20)
    return max(1, min(8, -(-3 * l2 // max(bytes_per_copy, 1))))


def rotating(make_set, set_bytes):
    """rotating_sets(set_bytes) copies of a benchmark's operands (make_set() each), and a maker of turns over
    them: each timed call reads its own copy."""
    sets = [make_set() for _ in range(rotating_sets(set_bytes))]

    def turns():
        i = 0

        def next_set():
            nonlocal i
            i = (i + 1) % len(sets)
            return sets[i]

        return next_set

    return sets, turns


def bench_matmul_ops(comm, world, rank, group_name, symm, quick):
    """The issue's shapes (global M, N, K; each rank multiplies by its slice, weights [N, K] as nn.Linear); the
    operands rotate through copies past 3 x L2 (rotating)."""
    rows = []
    ms = (2048, 8192) if quick else (1024, 4096, 8192, 16384, 32768)
    for n_glob, k_glob in ((8192, 8192), (28672, 8192)):
        for m in ms:
            iters = 10 if m <= 4096 else 3
            g = torch.Generator(device="cuda").manual_seed(100 + rank)

            def operands(rows_a, cols, n_w):  # a [rows_a, cols] (also symmetric), weight [n_w, cols]
                a = torch.randn(rows_a, cols, device="cuda", dtype=torch.bfloat16, generator=g)
                w = torch.randn(n_w, cols, device="cuda", dtype=torch.bfloat16, generator=g) / k_glob**0.5
                a_sym = torch.from_dlpack(comm.empty(tuple(a.shape), "bf16"))
                a_sym.copy_(a)
                return a, w, a_sym

            # all_gather_matmul: a [M/W, K] shard, weight [N/W, K].
            sets, turns = rotating(lambda: operands(m // world, k_glob, n_glob // world),
                                   2 * k_glob * (m // world + n_glob // world))
            gathered = torch.empty(m, k_glob, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n_glob // world, device="cuda", dtype=torch.bfloat16)

            def ag_seq(a_shard, w):
                dist.all_gather_into_tensor(gathered, a_shard)
                return gathered @ w.t()

            comm.barrier()
            a_shard, w, a_sym = sets[0]
            err = rel_err(weft.all_gather_matmul(a_sym, w.t(), out=out), ag_seq(a_shard, w))
            seq_set, fused_set, weft_set = turns(), turns(), turns()

            def ag_fused():
                a_shard, w, _ = fused_set()
                return torch.ops.symm_mem.fused_all_gather_matmul(a_shard, [w.t()], 0, group_name)

            def ag_weft():
                _, w, a_sym = weft_set()
                return weft.all_gather_matmul(a_sym, w.t(), out=out)

            fused = try_symm(ag_fused)
            t = timed_alternating({"seq": lambda: ag_seq(*seq_set()[:2]), "fused": fused, "weft": ag_weft}, iters)
            rows.append({"op": "all_gather_matmul", "M": m, "N": n_glob, "K": k_glob, "torch seq us": t["seq"],
                         "torch symm fused us": t["fused"] if fused else "n/a", "weft us": t["weft"],
                         "weft rel err": f"{err:.1e}", "operand copies": len(sets)})
            del sets, a_shard, w, a_sym, gathered, out
            # matmul_reduce_scatter / matmul_all_reduce: a [M, K/W], weight [N, K/W].
            sets, turns = rotating(lambda: operands(m, k_glob // world, n_glob), 2 * (k_glob // world) * (m + n_glob))
            rs_out = torch.empty(m // world, n_glob, device="cuda", dtype=torch.bfloat16)
            ar_out = torch.empty(m, n_glob, device="cuda", dtype=torch.bfloat16)

            def rs_seq(a, w):
                dist.reduce_scatter_tensor(rs_out, a @ w.t())
                return rs_out

            def ar_seq(a, w):
                p = a @ w.t()
                dist.all_reduce(p)
                return p

            comm.barrier()
            a, w, a_sym = sets[0]
            rs_want = rs_seq(a, w).clone()
            err = rel_err(weft.matmul_reduce_scatter(a_sym, w.t(), out=torch.empty_like(rs_out)), rs_want)
            seq_set, fused_set, weft_set, sym_set = turns(), turns(), turns(), turns()

            def rs_fused():
                a, w, _ = fused_set()
                return torch.ops.symm_mem.fused_matmul_reduce_scatter(a, w.t(), "sum", 0, group_name)

            def weft_op(op, out, turn):  # weft's op on the next copy, into out
                _, w, a_sym = turn()
                return op(a_sym, w.t(), out=out)

            fused = try_symm(rs_fused)
            t = timed_alternating({"seq": lambda: rs_seq(*seq_set()[:2]), "fused": fused,
                                   "weft": lambda: weft_op(weft.matmul_reduce_scatter, rs_out, weft_set)}, iters)
            rows.append({"op": "matmul_reduce_scatter", "M": m, "N": n_glob, "K": k_glob, "torch seq us": t["seq"],
                         "torch symm fused us": t["fused"] if fused else "n/a", "weft us": t["weft"],
                         "weft rel err": f"{err:.1e}", "operand copies": len(sets)})
            ar_want = ar_seq(a, w)
            err = rel_err(weft.matmul_all_reduce(a_sym, w.t(), out=ar_out), ar_want)
            # A symmetric out is the zero-copy path (an ordinary out costs a local copy of [M, N] at the end).
            ar_sym = torch.from_dlpack(comm.empty((m, n_glob), "bf16"))
            t = timed_alternating({"seq": lambda: ar_seq(*seq_set()[:2]),
                                   "weft": lambda: weft_op(weft.matmul_all_reduce, ar_out, weft_set),
                                   "weft sym": lambda: weft_op(weft.matmul_all_reduce, ar_sym, sym_set)}, iters)
            rows.append({"op": "matmul_all_reduce", "M": m, "N": n_glob, "K": k_glob, "torch seq us": t["seq"],
                         "torch symm fused us": "n/a (no such op)", "weft us": t["weft"], "weft rel err": f"{err:.1e}",
                         "operand copies": len(sets), "weft, symmetric out us": t["weft sym"]})
            del sets, a, w, a_sym, rs_out, ar_out, ar_want, rs_want, ar_sym
            torch.cuda.empty_cache()
    for r in rows:
        r.setdefault("weft, symmetric out us", "-")
        t = r["torch symm fused us"]
        best_torch = min(r["torch seq us"], t) if isinstance(t, float) else r["torch seq us"]
        r["weft vs best torch"] = f"{best_torch / r['weft us']:.2f}x"
    print_table(f"tensor-parallel matmul ops, bf16, {world} GPUs: device us per call (slowest rank)", rows)


def host_cases(comm, world):
    """The host-time rows, small tensors: (cases, through_op, t). cases: symmetric inputs and outputs (the
    zero-copy path), plain torch tensors (copied into symmetric memory inside the call), torch's own
    all_reduce for scale; through_op: calls that return a new tensor, through weft's torch operators (eagerly
    the operator's implementation is called directly, weft._torch_ops._plain_eager); t: the tensors they use
    (t.small also for a plain torch launch). Also python/benchmarks/host_ab.py's rows, on builds that may
    lack the newer ops (flash_decode)."""
    t = types.SimpleNamespace()
    t.x = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    t.sym = torch.from_dlpack(comm.empty((4096,), "bf16"))
    t.sym_out = torch.from_dlpack(comm.empty((4096 * world,), "bf16"))
    t.sym.copy_(t.x)
    t.a_sym = torch.from_dlpack(comm.empty((64, 64), "bf16"))
    t.a_sym.copy_(torch.randn(64, 64, device="cuda", dtype=torch.bfloat16))
    t.w = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    t.out = torch.empty(64 * world, 64, device="cuda", dtype=torch.bfloat16)
    t.small = torch.empty(4096, device="cuda", dtype=torch.bfloat16)
    x, sym, sym_out, a_sym, w, out, small = t.x, t.sym, t.sym_out, t.a_sym, t.w, t.out, t.small
    cases = {
        "all_reduce (symmetric in/out)": lambda: weft.all_reduce(sym, out=sym_out[:4096]),
        "all_reduce (torch tensors, copy-in)": lambda: weft.all_reduce(x, out=small),
        "all_gather (symmetric in)": lambda: weft.all_gather(sym, out=sym_out),
        "reduce_scatter (symmetric in)": lambda: weft.reduce_scatter(sym, out=sym_out[:4096 // world]),
        "all_to_all (symmetric in)": lambda: weft.all_to_all(sym, out=sym_out[:4096]),
        "all_gather_matmul (symmetric a)": lambda: weft.all_gather_matmul(a_sym, w.t(), out=out),
        "matmul_reduce_scatter (symmetric a)": lambda: weft.matmul_reduce_scatter(a_sym, w.t(), out=out[:64 // world]),
        "matmul_all_reduce (symmetric a)": lambda: weft.matmul_all_reduce(a_sym, w.t(), out=out[:64]),
        "torch.distributed.all_reduce (for scale)": lambda: dist.all_reduce(x),
    }
    a = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    through_op = {
        "all_reduce (returns its output)": lambda: weft.all_reduce(x),
        "matmul_all_reduce (returns its output)": lambda: weft.matmul_all_reduce(a, w.t()),
    }
    if hasattr(weft, "flash_decode"):
        q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
        kv = torch.randn(1, 4096, 8, 128, device="cuda", dtype=torch.bfloat16)
        lens = torch.full((1,), 4096, device="cuda", dtype=torch.int32)
        through_op["flash_decode (batch 1, 4096 tokens a rank, 32 / 8 heads)"] = lambda: weft.flash_decode(
            q, kv, kv, lens, causal=False)
    return cases, through_op, t


def bench_host_overhead(comm, world):
    """Host us per call with small tensors (host_cases), each also as a multiple of a plain torch launch
    timed beside it; for two calls, the C++ op and binding alone; for the calls that return their output,
    also through torch's operator dispatch (the last column)."""
    cases, through_op, t = host_cases(comm, world)
    cases.update(through_op)
    sym, sym_out, a_sym, w, out, small = t.sym, t.sym_out, t.a_sym, t.w, t.out, t.small
    # The same calls straight into the extension (pointers and sizes computed beforehand): what the C++ op
    # and pybind11 cost. The Python layer's own overhead is the difference.
    from weft import _torch_ops as ops, _weft

    stream = torch.cuda.current_stream().cuda_stream
    native = {
        "all_reduce (symmetric in/out)": lambda: _weft.all_reduce(comm._c, sym.data_ptr(), sym_out.data_ptr(), 4096,
                                                                  "bf16", "sum", stream),
        "all_gather_matmul (symmetric a)": lambda: _weft.all_gather_matmul(
            comm._c, a_sym.data_ptr(), w.data_ptr(), out.data_ptr(), 0, 64 * world, 64, 64, "nk", stream),
    }
    # The host's speed drifts while a run lasts (lent machines were seen switching between two speeds ~1.5x
    # apart, mid-run): each row is also given as a multiple of a plain torch launch (x.add_) timed just before
    # and after it. That damps the drift without removing it (the ratio of torch's own dist.all_reduce moved
    # ~10% between the two speeds, bench/RESULTS.md 2026-11-29): compare builds within one process speed.
    launch = lambda: small.add_(1)  # noqa: E731
    rows = []
    for name, fn in cases.items():
        before = host_us(launch)
        total = host_us(fn)
        beside = (before + host_us(launch)) / 2
        row = {"call": name, "host us per call (Python API)": total, "torch launches (x.add_ beside it)":
               f"{total / beside:.2f}", "of which C++ op + binding": "-", "Python layer": "-",
               "through torch's operator us": "-"}
        if name in native:
            direct = host_us(native[name])
            row["of which C++ op + binding"], row["Python layer"] = direct, total - direct
        if name in through_op:
            fast, ops._FAST_PATH = ops._FAST_PATH, False
            try:
                row["through torch's operator us"] = host_us(fn)
            finally:
                ops._FAST_PATH = fast
        rows.append(row)
    print_table(f"host time per call from Python, {world} GPUs (200 back-to-back calls, median of 7, max over ranks; "
                f"x.add_ beside it: {beside:.1f} us last)", rows)


def start(title):
    """weft's communicator and torch.distributed's NCCL group on this process's GPU; rank 0 prints the
    bench's header. Returns (comm, rank, world)."""
    comm = weft.init()
    torch.cuda.set_device(comm.device)
    dist.init_process_group("nccl", device_id=torch.device("cuda", comm.device))
    if comm.rank == 0:
        print(f"# {title}: {comm.world_size} GPUs ({torch.cuda.get_device_name()}), torch {torch.__version__}, "
              f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}", flush=True)
    return comm, comm.rank, comm.world_size


def enable_symm(group_name):
    """torch's symmetric-memory module with the group enabled (where this torch needs it), or None."""
    try:
        import torch.distributed._symmetric_memory as symm

        if hasattr(symm, "enable_symm_mem_for_group"):
            symm.enable_symm_mem_for_group(group_name)
        return symm
    except Exception:  # noqa: BLE001
        return None


def main():
    quick = "--quick" in sys.argv
    comm, rank, world = start("weft Python bench")
    group_name = dist.group.WORLD.group_name
    symm = enable_symm(group_name)
    bench_host_overhead(comm, world)
    bench_collectives(comm, world, group_name, symm, quick)
    bench_matmul_ops(comm, world, rank, group_name, symm, quick)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
