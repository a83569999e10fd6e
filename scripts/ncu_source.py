#!/usr/bin/env python3
"""Where a kernel's warps stall, instruction by instruction, from ncu's source page (SASS with stall samples).

On the GPU machine (Nsight Systems does not run there; ncu does):
    ncu --profile-from-start off -k regex:persistent_kernel --set full --import-source no -o /tmp/rep \\
        python3 script.py          # the script brackets the calls with torch.cuda.profiler.start() / stop()
    ncu -i /tmp/rep.ncu-rep --page source --print-source sass --csv > src.csv   # one kernel per report
(-k matches the function's base name: `persistent_kernel` for every LCSC op, `--kernel-name-base mangled` to
pick one instantiation.) Here:
    scripts/ncu_source.py src.csv                      stall reasons in all, then the 25 instructions with the
                                                       most samples
    scripts/ncu_source.py src.csv --top 40 --by wait   the 40 with the most samples of one reason
    scripts/ncu_source.py src.csv --list 1380:2400 --min 150
                                                       the instructions of a range with at least 150 samples,
                                                       and every barrier, wait, branch and wgmma fence there
    scripts/ncu_source.py src.csv --regions 1399,1490,1598,2000
                                                       samples and instructions summed between the cuts
Instruction numbers are rows of the SASS listing (0 = the kernel's first instruction).
"""
import argparse
import csv
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
# Instructions listed in a range whatever their samples: where a warp waits or the control flow turns.
LANDMARKS = ("BAR", "SYNCS", "BRA", "WARPGROUP", "WARPSYNC", "BSYNC", "BSSY", "EXIT", "RET", "CALL", "DEPBAR")


def read(path):
    """(stall reason columns, rows as dicts) of an ncu source-page CSV of one kernel (the header is the line
    with the "Source" column; ncu writes the kernel's name above it)."""
    with open(path, newline="") as f:
        lines = list(csv.reader(f))
    at = next((i for i, r in enumerate(lines) if "Source" in r and SAMPLES in r), None)
    if at is None:
        sys.exit(f"ncu_source.py: {path}: no header with 'Source' and '{SAMPLES}' (ncu -i REP --page source "
                 "--print-source sass --csv)")
    header, rows = lines[at], [r for r in lines[at + 1:] if len(r) == len(lines[at])]
    if any("Source" in r and SAMPLES in r for r in rows):
        sys.exit(f"ncu_source.py: {path} holds several kernels: export one report per kernel")
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    return reasons, [dict(zip(header, r)) for r in rows]


def opcode_of(source):
    """The instruction's opcode: its first word after a predicate ("@!P0  BRA ..." -> "BRA")."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0] if words else ""


def number(value):
    """A cell as a float ("1,234" -> 1234; "" or "-" -> 0); sums already are."""
    if isinstance(value, float):
        return value
    try:
        return float(value.replace(",", ""))
    except ValueError:
        return 0.0


def top_reasons(row, reasons, count=3):
    ranked = sorted(((number(row[r]), r[len("stall_"):]) for r in reasons), reverse=True)[:count]
    return " ".join(f"{name}:{value:.0f}" for value, name in ranked if value)


def line(i, row, reasons):
    return (f"{i:5d} {number(row[SAMPLES]):7.0f} ex={number(row[EXECUTED]):10.0f}  "
            f"{row['Source'].strip()[:72]:72s} {top_reasons(row, reasons)}")


def summary(reasons, rows):
    total = sum(number(r[SAMPLES]) for r in rows)
    print(f"samples {total:.0f}, instructions executed {sum(number(r[EXECUTED]) for r in rows):.0f}")
    sums = sorted(((sum(number(r[k]) for r in rows), k[len("stall_"):]) for k in reasons), reverse=True)
    for value, name in sums[:10]:
        print(f"  {name:20s} {value:8.0f} {100 * value / max(total, 1):5.1f}%")
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--by", default=None, help="a stall reason (wait, barrier, long_sb, ...): rank by it")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--list", default=None, help="FIRST:LAST instructions to list")
    mode.add_argument("--regions", default=None, help="comma-separated cut points")
    ap.add_argument("--min", type=float, default=100, help="--list: the samples an instruction needs")
    args = ap.parse_args()
    try:
        span = [int(x) for x in args.list.split(":")] if args.list else None
        cuts = sorted(int(c) for c in args.regions.split(",")) if args.regions else None
    except ValueError:
        ap.error("--list takes FIRST:LAST and --regions comma-separated instruction numbers")
    if span is not None and len(span) != 2:
        ap.error("--list takes FIRST:LAST")
    reasons, rows = read(args.csv)
    key = f"stall_{args.by}" if args.by else SAMPLES
    if not rows or key not in rows[0]:
        sys.exit(f"ncu_source.py: no instructions, or no column {key!r}")
    total = summary(reasons, rows)
    if cuts is not None:
        cuts = [0] + [c for c in cuts if 0 < c < len(rows)] + [len(rows)]
        for a, b in zip(cuts, cuts[1:]):
            part = rows[a:b]
            s = sum(number(r[SAMPLES]) for r in part)
            agg = {k: sum(number(r[k]) for r in part) for k in reasons}
            print(f"[{a:5d}, {b:5d}) samples {s:7.0f} ({100 * s / max(total, 1):4.1f}%) executed "
                  f"{sum(number(r[EXECUTED]) for r in part):11.0f}  {top_reasons(agg, reasons, 5)}")
    elif span is not None:
        for i in range(max(span[0], 0), min(span[1] + 1, len(rows))):
            opcode = opcode_of(rows[i]["Source"])
            if number(rows[i][SAMPLES]) >= args.min or opcode.startswith(LANDMARKS):
                print(line(i, rows[i], reasons))
    else:
        for i in sorted(sorted(range(len(rows)), key=lambda i: -number(rows[i][key]))[:args.top]):
            print(line(i, rows[i], reasons))

if __name__ == "__main__":
    main()
