#!/usr/bin/env bash
# Same-call A/B of two qinfer builds on the GPU machine: each model's bench
# runs with the baseline binary and the candidate in turn, `rounds` times, so
# both see the same card in the same state. Writes $OUT/ab.json (every run and
# the candidate/baseline ratio of each metric's best run) and prints a table.
# Usage: bench/cuda_ab.sh BASE_BIN NEW_BIN [rounds] [config:dtype ...]
#   default models: qwen3-8b:bf16 qwen3-8b:q4g64 qwen3_5-4b-hybrid:bf16
set -uo pipefail
base="$1"; new="$2"; rounds="${3:-2}"; shift 3 || shift $#
OUT="${OUT:-/tmp/qinfer-out}"
mkdir -p "$OUT/ab"
export QINFER_CACHE="${QINFER_CACHE:-/tmp/qinfer-cache}"
specs=("$@")
[ ${#specs[@]} -eq 0 ] && specs=(qwen3-8b:bf16 qwen3-8b:q4g64 qwen3_5-4b-hybrid:bf16)
for spec in "${specs[@]}"; do
  cfg="${spec%%:*}"; dtype="${spec##*:}"
  for r in $(seq 1 "$rounds"); do
    for which in base new; do
      bin="$base"; [ "$which" = new ] && bin="$new"
      f="$OUT/ab/$cfg-$dtype-$which-$r.json"
      timeout 280 "$bin" --device cuda bench --config "bench/configs/$cfg.json" --random-weights --dtype "$dtype" \
        -p 8192 -n 128 -r 3 --json > "$f" 2> "${f%.json}.err"
      echo "== $cfg $dtype $which round $r: rc $?"
    done
  done
done
python3 - "$OUT/ab" > "$OUT/ab.json" <<'PY'
import json, os, sys, glob, collections
d = sys.argv[1]
best = collections.defaultdict(dict)
runs = []
for f in sorted(glob.glob(os.path.join(d, "*.json"))):
    name = os.path.basename(f)[:-5]
    model, which, r = name.rsplit("-", 2)
    try:
        rows = json.load(open(f))
    except Exception as e:
        runs.append({"file": name, "error": str(e)})
        continue
    rows = rows if isinstance(rows, list) else rows.get("results", [rows])
    for row in rows:
        test = row.get("test") or row.get("name")
        tps = row.get("tok_s_mean") or row.get("avg_ts") or row.get("tok_s")
        runs.append({"model": model, "binary": which, "round": int(r), "test": test, "tok_s": tps})
        if tps is not None:
            key = (model, test)
            best[key][which] = max(best[key].get(which, 0), tps)
ratios = {f"{m} {t}": {"base": v.get("base"), "new": v.get("new"),
                       "new_over_base": round(v["new"] / v["base"], 4) if v.get("base") and v.get("new") else None}
          for (m, t), v in sorted(best.items())}
print(json.dumps({"runs": runs, "best_of_rounds": ratios}, indent=1))
PY
python3 -c "
import json,sys
d=json.load(open('$OUT/ab.json'))
for k,v in d['best_of_rounds'].items(): print(f\"{k:40s} base {v['base']} new {v['new']} ratio {v['new_over_base']}\")
"
