#!/usr/bin/env bash
# qinfer vs llama.cpp on the CPU, same model, same threads, one run:
# SmolLM2-135M-Instruct Q4_1, pp128 and tg64 (llama-bench's tests), 2 threads.
# Writes bench/results/cpu-smollm2.json. llama.cpp's llama-bench is optional
# (LLAMA_BENCH=/path/to/llama-bench); without it only qinfer is measured.
set -euo pipefail
cd "$(dirname "$0")/.."
model="$(scripts/fetch_default_model.sh)"
threads="${THREADS:-2}"
reps="${REPS:-5}"
cargo build --release -q -p qinfer-cli
qinfer_json="$(./target/release/qinfer --threads "$threads" bench --model "$model" -p 128 -n 64 -r "$reps" --json)"
llama_json="null"
if [ -n "${LLAMA_BENCH:-}" ] && [ -x "$LLAMA_BENCH" ]; then
  llama_json="$("$LLAMA_BENCH" -m "$model" -t "$threads" -p 128 -n 64 -r "$reps" -o json)"
fi
python3 - "$qinfer_json" "$llama_json" "$threads" <<'PY' > bench/results/cpu-smollm2.json
import json, os, platform, subprocess, sys, datetime
q = json.loads(sys.argv[1])
l = json.loads(sys.argv[2])
def rate(rows, test, key_test, key_avg):
    for r in rows or []:
        if r[key_test] == test:
            return r[key_avg]
    return None
qr = {r["test"]: r["avg_ts"] for r in q["results"]}
lr = {}
for r in l or []:
    name = f"pp{r['n_prompt']}" if r["n_gen"] == 0 else f"tg{r['n_gen']}"
    lr[name] = r["avg_ts"]
cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), platform.processor())
out = {
    "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
    "cpu": cpu,
    "threads": int(sys.argv[3]),
    "loadavg": open("/proc/loadavg").read().split()[:3],
    "command": "bench/cpu_smollm2.sh",
    "qinfer": q,
    "llama_cpp": l,
    "ratio_qinfer_over_llama_cpp": {k: round(qr[k] / lr[k], 3) for k in qr if k in lr},
}
print(json.dumps(out, indent=1))
PY
cat bench/results/cpu-smollm2.json | python3 -c "import json,sys; d=json.load(sys.stdin); print(d['ratio_qinfer_over_llama_cpp'], [(r['test'], round(r['avg_ts'],1)) for r in d['qinfer']['results']])"
