#!/usr/bin/env bash
# One device call (run tool, carry .devpack with a packed .device/ from
# scripts/cuda_device_bundle.sh): the 8B bf16 batched bench with and without
# n-gram speculation (4 draft tokens), random weights, results under $OUT.
set -uo pipefail
tar -xJf .devpack/device.tar.xz
export QINFER_CACHE=/tmp/qinfer-cache; mkdir -p $QINFER_CACHE; tar -C $QINFER_CACHE -xJf .device/ptx.tar.xz
nvidia-smi --query-gpu=name --format=csv,noheader
for v in plain:"" ngram4:"--speculative ngram --draft-tokens 4"; do
  name=${v%%:*}; flags=${v#*:}
  timeout 60 .device/qinfer --device cuda bench --config bench/configs/qwen3-8b.json --random-weights --dtype bf16 -p 128 -n 128 -r 1 --concurrency 1,16 $flags --json > $OUT/spec-$name.json 2> $OUT/spec-$name.err
  echo "$name rc $?"; grep -E '"test"|avg_ts"|"acceptance"' $OUT/spec-$name.json | paste - - | head; tail -2 $OUT/spec-$name.err
done
