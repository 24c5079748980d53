"""Summarizes bench/cuda_h200.sh's runs into one JSON: per model and dtype the
decode and prefill rates, and the decode roofline (bytes that must be read per
decoded token ÷ the measured device-to-device bandwidth), and the prefill
ratio at 8192 tokens (model FLOPs per token × tokens/s ÷ the cuBLAS bf16 GEMM
rate measured in the same run). For each hybrid (Gated DeltaNet) model, its
time per token against dense models' of the same dtype, per byte read
(`hybrid_vs_dense`), the dense model closest in bytes per token named first.

Bytes per token count every matrix a decode step reads, as qinfer stores it on
the GPU: bf16 2 bytes per value; affine q<b>g<G> b/8 bytes per value plus a bf16
scale and bias per group (matrices whose rows do not split into groups stay
bf16); ggml types (q4_k, q6_k, …, and llama.cpp's q4_k_m/q5_k_m mixes) as the
GGUF file stores them, which is less than qinfer's GPU copy reads (it holds
them as affine groups with f32 scales and biases); the embedding table is read one row per token unless it is also the
lm_head (tied). MoE layers count the shared weights and top-k experts only.
The KV cache is not counted (tg128 reads 64 positions on average: 19 MB a
token at Qwen3-8B's shape in qinfer's f32 cache, 0.4% of its 4.26 GB).
"""
import datetime
import json
import re
import os
import subprocess
import sys
from pathlib import Path


# ggml block types: (values, bytes) per block, as the GGUF file stores them.
GGML_BLOCKS = {
    "q4_0": (32, 18), "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24), "q8_0": (32, 34),
    "q2_k": (256, 84), "q3_k": (256, 110), "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210),
}
# llama.cpp's _M mixes: (type, type of the matrices given more bits).
GGUF_MIXES = {"q4_k_m": ("q4_k", "q6_k"), "q5_k_m": ("q5_k", "q6_k")}


def matrix_dtype(dtype: str, more: bool) -> str:
    """The storage of a matrix: a mix's high type where llama.cpp gives more bits."""
    if dtype in GGUF_MIXES:
        return GGUF_MIXES[dtype][1 if more else 0]
    return dtype


def bytes_per_value(dtype: str, cols: int) -> float:
    if dtype in GGML_BLOCKS:
        # What the file holds: the minimum a decode step must read (rows that
        # do not split into blocks are f32 in qinfer's random weights).
        values, nbytes = GGML_BLOCKS[dtype]
        return nbytes / values if cols % values == 0 else 4
    m = re.fullmatch(r"q(\d)g(\d+)", dtype)
    if m and cols % int(m.group(2)) == 0:
        bits, group = int(m.group(1)), int(m.group(2))
        # Packed levels plus a bf16 scale and bias per group: what MLX stores
        # and what qinfer's GPU copy reads.
        return bits / 8 + 4 / group
    return {"bf16": 2, "f16": 2, "f32": 4}.get(dtype, 2)


