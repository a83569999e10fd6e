#!/usr/bin/env python3
"""A model, not a measurement: the time of weft's hierarchical collectives across nodes (weft's NVLink kernels
inside each node, NCCL between nodes) beside a flat ring over every GPU, at 2-16 nodes of 8 GPUs.

    python3 scripts/scaleout_model.py                       # the table of bench/RESULTS.md (markdown)
    python3 scripts/scaleout_model.py --gpus-per-node 4 --net-gbps 200 --sizes 16M,1G

Each op is a sum of legs, each leg latency + bytes / bandwidth (the alpha-beta model):
  inside a node   weft's measured busbw on NVLink (4 x H200, bench/RESULTS.md: all-reduce 345, all-gather
                  352, reduce-scatter 331, all-to-all 353 GB/s at >= 256 MiB; a meeting ~7 us per call)
  between nodes   one NIC per GPU (--net-gbps per GPU, 400 Gb/s by default: 8 x 400 Gb/s per node) at
                  --net-efficiency of line rate, --net-latency-us per step
Hierarchical forms (every GPU drives its own NIC in the cross-node leg, on 1 / gpus_per_node of the data):
  all-reduce      reduce-scatter in the node, all-reduce of the shard across nodes (NCCL: its ring or tree,
                  whichever is faster), all-gather in the node; the legs pipelined in chunks overlap the node
                  legs with the network leg
  all-gather      the network leg (ring over nodes, each GPU its rank's shard) then the node all-gather of what
                  arrived; pipelined likewise
  reduce-scatter  the mirror of all-gather
  all-to-all      the cross-node share (1 - 1 / nodes of every rank's data) over the NICs, the node share on
                  NVLink beside it (the two overlap)
  MoE dispatch    all-to-all of tokens, each token sent once per destination node (DeepEP's aggregation)
                  rather than once per expert (top_k copies): the network carries distinct_nodes / top_k of it
  MoE, every node weft's hierarchical_moe_dispatch as built: every token once to every node (fixed-size legs,
                  no count exchange), then the dispatch inside the node; the network carries (nodes - 1) /
                  top_k of the naive all-to-all's data
  all_gather_matmul  size = the gathered A per GPU (bf16 [rows, K]), the GEMM 2 rows K N flops at --gemm-tflops
                  (N = --gemm-n, this GPU's columns): as built, the cross-node all-gather on NCCL beside the
                  GEMM on the rows already in the node: max(all-gather, GEMM) + one chunk's GEMM
  matmul_reduce_scatter  size = the GEMM's output per GPU before the reduction: as built, the GEMM, then the
                  hierarchical reduce-scatter (the network leg not yet overlapped with the GEMM)
Flat: NCCL's rings over all P GPUs, one ring per NIC (gpus_per_node rings, each carrying 1 / gpus_per_node of
the data across each node boundary at one NIC's rate): 2 (P - 1) / P (all-reduce) or (P - 1) / P of the data
over gpus_per_node NICs, and 2 (P - 1) or P - 1 steps of latency (all-reduce: or NCCL's tree, 2 log2(nodes)
network steps, where that is faster); all-to-all as point-to-point over the NICs; the GEMM ops as the flat
collective and the GEMM one after the other (NCCL + cuBLAS).
At large sizes the two meet (both keep every NIC busy); the hierarchy wins on latency (steps across nodes, not
across GPUs), on the overlap of its legs and, for MoE, on sending a token once per node. A projection to plan
by, each row to be checked against a real multi-node run.
"""
import argparse
import math
import sys

# weft inside a node: busbw at large sizes (GB/s) and a call's fixed cost (us), 4 x H200 (bench/RESULTS.md).
NODE_BUSBW = {"all_reduce": 345.0, "all_gather": 352.0, "reduce_scatter": 331.0, "all_to_all": 353.0}
NODE_LATENCY_US = 7.0


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B").rstrip("I")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def human(n):
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


