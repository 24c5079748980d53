#!/usr/bin/env bash
# The MoE / Gated-DeltaNet hybrids on the CPU with random weights of small real
# shapes (bench/configs/cpu-*.json): prefill at 512, 1024 and 2048 tokens must
# cost time linear in length (tok/s flat), plus single-token decode.
# Writes bench/results/cpu-hybrid.json.
set -euo pipefail
cd "$(dirname "$0")/.."
threads="${THREADS:-2}"
reps="${REPS:-2}"
dtype="${DTYPE:-q8_0}"
cargo build --release -q -p qinfer-cli
runs=()
for cfg in bench/configs/cpu-hybrid-small.json bench/configs/cpu-moe-small.json; do
  runs+=("$(./target/release/qinfer --threads "$threads" bench --config "$cfg" --random-weights --dtype "$dtype" \
    -p 512,1024,2048 -n 32 -r "$reps" --json)")
done
python3 - "$threads" "$dtype" "${runs[@]}" <<'PY' > bench/results/cpu-hybrid.json
import json, platform, subprocess, sys, datetime
threads, dtype, runs = int(sys.argv[1]), sys.argv[2], [json.loads(a) for a in sys.argv[3:]]
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
summary = {}
for r in runs:
    rate = {x["test"]: x["avg_ts"] for x in r["results"]}
    ms_per_token = {k: round(1000.0 / v, 3) for k, v in rate.items() if k.startswith("pp")}
    summary[r["model"]] = {
        "tok_per_s": {k: round(v, 2) for k, v in rate.items()},
        "prefill_ms_per_token": ms_per_token,
        # 1.0 = perfectly linear prefill; quadratic cost would give ~4 here.
        "pp2048_over_pp512_time_per_token": round(ms_per_token["pp2048"] / ms_per_token["pp512"], 3),
    }
out = {
    "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
    "cpu": cpu,
    "threads": threads,
    "weights": f"random {dtype}",
    "loadavg": open("/proc/loadavg").read().split()[:3],
    "command": "bench/cpu_hybrid.sh",
    "summary": summary,
    "runs": runs,
}
print(json.dumps(out, indent=1))
PY
python3 -c "import json; print(json.dumps(json.load(open('bench/results/cpu-hybrid.json'))['summary'], indent=1))"
