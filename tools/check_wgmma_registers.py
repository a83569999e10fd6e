#!/usr/bin/env python3
"""Fails where a kernel's PTX breaks wgmma's two register rules. A `wgmma.mma_async` reads and writes the
registers in its braces (its accumulator, and its A fragment when A comes from registers):
  1. between a `wgmma.fence` and an MMA after it, no other instruction may write those registers;
  2. from the MMA until a `wgmma.wait_group` retires its commit group, no other instruction may read or
     write them.
PTX leaves a kernel that breaks either undefined; ptxas may still build it, and a test may still pass. The
compiler moves ordinary instructions freely around the fence and the wait (neither names registers), so source
that writes an accumulator just before `wgmma::fence()`, or reads one just after `wgmma::wait<N>()`, pins the
accesses with `wgmma::fence_operands` (weft/tile/wgmma.cuh).

    python3 tools/check_wgmma_registers.py FILE.ptx...

Prints each offence as `file: kernel: line N: ...` and exits 1 if there is any. The build makes the ops' PTX
(target weft_ptx) and the tests run this over it (tree.wgmma_registers). Both checks follow straight-line code
only: a label or a branch ends what they track (they can miss an offence, not invent one).
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


def wait_offences(lines):
    """Rule 2: (kernel, line, register, instruction) of every access to a register of an MMA still in
    flight (not yet retired by a wgmma.wait_group)."""
    kernel, pending, current, found, i = "?", [], set(), [], 0
    while i < len(lines):
        text = lines[i].strip()
        m = ENTRY.match(lines[i])
        if m:
            kernel, pending, current = m.group(1), [], set()
        elif text.startswith("$L") or re.search(r"\bbra(\.uni)?\b", text) or text.startswith("ret"):
            pending, current = [], set()  # control flow: the groups in flight are not followed
        elif "wgmma.mma_async" in text:
            k, instruction = i, lines[i]
            while ";" not in instruction and k + 1 < len(lines):
                k += 1
                instruction += lines[k]
            current |= braced_registers(instruction)
            i = k + 1
            continue
        elif "wgmma.commit_group" in text:
            pending, current = pending + ([current] if current else []), set()
        elif "wgmma.wait_group" in text:
            keep = int(re.search(r"wait_group(?:\.sync\.aligned)?\s+(\d+)", text).group(1))
            pending = pending[len(pending) - keep:] if 0 < keep < len(pending) else ([] if keep == 0 else pending)
        elif text and not text.startswith(("//", ".", "{", "}")) and "wgmma" not in text:
            in_flight = current.union(*pending)
            for reg in sorted(set(re.findall(r"%\w+", text)) & in_flight):
                found.append((kernel, i + 1, reg, text))
        i += 1
    return found


def fence_offences(lines):
    """Rule 1: (kernel, line, register, instruction) of every write between a fence and the MMA reading it."""
    kernel, found, i = "?", [], 0
    while i < len(lines):
        m = ENTRY.match(lines[i])
        if m:
            kernel = m.group(1)
        if "wgmma.fence.sync.aligned" in lines[i]:
            run, i = offences_after_fence(lines, i)
            found += [(kernel, line, reg, by) for line, reg, by in run]
            continue
        i += 1
    return found


def main():
    # CMake hands a generator expression's list over as one argument, its items joined by ';'.
    paths = [p for arg in sys.argv[1:] for p in arg.split(";") if p]
    if not paths:
        sys.exit(__doc__)
    bad = 0
    for path in paths:
        with open(path) as f:
            lines = f.read().split("\n")
        for kernel, line, reg, by in fence_offences(lines):
            print(f"{path}: {kernel}: line {line}: wgmma reads {reg}, written by `{by}` after the wgmma.fence")
            bad += 1
        for kernel, line, reg, by in wait_offences(lines):
            print(f"{path}: {kernel}: line {line}: `{by}` touches {reg} of a wgmma not yet waited for")
            bad += 1
    print(f"check_wgmma_registers: {len(paths)} files, {bad} offences")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
