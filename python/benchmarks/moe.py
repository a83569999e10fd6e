"""Expert-parallel MoE on real GPUs, one process per GPU: weft's dispatch, combine and MoE layer against a torch
baseline and the all-to-all bandwidth measured in the same run.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    PYTHONPATH=build/python torchrun --nproc_per_node=W python/benchmarks/moe.py [--quick]

Shapes: DeepSeek-V3-like (hidden 7168, 256 experts over the ranks, top-8, expert intermediate 2048) and
Mixtral-like (hidden 4096, 8 experts, top-2, intermediate 14336); 128, 512, 4096, 8192, 16384 tokens per rank
(--quick: 128, 4096); routing uniform, or with one rank's experts 4x as likely as the others' ("hot").
- weft layer: weft.moe_layer with SwiGLU in the first GEMM's epilogue, unfused combine and fused (second GEMM +
  combine in one kernel), the dispatch as the layer's default picks it (fused with the first GEMM from 4 ranks
  with at most 32 experts and 2048 tokens); the fused-combine layer with the dispatch fused and unfused, forced;
  its parts alone: dispatch, combine, the two grouped GEMMs (on the dispatched rows);
- weft FP8 layer: weft.moe_layer_fp8 on the same weights quantized to e4m3 with 128 x 128 block scales (tokens
  dispatched in FP8 with 1 x 128 scales, block-scaled FP8 grouped GEMMs, bf16 combine), its time against the best
  bf16 weft layer and its largest difference from the torch bf16 layer (relative to the output's largest value);
- torch layer: all_to_all_single of the per-expert counts (then read on the host for the splits), of the tokens
  (one row per (token, expert) pair), a permute into expert groups (padded to 16 rows for _grouped_mm),
  torch._grouped_mm, silu(gate) * up, torch._grouped_mm, all_to_all_single back, the weighted un-permute in fp32;
- all-to-all: torch.distributed's (NCCL) and weft's of equal splits moving as many bytes to the other ranks
  as the dispatch does;
- graph columns: dispatch and combine replayed from CUDA graphs (decoding's way: no host time per call), and
  at <= 256 tokens a rank the layer and the low-latency dispatch (weft.moe_dispatch(low_latency=True)), its
  combine and its layer (inference), and the low-latency floor: the bytes a rank moves at NVLink's peak egress
  (450 GB/s) plus one signal round trip (3 us).
Bandwidth counts the bytes that cross to other ranks (dispatch: one row per token and remote destination rank;
combine: one row per remote slot), per rank, max over ranks of per-rank medians; the layer's target is
<= 1.10 x max(dispatch + combine, grouped GEMMs).
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import graphed, print_table, start, team_max, timed, timed_alternating  # noqa: E402

import weft  # noqa: E402

GROUP_ALIGN = 16  # rows per group torch._grouped_mm is given (its kernels want aligned group starts)


def routing(tokens, num_experts, top_k, world, hot, seed):
    """Top-k distinct experts per token; hot: rank 0's experts 4x as likely. Weights: softmax of random logits."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    p = torch.ones(num_experts, device="cuda")
    if hot:
        p[: num_experts // world] = 4.0
    experts = torch.multinomial(p.expand(tokens, num_experts), top_k, replacement=False, generator=g)
    weights = torch.softmax(torch.randn(tokens, top_k, device="cuda", generator=g), dim=1)
    return experts.to(torch.int32), weights


LINK_GBPS = 450.0  # NVLink egress a GPU, H100 / H200 SXM (18 links of 25 GB/s each way)
ROUND_TRIP_US = 3.0  # a signal's round trip between two GPUs (bench/RESULTS.md, "latency: signal round trip")


def crossing_rows(experts, rank, world, local):
    """(rows dispatch sends to other ranks: one per token and remote rank; rows combine moves: one per remote
    slot)."""
    dest = experts.long() // local
    remote = dest != rank
    per_rank = torch.zeros(experts.shape[0], world, dtype=torch.bool, device=experts.device)
    per_rank.scatter_(1, dest, True)
    per_rank[:, rank] = False
    return int(per_rank.sum().item()), int(remote.sum().item())


class TorchLayer:
    """The baseline MoE layer from torch ops (see the module's docstring)."""

    def __init__(self, w_up, w_down, num_experts, world):
        self.w_up, self.w_down = w_up, w_down  # [E_local, hidden, 2 inter], [E_local, inter, hidden]
        self.num_experts, self.world = num_experts, world
        self.local = num_experts // world
        self.inter = w_down.shape[1]

    def __call__(self, x, experts, weights):
        tokens, top_k = experts.shape
        flat = experts.flatten().long()
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, hence by rank
        send = x.index_select(0, order // top_k)
        counts = torch.bincount(flat, minlength=self.num_experts).to(torch.int64)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts)  # [source][local expert]
        both = torch.stack((counts.view(self.world, self.local).sum(1), recv_counts.view(self.world, self.local).sum(1)))
        send_splits, recv_splits = both.tolist()
        recv = x.new_empty(sum(recv_splits), x.shape[1])
        dist.all_to_all_single(recv, send, recv_splits, send_splits)
        # Rows arrive by source, then expert: regroup them by local expert, each group padded for _grouped_mm.
        per = recv_counts.view(self.world, self.local)
        expert_of = torch.repeat_interleave(torch.arange(self.local, device=x.device).repeat(self.world),
                                            recv_counts, output_size=recv.shape[0])
        perm = torch.argsort(expert_of, stable=True)
        group = per.sum(0)
        padded = (group + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
        start = torch.cumsum(padded, 0) - padded
        first = torch.cumsum(group, 0) - group
        e_sorted = expert_of[perm]
        dest = start[e_sorted] + torch.arange(recv.shape[0], device=x.device) - first[e_sorted]
        rows_total = int(recv.shape[0] + self.local * GROUP_ALIGN)  # an upper bound: no host read
        rows = x.new_zeros(rows_total, x.shape[1])
        rows[dest] = recv[perm]
        offs = torch.cumsum(padded, 0).to(torch.int32)
        h = torch._grouped_mm(rows, self.w_up, offs=offs)
        a = F.silu(h[:, : self.inter]) * h[:, self.inter:]
        y = torch._grouped_mm(a, self.w_down, offs=offs)
        back = torch.empty_like(recv)
        back[perm] = y[dest]
        out_rows = x.new_empty(send.shape)
        dist.all_to_all_single(out_rows, back, send_splits, recv_splits)
        contrib = out_rows.float() * weights.flatten()[order].unsqueeze(1).float()
        out = torch.zeros(tokens, x.shape[1], device=x.device, dtype=torch.float32)
        out.index_add_(0, order // top_k, contrib)
        return out.to(x.dtype)


def bench_config(comm, rank, world, model, tokens, hot):
    name, hidden, num_experts, top_k, inter = model
    local = num_experts // world
    g = torch.Generator(device="cuda").manual_seed(7 + rank)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    experts, weights = routing(tokens, num_experts, top_k, world, hot, 100 * tokens + rank)
    # This rank's experts' weights as stacked nn.Linear weights ([E, N, K]) used as [E, K, N].
    w_up = (torch.randn(local, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16, generator=g) /
            hidden**0.5).transpose(-2, -1)
    w_down = (torch.randn(local, hidden, inter, device="cuda", dtype=torch.bfloat16, generator=g) /
              inter**0.5).transpose(-2, -1)
    w_up_i = weft.swiglu_interleave(w_up)
    baseline = TorchLayer(w_up, w_down, num_experts, world)
    # The same weights in FP8 with 128 x 128 block scales, [E, N, K] (weft.moe_layer_fp8's layout).
    fp8_up = [weft.quantize_fp8(w.t().contiguous(), "block", "b") for w in w_up]
    fp8_down = [weft.quantize_fp8(w.t().contiguous(), "block", "b") for w in w_down]
    q_up, s_up = (torch.stack(t) for t in zip(*fp8_up))
    q_down, s_down = (torch.stack(t) for t in zip(*fp8_down))
    del fp8_up, fp8_down
    fp8_layer = lambda: weft.moe_layer_fp8(x, experts, weights, q_up, s_up, q_down, s_down,  # noqa: E731
                                           num_experts)

    def layer(fused, fused_dispatch=None):
        return lambda: weft.moe_layer(x, experts, weights, w_up_i, w_down, num_experts, swiglu_interleaved=True,
                                      fused_combine=fused, fused_dispatch=fused_dispatch)

    with torch.no_grad():
        want = baseline(x, experts, weights).float()
        got = {f: layer(f)().float() for f in (False, True)}
        scale = want.abs().max().item()
        err = team_max(max((got[f] - want).abs().max().item() for f in got) / max(scale, 1e-30))
        fp8_err = team_max((fp8_layer().float() - want).abs().max().item() / max(scale, 1e-30))
        # The parts alone, on one dispatch.
        d = weft.moe_dispatch(x, experts, num_experts)
        y_in = weft.moe_combine_input(d)

        def gemms():
            a = weft.grouped_mm(d.rows, w_up_i, d.group_end, validate=False, zero_unused_rows=False,
                                activation="swiglu")
            return weft.grouped_mm(a, w_down, d.group_end, validate=False, zero_unused_rows=False)

        y_in.copy_(gemms())
        iters = 3 if tokens >= 8192 else 10
        parts = {"dispatch": timed(lambda: weft.moe_dispatch(x, experts, num_experts), iters, reps=3)}
        d = weft.moe_dispatch(x, experts, num_experts)  # combine reads the latest dispatch
        y_in = weft.moe_combine_input(d)
        parts["combine"] = timed(lambda: weft.moe_combine(y_in, d, weights), iters, reps=3)
        parts["gemms"] = timed(gemms, iters, reps=3)
        # The same from CUDA graphs (as decoding runs them: the kernels' time without the host's per call).
        graph_parts = {"dispatch": graphed(lambda: weft.moe_dispatch(x, experts, num_experts))}
        d = weft.moe_dispatch(x, experts, num_experts)
        y_in = weft.moe_combine_input(d)
        y_in.copy_(gemms())
        graph_parts["combine"] = graphed(lambda: weft.moe_combine(y_in, d, weights))
        if tokens <= 256:  # the low-latency dispatch and its combine (inference)
            graph_parts["LL dispatch"] = graphed(
                lambda: weft.moe_dispatch(x, experts, num_experts, low_latency=True))
            dl = weft.moe_dispatch(x, experts, num_experts, low_latency=True)
            yl = weft.moe_combine_input(dl)
            a = weft.grouped_mm(dl.rows, w_up_i, dl.group_end, validate=False, zero_unused_rows=False,
                                activation="swiglu", group_rows=dl.group_rows)
            yl.copy_(weft.grouped_mm(a, w_down, dl.group_end, validate=False, zero_unused_rows=False,
                                     group_rows=dl.group_rows))
            graph_parts["LL combine"] = graphed(lambda: weft.moe_combine(yl, dl, weights))
            ll_layer = lambda: weft.moe_layer(x, experts, weights, w_up_i, w_down, num_experts,  # noqa: E731
                                              swiglu_interleaved=True, low_latency=True)
            graph_parts["LL layer"] = graphed(ll_layer)
            graph_parts["layer"] = graphed(layer(False))
            ll_err = team_max((ll_layer().float() - want).abs().max().item() / max(scale, 1e-30))
        graph_us = {k: (timed(f, iters, reps=3) if f is not None else None) for k, f in graph_parts.items()}
        whole = timed_alternating({"weft": layer(False), "weft fused": layer(True),
                                   "weft, dispatch fused": layer(True, True),
                                   "weft, dispatch unfused": layer(True, False), "weft FP8": fp8_layer,
                                   "torch": lambda: baseline(x, experts, weights)}, iters, rounds=2, reps=3)
        # All-to-all of equal splits moving as many bytes to the other ranks as the dispatch does.
        sent_rows, slot_rows = crossing_rows(experts, rank, world, local)
        cross = team_max(sent_rows * hidden * 2)
        per_peer = max(1, int(cross // (world - 1) // 2))
        buf = torch.randn(world * per_peer, device="cuda", dtype=torch.bfloat16)
        sym = torch.from_dlpack(comm.empty((world * per_peer,), "bf16"))
        sym.copy_(buf)
        a2a_out = torch.empty_like(buf)
        a2a = timed_alternating({"nccl": lambda: dist.all_to_all_single(a2a_out, buf),
                                 "weft": lambda: weft.all_to_all(sym, out=a2a_out)}, iters, rounds=2, reps=3)
        del sym
    comm_us = parts["dispatch"] + parts["combine"]
    bound = max(comm_us, parts["gemms"])
    best = min(whole["weft"], whole["weft fused"])
    a2a_bw = (world - 1) * per_peer * 2 / (min(a2a.values()) * 1e3)  # GB/s (bytes / us / 1e3)
    disp_bw = team_max(sent_rows * hidden * 2) / (parts["dispatch"] * 1e3)
    comb_bw = team_max(slot_rows * hidden * 2) / (parts["combine"] * 1e3)
    # The low-latency floor: the bytes a rank moves over NVLink at its peak egress, plus one signal round trip
    # (the end wait): the dispatch pushes a token once per remote rank of its experts; the combine pulls one row
    # per remote slot.
    ll = tokens <= 256
    ll_floor = [team_max(n * hidden * 2) / (LINK_GBPS * 1e3) + ROUND_TRIP_US for n in (sent_rows, slot_rows)]
    unit = (lambda us: f"{us:.1f} us") if tokens <= 512 else (lambda us: f"{us / 1e3:.3f} ms")
    in_graph = (lambda k: "-" if graph_us.get(k) is None else unit(graph_us[k]))
    return {
        "model": name, "tokens / rank": tokens, "routing": "hot rank 4x" if hot else "uniform",
        "dispatch": unit(parts["dispatch"]), "dispatch GB/s": f"{disp_bw:.0f}",
        "combine": unit(parts["combine"]), "combine GB/s": f"{comb_bw:.0f}",
        "a2a GB/s (nccl / weft)": f"{(world - 1) * per_peer * 2 / (a2a['nccl'] * 1e3):.0f} / "
                                  f"{(world - 1) * per_peer * 2 / (a2a['weft'] * 1e3):.0f}",
        "dispatch / a2a bw": f"{disp_bw / a2a_bw:.2f}", "combine / a2a bw": f"{comb_bw / a2a_bw:.2f}",
        "GEMMs": unit(parts["gemms"]), "weft layer": unit(whole["weft"]), "weft fused": unit(whole["weft fused"]),
        "weft fused, dispatch fused / unfused": f"{unit(whole['weft, dispatch fused'])} / "
                                                f"{unit(whole['weft, dispatch unfused'])}",
        "torch layer": unit(whole["torch"]), "weft / max(comm, GEMMs)": f"{best / bound:.2f}",
        "torch / weft": f"{whole['torch'] / best:.2f}", "max err vs torch": f"{err:.1e}",
        "weft FP8 layer": unit(whole["weft FP8"]), "FP8 / bf16 weft layer": f"{whole['weft FP8'] / best:.2f}",
        "FP8 max err vs torch bf16": f"{fp8_err:.1e}",
        "graph: dispatch / combine": f"{in_graph('dispatch')} / {in_graph('combine')}",
        "graph, low latency: dispatch / combine": f"{in_graph('LL dispatch')} / {in_graph('LL combine')}",
        "graph: layer / low-latency layer": f"{in_graph('layer')} / {in_graph('LL layer')}",
        "low latency: floor dispatch / combine": f"{unit(ll_floor[0])} / {unit(ll_floor[1])}" if ll else "-",
        "low latency / floor: dispatch / combine": " / ".join(
            "-" if graph_us.get(k) is None else f"{graph_us[k] / f:.2f}"
            for k, f in (("LL dispatch", ll_floor[0]), ("LL combine", ll_floor[1]))) if ll else "-",
        "low latency max err vs torch": f"{ll_err:.1e}" if ll else "-",
    }


def main():
    quick = "--quick" in sys.argv
    comm, rank, world = start("expert-parallel MoE")
    models = [("DeepSeek-V3-like", 7168, 256, 8, 2048), ("Mixtral-like", 4096, 8, 2, 14336)]
    sizes = [128, 4096] if quick else [128, 512, 4096, 8192, 16384]
    for model in models:
        if model[2] % world:
            continue
        rows = []
        for tokens in sizes:
            for hot in (False, True):
                rows.append(bench_config(comm, rank, world, model, tokens, hot))
                if rank == 0:
                    print(f"  {model[0]} {tokens} tokens {'hot' if hot else 'uniform'} done", flush=True)
                torch.cuda.empty_cache()
        print_table(f"MoE layer, {model[0]} (hidden {model[1]}, {model[2]} experts, top-{model[3]}, inter "
                    f"{model[4]}), bf16, {world} GPUs: times are the slowest rank's medians", rows)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
