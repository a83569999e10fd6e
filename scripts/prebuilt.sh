#!/usr/bin/env bash
# Development helper: build the GPU suite's and the benchmark's executables here, carry them to a lent GPU
# machine and run them there without building (a fresh machine spends 110-175 s of device time building;
# the executables built here run on it: same CUDA 13.0 toolchain, sm_90a, cuBLAS / NCCL loaded from its
# CUDA install; checked on the H200 image, Ubuntu 24.04, 2026-11-29).
#   here:    scripts/prebuilt.sh pack [TARGET...]   builds TARGETs (default: the suite's and weft-bench) in
#                                                   build/ and packs them, with weft's install tree (library,
#                                                   headers, CMake package), into out/prebuilt/bins.tgz with the
#                                                   source tree's hash; carry "out" to the device call
#   device:  scripts/prebuilt.sh unpack [--no-python] [DIR]
#                                                   unpacks them into DIR (default build-prebuilt) if the tree's
#                                                   hash matches (exit 1 otherwise: built from other sources),
#                                                   then builds the Python module there against the install
#                                                   tree (python/CMakeLists.txt on its own: one file, ~10 s;
#                                                   the module is not carried, the device's Python differs)
#   A / B:   scripts/prebuilt.sh pack --as NAME ...  the same into out/prebuilt/NAME (the working tree's build
#            scripts/prebuilt.sh unpack --as NAME DIR at the time: pack one version, change the code, pack the
#                                                   next: incremental builds here, no device time), unpacked
#                                                   without the tree check (a version is other sources by
#                                                   design; it says which: the commit and the diff's stat).
#                                                   A device call carries at most 64 MiB: pack the one
#                                                   program the A / B runs (weft-bench: ~18 MB a version)
#            scripts/prebuilt.sh pack --as NAME --revert REV ... [TARGET...]
#                                                   a held-back change as a version: REV (a "Hold back"
#                                                   commit; --revert again for several) reverted here, the
#                                                   version packed, then the tree reset to where it was (a
#                                                   clean working tree only)
#            scripts/prebuilt.sh pack --as NAME --at REV [TARGET...]
#                                                   an earlier commit as a version (a measured build to time
#                                                   the current one against): REV checked out here, packed,
#                                                   then the branch checked out again (a clean tree only)
# Then e.g. WEFT_BUILD_DIR=build-prebuilt tests/gpu/run.sh PATTERN, or WEFT_PREBUILT=1 scripts/device_suite.sh
# PATTERN... DIR has the build tree's layout for run.sh (bench/, tests/gpu/, examples/, python/weft), not a
# CMake build: the find_package consumer step needs a build made on the machine. Not for the suite of
# record: that builds on the machine it runs on.
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 1
pack=out/prebuilt
# The hash of every file the executables are built from (the device's copy of the tree has no .git).
tree_hash() {
  find CMakeLists.txt cmake include src tests bench examples tools -name __pycache__ -prune -o -type f -print \
    2>/dev/null | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -d' ' -f1
}
# The programs: the suite's (tests/gpu/programs.txt: target, path in the build tree) and the benchmark.
programs() {
  grep -v '^#' tests/gpu/programs.txt
  echo "weft-bench bench/weft-bench"
}
what=${1:-}
shift
name=""
if [ "${1:-}" = --as ]; then
  name=${2:?prebuilt.sh: --as needs a name}
  pack=out/prebuilt/$name
  shift 2
fi
# On exit: the pack's staging directory removed, and with --revert the tree reset to where it was.
staged="" head="" branch=""
cleanup() {
  [ -z "$staged" ] || rm -rf "$staged"
  if [ -n "$branch" ]; then
    git checkout -q "$branch" && echo "prebuilt.sh: back on $branch at $(git log -1 --format=%h)" >&2
  elif [ -n "$head" ]; then
    git reset -q --hard "$head" && echo "prebuilt.sh: the tree is back at $(git log -1 --format=%h)" >&2
  fi
}
trap cleanup EXIT
reverts=()
while [ "${1:-}" = --revert ]; do
  [ -n "$name" ] || { echo "prebuilt.sh: --revert needs --as NAME (a version)" >&2; exit 2; }
  reverts+=("${2:?prebuilt.sh: --revert needs a commit}")
  shift 2
