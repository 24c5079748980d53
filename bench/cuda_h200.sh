#!/usr/bin/env bash
# One call on the GPU machine: the CUDA kernel/model tests, the device-to-device
# bandwidth (the roofline's denominator), then qinfer bench on random-weight
# models of real shape; writes $OUT/cuda-h200.json (and logs).
# Expects the binaries built on the development machine in .device/
# (scripts/cuda_device_bundle.sh: the qinfer CLI, the CUDA test binaries and
# the GPU profile, and the kernels as PTX in ptx.tar.xz when NVRTC was at hand
# there).
# Usage: QINFER_COMMIT=<commit> bench/cuda_h200.sh [config:dtype ...]   (default: qwen3-0.6b:bf16)
# For each model: decode at context 128 (tg128 from empty) and 8192 (tg32 @ d8192),
# prefill of 512 and 8192 tokens, and the decode roofline ratio.
set -uo pipefail
OUT="${OUT:-/tmp/qinfer-out}"
mkdir -p "$OUT/runs"
# The test binary looks for fixtures under the path it was built in.
mkdir -p /work && ln -sfn "$PWD" /work/main
export QINFER_CACHE=/tmp/qinfer-cache
# Kernels compiled ahead (a cache keyed by their source's hash: stale ones are
# never loaded).
mkdir -p "$QINFER_CACHE"
[ -f .device/ptx.tar.xz ] && tar -C "$QINFER_CACHE" -xJf .device/ptx.tar.xz
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv > "$OUT/runs/gpu.txt"
python3 - <<'PY' > "$OUT/runs/bandwidth.json"
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
# The cuBLAS bf16 GEMM rate (torch.matmul is cuBLAS/cuBLASLt) at the 8B's
# prefill shapes for 8192 tokens: the denominator of the prefill ratio.
python3 - <<'PY' > "$OUT/runs/cublas.json"
import json, torch
rates = {}
for m, k, n in [(8192, 4096, 6144), (8192, 4096, 24576), (8192, 12288, 4096), (8192, 4096, 4096)]:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3): a @ b
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        s.record(); a @ b; e.record(); torch.cuda.synchronize(); times.append(s.elapsed_time(e) / 1e3)
    times.sort()
    rates[f"{m}x{k}x{n}"] = 2 * m * k * n / times[len(times) // 2] / 1e12
print(json.dumps({"tflops_by_shape": rates, "tflops": max(rates.values())}))
PY
# Every CUDA test binary; here a missing driver or device fails instead of
# skipping. (The GPU profile, .device/cuda_profile [8b chain hybrid moe
# moe-prefill], is run on its own: it asserts nothing.)
rc=0
: > "$OUT/tests.log"
for t in .device/cuda_* .device/kernel_sources; do
  case "$t" in .device/cuda_profile) continue ;; esac
  echo "== $t" >> "$OUT/tests.log"
  QINFER_REQUIRE_GPU=1 "$t" --test-threads=1 --nocapture >> "$OUT/tests.log" 2>&1 || rc=1
done
echo "cuda tests rc $rc" | tee "$OUT/runs/tests_rc.txt"
grep -E "^== |test result|panicked" "$OUT/tests.log"
for spec in "${@:-qwen3-0.6b:bf16}"; do
  cfg="${spec%%:*}"; dtype="${spec##*:}"
  timeout 240 .device/qinfer --device cuda bench --config "bench/configs/$cfg.json" --random-weights --dtype "$dtype" \
    -p 512,8192 -n 128 -r 2 --json > "$OUT/runs/$cfg-$dtype-d0.json" 2> "$OUT/runs/$cfg-$dtype-d0.err"
  echo "== $cfg $dtype depth 0: rc $?"
  timeout 200 .device/qinfer --device cuda bench --config "bench/configs/$cfg.json" --random-weights --dtype "$dtype" \
    -p 0 -n 32 -d 8192 -r 1 --json > "$OUT/runs/$cfg-$dtype-d8192.json" 2> "$OUT/runs/$cfg-$dtype-d8192.err"
  echo "== $cfg $dtype depth 8192: rc $?"
done
python3 bench/cuda_summary.py "$OUT/runs" "$@" > "$OUT/cuda-h200.json"
cat "$OUT/cuda-h200.json" | python3 -c "import json,sys; d=json.load(sys.stdin); [print(k, v) for k, v in d['models'].items()]; print('hybrid_vs_dense', d['hybrid_vs_dense'])"
tar -czf "$OUT/runs.tgz" -C "$OUT" runs && rm -rf "$OUT/runs"
