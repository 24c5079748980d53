#!/usr/bin/env bash
# One device call (run tool, carry .devpack): the 8B bf16 batched bench with no
# adapter, a random rank-16 adapter on all seven projections and one on q/k/v/o
# (bench/random_lora.py), then bench/ncu_batch_decode.sh at 64 sequences.
# Expects .devpack/device.tar.xz, a packed .device/ from scripts/cuda_device_bundle.sh.
set -uo pipefail
tar -xJf .devpack/device.tar.xz
export QINFER_CACHE=/tmp/qinfer-cache; mkdir -p $QINFER_CACHE; tar -C $QINFER_CACHE -xJf .device/ptx.tar.xz
nvidia-smi --query-gpu=name --format=csv,noheader
python3 bench/random_lora.py bench/configs/qwen3-8b.json /tmp/lora8b --rank 16
python3 bench/random_lora.py bench/configs/qwen3-8b.json /tmp/lora8b-attn --rank 16 --targets q,k,v,o
mkdir -p $OUT/lora
for v in base:"" all:"--lora /tmp/lora8b" attn:"--lora /tmp/lora8b-attn"; do
  name=${v%%:*}; flags=${v#*:}
  timeout 110 .device/qinfer --device cuda bench --config bench/configs/qwen3-8b.json --random-weights --dtype bf16 -p 1024 -n 128 -r 1 --concurrency 1,16,64 $flags --json > $OUT/lora/8b-$name.json 2> $OUT/lora/8b-$name.err
  echo "$name rc $?"; grep -E '"test"|avg_ts"' $OUT/lora/8b-$name.json | paste - - 
done
timeout 200 bench/ncu_batch_decode.sh qwen3-8b bf16 64 1024 3; gzip $OUT/*.csv