done
at=""
if [ "${1:-}" = --at ]; then
  [ -n "$name" ] && [ ${#reverts[@]} -eq 0 ] || { echo "prebuilt.sh: --at needs --as NAME, not --revert" >&2; exit 2; }
  at=${2:?prebuilt.sh: --at needs a commit}
  shift 2
fi
if [ ${#reverts[@]} -gt 0 ] || [ -n "$at" ]; then  # pack another tree, then put this one back
  git diff --quiet && git diff --cached --quiet ||
    { echo "prebuilt.sh: --revert / --at need a clean working tree (commit or stash first)" >&2; exit 2; }
  head=$(git rev-parse HEAD)
  if [ -n "$at" ]; then
    branch=$(git symbolic-ref -q --short HEAD || git rev-parse HEAD)
    git checkout -q --detach "$at" || exit 1
  else
    git revert --no-edit "${reverts[@]}" >/dev/null || { git revert --abort 2>/dev/null; exit 1; }
  fi
fi
case "$what" in
  pack)
    declare -A path_of
    while read -r target path; do path_of[$target]=$path; done < <(programs)
    targets=("$@")
    [ ${#targets[@]} -gt 0 ] || targets=($(programs | cut -d' ' -f1))
    files=()
    for t in "${targets[@]}"; do
      [ -n "${path_of[$t]:-}" ] || { echo "prebuilt.sh: $t is not one of: ${!path_of[*]}" >&2; exit 2; }
      files+=("${path_of[$t]}")
    done
    # (weft-launch and weft-bench too: the install below installs them)
    cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null &&
      cmake --build build -j "$(nproc)" --target "${targets[@]}" weft-launch weft-bench || exit 1
    mkdir -p "$pack"
    stage=$(mktemp -d)
    staged=$stage  # (removed on exit)
    cmake --install build --prefix "$stage/install" >/dev/null || exit 1
    rm -f "$stage/install/bin/weft-bench"  # (it travels at its build-tree place when packed)
    tar -C build -cf "$stage/bins.tar" "${files[@]}" && tar -C "$stage" -rf "$stage/bins.tar" install &&
      gzip -c "$stage/bins.tar" >"$pack/bins.tgz" || exit 1
    tree_hash >"$pack/sources.sha256"
    { git log -1 --format='%h %s' && git diff --stat HEAD; } >"$pack/sources.txt" 2>/dev/null
    echo "$pack/bins.tgz: ${files[*]} ($(du -h "$pack/bins.tgz" | cut -f1)); carry \"out\""
    ;;
  unpack)
    python=1
    [ "${1:-}" = --no-python ] && { python=0; shift; }
    dir=${1:-build-prebuilt}
    [ -f "$pack/bins.tgz" ] || { echo "prebuilt.sh: no $pack/bins.tgz (carry \"out\")" >&2; exit 1; }
    if [ -n "$name" ]; then
      echo "prebuilt.sh: version $name, built from: $(head -1 "$pack/sources.txt" 2>/dev/null)"
      tail -n +2 "$pack/sources.txt" 2>/dev/null | sed 's/^/    /'
    elif [ "$(tree_hash)" != "$(cat "$pack/sources.sha256" 2>/dev/null)" ]; then
      echo "prebuilt.sh: $pack was built from other sources than this tree; not used" >&2
      exit 1
    fi
    [ ! -f "$dir/CMakeCache.txt" ] || { echo "prebuilt.sh: $dir is a CMake build; unpack elsewhere" >&2; exit 1; }
    mkdir -p "$dir" && tar -C "$dir" -xzf "$pack/bins.tgz" || exit 1
    dir=$(realpath "$dir")
    if [ $python = 0 ]; then
      echo "prebuilt.sh: unpacked into $dir"
    elif cmake -S python -B "$dir/python" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$dir/install" \
      >"$dir/python-build.log" 2>&1 && cmake --build "$dir/python" -j "$(nproc)" >>"$dir/python-build.log" 2>&1 &&
      ls "$dir"/python/weft/_weft*.so >/dev/null 2>&1; then
      echo "prebuilt.sh: unpacked into $dir, the Python module built there"
    else
      echo "prebuilt.sh: unpacked into $dir; the Python module did not build ($dir/python-build.log)"
    fi
    ;;
  *)
    echo "usage: scripts/prebuilt.sh pack [--as NAME] [TARGET...] | unpack [--as NAME] [--no-python] [DIR]" \
      "(see the header)" >&2
    exit 2
    ;;
esac
