#!/usr/bin/env bash
. dev/common.sh
build weft-bench _weft
B=$PWD/build
TR="python3 -m torch.distributed.run --master-port=$((20000 + RANDOM % 20000))"
step moepy4 330 env PYTHONPATH=$B/python $TR --nproc_per_node=4 python/benchmarks/moe.py
tail -60 $LOGS/moepy4.txt | grep "^|\|^#"
step moepy2 200 env CUDA_VISIBLE_DEVICES=0,1 PYTHONPATH=$B/python $TR --nproc_per_node=2 python/benchmarks/moe.py
tail -60 $LOGS/moepy2.txt | grep "^|\|^#"
