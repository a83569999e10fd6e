"""Host time per weft call of two builds, compared within one host speed (lent hosts switch between two
speeds ~1.5x apart, inside a process too: bench/RESULTS.md, 2026-11-29).

    scripts/ab_builds.sh pack OLD_REF                    # here; carry "out" to the device call
    # on the device, after building _weft in build/ and in out/ab/OLD_REF/build:
    for b in old new new old old new new old; do
      PYTHONPATH=<that build>/python AB_BUILD=$b torchrun --nproc_per_node=1 \\
        python/benchmarks/host_ab.py sample samples.jsonl
    done
    python3 python/benchmarks/host_ab.py report samples.jsonl

`sample FILE [ROUNDS]`: every row of bench.py's host table (bench.host_cases: the zero-copy paths, a copy-in,
the fused TP ops, the calls that return their output, torch's own all_reduce; rows a build lacks are left out)
timed ROUNDS times (12) as 100 back-to-back calls between two timings of a plain torch launch (x.add_),
appended to FILE as JSON lines. `report FILE`: each sample classed by the x.add_ beside it (fast: within 1.15x
of the 10th percentile of all samples, else slow); per class and row, each build's median and new / old (the
builds named old and new in AB_BUILD).
"""
import json
import os
import statistics
import sys
import time
from collections import defaultdict


def batch_us(fn, calls=100):
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = (time.perf_counter() - t0) * 1e6 / calls
    torch.cuda.synchronize()
    return t


def sample(path, rounds):
    import torch
    import torch.distributed as dist
    import weft

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench  # noqa: E402  (its host_cases: the same rows as its host table)

    comm = weft.init()
    torch.cuda.set_device(comm.device)
    dist.init_process_group("nccl", device_id=torch.device("cuda", comm.device))
    cases, through_op, t = bench.host_cases(comm, comm.world_size)
    cases.update(through_op)
    launch = lambda: t.small.add_(1)  # noqa: E731
    for fn in list(cases.values()) + [launch]:
        for _ in range(30):
            fn()
    torch.cuda.synchronize()
    with open(path, "a") as f:
        for r in range(rounds):
            for name, fn in cases.items():
                before = batch_us(launch)
                us = batch_us(fn)
                beside = (before + batch_us(launch)) / 2
                f.write(json.dumps({"build": os.environ["AB_BUILD"], "pid": os.getpid(), "round": r,
                                    "row": name, "us": us, "launch_us": beside}) + "\n")
    dist.destroy_process_group()


def report(path):
    samples = [json.loads(line) for line in open(path)]
    launch = sorted(s["launch_us"] for s in samples)
    fast_max = launch[len(launch) // 10] * 1.15
    print(f"{len(samples)} samples; x.add_ us: 10th percentile {launch[len(launch) // 10]:.2f}, median "
          f"{statistics.median(launch):.2f}, 90th {launch[9 * len(launch) // 10]:.2f}; fast: <= {fast_max:.2f}")
    by = defaultdict(list)
    for s in samples:
        by[(s["row"], s["build"], "fast" if s["launch_us"] <= fast_max else "slow")].append(s["us"])
    names = list(dict.fromkeys(s["row"] for s in samples))
    print("\n| call | fast: old | fast: new | new / old | slow: old | slow: new | new / old |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        cells = []
        for state in ("fast", "slow"):
            med = {b: statistics.median(by[(name, b, state)]) for b in ("old", "new") if by[(name, b, state)]}
            cells += [f"{med[b]:.2f} ({len(by[(name, b, state)])})" if b in med else "-" for b in ("old", "new")]
            cells.append(f"{med['new'] / med['old']:.3f}" if len(med) == 2 else "-")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "sample":
        sample(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 12)
    elif len(sys.argv) == 3 and sys.argv[1] == "report":
        report(sys.argv[2])
    else:
        sys.exit(__doc__)
