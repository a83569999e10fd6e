#!/usr/bin/env bash
# The whole GPU suite in one command (run it on a GPU machine from anywhere):
#   tests/gpu/run.sh            builds into ./build if needed, then runs everything below
#   tests/gpu/run.sh PATTERN    only the steps whose name contains PATTERN (e.g. "virtual"; -PATTERN: all
#                               but those, e.g. -sanitizer)
#   WEFT_SUITE_QUICK=1 tests/gpu/run.sh   the real-GPU team steps with --quick too (fewer sizes: about half
#                               the device time; a check of a change, not the suite of record)
# At 2 and 4 GPUs (as many as the machine has): weft-gpu-tests single-process and one process per rank
# (weft-launch), the rank-death test, teams spanning fake nodes (2 x 1, 2 x 2 ranks). On any machine: virtual ranks (teams of W = 2, 3, 4 and 8 on one GPU),
# the team under a small SM budget, the refusal of processes sharing a GPU; the Python package under torchrun
# (a team of one on a single GPU), and compute-sanitizer memcheck / racecheck / synccheck on small cases.
# Logs go to $WEFT_LOG_DIR (default: build/gpu-logs). Each step is stopped after WEFT_STEP_TIMEOUT_S seconds
# (default 900). Exit 0 only if every step passed.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

root=$(cd "$(dirname "$0")/../.." && pwd)
build=${WEFT_BUILD_DIR:-$root/build}
logs=${WEFT_LOG_DIR:-$build/gpu-logs}
# The programs it runs (tests/gpu/programs.txt: target, path), built where one is missing.
programs=() missing=0
while read -r target path; do
  programs+=("$target")
  [ -x "$build/$path" ] || missing=1
done < <(grep -v '^#' "$root/tests/gpu/programs.txt")
if [ $missing = 1 ]; then
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null &&
    cmake --build "$build" -j "$(nproc)" --target "${programs[@]}" || exit 1
fi
mkdir -p "$logs"
tests=$build/tests/gpu/weft-gpu-tests
launch=$build/weft-launch
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
# The one GPU of the one-GPU steps: the first of CUDA_VISIBLE_DEVICES (a lane of scripts/device_suite.sh),
# else 0.
one_gpu=${CUDA_VISIBLE_DEVICES:-0}
one_gpu=${one_gpu%%,*}
if [ "${ngpu:-0}" -lt 1 ]; then
  echo "SKIPPED: tests/gpu/run.sh found no GPU; the GPU suite did not run"
  exit 77
fi

passed=0 failed=0 summary=()
only=${1:-}
wanted() {  # wanted NAME: whether the pattern selects the step NAME
  case "$only" in
    -*) case "$1" in *"${only#-}"*) return 1 ;; esac ;;
    *) case "$1" in *"$only"*) ;; *) return 1 ;; esac ;;
  esac
}
step() {  # step NAME LOGFILE CMD...
  local name=$1 log=$logs/$2.log
  shift 2
  wanted "$name" || return 0
  echo "=== $name"
  local t0=$SECONDS
  timeout "${WEFT_STEP_TIMEOUT_S:-900}" "$@" >"$log" 2>&1
  local rc=$?
  grep -E 'summary:|FAILED|HUNG|SKIPPED|ERROR SUMMARY|saw after' "$log" | sed 's/^/    /' | head -20
  if [ $rc -eq 0 ]; then
    passed=$((passed + 1)); summary+=("PASS  $name ($((SECONDS - t0)) s)")
  else
    failed=$((failed + 1)); summary+=("FAIL  $name (exit $rc, log $log)")
    tail -20 "$log" | sed 's/^/    | /'
  fi
}

