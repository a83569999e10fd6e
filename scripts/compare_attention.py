#!/usr/bin/env python3
"""Compares `weft-bench attention` outputs of two builds (and, optionally, cuDNN from the same machine).

    scripts/compare_attention.py NEW_GLOB OLD_GLOB [CUDNN.txt] [--rows]

NEW_GLOB / OLD_GLOB: the files of each build's rounds (e.g. 'new_*.txt' 'base_*.txt', quoted); each shape takes
its best time over a build's rounds (time-alone medians move a few % run to run; A/B builds in turns in one
device call). CUDNN.txt: the table of `python3 python/benchmarks/attention.py` (its 'cudnn' rows). Prints the
geomean, lowest and highest of old / new for the forward, backward and deterministic backward, and of cuDNN /
new (and cuDNN / old) for the forward and backward; --rows also prints every shape.
"""
import argparse
import glob
import math
import sys

PASSES = ("forward", "backward", "deterministic backward")


def cells(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def weft_times(pattern):
    """{(B, S, H / KV, D, causal): [fwd, bwd, det] ms}, best over the files matching `pattern`."""
    best = {}
    files = sorted(glob.glob(pattern))
    if not files:
        sys.exit(f"compare_attention.py: no file matches {pattern!r}")
    for path in files:
        for line in open(path):
            c = cells(line)
            if len(c) < 13 or not c[0].isdigit():
                continue
            key, times = tuple(c[:5]), [float(c[5]), float(c[9]), float(c[11])]
            best[key] = [min(a, b) for a, b in zip(best[key], times)] if key in best else times
    return best


def cudnn_times(path):
    """{shape: [fwd, bwd] ms} of the cuDNN rows of python/benchmarks/attention.py's table."""
    out = {}
    for line in open(path):
        c = cells(line)
        if len(c) >= 10 and c[5] == "cudnn":
            out[tuple(c[:5])] = [float(c[6]), float(c[8])]
    return out


def summary(name, ratios):
    if not ratios:
        return
    g = math.exp(sum(map(math.log, ratios)) / len(ratios))
    print(f"{name:40s} geomean {g:.3f}  lowest {min(ratios):.3f}  highest {max(ratios):.3f}  ({len(ratios)} shapes)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("new")
    ap.add_argument("old")
    ap.add_argument("cudnn", nargs="?")
    ap.add_argument("--rows", action="store_true")
    a = ap.parse_args()
    new, old = weft_times(a.new), weft_times(a.old)
    ref = cudnn_times(a.cudnn) if a.cudnn else {}
    shapes = [k for k in new if k in old]
    speedup = {p: [] for p in PASSES}
    vs_ref = {"forward, cuDNN / new": [], "backward, cuDNN / new": [], "forward, cuDNN / old": [],
              "backward, cuDNN / old": []}
    for k in shapes:
        r = [o / n for o, n in zip(old[k], new[k])]
        for p, x in zip(PASSES, r):
            speedup[p].append(x)
        line = f"{' '.join(k):28s} new {new[k]} old {old[k]} old/new " + " ".join(f"{x:.3f}" for x in r)
        if k in ref:
            f, b = ref[k]
            vs_ref["forward, cuDNN / new"].append(f / new[k][0])
            vs_ref["backward, cuDNN / new"].append(b / new[k][1])
            vs_ref["forward, cuDNN / old"].append(f / old[k][0])
            vs_ref["backward, cuDNN / old"].append(b / old[k][1])
            line += f" | cuDNN {ref[k]} cuDNN/new {f / new[k][0]:.3f} {b / new[k][1]:.3f}"
        if a.rows:
            print(line)
    for p in PASSES:
        summary(f"{p}, old / new", speedup[p])
    for name, ratios in vs_ref.items():
        summary(name, ratios)


if __name__ == "__main__":
    main()
