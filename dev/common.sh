# Device-call helpers (development only; not committed).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
LOGS=/tmp/logs; mkdir -p $LOGS
T0=$(date +%s)
LIMIT=${LIMIT:-560}
pack() { cp $LOGS/*.txt $OUT/ 2>/dev/null; tar czf $OUT/logs.tgz -C /tmp logs; }
trap pack EXIT
build() {
  local t=$(date +%s)
  cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >$LOGS/build.log 2>&1 &&
    cmake --build build -j "$(nproc)" --target "$@" >>$LOGS/build.log 2>&1 || { echo BUILD FAILED; tail -30 $LOGS/build.log; exit 1; }
  echo "build $(( $(date +%s) - t )) s"
}
# step NAME TIMEOUT CMD...: runs with a timeout capped by what is left of LIMIT
step() {
  local name=$1 to=$2; shift 2
  local left=$(( LIMIT - ($(date +%s) - T0) ))
  [ $left -lt 20 ] && { echo "SKIP $name (no time)"; return; }
  [ $to -gt $left ] && to=$left
  local t=$(date +%s)
  timeout $to "$@" >$LOGS/$name.txt 2>&1; local rc=$?
  echo "== $name rc=$rc $(( $(date +%s) - t )) s"
  grep -E "passed|failed|FAIL|error" $LOGS/$name.txt | tail -4
}
