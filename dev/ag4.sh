#!/usr/bin/env bash
. dev/common.sh
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
build weft-gpu-tests weft-bench weft-launch
B=build
step tests4 200 $B/tests/gpu/weft-gpu-tests --gpus 4 --quick --filter fused
step bench4 330 $B/bench/weft-bench fused --gpus 4 --fused-ops ag --fused-m 2048,4096,8192,16384
grep -E "^\| *all_gather" $LOGS/bench4.txt | head -20
step launch4 90 $B/weft-launch -n 4 $B/tests/gpu/weft-gpu-tests --quick --filter fused