# Real teams: 2 and 4 GPUs (as many as the machine has), single-process and one process per GPU.
quick=()
[ "${WEFT_SUITE_QUICK:-0}" = 1 ] && quick=(--quick)
if [ "$ngpu" -ge 2 ]; then
  for n in 2 4; do
    [ "$n" -le "$ngpu" ] || continue
    step "single-process, $n GPUs" "single_$n" "$tests" --gpus "$n" "${quick[@]}"
    step "multi-process, $n ranks" "multi_$n" "$launch" -n "$n" "$tests" "${quick[@]}"
  done
  step "rank death, 2 ranks (one exits mid-wait)" "rank_death" env WEFT_TEST_RANK_DEATH=1 "$launch" -n 2 "$tests" --filter rank_death
  # Teams spanning nodes on fake nodes of this host (WEFT_NODE_SIZE), NCCL forced onto sockets between them:
  # the hierarchical collectives against NCCL's flat ones.
  for size in 1 2; do  # nodes of `size` ranks, 2 nodes
    [ $((2 * size)) -le "$ngpu" ] || continue
    step "fake nodes: 2 x $size ranks (NCCL over sockets between nodes), hierarchical collectives" \
      "fake_nodes_2x$size" env WEFT_NODE_SIZE="$size" MASTER_ADDR=127.0.0.1 \
      WEFT_RENDEZVOUS_PORT=$((20000 + RANDOM % 20000)) NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 \
      "$launch" -n $((2 * size)) "$build/tests/gpu/weft-multinode-tests"
    step "fake nodes: 2 x $size ranks, the last rank leaves: every other rank reports it" \
      "fake_nodes_death_2x$size" env WEFT_TEST_RANK_DEATH=1 WEFT_NODE_SIZE="$size" MASTER_ADDR=127.0.0.1 \
      WEFT_RENDEZVOUS_PORT=$((20000 + RANDOM % 20000)) NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 \
      "$launch" -n $((2 * size)) --grace 60 "$build/tests/gpu/weft-multinode-tests"
  done
  step "examples: hello_nodes on 2 fake nodes of 1 GPU" "hello_nodes" env WEFT_NODE_SIZE=1 MASTER_ADDR=127.0.0.1 \
    MASTER_PORT=$((20000 + RANDOM % 20000)) NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 \
    "$launch" -n 2 "$build/examples/hello_nodes"
else
  step "single-process, 1 GPU (one-GPU tests)" "single_1" "$tests" --gpus 1
fi
# Virtual ranks: teams of W ranks on one GPU (every protocol, on any machine with a GPU; not a substitute for
# real GPUs: one L2 hides a missing system-scope fence). The one-GPU tests ran above. W = 2 in full; 3, 4 and
# 8 with --quick (every test, fewer sizes and rounds: the host references grow with W).
step "virtual ranks, W = 2 on 1 GPU" "virtual_2" "$tests" --gpus 1 --ranks 2 --team-only
for w in 3 4; do
  step "virtual ranks, W = $w on 1 GPU (quick)" "virtual_$w" "$tests" --gpus 1 --ranks "$w" --team-only --quick
done
step "virtual ranks, W = 8 on 1 GPU (runtime, primitives, collectives; quick)" "virtual_8" \
  "$tests" --gpus 1 --ranks 8 --team-only --quick --filter -matmul,-fused
# An SM budget of a few SMs per rank: the collectives and fused ops still right (grids sized from it).
step "virtual ranks, W = 2, SM budget 4" "budget_4" "$tests" --gpus 1 --ranks 2 --sm-budget 4 --team-only \
  --filter all_reduce,all_gather,reduce_scatter,all_to_all,collective,matmul,fused,budget
# The C++ examples (a team program, an LCSC op of one's own) on 3 virtual ranks of one GPU.
step "examples (hello_team, matmul_to_next), 3 virtual ranks" "examples" env WEFT_RANKS_PER_GPU=3 \
  CUDA_DEVICE_MAX_CONNECTIONS=32 CUDA_VISIBLE_DEVICES=$one_gpu bash -c \
  "'$build/examples/hello_team' && '$build/examples/matmul_to_next'"
# The installed package as a user's project consumes it (README "Using it from CMake"): examples/consumer
# builds hello_team with find_package(weft) against `cmake --install` (which installs every built program,
# so everything is built first); it runs on 2 virtual ranks.
if [ -f "$build/CMakeCache.txt" ]; then
  step "find_package(weft) consumer: hello_team, 2 virtual ranks" "consumer" bash -c \
    "cmake --build '$build' -j '$(nproc)' >/dev/null && \
     cmake -DWEFT_BUILD='$build' -DWEFT_SOURCE='$root' -P '$root/cmake/TestPackage.cmake' && \
     WEFT_RANKS_PER_GPU=2 CUDA_DEVICE_MAX_CONNECTIONS=32 CUDA_VISIBLE_DEVICES=$one_gpu '$build/package-test/consumer/hello_team'"
elif wanted "find_package(weft) consumer: hello_team, 2 virtual ranks"; then  # (executables from elsewhere, scripts/prebuilt.sh)
  echo "=== find_package(weft) consumer: skipped, $build is not a CMake build"
fi
# One process per rank on a shared GPU is refused at creation with the reason and what to do instead.
step "one process per rank on one GPU: refused" "shared_gpu" bash -c \
  "! CUDA_VISIBLE_DEVICES=$one_gpu '$launch' -n 2 '$tests' --filter team_layout && \
   grep -q 'one process per rank needs a GPU per rank' '$logs/shared_gpu.log'"
