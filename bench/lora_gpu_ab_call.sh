#!/usr/bin/env bash
# One device call (run tool, carry .devpack): the CUDA batch/LoRA/attention tests,
# then the 8B bf16 batched bench with and without a random rank-16 adapter for
# two builds: .devpack/device.tar.xz (a packed .device/ from
# scripts/cuda_device_bundle.sh) and .devpack/qinfer-prev.xz (an earlier qinfer
# binary), back to back. Results under $OUT/r.
set -uo pipefail
tar -xJf .devpack/device.tar.xz; mkdir -p /work; ln -sfn "$PWD" /work/wt-kern
export QINFER_CACHE=/tmp/qinfer-cache; mkdir -p $QINFER_CACHE; tar -C $QINFER_CACHE -xJf .device/ptx.tar.xz
nvidia-smi --query-gpu=name --format=csv,noheader
for t in .device/cuda_batch .device/cuda_lora .device/cuda_attention; do
  echo "== $t"; QINFER_REQUIRE_GPU=1 timeout 100 $t --test-threads=1 2>&1 | grep -E "test result|panicked|FAILED"
done
python3 bench/random_lora.py bench/configs/qwen3-8b.json /tmp/lora8b --rank 16 > /dev/null
mkdir -p $OUT/r
cp .device/qinfer /tmp/qinfer-new; xz -dc .devpack/qinfer-prev.xz > /tmp/qinfer-prev; chmod +x /tmp/qinfer-prev
for v in new:base:"" prev:base:"" new:lora:"--lora /tmp/lora8b" prev:lora:"--lora /tmp/lora8b"; do
  bin=${v%%:*}; rest=${v#*:}; name=${rest%%:*}; flags=${rest#*:}
  timeout 100 /tmp/qinfer-$bin --device cuda bench --config bench/configs/qwen3-8b.json --random-weights --dtype bf16 -p 1024 -n 128 -r 1 --concurrency 1,16,64 $flags --json > $OUT/r/$bin-$name.json 2> $OUT/r/$bin-$name.err
  echo "$bin $name rc $?"; grep -E '"test"|avg_ts"' $OUT/r/$bin-$name.json | paste - -
done
