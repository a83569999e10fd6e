#!/usr/bin/env python3
"""An attention timeline's cost per item: fixed part and per key block (forward) or query step (backward).

    scripts/attention_timeline.py FILE.csv... [--block-rows N] [--group N] [--causal | --no-causal]

FILE.csv: spans of `weft-bench attention --timeline DIR` (DIR/attention_{fwd,bwd,bwd_det}_B_S_H_D.csv; the
bench records causal shapes at S 1024 and 8192). Each consumer warpgroup's mainloop span of an item is fitted
as fixed + per_unit x units, where an item's units are the key blocks it attends to (forward; item = query
block) or its query-block steps (backward; item = key block of 128 keys), from the item's block in the
span's arg (head << 16 | block). Prints the fit, the store spans and the gaps between a warpgroup's spans (the
marks themselves cost some of each gap). The rows per query block default to the library's choice for the
file's shape (forward: 128 at D 128, and at D 64 for causal S <= 2048, else 192; backward: 64, or 128 at D 64
from 4096 query rows); --block-rows overrides it. --group: query heads per K / V head (a backward item steps
through each of them; the bench's GQA shape, 32 / 8 heads, has 4; the file name does not say). Marks cost time: compare fits of timed runs with each other,
not with the bench's untimed times. The chained forward (ChainedAttentionFwdOp) stores an item inside the next
item's mainloop: its fixed part holds the store, and its store spans are empty.
"""
import argparse
import collections
import csv
import os
import re
import sys

KEYS = 128  # keys per block (kAttentionBlockN, kAttentionBwdBlockN)


def shape_of(path):
    m = re.search(r"attention_(fwd|bwd_det|bwd)_(\d+)_(\d+)_(\d+)_(\d+)\.csv$", os.path.basename(path))
    if not m:
        sys.exit(f"attention_timeline.py: {path}: not a name of weft-bench attention's timeline files")
    return m.group(1), int(m.group(3)), int(m.group(5))  # pass, S, D


def default_rows(kind, seq, dim, causal):
    if kind == "fwd":
        return 128 if dim == 128 or (causal and seq <= 2048) else 192
    return 128 if dim == 64 and seq >= 4096 else 64


def units(kind, block, seq, rows, causal, group):
    """Key blocks a forward item attends to, or query steps a backward item takes (square, bottom-right)."""
    if kind == "fwd":
        last_row = min(seq, (block + 1) * rows)
        return -(-(last_row if causal else seq) // KEYS)
    first_row = block * KEYS if causal else 0  # the diagonal's query block on
    return group * -(-(seq - first_row) // rows)


def fit(points):
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return my, 0.0, 0.0
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    a = my - b * mx
    ss = sum((y - my) ** 2 for _, y in points)
    r2 = 1 - sum((y - a - b * x) ** 2 for x, y in points) / ss if ss else 1.0
    return a, b, r2


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--block-rows", type=int)
    ap.add_argument("--group", type=int, default=1)
    ap.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    a = ap.parse_args()
    for path in a.files:
        kind, seq, dim = shape_of(path)
        rows = a.block_rows or default_rows(kind, seq, dim, a.causal)
        spans = list(csv.DictReader(open(path)))
        lanes = collections.defaultdict(list)
        points, stores = [], []
        for s in spans:
            t0, t1 = float(s["begin_us"]), float(s["end_us"])
            lanes[(s["rank"], s["block"], s["warp"])].append((t0, t1, s["phase"]))
            if s["phase"] == "mainloop":
                points.append((units(kind, int(s["arg"]) & 0xFFFF, seq, rows, a.causal, a.group), t1 - t0))
            elif s["phase"] == "store":
                stores.append(t1 - t0)
        if not points:
            print(f"{path}: no mainloop spans")
            continue
        if all(int(s["arg"]) == 0 for s in spans if s["phase"] == "mainloop") and len(points) > 1:
            print(f"{path}: the spans carry no item (recorded before the marks' (head, block) arg)")
            continue
        gaps = [b[0] - p[1] for v in lanes.values() for p, b in zip(sorted(v), sorted(v)[1:])
                if p[2] in ("mainloop", "store") and b[2] in ("mainloop", "store")]
        fixed, per_unit, r2 = fit(points)
        unit = "key block" if kind == "fwd" else "query step"
        mean = lambda v: sum(v) / len(v) if v else float("nan")
        print(f"{os.path.basename(path)}: {len(points)} items, {rows}-row query blocks; mainloop = {fixed:.2f} us + "
              f"{per_unit:.3f} us a {unit} (R^2 {r2:.3f}); store {mean(stores):.2f} us; gaps between a "
              f"warpgroup's spans {mean(gaps):.2f} us")


if __name__ == "__main__":
    main()
