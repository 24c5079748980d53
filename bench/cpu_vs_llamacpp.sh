#!/usr/bin/env bash
# qinfer against llama.cpp on the CPU, interleaved: for each round and each
# model, llama-bench, then qinfer with its best kernels, then qinfer held to
# its AVX2 kernels (--cpu-kernels avx2), each `-p 128 -n 64` on THREADS threads.
# Writes bench/results/cpu-vs-llamacpp.json (every sample, and the ratios of
# the per-test means).
#
# Models: the default SmolLM2-135M-Instruct Q4_1 and llama.cpp's own
# Qwen2.5-Coder-0.5B-Instruct Q4_K_M (scripts/fetch_qwen_coder.sh).
# llama.cpp: build llama-bench first (scripts/llamacpp_reference.sh shows how);
# on a CPU whose AMX tiles fault under virtualization, build it with
# GGML_NATIVE=OFF and the AVX-512 options on (bench/NOTES.md says which).
#
# Usage: LLAMA_BENCH=/path/to/llama-bench bench/cpu_vs_llamacpp.sh
# Env:   THREADS (2), ROUNDS (3), REPS (3 per tool per round), OUT
set -euo pipefail
cd "$(dirname "$0")/.."
threads="${THREADS:-2}"
rounds="${ROUNDS:-3}"
reps="${REPS:-3}"
out="${OUT:-bench/results/cpu-vs-llamacpp.json}"
llama="${LLAMA_BENCH:-/work/llamacpp/build/bin/llama-bench}"
[ -x "$llama" ] || { echo "llama-bench not found at $llama (set LLAMA_BENCH)" >&2; exit 1; }
models=("$(scripts/fetch_default_model.sh)" "$(scripts/fetch_qwen_coder.sh)")
cargo build --release -q -p qinfer-cli
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
for r in $(seq 1 "$rounds"); do
  for m in "${models[@]}"; do
    b="$(basename "$m" .gguf)"
    "$llama" -m "$m" -t "$threads" -p 128 -n 64 -r "$reps" -o json > "$tmp/$b.llama.$r.json" 2>/dev/null
    ./target/release/qinfer --threads "$threads" bench --model "$m" -p 128 -n 64 -r "$reps" --json > "$tmp/$b.qinfer.$r.json"
    ./target/release/qinfer --threads "$threads" --cpu-kernels avx2 bench --model "$m" -p 128 -n 64 -r "$reps" --json \
      > "$tmp/$b.qinfer-avx2.$r.json"
  done
done
lscpu > "$tmp/lscpu"
python3 - "$tmp" "$out" "$threads" "$rounds" "$reps" "$(git rev-parse --short HEAD)" "${models[@]}" <<'PY'
import datetime, glob, json, os, statistics, sys
tmp, out, threads, rounds, reps, commit, *models = sys.argv[1:]
lscpu = {k.strip(): v.strip() for k, v in (l.split(":", 1) for l in open(os.path.join(tmp, "lscpu")) if ":" in l)}
res = {
    "what": "qinfer vs llama.cpp on the CPU, interleaved rounds (llama-bench, qinfer, qinfer --cpu-kernels avx2 per model per round)",
    "command": "bench/cpu_vs_llamacpp.sh",
    "qinfer_commit": commit,
    "llama_cpp": "llama-cpp-python 0.3.36 sdist (vendor/llama.cpp), GGML_NATIVE=OFF with AVX2/FMA/F16C/AVX-VNNI/AVX-512 F/BW/VL/VBMI/VNNI/BF16 on (AMX off: its tiles fault on this VM)",
    "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    "cpu_model": lscpu.get("Model name"),
    "cpu_flags_simd": sorted(f for f in lscpu.get("Flags", "").split() if f.startswith(("avx", "fma", "f16c", "amx"))),
    "threads": int(threads), "rounds": int(rounds), "reps_per_round": int(reps),
    "models": {},
}
for m in models:
    b = os.path.basename(m)[:-5]
    samples = {}
    for tool in ("llama", "qinfer", "qinfer-avx2"):
        for f in sorted(glob.glob(os.path.join(tmp, f"{b}.{tool}.*.json"))):
            d = json.load(open(f))
            if tool == "llama":
                for r in d:
                    test = f"pp{r['n_prompt']}" if r["n_gen"] == 0 else f"tg{r['n_gen']}"
                    samples.setdefault(tool, {}).setdefault(test, []).extend(r["samples_ts"])
            else:
                for r in d["results"]:
                    samples.setdefault(tool, {}).setdefault(r["test"], []).extend(r.get("samples_ts") or [r["avg_ts"]])
    mean = {t: {k: round(statistics.mean(v), 2) for k, v in s.items()} for t, s in samples.items()}
    ratio = {
        f"{t}/llama": {k: round(mean[t][k] / mean["llama"][k], 3) for k in mean["llama"] if k in mean[t]}
        for t in ("qinfer", "qinfer-avx2")
    }
    res["models"][b] = {"mean_tok_s": mean, "ratio": ratio, "samples_tok_s": samples}
    print(b, json.dumps(mean), json.dumps(ratio))
with open(out, "w") as f:
    json.dump(res, f, indent=1)
    f.write("\n")
print("wrote", out)
PY
