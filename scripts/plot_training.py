#!/usr/bin/env python3
"""Draws a train_transformer run: its loss curves (weft bf16, torch bf16, torch fp32) and tokens / s.

    torchrun --nproc_per_node=4 examples/train_transformer.py --tp 2 --csv run.csv
    scripts/plot_training.py run.csv loss.png

The CSV: '# run: ...' and '# tokens_per_s: weft=N,torch=N' lines, then step,loss_weft,loss_torch,loss_fp32 rows.
Needs matplotlib.
"""
import csv
import sys


def read_run(path):
    """(run description, {model: tokens/s}, rows of (step, weft, torch, fp32))."""
    run, speed, lines = "", {}, []
    with open(path) as f:
        for line in f:
            if line.startswith("# run:"):
                run = line.split(":", 1)[1].strip()
            elif line.startswith("# tokens_per_s:"):
                for item in line.split(":", 1)[1].strip().split(","):
                    name, value = item.split("=")
                    speed[name] = float(value)
            elif not line.startswith("#"):
                lines.append(line)
    rows = [(int(r["step"]), float(r["loss_weft"]), float(r["loss_torch"]), float(r["loss_fp32"]))
            for r in csv.DictReader(lines)]
    return run, speed, rows


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: scripts/plot_training.py RUN.csv OUT.png")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run, speed, rows = read_run(sys.argv[1])
    fig, (loss, tps) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 1]})
    steps = [r[0] for r in rows]
    loss.plot(steps, [r[3] for r in rows], color="0.6", linewidth=3, label="torch, fp32 (reference)")
    loss.plot(steps, [r[1] for r in rows], label="weft, bf16")
    loss.plot(steps, [r[2] for r in rows], "--", label="torch, bf16")
    loss.set_xlabel("step")
    loss.set_ylabel("loss")
    loss.legend()
    if speed:
        bars = tps.bar(list(speed), list(speed.values()), color=["C0", "C1"][: len(speed)])
        tps.bar_label(bars, fmt="%.0f")
        tps.set_ylabel("tokens / s (team)")
    else:
        tps.set_axis_off()
    fig.suptitle(f"examples/train_transformer.py: {run}" if run else "examples/train_transformer.py")
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=100)


if __name__ == "__main__":
    main()
