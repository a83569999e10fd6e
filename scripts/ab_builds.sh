#!/usr/bin/env bash
# Development helper: the same benchmark on several versions of the code in one device call, so that their
# numbers come from one machine (a lent machine differs from the next; bench/RESULTS.md compares only within
# one). Two halves, because a device call copies the working tree but not the local git history:
#   here:   scripts/ab_builds.sh pack REF...          git archive of each REF into out/ab/<name> (name: the
#                                                     ref with '/' as '-'); carry "out" to the device call
#   device: scripts/ab_builds.sh run [TARGETS] -- CMD builds TARGETS (comma-separated, default weft-bench)
#                                                     of the working tree into build/ and of every
#                                                     out/ab/<name> into
#                                                     out/ab/<name>/build, side by side, then runs CMD once per
#                                                     version in turn, with {} replaced by that version's
#                                                     build dir, e.g.
#           scripts/ab_builds.sh run -- {}/bench/weft-bench --quick fused --fused-ops ag
#           scripts/ab_builds.sh run weft-bench,weft-launch -- bash -c "{}/weft-launch -n 4 {}/bench/weft-bench alltoall"
# Each version's output goes to $OUT/ab-<name>.txt (the working tree's: $OUT/ab-worktree.txt) and its last
# lines to stdout. Not for the suite of record: tests/gpu/run.sh runs on the working tree.
# Without a build on the device (its 110-175 s a version): versions built here one after another
# (scripts/prebuilt.sh pack --as NAME weft-bench, after each change), then on the device
#           scripts/ab_builds.sh prebuilt NAME... -- CMD  each version unpacked into out/ab-prebuilt/NAME, CMD
#                                                         run once per version and round (AB_ROUNDS, default
#                                                         2), the versions in turn within a round, {} its dir;
#                                                         outputs $OUT/ab-NAME-ROUND.txt
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 1
case "${1:-}" in
  pack)
    shift
    [ $# -gt 0 ] || { echo "usage: scripts/ab_builds.sh pack REF..." >&2; exit 2; }
    for ref in "$@"; do
      name=${ref//\//-}
      rm -rf "out/ab/$name"
      mkdir -p "out/ab/$name"
      git archive "$ref" | tar -x -C "out/ab/$name" || exit 1
      echo "out/ab/$name: $(git log -1 --format='%h %s' "$ref" | cut -c1-100)"
    done
    ;;
  run)
    shift
    target=weft-bench
    if [ "${1:-}" != "--" ] && [ $# -gt 0 ]; then target=$1; shift; fi
    [ "${1:-}" = "--" ] && shift
    [ $# -gt 0 ] || { echo "usage: scripts/ab_builds.sh run [TARGET] -- CMD ({} = the build dir)" >&2; exit 2; }
    OUT=${OUT:-/tmp/out}
    mkdir -p "$OUT"
    names=(worktree) dirs=("$root")
    for d in out/ab/*/; do
      [ -d "$d" ] || continue
      names+=("$(basename "$d")")
      dirs+=("$root/${d%/}")
    done
    # Every build at once, the cores shared: one build alone leaves most of a 16+ core machine idle in its
    # serial phases (CMake, the link).
    jobs=$(($(nproc) / ${#dirs[@]} + 1))
    t0=$SECONDS
    for i in "${!dirs[@]}"; do
      b=${dirs[i]}/build
      [ "${names[i]}" = worktree ] && b=$root/build
      (cmake -S "${dirs[i]}" -B "$b" -DCMAKE_BUILD_TYPE=Release >"$OUT/ab-build-${names[i]}.log" 2>&1 &&
        cmake --build "$b" -j "$jobs" --target ${target//,/ } >>"$OUT/ab-build-${names[i]}.log" 2>&1) &
    done
    rc=0
    for job in $(jobs -p); do wait "$job" || rc=1; done
    echo "builds: $((SECONDS - t0)) s"
    [ $rc -eq 0 ] || { tail -20 "$OUT"/ab-build-*.log; exit 1; }
    for i in "${!dirs[@]}"; do
      b=${dirs[i]}/build
      [ "${names[i]}" = worktree ] && b=$root/build
      cmd=("$@")
      for j in "${!cmd[@]}"; do cmd[j]=${cmd[j]//\{\}/$b}; done
      echo "=== ${names[i]}: ${cmd[*]}"
      "${cmd[@]}" >"$OUT/ab-${names[i]}.txt" 2>&1 || echo "    (exit $?)"
      tail -5 "$OUT/ab-${names[i]}.txt"
    done
    ;;
  prebuilt)
    shift
    names=()
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do names+=("$1"); shift; done
    [ "${1:-}" = "--" ] && shift
    [ ${#names[@]} -gt 0 ] && [ $# -gt 0 ] ||
      { echo "usage: scripts/ab_builds.sh prebuilt NAME... -- CMD ({} = the version's dir)" >&2; exit 2; }
    OUT=${OUT:-/tmp/out}
    mkdir -p "$OUT"
    for name in "${names[@]}"; do
      rm -rf "out/ab-prebuilt/$name"
      scripts/prebuilt.sh unpack --as "$name" --no-python "out/ab-prebuilt/$name" || exit 1
    done
    for ((round = 1; round <= ${AB_ROUNDS:-2}; round++)); do
      for name in "${names[@]}"; do
        cmd=("$@")
        for j in "${!cmd[@]}"; do cmd[j]=${cmd[j]//\{\}/$root/out/ab-prebuilt/$name}; done
        echo "=== $name, round $round: ${cmd[*]}"
        "${cmd[@]}" >"$OUT/ab-$name-$round.txt" 2>&1 || echo "    (exit $?)"
        tail -3 "$OUT/ab-$name-$round.txt"
      done
    done
    ;;
  *)
    echo "usage: scripts/ab_builds.sh pack REF... | run [TARGET] -- CMD | prebuilt NAME... -- CMD (see the header)" >&2
    exit 2
    ;;
esac
