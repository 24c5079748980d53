#!/usr/bin/env bash
# One call on the GPU machine for the encoded KV pools (issue 42): the CUDA
# tests they touch (cuda_kv_coded against the CPU codecs, cuda_batch for the
# plain pool, kernel_sources), then qinfer bench through the continuous-
# batching engine on random-weight Qwen3-8B q4g64 (and the Qwen3.5-4B-shaped
# hybrid) with the f16 pool and each encoded format, same machine, same run:
# one sequence decoding after a long prompt, many sequences at once, and a
# short context. Expects .device/ from scripts/cuda_device_bundle.sh.
# Usage: bench/cuda_kv.sh; writes $OUT/summary.json and $OUT/tests.log.
set -uo pipefail
OUT="${OUT:-/tmp/qinfer-out}"
mkdir -p "$OUT/runs"
mkdir -p /work && ln -sfn "$PWD" /work/main && ln -sfn "$PWD" /work/wt-gpu
export QINFER_CACHE=/tmp/qinfer-cache
mkdir -p "$QINFER_CACHE"
[ -f .device/ptx.tar.xz ] && tar -C "$QINFER_CACHE" -xJf .device/ptx.tar.xz
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv > "$OUT/runs/gpu.txt"
: > "$OUT/tests.log"
for t in ${TESTS:-cuda_kv_coded cuda_batch kernel_sources}; do
  echo "== $t" >> "$OUT/tests.log"
  QINFER_REQUIRE_GPU=1 timeout 400 ".device/$t" --test-threads=1 --nocapture >> "$OUT/tests.log" 2>&1
  echo "== $t rc $?" >> "$OUT/tests.log"
done
grep -E "^== |test result|panicked" "$OUT/tests.log"
# cfg:dtype:concurrency:prompt:gen:formats
for spec in ${RUNS:-qwen3-8b:q4g64:1:32768:32:f16,turbo4,k8v4,fp8,turbo8 qwen3-8b:q4g64:16:16384:32:f16,turbo4,k8v4,fp8 qwen3-8b:q4g64:1:512:128:f16,turbo4,k8v4 qwen3_5-4b-hybrid:q4g64:1:32768:32:f16,turbo4,k8v4}; do
  IFS=: read -r cfg dtype conc p n formats <<< "$spec"
  for f in ${formats//,/ }; do
    name="$cfg-$dtype-c$conc-p$p-$f"
    timeout 300 .device/qinfer --device cuda --kv-cache "$f" bench --config "bench/configs/$cfg.json" --random-weights \
      --dtype "$dtype" -p "$p" -n "$n" -r 1 --concurrency "$conc" --json > "$OUT/runs/$name.json" 2> "$OUT/runs/$name.err"
    echo "== $name: rc $?"
    tail -2 "$OUT/runs/$name.err"
  done
done
python3 - "$OUT/runs" > "$OUT/summary.json" <<'PY'
import json, os, sys
d = sys.argv[1]
out = {"gpu": open(os.path.join(d, "gpu.txt")).read().strip().splitlines()[-1], "runs": {}}
for f in sorted(os.listdir(d)):
    if f.endswith(".json"):
        try:
            out["runs"][f[:-5]] = json.load(open(os.path.join(d, f)))["results"]
        except Exception as e:
            out["runs"][f[:-5]] = "unreadable: %s; %s" % (e, open(os.path.join(d, f[:-5] + ".err")).read()[-400:])
print(json.dumps(out, indent=1))
PY
grep -h "" "$OUT"/runs/*.err | grep -i "pool\|error" | head -40
