#!/usr/bin/env python3
"""MLX-quantized oracle fixtures: tests/fixtures/mlx/<case>/.

Takes the committed tiny transformers fixtures (tests/fixtures/tiny/<arch>/),
converts them the way `mlx_lm.convert` does (load_model → cast → quantize_model
→ save_model + save_config; `convert` itself also wants a tokenizer, which the
tiny fixtures do not have), then runs mlx-lm on the fixture's `input_ids`:
teacher-forced logits (logits.npy) and a 24-token greedy continuation with
mlx-lm's KV cache (reference.json). Deterministic: quantization is a pure
function of the weights, and the forward runs on the CPU device.

    /work/venv/bin/pip install "mlx[cpu]" mlx-lm
    /work/venv/bin/python scripts/make_fixtures_mlx.py [--only CASE]

Rewrites reference.json: afterwards run scripts/mlx_f64_truth.py, which adds the
float64 truth of the hybrid cases (logits_f64.npy, checks.float64_truth).

Also writes tests/fixtures/mlx/packing.json: mx.quantize outputs (packed words,
scales, biases, dequantized values) of one small matrix for every bit width.
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm.convert import mixed_quant_predicate_builder
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model, quantize_model, save_config, save_model

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "fixtures" / "tiny"
OUT = ROOT / "tests" / "fixtures" / "mlx"
GREEDY_NEW = 24


def layer_mixed_predicate(path, module):
    """Custom mixed precision: layer 0 at 8 bits (group 32), the rest at 4 bits
    (group 64), routers at 8 bits (group 64, as mlx-lm's qwen3_moe predicate),
    lm_head at 6 bits (group 32)."""
    if path.endswith("mlp.gate") or path.endswith("shared_expert_gate"):
        return {"group_size": 64, "bits": 8, "mode": "affine"}
    if path == "lm_head":
        return {"group_size": 32, "bits": 6, "mode": "affine"}
    if ".layers.0." in path:
        return {"group_size": 32, "bits": 8, "mode": "affine"}
    return {"group_size": 64, "bits": 4, "mode": "affine"}


# case: (tiny source, bits, group, storage dtype, predicate, description)
CASES = {
    "qwen3_q4_g64": ("qwen3", 4, 64, "float32", None, "Qwen3 4-bit, group 64"),
    "qwen3_q8_g32": ("qwen3", 8, 32, "float32", None, "Qwen3 8-bit, group 32"),
    "qwen3_q3_g32": ("qwen3", 3, 32, "float32", None, "Qwen3 3-bit (values straddle u32 words), group 32"),
    "qwen3_q6_g32": ("qwen3", 6, 32, "float32", None, "Qwen3 6-bit (values straddle u32 words), group 32"),
    "qwen3_q4_g32_bf16": ("qwen3", 4, 32, "bfloat16", None,
                          "Qwen3 4-bit, group 32, scales/biases/norms stored bf16; reference computed in f32 from them"),
    "qwen3_mixed_3_6": ("qwen3", 3, 32, "float32", "mixed_3_6", "Qwen3, mlx-lm recipe mixed_3_6 (3-bit, v_proj/down_proj/lm_head 6-bit on some layers), group 32"),
    "qwen3_moe_q4_g64": ("qwen3_moe", 4, 64, "float32", "model",
                         "Qwen3-MoE 4-bit group 64 (expert down_proj in=32 stays f32), router 8-bit"),
    "qwen3_moe_q8_g32": ("qwen3_moe", 8, 32, "float32", "model", "Qwen3-MoE 8-bit group 32, router 8-bit group 64"),
    "qwen3_moe_mixed": ("qwen3_moe", 4, 64, "float32", "layers",
                        "Qwen3-MoE mixed: layer 0 8-bit g32, others 4-bit g64, routers 8-bit g64, lm_head 6-bit g32"),
    "qwen3_5_q4_g32": ("qwen3_5", 4, 32, "float32", "model", "Qwen3.5 hybrid (tied, quantized embeddings) 4-bit group 32"),
    "qwen3_5_q8_g64": ("qwen3_5", 8, 64, "float32", "model", "Qwen3.5 hybrid 8-bit group 64 (down_proj in=96 stays f32)"),
    "qwen3_5_moe_q4_g32": ("qwen3_5_moe", 4, 32, "float32", "model",
                           "Qwen3.5-MoE 4-bit group 32, routers and shared-expert gates 8-bit g64"),
    "qwen3_next_q4_g32": ("qwen3_next", 4, 32, "float32", "model", "Qwen3-Next 4-bit group 32, routers 8-bit g64"),
}


def convert(src: Path, dst: Path, bits, group, dtype, predicate):
    # mlx-lm's flat Qwen3-MoE / Next args want `rope_theta`; transformers 5
    # writes it only inside `rope_parameters` (hub configs have both).
    raw = json.loads((src / "config.json").read_text())
    extra = None
    if "rope_theta" not in raw and "rope_parameters" in raw and "text_config" not in raw:
        rp = raw["rope_parameters"]
        extra = {k: rp[k] for k in ("rope_theta", "partial_rotary_factor") if k in rp}
    model, config = load_model(src, lazy=False, model_config=extra)
    cast_predicate = getattr(model, "cast_predicate", lambda _: True)
    dt = getattr(mx, dtype)

    def set_dtype(k, v):
        if cast_predicate(k) and mx.issubdtype(v.dtype, mx.floating):
            return v.astype(dt)
        return v

    model.update(tree_map_with_path(set_dtype, model.parameters()))
    if predicate == "model":
        pred = None  # quantize_model falls back to model.quant_predicate
    elif predicate == "layers":
        pred = layer_mixed_predicate
    elif predicate is None:
        pred = None
    else:
        pred = mixed_quant_predicate_builder(predicate, model, group)
    model, config = quantize_model(model, config, group, bits, mode="affine", quant_predicate=pred)
    if dst.exists():
        shutil.rmtree(dst)
    save_model(dst, model, donate_model=False)
    save_config(config, dst / "config.json")
    shutil.copy(src / "generation_config.json", dst / "generation_config.json")


def reference(dst: Path, ids, prompt):
    model, config = load_model(dst, lazy=False)
    # Compute in f32 whatever the storage dtype: the reference is the exact
    # f32 forward of the stored (quantized) values.
    def up(k, v):
        if mx.issubdtype(v.dtype, mx.floating) and v.dtype != mx.float32:
            return v.astype(mx.float32)
        return v
    model.update(tree_map_with_path(up, model.parameters()))
    logits = model(mx.array(ids)[None])[0].astype(mx.float32)
    mx.eval(logits)
    full = np.array(logits)
    # Greedy with mlx-lm's cache, one token per step after the prompt.
    cache = make_prompt_cache(model)
    out = model(mx.array(prompt)[None], cache=cache)[0, -1]
    toks, margins = [], []
    for _ in range(GREEDY_NEW):
        l = np.array(out.astype(mx.float32))
        order = np.argsort(-l)
        margins.append(float(l[order[0]] - l[order[1]]))
        t = int(order[0])
        toks.append(t)
        out = model(mx.array([[t]]), cache=cache)[0, -1]
    # Cache-free check: full recompute of prompt + tokens.
    seq = list(prompt) + toks
    nocache = np.array(model(mx.array(seq)[None])[0].astype(mx.float32))
    recompute_ok = all(int(np.argmax(nocache[len(prompt) - 1 + i])) == toks[i] for i in range(GREEDY_NEW))
    return full, toks, min(margins), recompute_ok


def packing_fixture():
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((3, 128)) * 0.5).astype(np.float32)
    cases = []
    for bits in [2, 3, 4, 5, 6, 8]:
        for group in [32, 64, 128]:
            q, s, b = mx.quantize(mx.array(w), group_size=group, bits=bits)
            deq = mx.dequantize(q, s, b, group_size=group, bits=bits)
            cases.append({
                "bits": bits, "group_size": group,
                "packed": np.array(q).astype(np.uint32).flatten().tolist(),
                "scales": np.array(s).flatten().tolist(),
                "biases": np.array(b).flatten().tolist(),
                "dequantized": np.array(deq).flatten().tolist(),
            })
    data = {"rows": 3, "cols": 128, "weights": w.flatten().tolist(), "cases": cases,
            "mlx_version": mx.__version__}
    (OUT / "packing.json").write_text(json.dumps(data))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only")
    args = ap.parse_args()
    mx.set_default_device(mx.cpu)
    OUT.mkdir(parents=True, exist_ok=True)
    if args.only in (None, "packing"):
        packing_fixture()
    for case, (tiny, bits, group, dtype, predicate, desc) in CASES.items():
        if args.only and args.only != case:
            continue
        src = TINY / tiny
        ref = json.loads((src / "reference.json").read_text())
        dst = OUT / case
        convert(src, dst, bits, group, dtype, predicate)
        ids, prompt = ref["input_ids"], ref["greedy"]["prompt"]
        full, toks, margin, recompute_ok = reference(dst, ids, prompt)
        np.save(dst / "logits.npy", full.astype(np.float32))
        cfg = json.loads((dst / "config.json").read_text())
        out = {
            "case": case, "description": desc, "source": f"tests/fixtures/tiny/{tiny}",
            "bits": bits, "group_size": group, "dtype": dtype, "predicate": predicate,
            "quantization": cfg.get("quantization"),
            "input_ids": ids,
            "logits": {"file": "logits.npy", "dtype": "float32", "shape": list(full.shape)},
            "greedy": {"prompt": prompt, "new_tokens": toks, "eos_disabled": True},
            "checks": {"greedy_min_top2_margin": round(margin, 5), "cache_free_greedy_matches": recompute_ok},
            "mlx_version": mx.__version__, "mlx_lm_version": mlx_lm.__version__,
        }
        (dst / "reference.json").write_text(json.dumps(out, indent=1) + "\n")
        print(f"{case}: logits {full.shape}, margin {margin:.4f}, recompute {recompute_ok}", file=sys.stderr)


if __name__ == "__main__":
    main()
