#!/usr/bin/env python3
"""Checks that mlx-lm loads and runs what `qinfer quantize` writes.

For each setting: `qinfer quantize` the tiny qwen3 fixture, load the output with
mlx-lm (`load_model`), compute teacher-forced logits and a 24-token greedy
continuation, and compare them with `qinfer score` / qinfer's own load of the
same directory. Writes bench/results/quantize-mlx-verify.json (the dense entries;
scripts/verify_quantize_mlx_moe.py adds the MoE and hybrid ones).

    cargo build --release -p qinfer-cli
    /work/venv/bin/python scripts/verify_quantize_mlx.py
"""

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
from mlx_lm.models.cache import make_prompt_cache
from mlx.utils import tree_map_with_path
from mlx_lm.utils import load_model

ROOT = Path(__file__).resolve().parent.parent
QINFER = ROOT / "target" / "release" / "qinfer"
SRC = ROOT / "tests" / "fixtures" / "tiny" / "qwen3"
SETTINGS = [
    ("q4_g64", ["--bits", "4", "--group-size", "64"]),
    ("q8_g32", ["--bits", "8", "--group-size", "32"]),
    ("q3_g32", ["--bits", "3", "--group-size", "32"]),
    ("mixed_3_6_g32", ["--bits", "3", "--group-size", "32", "--mixed", "mixed_3_6"]),
]


def greedy(model, prompt, n=24):
    cache = make_prompt_cache(model)
    out = model(mx.array(prompt)[None], cache=cache)[0, -1]
    toks = []
    for _ in range(n):
        t = int(mx.argmax(out).item())
        toks.append(t)
        out = model(mx.array([[t]]), cache=cache)[0, -1]
    return toks


def main():
    mx.set_default_device(mx.cpu)
    ref = json.loads((SRC / "reference.json").read_text())
    ids, prompt = ref["input_ids"], ref["greedy"]["prompt"]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for tag, flags in SETTINGS:
            out = Path(tmp) / tag
            subprocess.run([str(QINFER), "quantize", "--model", str(SRC), "--out", str(out), *flags], check=True)
            # Refuses to overwrite without --force.
            again = subprocess.run([str(QINFER), "quantize", "--model", str(SRC), "--out", str(out), *flags],
                                   capture_output=True, text=True)
            model, config = load_model(out)
            # Scales/biases/norms are stored bf16 (as the source); mlx-lm would
            # compute in bf16. Widen to f32 so the comparison is of f32 forwards.
            model.update(tree_map_with_path(
                lambda _, v: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v, model.parameters()))
            mlx_logits = np.array(model(mx.array(ids)[None])[0].astype(mx.float32))
            mlx_greedy = greedy(model, prompt)
            qpath = Path(tmp) / f"{tag}.npy"
            subprocess.run([str(QINFER), "score", "--model", str(out), "--tokens", ",".join(map(str, ids)),
                            "--logits-out", str(qpath)], check=True, capture_output=True)
            q_logits = np.load(qpath)
            gen = subprocess.run([str(QINFER), "generate", "--model", str(out), "--tokens", ",".join(map(str, prompt)),
                                  "--max-tokens", "24", "--ignore-eos", "--json"], capture_output=True, text=True)
            results.append({
                "setting": tag, "flags": flags,
                "mlx_lm_loaded": True,
                "quantization": config.get("quantization"),
                "max_abs_logit_diff_qinfer_vs_mlx_lm": float(np.abs(mlx_logits - q_logits).max()),
                "max_abs_logit_diff_vs_unquantized_transformers": float(np.abs(mlx_logits - np.load(SRC / "logits.npy")).max()),
                "mlx_lm_greedy": mlx_greedy,
                "qinfer_generate_stdout": gen.stdout.strip()[-400:] if gen.returncode == 0 else None,
                "second_run_refused": again.returncode != 0 and "--force" in again.stderr,
            })
            print(json.dumps(results[-1]))
    # The MoE/hybrid entry (scripts/verify_quantize_mlx_moe.py) shares the file: keep it.
    path = ROOT / "bench" / "results" / "quantize-mlx-verify.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update({"source": "tests/fixtures/tiny/qwen3", "mlx_version": mx.__version__,
                 "mlx_lm_version": mlx_lm.__version__, "results": results})
    path.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