# The Python package under torchrun, against torch.distributed (when torch and the module are there).
if python3 -c "import torch" 2>/dev/null; then
  # (WEFT_SUITE_NO_BUILD=1: built already; lanes of scripts/device_suite.sh must not build side by side.)
  [ "${WEFT_SUITE_NO_BUILD:-0}" = 1 ] || cmake --build "$build" -j "$(nproc)" --target _weft >/dev/null 2>&1 || true
  if ls "$build"/python/weft/_weft*.so >/dev/null 2>&1; then
    for n in 1 2 4; do
      [ "$n" -le "$ngpu" ] || continue
      [ "$n" -eq 1 ] && [ "$ngpu" -ge 2 ] && continue
      step "python (torchrun), $n processes" "python_$n" env PYTHONPATH="$build/python" \
        python3 -m torch.distributed.run --master-port=$((20000 + RANDOM % 20000)) \
        --nproc_per_node="$n" "$root/python/tests/gpu_ops.py"
      # weft as torch.distributed's backend (init_process_group("weft")): collectives, DDP, FSDP2, a mesh,
      # against an NCCL group of the same ranks.
      [ "$n" -ge 2 ] && step "python: the torch.distributed backend 'weft' (torchrun), $n processes" \
        "python_backend_$n" env PYTHONPATH="$build/python" \
        python3 -m torch.distributed.run --master-port=$((20000 + RANDOM % 20000)) \
        --nproc_per_node="$n" "$root/python/tests/gpu_backend.py"
      # A job spanning fake nodes of this host (WEFT_NODE_SIZE; NCCL onto sockets between them): the
      # hierarchical collectives from Python, and the backend on them (DDP), against NCCL.
      for size in 1 2; do
        [ "$n" -eq $((2 * size)) ] || continue
        for mode in ops backend; do
          step "python: a job of 2 fake nodes of $size (weft.init_multi_node, $mode; torchrun), $n processes" \
            "python_multinode_${mode}_2x$size" env PYTHONPATH="$build/python" WEFT_NODE_SIZE="$size" \
            NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 python3 -m torch.distributed.run \
            --master-port=$((20000 + RANDOM % 20000)) --nproc_per_node="$n" "$root/python/tests/gpu_multinode.py" \
            "$mode"
        done
      done
      # A two-node job as a user launches one: a torchrun per node (--nnodes 2, its node rank, the first node's
      # address), here both on this host, one GPU each: the job's rendezvous across launchers, then the
      # hierarchical ops against NCCL.
      [ "$n" -eq 2 ] && step "python: two torchrun launchers as 2 nodes of 1 GPU (weft.init_multi_node, ops)" \
        "python_two_launchers" env PYTHONPATH="$build/python" NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 \
        NCCL_IB_DISABLE=1 WEFT_JOB_SECRET="$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')" bash -c '
          port=$((20000 + RANDOM % 20000)); pids=(); IFS=, read -ra gpus <<< "${CUDA_VISIBLE_DEVICES:-0,1}"
          for node in 0 1; do
            CUDA_VISIBLE_DEVICES=${gpus[$node]} python3 -m torch.distributed.run --nnodes=2 --node-rank=$node \
              --nproc-per-node=1 --master-addr=127.0.0.1 --master-port=$port "$0" ops & pids+=($!)
          done
          rc=0; for p in "${pids[@]}"; do wait "$p" || rc=1; done; exit $rc' "$root/python/tests/gpu_multinode.py"
      # Training through weft's ops against torch.distributed's differentiable collectives and fp32.
      [ "$n" -ge 2 ] && step "python: examples/tp_mlp.py trains (torchrun), $n processes" "python_tp_mlp_$n" \
        env PYTHONPATH="$build/python" python3 -m torch.distributed.run --master-port=$((20000 + RANDOM % 20000)) \
        --nproc_per_node="$n" "$root/examples/tp_mlp.py" 4096 2048 8192
      # A small decoder (attention, MLP and two MoE layers) on a (context x tensor) mesh, against plain torch.
      [ "$n" -ge 2 ] && step "python: examples/train_transformer.py (torchrun), $n processes" \
        "python_train_transformer_$n" env PYTHONPATH="$build/python" python3 -m torch.distributed.run \
        --master-port=$((20000 + RANDOM % 20000)) --nproc_per_node="$n" "$root/examples/train_transformer.py" \
        --tp 2 --steps 8 --layers 4 --seq 512
    done
    step "python: flash attention against fp32 and SDPA" "python_attention" env PYTHONPATH="$build/python" \
      python3 "$root/python/tests/gpu_attention.py"
    step "python: grouped_mm against fp32 (forward, autograd, CUDA graph)" "python_grouped_mm" \
      env PYTHONPATH="$build/python" python3 "$root/python/tests/gpu_grouped_mm.py"
    step "python: scaled_mm and quantize_fp8 against torch._scaled_mm and fp32" "python_fp8" \
      env PYTHONPATH="$build/python" python3 "$root/python/tests/gpu_fp8.py"
    # Torch operators on virtual teams of 2 and 4 ranks: autograd against plain torch, torch.compile,
    # CUDA graphs through torch.
    step "python: torch operators on virtual teams (W = 2, 4)" "python_team" env PYTHONPATH="$build/python" \
      CUDA_DEVICE_MAX_CONNECTIONS=32 CUDA_VISIBLE_DEVICES=$one_gpu python3 "$root/python/tests/gpu_team.py" 2 4
    step "python: examples/tp_mlp.py trains on virtual teams (W = 2, 4) as plain torch does" "python_tp_mlp" \
      env PYTHONPATH="$build/python" CUDA_DEVICE_MAX_CONNECTIONS=32 CUDA_VISIBLE_DEVICES=$one_gpu bash -c \
      "python3 '$root/examples/tp_mlp.py' --ranks 2 && python3 '$root/examples/tp_mlp.py' --ranks 4"
    step "python: examples/train_transformer.py on a virtual team (cp 2 x tp 2) as plain torch does" \
      "python_train_transformer_virtual" env PYTHONPATH="$build/python" CUDA_DEVICE_MAX_CONNECTIONS=32 \
      CUDA_VISIBLE_DEVICES=$one_gpu python3 "$root/examples/train_transformer.py" --ranks 4 --tp 2 --steps 8 \
      --layers 2 --seq 512
  else
    echo "=== python: the extension module was not built (pybind11 / Python headers missing); skipped"
  fi
