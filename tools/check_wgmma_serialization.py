#!/usr/bin/env python3
"""Fails where ptxas serialises a kernel's wgmma pipeline. ptxas builds such a kernel without a warning, and
reports why only under -v, as "info" lines:
  C7510  "wgmma.mma_async instructions are serialized due to ..." (a call, too few registers, ...)
  C7517  "warpgroup.wait is injected ... to allow use of registers defined by GMMA": a path reads an MMA's
         registers while, on another path that merges into it, the MMA may still run
  C7518  "wgmma.mma_async instructions are serialized due to program dependence on compiler-inserted WG.DP
         in divergent path": the consequence of C7517 where the paths diverge
Every wgmma of the kernel then waits for the previous one: the tests still pass, and the kernel runs at a
fraction of its speed (the chained attention forward measured 0.74x with one such merge).

    python3 tools/check_wgmma_serialization.py PTXAS FILE.ptx...

Runs `PTXAS -arch=sm_90a -v` over each file (in parallel), prints each such line with its kernel, and exits 1
if there is any. The build makes the ops' PTX (target weft_ptx); the tests run this over it
(tree.wgmma_serialization).
"""
import concurrent.futures
import os
import re
import subprocess
import sys

CODES = re.compile(r"\((C7510|C7517|C7518)\)")
KERNEL = re.compile(r"function '([^']+)'")


def check(ptxas, path):
    """(path, lines reporting serialisation, error text) of one PTX file."""
    run = subprocess.run([ptxas, "-arch=sm_90a", "-v", "-o", os.devnull, path], capture_output=True, text=True)
    if run.returncode != 0:
        return path, [], run.stderr.strip() or f"ptxas exited {run.returncode}"
    return path, [line for line in (run.stdout + run.stderr).splitlines() if CODES.search(line)], ""


def main(argv):
    if len(argv) < 3:
        sys.exit(__doc__)
    # (CTest hands $<TARGET_OBJECTS:...> over as one ';'-separated argument.)
    ptxas, files = argv[1], [p for arg in argv[2:] for p in arg.split(";") if p]
    failed = False
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        for path, lines, error in pool.map(lambda f: check(ptxas, f), files):
            if error:
                print(f"{path}: ptxas failed: {error}")
                failed = True
            for line in lines:
                kernel = KERNEL.search(line)
                print(f"{os.path.basename(path)}: {kernel.group(1) if kernel else '?'}: {CODES.search(line).group(1)}: "
                      f"{line.split(':', 1)[-1].strip()}")
                failed = True
    if failed:
        print("check_wgmma_serialization: ptxas serialises these kernels' wgmma (see the docstring)")
        return 1
    print(f"check_wgmma_serialization: {len(files)} files, no serialised wgmma")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
