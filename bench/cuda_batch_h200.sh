#!/usr/bin/env bash
# One call on the GPU machine for the batched engine: every CUDA test binary
# (cuda_batch first), then `qinfer bench --concurrency` on random-weight
# models of real shape, each sequence a -p token prompt then -n new tokens
# (as llama-batched-bench), and the one-sequence rows of the same models for
# the same-run ratio. Writes $OUT/batch-h200.json and the logs.
# Expects .device/ from scripts/cuda_device_bundle.sh.
# Usage: bench/cuda_batch_h200.sh [config:dtype:concurrencies ...]
#   (default qwen3-0.6b:bf16:1,16,64 qwen3-8b:bf16:1,16,64)
set -uo pipefail
OUT="${OUT:-/tmp/qinfer-out}"
mkdir -p "$OUT/runs"
mkdir -p /work && ln -sfn "$PWD" /work/main
export QINFER_CACHE=/tmp/qinfer-cache
mkdir -p "$QINFER_CACHE"
[ -f .device/ptx.tar.xz ] && tar -C "$QINFER_CACHE" -xJf .device/ptx.tar.xz
: "${TESTS:=1}"
: "${PROMPT:=1024}"
: "${GEN:=128}"
if [ "$TESTS" = 1 ]; then
  : > "$OUT/tests.log"
  # TEST_BINS: the test binaries to run (default: all, cuda_batch first).
  : "${TEST_BINS:=.device/cuda_batch $(ls .device/cuda_* | grep -v -e cuda_batch -e cuda_profile) .device/kernel_sources}"
  for t in $TEST_BINS; do
    case "$t" in .device/cuda_profile) continue ;; esac
    echo "== $t" >> "$OUT/tests.log"
    QINFER_REQUIRE_GPU=1 timeout 150 "$t" --test-threads=1 --nocapture >> "$OUT/tests.log" 2>&1
    echo "rc $? $t" >> "$OUT/tests.log"
  done
  grep -E "^== |^rc |test result|panicked" "$OUT/tests.log"
fi
for spec in "${@:-qwen3-0.6b:bf16:1,16,64 qwen3-8b:bf16:1,16,64}"; do
  for s in $spec; do
    IFS=: read -r cfg dtype conc <<< "$s"
    timeout "${BENCH_TIMEOUT:-240}" .device/qinfer --device cuda bench --config "bench/configs/$cfg.json" --random-weights \
      --dtype "$dtype" -p "$PROMPT" -n "$GEN" -r 1 --concurrency "$conc" --json \
      > "$OUT/runs/$cfg-$dtype-batch.json" 2> "$OUT/runs/$cfg-$dtype-batch.err"
    echo "== $cfg $dtype concurrency $conc: rc $?"
    cat "$OUT/runs/$cfg-$dtype-batch.json"; tail -3 "$OUT/runs/$cfg-$dtype-batch.err"
  done
done
# MULTITURN=cfg:dtype: the prefix cache's multi-turn run (16 conversations
# x 8 turns sharing a 2,000-token system prompt, ~200 tokens a turn).
if [ -n "${MULTITURN:-}" ]; then
  IFS=: read -r cfg dtype <<< "$MULTITURN"
  timeout "${MULTITURN_TIMEOUT:-150}" .device/qinfer --device cuda bench --config "bench/configs/$cfg.json" --random-weights \
    --dtype "$dtype" --multi-turn --conversations 16 --turns 8 --system-tokens 2000 --turn-tokens 200 -n 32 --json \
    > "$OUT/runs/$cfg-$dtype-multiturn.json" 2> "$OUT/runs/$cfg-$dtype-multiturn.err"
  echo "== $cfg $dtype multi-turn: rc $?"
  cat "$OUT/runs/$cfg-$dtype-multiturn.json"; tail -3 "$OUT/runs/$cfg-$dtype-multiturn.err"
fi
# EMBED=cfg:dtype:concurrency: last-token embedding requests of 512 tokens.
if [ -n "${EMBED:-}" ]; then
  IFS=: read -r cfg dtype conc <<< "$EMBED"
  timeout "${EMBED_TIMEOUT:-90}" .device/qinfer --device cuda bench --config "bench/configs/$cfg.json" --random-weights \
    --dtype "$dtype" -p 512 -r 2 --concurrency "$conc" --embed --json \
    > "$OUT/runs/$cfg-$dtype-embed.json" 2> "$OUT/runs/$cfg-$dtype-embed.err"
  echo "== $cfg $dtype embed: rc $?"
  cat "$OUT/runs/$cfg-$dtype-embed.json"; tail -3 "$OUT/runs/$cfg-$dtype-embed.err"
fi
tar -czf "$OUT/runs.tgz" -C "$OUT" runs