fi
for tool in memcheck racecheck synccheck; do
  # racecheck flags cuBLAS's own kernels (nvjet_*), which the GEMM tests, fused_rs_ar_large (its sequential
  # reference) and fused_ops_on_a_team_of_one (cuBLAS on a team of one) use; weft's kernels were
  # racecheck-clean with them included (2026-11-21), and the other fused tests still race-check the fused
  # kernels. Leave those out of racecheck.
  # host_calls times host calls against a 3 s patience (sanitized calls run far slower) and runs no weft
  # kernel of its own: left out.
  # fail_fast runs a 0.5 s team timeout, which sanitized kernels can outlast without any peer stalling.
  skip=-create_destroy,-rank_death,-host_calls,-fail_fast
  [ "$tool" = racecheck ] && skip=$skip,-gemm,-fused_rs_ar_large,-fused_ops_on_a_team_of_one
  # synccheck: cuBLAS's own kernels (nvjet_*: the GEMM tests' references) left uninstrumented. Under
  # synccheck a cuBLAS reference GEMM (4096^3, bf16 or f32 out) never finished in 3 of 8 runs at 2 ranks
  # (2 x H200, 2026-11-27), after weft's kernel of the same case had ended; weft's kernels stay checked.
  excluded=()
  [ "$tool" = synccheck ] && excluded=(--kernel-name-exclude kns=nvjet)
  # Sanitized kernels run many times slower: a 300 s device and host-collective timeout instead of 10 / 30 s,
  # and 850 s per test (weft-gpu-tests' watchdog) instead of 300. Two ranks: one process per GPU where there
  # are two GPUs, else two virtual ranks on one.
  if [ "$ngpu" -ge 2 ]; then
    run=("$launch" -n 2 compute-sanitizer --tool "$tool" "${excluded[@]}" --error-exitcode 9 "$tests" --quick
      --filter "$skip")
    what="2 ranks"
  else
    run=(compute-sanitizer --tool "$tool" "${excluded[@]}" --error-exitcode 9 "$tests" --gpus 1 --ranks 2
      --team-only --quick --filter "$skip")
    what="2 virtual ranks on 1 GPU"
  fi
  step "compute-sanitizer $tool, $what" "sanitizer_$tool" env WEFT_TIMEOUT_MS=300000 WEFT_TEST_TIMEOUT_S=850 \
    "${run[@]}"
  step "compute-sanitizer $tool, attention (small cases)" "sanitizer_attention_$tool" env WEFT_TEST_TIMEOUT_S=850 \
    compute-sanitizer --tool "$tool" --error-exitcode 9 "$tests" --gpus 1 --filter flash_attention_small
  # The FP8 GEMM's paths (one-GPU tests, which the team steps above leave out): staged scales read by each
  # warp from the stage it releases on its own.
  step "compute-sanitizer $tool, FP8 GEMM scale paths" "sanitizer_fp8_$tool" env WEFT_TEST_TIMEOUT_S=850 \
    compute-sanitizer --tool "$tool" --error-exitcode 9 "$tests" --gpus 1 --quick --filter gemm_fp8_m_major_block_scales
done

echo
echo "GPU suite results:"
printf '  %s\n' "${summary[@]}"
echo "gpu-suite: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
