#!/usr/bin/env bash
. dev/common.sh
build weft-gpu-tests weft-bench weft-launch _weft
B=$PWD/build; T=$B/tests/gpu/weft-gpu-tests
PY="env PYTHONPATH=$B/python python3"
TR="python3 -m torch.distributed.run --master-port=$((20000 + RANDOM % 20000))"
step moe_real4 150 $T --gpus 4 --filter moe
step moe_launch4 150 $B/weft-launch -n 4 $T --filter moe
step py_ops4 200 env PYTHONPATH=$B/python $TR --nproc_per_node=4 python/tests/gpu_ops.py
# in parallel: pairs 0,1 (real 2), GPU 2 (python virtual team), GPU 3 (virtual 3 and 8)
( step moe_real2 120 env CUDA_VISIBLE_DEVICES=0,1 $T --gpus 2 --filter moe
  step moe_launch2 120 env CUDA_VISIBLE_DEVICES=0,1 $B/weft-launch -n 2 $T --filter moe
  step py_ops2 200 env CUDA_VISIBLE_DEVICES=0,1 PYTHONPATH=$B/python $TR --nproc_per_node=2 python/tests/gpu_ops.py ) > $LOGS/pair.out 2>&1 &
( step py_team 330 env CUDA_VISIBLE_DEVICES=2 CUDA_DEVICE_MAX_CONNECTIONS=32 PYTHONPATH=$B/python python3 python/tests/gpu_team.py 2 4 ) > $LOGS/team.out 2>&1 &
( step virt3 150 env CUDA_VISIBLE_DEVICES=3 $T --gpus 1 --ranks 3 --team-only --quick --filter moe
  step virt8 150 env CUDA_VISIBLE_DEVICES=3 $T --gpus 1 --ranks 8 --team-only --quick --filter moe
  step virt4 150 env CUDA_VISIBLE_DEVICES=3 $T --gpus 1 --ranks 4 --team-only --quick --filter moe
  step virt2 150 env CUDA_VISIBLE_DEVICES=3 $T --gpus 1 --ranks 2 --team-only --quick --filter moe ) > $LOGS/virt.out 2>&1 &
wait
cat $LOGS/pair.out $LOGS/team.out $LOGS/virt.out
grep -E "FAIL|Error|error" $LOGS/py_team.txt | head -5; tail -3 $LOGS/py_team.txt
step moe_tl 150 $B/bench/weft-bench moe --gpus 4 --timeline $LOGS/tl
grep -A12 "^## " $LOGS/moe_tl.txt | grep "^|" | head -40
