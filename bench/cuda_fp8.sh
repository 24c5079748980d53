#!/usr/bin/env bash
# One call on the GPU machine for FP8 weights: the CUDA tests that FP8 touches
# (cuda_fp8 against the CPU and the FP8 fixtures, the kernel-source rules,
# linear layers and the fixture models, whose MoE recording changed), the
# device-to-device bandwidth, then qinfer bench on random-weight Qwen3-8B
# (and 30B-A3B) in FP8 beside bf16 and q4g64, same machine, same run.
# Expects .device/ from scripts/cuda_device_bundle.sh.
# Usage: bench/cuda_fp8.sh; writes $OUT/runs/*.json and $OUT/tests.log.
set -uo pipefail
OUT="${OUT:-/tmp/qinfer-out}"
mkdir -p "$OUT/runs"
# The test binaries look for fixtures under the path they were built in.
mkdir -p /work && ln -sfn "$PWD" /work/main && ln -sfn "$PWD" /work/wt-gpu
export QINFER_CACHE=/tmp/qinfer-cache
mkdir -p "$QINFER_CACHE"
[ -f .device/ptx.tar.xz ] && tar -C "$QINFER_CACHE" -xJf .device/ptx.tar.xz
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv > "$OUT/runs/gpu.txt"
python3 - <<'PY' > "$OUT/runs/bandwidth.json"
import json, torch
n = 1 << 30
a = torch.randn(n, device="cuda"); b = torch.empty_like(a)
for _ in range(3): b.copy_(a)
torch.cuda.synchronize()
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
times = []
for _ in range(10):
    s.record(); b.copy_(a); e.record(); torch.cuda.synchronize(); times.append(s.elapsed_time(e) / 1e3)
times.sort()
t = times[len(times) // 2]
print(json.dumps({"bytes_read_plus_written": 2 * 4 * n, "median_s": t, "GBps": 2 * 4 * n / t / 1e9}))
PY
: > "$OUT/tests.log"
for t in ${TESTS:-cuda_fp8 kernel_sources cuda_linear cuda_model}; do
  echo "== $t" >> "$OUT/tests.log"
  QINFER_REQUIRE_GPU=1 timeout 300 ".device/$t" --test-threads=1 --nocapture >> "$OUT/tests.log" 2>&1
  echo "== $t rc $?" >> "$OUT/tests.log"
done
grep -E "^== |test result|panicked" "$OUT/tests.log"
for spec in ${BENCH:-qwen3-8b:fp8 qwen3-8b:bf16 qwen3-8b:q4g64}; do
  cfg="${spec%%:*}"; dtype="${spec##*:}"
  timeout 240 .device/qinfer --device cuda bench --config "bench/configs/$cfg.json" --random-weights --dtype "$dtype" \
    -p 512,8192 -n 128 -r 2 --json > "$OUT/runs/$cfg-$dtype.json" 2> "$OUT/runs/$cfg-$dtype.err"
  echo "== bench $cfg $dtype: rc $?"
  tail -3 "$OUT/runs/$cfg-$dtype.err"
done
# Batched decode (continuous batching, paged KV) at 64 sequences.
for spec in ${BATCH:-qwen3-8b:fp8:64 qwen3-8b:bf16:64}; do
  IFS=: read -r cfg dtype conc <<< "$spec"
  timeout 200 .device/qinfer --device cuda bench --config "bench/configs/$cfg.json" --random-weights --dtype "$dtype" \
    -p 1024 -n 128 -r 1 --concurrency "$conc" --json > "$OUT/runs/$cfg-$dtype-batch$conc.json" 2> "$OUT/runs/$cfg-$dtype-batch$conc.err"
  echo "== batch $cfg $dtype x$conc: rc $?"
  tail -2 "$OUT/runs/$cfg-$dtype-batch$conc.err"
done
# The MoE in FP8 (experts run per expert with host routing for now).
for spec in ${MOE:-qwen3-30b-a3b:fp8}; do
  cfg="${spec%%:*}"; dtype="${spec##*:}"
  timeout 150 .device/qinfer --device cuda bench --config "bench/configs/$cfg.json" --random-weights --dtype "$dtype" \
    -p 512 -n 32 -r 1 --json > "$OUT/runs/$cfg-$dtype.json" 2> "$OUT/runs/$cfg-$dtype.err"
  echo "== bench $cfg $dtype: rc $?"
  tail -2 "$OUT/runs/$cfg-$dtype.err"
done
# Everything in one file (the call brings back only a few files).
python3 - "$OUT/runs" > "$OUT/summary.json" <<'PY'
import json, os, sys
d = sys.argv[1]
out = {"gpu": open(os.path.join(d, "gpu.txt")).read().strip().splitlines()[-1],
       "bandwidth": json.load(open(os.path.join(d, "bandwidth.json"))), "runs": {}}
for f in sorted(os.listdir(d)):
    if f.endswith(".json") and f != "bandwidth.json":
        try:
            j = json.load(open(os.path.join(d, f)))
            out["runs"][f[:-5]] = {r["test"]: round(r["avg_ts"], 1) for r in j["results"]}
        except Exception as e:
            out["runs"][f[:-5]] = f"unreadable: {e}"
print(json.dumps(out, indent=1))
PY
cat "$OUT/summary.json"