class Machine:
    def __init__(self, nodes, gpus_per_node, net_gbps, net_efficiency, net_latency_us, chunks):
        self.nodes, self.g = nodes, gpus_per_node
        self.p = nodes * gpus_per_node
        self.net = net_gbps / 8 * net_efficiency  # GB/s per GPU
        self.net_lat = net_latency_us
        self.chunks = chunks

    def node_leg(self, op, bytes_moved_factor, size):
        """Inside the node: size bytes of busbw-equivalent traffic, in us."""
        if self.g == 1:
            return 0.0
        return NODE_LATENCY_US + bytes_moved_factor * size / (NODE_BUSBW[op] * 1e3)

    def net_ring(self, size, factor, steps):
        """A ring over the nodes moving factor x size per GPU: us."""
        return steps * self.net_lat + factor * size / (self.net * 1e3)

    def pipelined(self, legs):
        """Legs of one op run in `chunks` pieces: the slowest leg whole, the others one chunk each."""
        if self.chunks <= 1:
            return sum(legs)
        slow = max(legs)
        return slow + sum(legs) / self.chunks - slow / self.chunks

    # ---- hierarchical (weft inside, NCCL across) -----------------------------------------------------------
    def all_reduce(self, s):
        n, g = self.nodes, self.g
        rs = self.node_leg("reduce_scatter", (g - 1) / g, s)
        net = 0.0
        if n > 1:  # NCCL across the nodes (the g-th GPUs of every node): its ring or its tree
            ring = self.net_ring(s / g, 2 * (n - 1) / n, 2 * (n - 1))
            tree = 2 * math.ceil(math.log2(n)) * self.net_lat + 2 * (s / g) / (self.net * 1e3)
            net = min(ring, tree)
        ag = self.node_leg("all_gather", (g - 1) / g, s)
        return self.pipelined([rs, net, ag])

    def all_gather(self, s):  # s: the output per GPU
        n, g = self.nodes, self.g
        net = self.net_ring(s / n, (n - 1) / n * n / g, n - 1) if n > 1 else 0.0
        node = self.node_leg("all_gather", (g - 1) / g, s)
        return self.pipelined([net, node])

    def reduce_scatter(self, s):  # s: the input per GPU
        return self.all_gather(s)

    def all_to_all(self, s):  # s: each GPU's send buffer
        n, g = self.nodes, self.g
        net = self.net_lat + s * (1 - 1 / n) / (self.net * 1e3) if n > 1 else 0.0
        node = self.node_leg("all_to_all", (g - 1) / g, s / n) if g > 1 else 0.0
        return max(net, node)

    def moe_dispatch(self, s, top_k, experts):
        """s: a GPU's tokens x top_k copies as a naive all-to-all would send; aggregation sends each token once
        per destination node: the expected distinct nodes of top_k experts spread over the nodes."""
        n = self.nodes
        distinct = n * (1 - (1 - 1 / n) ** top_k) if n > 1 else 1.0
        return self.all_to_all(s * distinct / top_k)

    def moe_every_node(self, s, top_k):
        """weft's MoE dispatch as built: each GPU's tokens (s / top_k bytes) to every other node over its NIC,
        beside the in-node dispatch of what arrived (nodes x its tokens' top_k share inside the node)."""
        n, g = self.nodes, self.g
        net = self.net_lat + (n - 1) * (s / top_k) / (self.net * 1e3) if n > 1 else 0.0
        node = self.node_leg("all_to_all", (g - 1) / g, s) if g > 1 else 0.0
        return net + node  # the legs are not pipelined

    def gemm_us(self, s, n, tflops):
        """The GEMM of a bf16 A of s bytes ([s / 2K, K]) by [K, n]: 2 (s / 2K) K n = s n flops."""
        return s * n / (tflops * 1e6)

    def all_gather_matmul(self, s, n, tflops):
        gemm = self.gemm_us(s, n, tflops)
        return max(self.all_gather(s), gemm) + gemm / self.chunks

    def matmul_reduce_scatter(self, s, n, tflops):
        # s: the GEMM's output per GPU (bf16 [rows, n]), whose A holds s / (2 n) rows of K = n columns (square).
        return self.gemm_us(s, n, tflops) + self.reduce_scatter(s)

    # ---- flat: rings over all P GPUs, one per NIC --------------------------------------------------------------
    def flat(self, op, s):
        p, nics = self.p, self.g
        if p == 1:
            return 0.0
        if op == "all_reduce":  # the ring, or NCCL's tree across nodes where its latency wins
            ring = 2 * (p - 1) * self.net_lat + 2 * (p - 1) / p * s / (nics * self.net * 1e3)
            tree = (2 * math.ceil(math.log2(self.nodes)) * self.net_lat + 2 * NODE_LATENCY_US +
                    2 * s / (nics * self.net * 1e3)) if self.nodes > 1 else ring
            return min(ring, tree)
        if op in ("all_gather", "reduce_scatter"):
            return (p - 1) * self.net_lat + (p - 1) / p * s / (nics * self.net * 1e3)
        # all-to-all (and MoE dispatch without aggregation): the cross-node share over each GPU's NIC
        return self.net_lat + s * (1 - self.g / p) / (self.net * 1e3)


