#!/usr/bin/env python3
"""Fails on an #include that goes the wrong way between weft's layers (run by CI through ctest).

Device side (include/weft/):  base < device < comm < tile < lcsc < ops, with runtime (host) beside device:
  base      dtype.hpp, host_device.hpp, team_view.hpp, timeline.hpp: plain types and the host / device
            qualifier every layer shares
  device    PTX wrappers, numerics, bulk copies
  runtime   the host runtime's public types (communicator, resources, errors)
  comm      transfer and synchronization primitives
  tile      tiles, TMA, wgmma, warp roles
  lcsc      the Load-Compute-Store-Communicate template and its launch
  ops       the ops' device code (.cuh), their public host API (.hpp) and the plain types the two share
            (*_types.hpp, plan.hpp)
Host side: src/runtime < src/ops (the launchers) < python/src (the bindings), examples; the bindings and
examples use the public headers only.
Inside ops: a host API header (.hpp) never includes device code; device code includes only the plain-type
headers of ops, and another op's device code only where it is built on that op (COMPOSES below).

    tools/check_layers.py [REPO]        prints each wrong include, exits 1 if there is any
"""
import os
import re
import sys

BASE = {"dtype.hpp", "host_device.hpp", "team_view.hpp", "timeline.hpp"}
# What each layer of include/weft may include (besides itself and system headers).
MAY_INCLUDE = {
    "base": set(),
    "device": {"base"},
    "runtime": {"base"},
    "comm": {"base", "device"},
    "tile": {"base", "device", "comm"},
    "lcsc": {"base", "device", "comm", "tile", "runtime"},
    "ops": {"base", "device", "comm", "tile", "lcsc", "runtime"},
    # Host code: private headers of its own directory, and these layers / directories.
    "src/runtime": {"base", "device", "runtime", "comm"},
    "src/ops": {"base", "device", "comm", "tile", "lcsc", "runtime", "ops", "src/runtime"},
    "python/src": {"base", "runtime", "ops"},
    "examples": {"base", "device", "comm", "tile", "lcsc", "runtime", "ops"},
}
# Device code of one op built on another's: (includer, included) in include/weft/ops.
COMPOSES = {
    ("attention_backward.cuh", "attention.cuh"),
    ("ring_attention.cuh", "attention.cuh"),
    ("ring_attention_backward.cuh", "attention_backward.cuh"),
    ("ring_attention_backward.cuh", "ring_attention.cuh"),
    ("ulysses_attention.cuh", "attention.cuh"),
    ("fused.cuh", "gemm.cuh"),
    ("fused.cuh", "collectives.cuh"),
    ("moe_dispatch.cuh", "gemm.cuh"),
}
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]')
SOURCES = (".h", ".hpp", ".cuh", ".cu", ".cpp")


def layer_of(rel):
    """The layer of a repository path, or None for files the check does not govern."""
    parts = rel.split("/")
    if parts[:2] == ["include", "weft"]:
        if len(parts) == 3:
            return "base" if parts[2] in BASE else "unknown"
        return parts[2] if parts[2] in MAY_INCLUDE else "unknown"
    for host in ("src/runtime", "src/ops", "python/src"):
        if rel.startswith(host + "/"):
            return host
    if rel.startswith("examples/"):
        return "examples"
    return None


def resolve(repo, includer, name):
    """The repository path an include names, or None (a system or third-party header)."""
    if name.startswith("weft/"):
        return "include/" + name
    for base in (os.path.dirname(includer), "src"):
        cand = os.path.normpath(os.path.join(base, name))
        if os.path.exists(os.path.join(repo, cand)):
            return cand
    return None


def violation(src, dst):
    """Why src may not include dst, or None."""
    a, b = layer_of(src), layer_of(dst)
    if a is None:
        return None
    if a == "unknown" or b == "unknown":
        return "a header outside the known layers (add its directory to tools/check_layers.py)"
    same_dir = os.path.dirname(src) == os.path.dirname(dst)
    if a == b and (same_dir or not a.startswith(("src/", "python/"))):
        if a != "ops":
            return None
        s, d = os.path.basename(src), os.path.basename(dst)
        if s.endswith(".hpp") and d.endswith(".cuh"):
            return "an ops host API header includes device code"
        if s.endswith(".cuh") and d.endswith(".hpp") and not (d.endswith("_types.hpp") or d == "plan.hpp"):
            return "ops device code includes a host API header (move the shared types to <op>_types.hpp)"
        if s.endswith(".cuh") and d.endswith(".cuh") and (s, d) not in COMPOSES:
            return "one op's device code includes another's (move the shared pieces down a layer, or list " \
                   "the composition in COMPOSES)"
        return None
    if b is None or (b.startswith(("src/", "python/", "examples")) and b not in MAY_INCLUDE[a]):
        return f"{a} includes a private header of {b or 'another directory'}"
    if b not in MAY_INCLUDE[a]:
        return f"{a} may not include {b} (layers: {', '.join(sorted(MAY_INCLUDE[a])) or 'none'} only)"
    return None


def main(repo):
    bad = 0
    for top in ("include", "src", "python/src", "examples"):
        for dirpath, _, files in os.walk(os.path.join(repo, top)):
            for f in sorted(files):
                if not f.endswith(SOURCES):
                    continue
                src = os.path.relpath(os.path.join(dirpath, f), repo)
                with open(os.path.join(repo, src), encoding="utf-8") as fh:
                    for n, line in enumerate(fh, 1):
                        m = INCLUDE.match(line)
                        dst = m and resolve(repo, src, m.group(1))
                        why = dst and violation(src, dst)
                        if why:
                            print(f"{src}:{n}: includes {dst}: {why}")
                            bad += 1
    print(f"check_layers: {bad} wrong include(s)" if bad else "check_layers: every include goes down the layers")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")))
