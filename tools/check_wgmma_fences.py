#!/usr/bin/env python3
"""Fails where a kernel's PTX breaks wgmma's register rule: between a `wgmma.fence` and a `wgmma.mma_async`
after it, no other instruction may write a register the MMA reads as its accumulator or A fragment (the
registers in its braces). PTX leaves such a kernel undefined; ptxas may still build it, and a test may still
pass. The compiler places ordinary instructions freely around the fence (it has no register operands), so
source that writes an accumulator just before `wgmma::fence()` must pin the writes with
`wgmma::fence_operands` (weft/tile/wgmma.cuh).

    python3 tools/check_wgmma_fences.py FILE.ptx...

Prints each offence as `file: kernel: line N: wgmma reads %f12 written by <instruction>` and exits 1 if
there is any. The build makes the ops' PTX (target weft_ptx) and the tests run this over it (tree.wgmma_fences).
"""
import re
import sys

ENTRY = re.compile(r"\s*\.(?:visible\s+)?\.entry\s+(\S+?)\(")
# An instruction writing a register: optional predicate, opcode, destination register first.
WRITE = re.compile(r"\s*(?:@!?%p\d+\s+)?([a-z][\w.]*)\s+(%\w+)\s*,")
NO_WRITE = ("st.", "setp", "wgmma", "mbarrier", "bar", "fence", "red.", "cp.")


def run_end(line):
    """Whether the fence's run of MMAs ends here: a new fence, the commit, a label or a branch."""
    return ("wgmma.fence" in line or "wgmma.commit_group" in line or line.lstrip().startswith("$L")
            or re.search(r"\bbra(\.uni)?\b", line) is not None)


def braced_registers(instruction):
    return {r for group in re.findall(r"\{([^}]*)\}", instruction) for r in re.findall(r"%\w+", group)}


def offences_after_fence(lines, i):
    """(offences, next line) of the run that starts with the fence on line i."""
    written, found, j = {}, [], i + 1
    while j < len(lines) and not run_end(lines[j]):
        if "wgmma.mma_async" in lines[j]:
            k, instruction = j, lines[j]
            while ";" not in instruction and k + 1 < len(lines):
                k += 1
                instruction += lines[k]
            for reg in sorted(braced_registers(instruction) & written.keys()):
                found.append((j + 1, reg, written[reg]))
            j = k + 1
            continue
        m = WRITE.match(lines[j])
        if m and not m.group(1).startswith(NO_WRITE):
            written[m.group(2)] = lines[j].strip()
        j += 1
    return found, j


def check(path):
    with open(path) as f:
        lines = f.read().split("\n")
    kernel, offences, i = "?", [], 0
    while i < len(lines):
        m = ENTRY.match(lines[i])
        if m:
            kernel = m.group(1)
        if "wgmma.fence.sync.aligned" in lines[i]:
            found, i = offences_after_fence(lines, i)
            offences += [(kernel, *o) for o in found]
            continue
        i += 1
    return offences


def main():
    # CMake hands a generator expression's list over as one argument, its items joined by ';'.
    paths = [p for arg in sys.argv[1:] for p in arg.split(";") if p]
    if not paths:
        sys.exit(__doc__)
    bad = 0
    for path in paths:
        for kernel, line, reg, by in check(path):
            print(f"{path}: {kernel}: line {line}: wgmma reads {reg} written by `{by}` after the fence")
            bad += 1
    print(f"check_wgmma_fences: {len(paths)} files, {bad} offences")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