def table(args):
    ops = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "moe_dispatch", "moe_every_node",
           "all_gather_matmul", "matmul_reduce_scatter"]
    rows = []
    for nodes in args.nodes:
        m = Machine(nodes, args.gpus_per_node, args.net_gbps, args.net_efficiency, args.net_latency_us, args.chunks)
        for size in args.sizes:
            for op in ops:
                if op == "moe_dispatch":
                    hier = m.moe_dispatch(size, args.top_k, args.experts)
                    flat = m.flat("all_to_all", size)
                elif op == "moe_every_node":
                    hier = m.moe_every_node(size, args.top_k)
                    flat = m.flat("all_to_all", size)
                elif op in ("all_gather_matmul", "matmul_reduce_scatter"):
                    hier = getattr(m, op)(size, args.gemm_n, args.gemm_tflops)
                    gemm = m.gemm_us(size, args.gemm_n, args.gemm_tflops)
                    flat = gemm + m.flat("all_gather" if op == "all_gather_matmul" else "reduce_scatter", size)
                else:
                    hier = getattr(m, op)(size)
                    flat = m.flat(op, size)
                rows.append((nodes, nodes * args.gpus_per_node, op, size, hier, flat))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--nodes", default="2,4,8,16", help="node counts (comma-separated)")
    ap.add_argument("--sizes", default="1M,64M,1G", help="bytes per GPU (K / M / G suffixes)")
    ap.add_argument("--net-gbps", type=float, default=400.0, help="network line rate per GPU, Gb/s")
    ap.add_argument("--net-efficiency", type=float, default=0.9, help="share of line rate a transfer reaches")
    ap.add_argument("--net-latency-us", type=float, default=8.0, help="latency of one network step")
    ap.add_argument("--chunks", type=int, default=8, help="pieces the hierarchical legs are pipelined in")
    ap.add_argument("--top-k", type=int, default=8, help="MoE: experts per token")
    ap.add_argument("--experts", type=int, default=256, help="MoE: experts in all")
    ap.add_argument("--gemm-n", type=int, default=8192, help="the GEMM ops: this GPU's columns of B (and K)")
    ap.add_argument("--gemm-tflops", type=float, default=700.0, help="the GEMM ops: bf16 dense TFLOP/s reached")
    args = ap.parse_args(argv)
    args.nodes = [int(x) for x in args.nodes.split(",")]
    args.sizes = [parse_size(x) for x in args.sizes.split(",")]
    if args.gpus_per_node < 1 or any(n < 1 for n in args.nodes) or args.chunks < 1:
        ap.error("gpus per node, node counts and chunks must be at least 1")
    print(f"Scale-out MODEL (not a measurement): {args.gpus_per_node} GPUs per node, {args.net_gbps:g} Gb/s per GPU "
          f"at {args.net_efficiency:.0%}, {args.net_latency_us:g} us per network step, legs in {args.chunks} chunks; "
          f"inside a node weft's measured busbw (4 x H200). MoE: top-{args.top_k} of {args.experts} experts. GEMM "
          f"ops: N = K = {args.gemm_n}, {args.gemm_tflops:g} TFLOP/s.\n")
    print("| nodes | GPUs | op | bytes / GPU | weft hierarchical us | NCCL flat rings us | flat / hierarchical |")
    print("|---|---|---|---|---|---|---|")
    for nodes, gpus, op, size, hier, flat in table(args):
        print(f"| {nodes} | {gpus} | {op} | {human(size)} | {hier:.0f} | {flat:.0f} | {flat / hier:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
