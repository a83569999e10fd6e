#!/usr/bin/env bash
. dev/common.sh
build weft-gpu-tests weft-bench weft-launch _weft
B=$PWD/build; T=$B/tests/gpu/weft-gpu-tests
TR="python3 -m torch.distributed.run --master-port=$((20000 + RANDOM % 20000))"
step fd4 200 $B/bench/weft-bench flash_decode --gpus 4 --timeline $LOGS/tl
grep "^|" $LOGS/fd4.txt | head -16
step fdpy4 120 env PYTHONPATH=$B/python $TR --nproc_per_node=4 python/benchmarks/decode.py
grep "^|" $LOGS/fdpy4.txt | head -10
( step fd2 150 env CUDA_VISIBLE_DEVICES=0,1 $B/bench/weft-bench flash_decode --gpus 2
  step fdpy2 120 env CUDA_VISIBLE_DEVICES=0,1 PYTHONPATH=$B/python $TR --nproc_per_node=2 python/benchmarks/decode.py ) > $LOGS/pair.out 2>&1 &
( step dec_v3 100 env CUDA_VISIBLE_DEVICES=2 $T --gpus 1 --ranks 3 --team-only --quick --filter decode
  step dec_v8 100 env CUDA_VISIBLE_DEVICES=2 $T --gpus 1 --ranks 8 --team-only --quick --filter decode ) > $LOGS/virt.out 2>&1 &
wait
cat $LOGS/pair.out $LOGS/virt.out
grep "^|" $LOGS/fd2.txt | head -14; grep "^|" $LOGS/fdpy2.txt | head -10
step dec4 100 $T --gpus 4 --filter decode
step dec_l4 100 $B/weft-launch -n 4 $T --filter decode
