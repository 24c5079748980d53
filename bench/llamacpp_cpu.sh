#!/usr/bin/env bash
# llama.cpp CPU baseline for the default model (SmolLM2-135M-Instruct Q4_1):
#   llama-bench -m MODEL -t 2 -p 128 -n 64 -r 5 -o json
# and writes bench/results/llamacpp-cpu-smollm2.json with the llama.cpp version,
# CPU model, date and load average around the run.
#
# llama.cpp is not part of this repo: build it first with scripts/llamacpp_reference.sh
# (BUILD=1), which puts the binaries in /work/llamacpp/build/bin.
#
# Usage: bench/llamacpp_cpu.sh [LLAMACPP_BIN] [MODEL]
# Env:   THREADS (default 2), REPS (default 5), OUT (default bench/results/llamacpp-cpu-smollm2.json)
#        WAIT_IDLE=SECONDS: first wait up to that long for the CPUs to be >= 90% idle over 5 s
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LLAMACPP_BIN="${1:-${LLAMACPP_BIN:-/work/llamacpp/build/bin}}"
MODEL="${2:-${MODEL:-$HOME/.cache/qinfer/models/SmolLM2-135M-Instruct.Q4_1.gguf}}"
THREADS="${THREADS:-2}"
REPS="${REPS:-5}"
OUT="${OUT:-$REPO/bench/results/llamacpp-cpu-smollm2.json}"
LLAMACPP_SRC="${LLAMACPP_SRC:-$(dirname "$(dirname "$LLAMACPP_BIN")")/src}"

# percentage of CPU time idle over the next 5 seconds (all cores)
idle_pct() {
  local a b
  a=($(head -1 /proc/stat)); sleep 5; b=($(head -1 /proc/stat))
  local idle=$(( (b[4] + b[5]) - (a[4] + a[5]) )) total=0 i
  for i in 1 2 3 4 5 6 7 8; do total=$(( total + b[i] - a[i] )); done
  echo $(( total > 0 ? 100 * idle / total : 0 ))
}

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
idle=$(idle_pct)
if [ -n "${WAIT_IDLE:-}" ]; then
  end=$(( $(date +%s) + WAIT_IDLE ))
  while [ "$idle" -lt 90 ] && [ "$(date +%s)" -lt "$end" ]; do idle=$(idle_pct); done
fi
echo "$idle" > "$tmp/idle_before"
cat /proc/loadavg > "$tmp/load_before"
date -u +%Y-%m-%dT%H:%M:%SZ > "$tmp/date"
"$LLAMACPP_BIN/llama-bench" -m "$MODEL" -t "$THREADS" -p 128 -n 64 -r "$REPS" -o json \
  > "$tmp/bench.json" 2> "$tmp/bench.err"
cat /proc/loadavg > "$tmp/load_after"
"$LLAMACPP_BIN/llama-bench" --version > "$tmp/version" 2>&1 || true
git -C "$LLAMACPP_SRC" rev-parse HEAD > "$tmp/commit" 2>/dev/null || echo unknown > "$tmp/commit"
lscpu > "$tmp/lscpu"

mkdir -p "$(dirname "$OUT")"
python3 - "$tmp" "$OUT" "$MODEL" "$THREADS" "$REPS" <<'PY'
import json, os, sys
tmp, out, model, threads, reps = sys.argv[1:]
rd = lambda n: open(os.path.join(tmp, n)).read().strip()
lscpu = dict(l.split(":", 1) for l in rd("lscpu").splitlines() if ":" in l)
lscpu = {k.strip(): v.strip() for k, v in lscpu.items()}
runs = json.loads(rd("bench.json"))
summary = []
for r in runs:
    kind = "pp%d" % r["n_prompt"] if r["n_prompt"] else "tg%d" % r["n_gen"]
    summary.append({"test": kind, "avg_ts": round(r["avg_ts"], 2), "stddev_ts": round(r["stddev_ts"], 2),
                    "samples_ts": [round(x, 2) for x in r.get("samples_ts", [])]})
res = {
    "tool": "llama-bench",
    "command": "llama-bench -m %s -t %s -p 128 -n 64 -r %s -o json" % (os.path.basename(model), threads, reps),
    "llama_cpp_commit": rd("commit"),
    "llama_cpp_version": rd("version").splitlines()[0] if rd("version") else "unknown",
    "llama_cpp_source": "PyPI sdist llama-cpp-python 0.3.36 (vendor/llama.cpp), CPU-only Release build, GGML_NATIVE=ON",
    "model": os.path.basename(model),
    "date_utc": rd("date"),
    "cpu_model": lscpu.get("Model name"),
    "cpu_count": lscpu.get("CPU(s)"),
    "cpu_flags_simd": sorted(f for f in lscpu.get("Flags", "").split()
                             if f.startswith(("avx", "fma", "f16c", "sse4", "vnni", "amx"))),
    "hypervisor": lscpu.get("Hypervisor vendor"),
    "threads": int(threads),
    "cpu_idle_pct_5s_before": int(rd("idle_before")),
    "loadavg_before": rd("load_before"),
    "loadavg_after": rd("load_after"),
    "summary": summary,
    "llama_bench": runs,
}
with open(out, "w") as f:
    json.dump(res, f, indent=1)
    f.write("\n")
for s in summary:
    print("%-6s %8.2f t/s +- %.2f" % (s["test"], s["avg_ts"], s["stddev_ts"]))
print("wrote", out)
PY