def layer_kinds(cfg: dict) -> list:
    n_layers, every = cfg["num_hidden_layers"], cfg.get("full_attention_interval")
    return cfg.get("layer_types") or [
        "full_attention" if every is None or (i + 1) % every == 0 else "linear_attention" for i in range(n_layers)
    ]


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's rule for the layers whose v and down projections a _M mix
    stores at the higher width."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def layer_matrices(cfg: dict) -> list:
    """(rows, cols, count, more) of every matrix the layers apply to a token;
    `more`: a v or down projection on a layer where _M mixes use more bits."""
    h = cfg["hidden_size"]
    hd = cfg.get("head_dim", h // cfg["num_attention_heads"])
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    gated = cfg["model_type"].startswith("qwen3_5") or cfg["model_type"] == "qwen3_next"
    mats = []
    kinds = layer_kinds(cfg)
    for layer, kind in enumerate(kinds):
        more = use_more_bits(layer, len(kinds))
        if kind == "full_attention":
            mats += [(nq * hd * (2 if gated else 1), h, 1, False), (nkv * hd, h, 1, False), (nkv * hd, h, 1, more),
                     (h, nq * hd, 1, False)]
        else:
            nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
            dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
            key, value = nk * dk, nv * dv
            mats += [(2 * key + value, h, 1, False), (value, h, 1, False), (nv, h, 2, False), (h, value, 1, False)]
        if cfg.get("num_experts"):
            e, k, inter = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
            mats += [(e, h, 1, False), (inter, h, 2 * k, False), (h, inter, k, more)]
            if cfg.get("shared_expert_intermediate_size"):
                s = cfg["shared_expert_intermediate_size"]
                mats += [(s, h, 2, False), (h, s, 1, more), (1, h, 1, False)]
        else:
            i = cfg["intermediate_size"]
            mats += [(i, h, 2, False), (h, i, 1, more)]
    return mats


def decode_bytes(cfg: dict, dtype: str) -> int:
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    mats = layer_matrices(cfg) + [(v, h, 1, True)]  # lm_head (or the tied embedding table)
    total = sum(r * c * n * bytes_per_value(matrix_dtype(dtype, more), c) for r, c, n, more in mats)
    if not cfg.get("tie_word_embeddings", False):
        total += h * bytes_per_value(matrix_dtype(dtype, False), h)  # one embedding row
    return int(total)


def prefill_flops(cfg: dict, tokens: int) -> float:
    """Multiply-add FLOPs per token of a prefill of `tokens` tokens: every
    matrix of a layer (as in decode_bytes, MoE counting the top-k experts)
    applied to each token, causal attention over the (tokens + 1) / 2 keys a
    token sees on average (QKᵀ and PV), the GDN recurrence (state update and
    read-out, 4·dk·dv per value head), and the lm_head once per prefill."""
    h = cfg["hidden_size"]
    hd = cfg.get("head_dim", h // cfg["num_attention_heads"])
    nq = cfg["num_attention_heads"]
    mats = layer_matrices(cfg)
    flops = 2 * sum(r * c * n for r, c, n, _ in mats)
    ctx = (tokens + 1) / 2
    for kind in layer_kinds(cfg):
        if kind == "full_attention":
            flops += 2 * 2 * nq * hd * ctx
        else:
            flops += 4 * cfg["linear_num_value_heads"] * cfg["linear_key_head_dim"] * cfg["linear_value_head_dim"]
    flops += 2 * cfg["vocab_size"] * h / tokens
    return flops


def main() -> None:
    runs = Path(sys.argv[1])
    bw = json.loads((runs / "bandwidth.json").read_text())
    gbps = bw["GBps"]
    cublas = json.loads((runs / "cublas.json").read_text()) if (runs / "cublas.json").exists() else None
    models, kinds = {}, {}
    for f in sorted(runs.glob("*-d0.json")):
        name = f.name[: -len("-d0.json")]
        cfg_name, dtype = name.rsplit("-", 1)
        cfg = json.loads(Path(f"bench/configs/{cfg_name}.json").read_text())
        cfg = cfg.get("text_config", cfg) | {"model_type": cfg["model_type"]}
        row = {}
        for depth_file in (f, runs / f"{name}-d8192.json"):
            try:
                for r in json.loads(depth_file.read_text())["results"]:
                    row[r["test"]] = round(r["avg_ts"], 1)
            except (OSError, ValueError, KeyError):
                row[f"missing {depth_file.name}"] = (runs / depth_file.name.replace(".json", ".err")).read_text()[-300:] if (runs / depth_file.name.replace(".json", ".err")).exists() else "no output"
        b = decode_bytes(cfg, dtype)
        roof = gbps * 1e9 / b
        row["bytes_per_token"] = b
        row["roofline_tok_s"] = round(roof, 1)
        if "tg128" in row:
            row["decode_roofline_ratio"] = round(row["tg128"] / roof, 3)
        if "pp8192" in row and cublas:
            f = prefill_flops(cfg, 8192)
            row["pp8192_flops_per_token"] = int(f)
            row["pp8192_tflops"] = round(row["pp8192"] * f / 1e12, 1)
            row["pp8192_cublas_ratio"] = round(row["pp8192"] * f / 1e12 / cublas["tflops"], 3)
        models[f"{cfg_name} {dtype}"] = row
        kinds[f"{cfg_name} {dtype}"] = (cfg, dtype)
    hybrid_vs_dense = {}
    for name, (cfg, dtype) in kinds.items():
        if "linear_attention" not in layer_kinds(cfg) or "tg128" not in models[name]:
            continue
        dense = [
            d for d, (c, t) in kinds.items()
            if t == dtype and set(layer_kinds(c)) == {"full_attention"} and not c.get("num_experts")
            and "tg128" in models[d]
        ]
        h = models[name]
        by_bytes = sorted(dense, key=lambda d: abs(models[d]["bytes_per_token"] - h["bytes_per_token"]))
        # Seconds per byte of the hybrid ÷ the dense model's, at context 128.
        hybrid_vs_dense[name] = {
            d: {
                "dense_bytes_per_token": models[d]["bytes_per_token"],
                "time_per_byte_ratio": round(
                    models[d]["tg128"] * models[d]["bytes_per_token"] / (h["tg128"] * h["bytes_per_token"]), 3
                ),
            }
            for d in by_bytes
        }
    # The device's copy of the tree may carry a stale .git: the caller names the commit.
    commit = os.environ.get("QINFER_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    print(json.dumps({
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": commit or "(tree copied without .git; see the commit that adds this file)",
        "gpu": (runs / "gpu.txt").read_text().strip().splitlines()[-1],
        "command": "bash bench/cuda_h200.sh " + " ".join(sys.argv[2:]),
        "bandwidth_d2d_GBps": round(gbps, 1),
        "cublas_bf16_tflops": cublas,
        "cuda_tests": (runs / "tests_rc.txt").read_text().strip(),
        "models": models,
        "hybrid_vs_dense": hybrid_vs_dense,
    }, indent=1))


if __name__ == "__main__":
    main()
