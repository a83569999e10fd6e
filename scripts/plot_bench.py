#!/usr/bin/env python3
"""Plots weft-bench results: `weft-bench --json` output in, one PNG per table out.

    build/bench/weft-bench allreduce gemm --json > results.json
    scripts/plot_bench.py results.json plots/        # plots/<table title>.png

What each table becomes:
  collectives (size, NCCL busbw, weft busbw)     bus bandwidth vs message size, weft against NCCL
  GEMM sweep (M, N, K, weft / cuBLAS TFLOP/s)     TFLOP/s per shape, weft against cuBLAS
  fused ops (op, M, N, K, weft us, sequential us) time per shape: weft, cuBLAS + NCCL in sequence, and the bound
Other tables are skipped (named on stderr). Needs matplotlib.
"""
import json
import os
import re
import sys


def number(cell):
    """A cell's leading number ("1.23x", "45.6", "-" -> None)."""
    m = re.match(r"\s*(-?[0-9.]+(?:e[-+]?[0-9]+)?)", str(cell))
    return float(m.group(1)) if m else None


def size_bytes(cell):
    """'8 KiB' -> 8192."""
    value, unit = str(cell).split()
    return float(value) * {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[unit]


def col(table, name):
    return table["columns"].index(name) if name in table["columns"] else None


def plot_collective(plt, table, path):
    c_size, c_nccl, c_weft = col(table, "size"), col(table, "NCCL busbw"), col(table, "weft busbw")
    rows = [r for r in table["rows"] if number(r[c_weft]) is not None]
    x = [size_bytes(r[c_size]) for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(x, [number(r[c_weft]) for r in rows], "o-", label="weft")
    nccl = [(xi, number(r[c_nccl])) for xi, r in zip(x, rows) if number(r[c_nccl]) is not None]
    if nccl:
        ax.plot([p[0] for p in nccl], [p[1] for p in nccl], "s--", label="NCCL")
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [r[c_size] for r in rows], rotation=45)
    ax.set_xlabel("message size")
    ax.set_ylabel("bus bandwidth (GB/s)")
    finish(plt, fig, ax, table, path)


def plot_gemm(plt, table, path):
    c_m, c_n, c_k = col(table, "M"), col(table, "N"), col(table, "K")
    c_w, c_b = col(table, "weft TFLOP/s"), col(table, "cuBLAS TFLOP/s")
    rows = [r for r in table["rows"] if number(r[c_m]) is not None and number(r[c_w]) is not None]
    labels = [f"{r[c_m]}x{r[c_n]}x{r[c_k]}" for r in rows]
    fig, ax = paired_bars(plt, labels, [number(r[c_w]) for r in rows], "weft",
                          [number(r[c_b]) for r in rows], "cuBLAS")
    ax.set_ylabel("TFLOP/s")
    finish(plt, fig, ax, table, path)


def plot_fused(plt, table, path):
    c_op, c_m, c_n, c_k = col(table, "op"), col(table, "M"), col(table, "N"), col(table, "K")
    c_w, c_s = col(table, "weft us"), col(table, "sequential us")
    c_g, c_c = col(table, "compute us"), col(table, "comm us")
    rows = [r for r in table["rows"] if number(r[c_w]) is not None]
    labels = [f"{r[c_op]} {r[c_m]}x{r[c_n]}x{r[c_k]}" for r in rows]
    fig, ax = paired_bars(plt, labels, [number(r[c_w]) for r in rows], "weft",
                          [number(r[c_s]) for r in rows], "sequential baseline")
    bound = [max(number(r[c_g]) or 0, number(r[c_c]) or 0) for r in rows]
    ax.plot(list(range(len(rows))), bound, "k_", markersize=14, label="max(compute, comm)")
    ax.set_yscale("log")
    ax.set_ylabel("time per call (us)")
    finish(plt, fig, ax, table, path)


def paired_bars(plt, labels, ours, our_name, theirs, their_name):
    """Two bars per label (weft's and a baseline's), labels slanted below."""
    x = list(range(len(labels)))
    fig, ax = plt.subplots(figsize=(max(8, 0.5 * len(labels)), 4.5))
    width = 0.4
    ax.bar([i - width / 2 for i in x], ours, width, label=our_name)
    ax.bar([i + width / 2 for i in x], theirs, width, label=their_name)
    ax.set_xticks(x, labels, rotation=60, ha="right", fontsize=7)
    return fig, ax


def finish(plt, fig, ax, table, path):
    ax.set_title(table["title"], fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def kind_of(table):
    cols = set(table["columns"])
    if {"size", "NCCL busbw", "weft busbw"} <= cols:
        return plot_collective
    if {"M", "N", "K", "weft TFLOP/s", "cuBLAS TFLOP/s"} <= cols:
        return plot_gemm
    if {"op", "M", "N", "K", "weft us", "sequential us"} <= cols:
        return plot_fused
    return None


def main(argv):
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_bench.py needs matplotlib (pip install matplotlib, or apt-get install python3-matplotlib)",
              file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        results = json.load(f)
    os.makedirs(argv[2], exist_ok=True)
    written = 0
    for table in results.get("tables", []):
        plot = kind_of(table)
        if plot is None:
            print(f"plot_bench.py: no plot for '{table['title']}'", file=sys.stderr)
            continue
        name = re.sub(r"[^A-Za-z0-9]+", "_", table["title"]).strip("_")[:100] + ".png"
        plot(plt, table, os.path.join(argv[2], name))
        print(os.path.join(argv[2], name))
        written += 1
    return 0 if written else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
