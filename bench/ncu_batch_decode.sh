#!/usr/bin/env bash
# Per-kernel device times of a batched run under Nsight Compute (one pass,
# gpu__time_duration only, so no kernel is replayed): C sequences of a -p
# token prompt, then -n new tokens, random weights of a config's shape.
# Writes $OUT/ncu-<cfg>-c<C>.csv (one row per launch, in launch order) and
# the bench's JSON. Expects .device/ from scripts/cuda_device_bundle.sh.
# Usage: bench/ncu_batch_decode.sh CONFIG DTYPE CONCURRENCY [PROMPT] [GEN]
set -uo pipefail
cfg=$1 dtype=$2 conc=$3 prompt=${4:-1024} gen=${5:-6}
OUT="${OUT:-/tmp/qinfer-out}"
mkdir -p "$OUT"
export QINFER_CACHE=/tmp/qinfer-cache
mkdir -p "$QINFER_CACHE"
[ -f .device/ptx.tar.xz ] && tar -C "$QINFER_CACHE" -xJf .device/ptx.tar.xz
ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
  --log-file "$OUT/ncu-$cfg-c$conc.csv" \
  .device/qinfer --device cuda bench --config "bench/configs/$cfg.json" --random-weights \
  --dtype "$dtype" -p "$prompt" -n "$gen" -r 1 --concurrency "$conc" --json \
  > "$OUT/ncu-$cfg-c$conc.json" 2> "$OUT/ncu-$cfg-c$conc.err"
echo "ncu rc $? $(wc -l < "$OUT/ncu-$cfg-c$conc.csv") lines"
