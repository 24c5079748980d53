"""Summarizes bench/cuda_batch_h200.sh's runs into one JSON: per model and
dtype the --concurrency rows (prefill and decode tok/s at each number of
sequences), and for decode the bytes roofline of a step: every weight
(cuda_summary.decode_bytes) plus each sequence's keys and values read once
(f16 pool, the mean context of the decode phase: prompt + half the new
tokens), over the device-to-device bandwidth given (GB/s, measured by
bench/cuda_h200.sh on the same kind of machine).
Usage: python3 bench/cuda_batch_summary.py RUNS_DIR BANDWIDTH_GBPS COMMIT > out.json
"""
import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from cuda_summary import decode_bytes  # noqa: E402


def kv_bytes_per_token(cfg: dict) -> int:
    heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    types = cfg.get("layer_types")
    attention_layers = sum(t == "full_attention" for t in types) if types else cfg["num_hidden_layers"]
    return attention_layers * 2 * heads * head_dim * 2


def main() -> None:
    runs, gbps, commit = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    out = {
        "date_utc": datetime.date.today().isoformat(),
        "machine": "NVIDIA H200 (one GPU of the device machine)",
        "commit": commit,
        "bandwidth_d2d_GBps": gbps,
        "models": {},
    }
    for f in sorted(runs.glob("*-batch.json")):
        name = f.name[: -len("-batch.json")]
        cfg_name, dtype = name.rsplit("-", 1)
        try:
            data = json.loads(f.read_text())
        except ValueError:
            continue
        cfg = json.loads((Path("bench/configs") / f"{cfg_name}.json").read_text())
        weights = decode_bytes(cfg, dtype)
        kv = kv_bytes_per_token(cfg)
        rows = []
        for r in data["results"]:
            row = {k: r[k] for k in ("test", "concurrency", "n_prompt", "n_gen", "avg_ts", "kv_cache_bytes")}
            if r["test"].startswith("tg"):
                c = r["concurrency"]
                context = r["n_prompt"] + r["n_gen"] / 2
                step_bytes = weights + c * context * kv
                roof = c * gbps * 1e9 / step_bytes
                row["per_seq_ts"] = r["per_seq_ts"]
                row["roofline_ts"] = round(roof, 1)
                row["roofline_ratio"] = round(r["avg_ts"] / roof, 3)
            rows.append(row)
        out["models"][f"{cfg_name} {dtype}"] = {"weight_bytes": weights, "kv_bytes_per_token_f16": kv, "rows": rows}
    for f in sorted(runs.glob("*-multiturn.json")) + sorted(runs.glob("*-embed.json")):
        try:
            out.setdefault("other", {})[f.stem] = json.loads(f.read_text())
        except ValueError:
            pass
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
