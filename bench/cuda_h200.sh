#!/usr/bin/env bash
# One call on the GPU machine: the CUDA kernel/model tests, the device-to-device
# bandwidth (the roofline's denominator), then qinfer bench on random-weight
# models of real shape. Expects the binaries built here in .device/ (see
# bench/README.md); writes logs and JSON under $OUT.
set -uo pipefail
OUT="${OUT:-/tmp/qinfer-out}"
mkdir -p "$OUT"
# The test binary looks for fixtures under the path it was built in.
mkdir -p /work && ln -sfn "$PWD" /work/main
export QINFER_CACHE=/tmp/qinfer-cache
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 - <<'PY' | tee "$OUT/bandwidth.json"
import json, torch
n = 1 << 30  # 4 GiB of f32 per buffer: well past the L2
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
.device/cuda_backend --test-threads=1 --nocapture 2>&1 | tee "$OUT/tests.log" | grep -E "rel err|Δlogit|test |panicked|seed" | tail -80
for spec in "${@:-qwen3-0.6b:bf16}"; do
  cfg="${spec%%:*}"; dtype="${spec##*:}"
  for depth in 0 8192; do
    .device/qinfer --device cuda bench --config "bench/configs/$cfg.json" --random-weights --dtype "$dtype" \
      -p 512,8192 -n 128 -d "$depth" -r 3 --json > "$OUT/bench-$cfg-$dtype-d$depth.json" 2> "$OUT/bench-$cfg-$dtype-d$depth.err"
    echo "== $cfg $dtype depth $depth: rc $?"
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(r['test'], round(r['avg_ts'],1)) for r in d['results']]" "$OUT/bench-$cfg-$dtype-d$depth.json" || tail -5 "$OUT/bench-$cfg-$dtype-d$depth.err"
  done
done
