#!/usr/bin/env python3
"""Draws a timeline recorded by `weft-bench fused|decode --timeline DIR` (one CSV per call: a span per line,
rank,block,warp,phase,begin_us,end_us,arg; weft/timeline.hpp says what each phase is).

    scripts/plot_timeline.py DIR/matmul_reduce_scatter_8192x8192x8192_fused.csv            # text chart
    scripts/plot_timeline.py DIR/matmul_reduce_scatter_8192x8192x8192_fused.csv out.png    # and a PNG
    scripts/plot_timeline.py --one-clock FILE.csv     # ranks of one GPU (virtual ranks): one time axis

GPUs do not share a clock, so by default each rank's times count from its own first mark.

Text: per rank, one line per role (the compute blocks' loaders waiting for inputs, their consumer warpgroups'
mainloops and stores, the communicator blocks' tasks, the collective kernels' blocks, the stream waits), each
column a slice of the call, its character how many of the role's lanes were in that phase then (' ' none,
'.' < 25%, ':' < 50%, '+' < 75%, '#' more). PNG (needs matplotlib): one panel per rank, a row per
(block, warp), a bar per span, colored by phase.
"""
import csv
import sys
from collections import defaultdict

PHASES = ["wait_inputs", "mainloop", "store", "comm_begin", "comm_task", "comm_wait", "collective", "stream_wait",
          "moe", "decode"]
COLORS = {"wait_inputs": "tab:red", "mainloop": "tab:blue", "store": "tab:green", "comm_begin": "tab:purple",
          "comm_task": "tab:orange", "comm_wait": "tab:pink", "collective": "tab:brown", "stream_wait": "tab:gray", "moe": "tab:olive",
          "decode": "tab:cyan", "block": "none"}


def load(path, one_clock):
    spans = []
    with open(path) as f:
        for r in csv.DictReader(f):
            spans.append((int(r["rank"]), int(r["block"]), int(r["warp"]), r["phase"], float(r["begin_us"]),
                          float(r["end_us"]), int(r["arg"])))
    if not one_clock:  # each rank from its own first mark
        first = {}
        for s in spans:
            first[s[0]] = min(first.get(s[0], s[4]), s[4])
        spans = [s[:4] + (s[4] - first[s[0]], s[5] - first[s[0]]) + s[6:] for s in spans]
    return spans


def text_chart(spans, width=100):
    t0 = min(s[4] for s in spans)
    t1 = max(s[5] for s in spans)
    step = max((t1 - t0) / width, 1e-3)
    out = [f"{t1 - t0:.1f} us in {width} columns of {step:.2f} us"]
    for rank in sorted({s[0] for s in spans}):
        out.append(f"rank {rank}")
        for phase in PHASES:
            mine = [s for s in spans if s[0] == rank and s[3] == phase]
            if not mine:
                continue
            lanes = len({(s[1], s[2]) for s in mine})
            busy = [0.0] * width
            for s in mine:
                a, b = (s[4] - t0) / step, (s[5] - t0) / step
                for c in range(int(a), min(int(b) + 1, width)):
                    busy[c] += max(0.0, min(b, c + 1) - max(a, c))
            line = "".join(" " if x == 0 else ".:+#"[min(3, int(4 * x / lanes))] for x in busy)
            out.append(f"  {phase:>11} {lanes:4d} |{line}|")
    return "\n".join(out)


def png(spans, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ranks = sorted({s[0] for s in spans})
    fig, axes = plt.subplots(len(ranks), 1, figsize=(14, 3 * len(ranks)), sharex=True, squeeze=False)
    for ax, rank in zip(axes[:, 0], ranks):
        mine = [s for s in spans if s[0] == rank and s[3] != "block"]
        lanes = sorted({(s[1], s[2]) for s in mine})
        row = {lane: i for i, lane in enumerate(lanes)}
        by_phase = defaultdict(list)
        for s in mine:
            by_phase[s[3]].append((row[(s[1], s[2])], s[4], s[5] - s[4]))
        for phase, bars in by_phase.items():
            for y, x, w in bars:
                ax.barh(y, w, left=x, height=0.8, color=COLORS.get(phase, "black"), linewidth=0)
        ax.set_ylabel(f"rank {rank}\n(block, warp)")
        ax.set_yticks([])
    axes[-1, 0].set_xlabel("us")
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[p]) for p in PHASES]
    fig.legend(handles, PHASES, loc="upper right", ncol=len(PHASES))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    args = [a for a in sys.argv[1:] if a != "--one-clock"]
    if not args:
        print(__doc__)
        return 2
    spans = load(args[0], "--one-clock" in sys.argv)
    if not spans:
        print("no spans in", args[0])
        return 1
    print(text_chart(spans))
    if len(args) > 1:
        png(spans, args[1])
        print("wrote", args[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
