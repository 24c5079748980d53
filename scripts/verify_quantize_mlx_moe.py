#!/usr/bin/env python3
"""Checks `qinfer quantize` on the MoE and hybrid architectures against
`mlx_lm.convert` itself, and writes the fixture the Rust tests compare with.

For each case: copy the tiny transformers fixture to a scratch directory and
give it what `mlx_lm.convert` needs to run (a word-level tokenizer; the hub
spellings `rope_theta` / `num_experts` next to transformers 5's), then

  - `mlx_lm.convert --hf-path SRC -q --q-bits B --q-group-size G [--dtype D]
    [--quant-predicate RECIPE]` → REF,
  - `qinfer quantize --model SRC --bits B --group-size G [--dtype D]
    [--mixed RECIPE]` → OURS,

and compare: every tensor's name, dtype, shape and bytes; config.json (parsed)
and the index; mlx-lm's logits and 24-token greedy continuation on OURS vs on
REF (`mlx_lm.utils.load`, computed in f32); qinfer's logits (`qinfer score`)
and greedy tokens (`qinfer generate`) on OURS vs mlx-lm's.

Writes the "moe_hybrid" entry of bench/results/quantize-mlx-verify.json
(other entries kept) and tests/fixtures/mlx/quantize_expected.json: for every
case, mlx-lm's quantization block and each tensor's [name, dtype, shape,
FNV-1a 64 of its bytes], all read from REF, never from qinfer's output.

    cargo build --release -p qinfer-cli
    /work/venv/bin/python scripts/verify_quantize_mlx_moe.py
"""

import json
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
from mlx.utils import tree_map_with_path
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load
from tokenizers import Tokenizer, models, pre_tokenizers

ROOT = Path(__file__).resolve().parent.parent
QINFER = ROOT / "target" / "release" / "qinfer"
TINY = ROOT / "tests" / "fixtures" / "tiny"
RESULTS = ROOT / "bench" / "results" / "quantize-mlx-verify.json"
FIXTURE = ROOT / "tests" / "fixtures" / "mlx" / "quantize_expected.json"
GREEDY_NEW = 24

# case: (tiny source, bits, group size, recipe, dtype; None = mlx-lm's default rule)
CASES = {
    "qwen3_moe_q4_g64": ("qwen3_moe", 4, 64, None, "float32"),
    "qwen3_moe_q8_g32": ("qwen3_moe", 8, 32, None, "float32"),
    "qwen3_moe_mixed_3_6_g32": ("qwen3_moe", 3, 32, "mixed_3_6", "float32"),
    "qwen3_moe_norm_q4_g64": ("qwen3_moe_norm", 4, 64, None, "float32"),
    "qwen3_next_q4_g64": ("qwen3_next", 4, 64, None, "float32"),
    "qwen3_next_q8_g32": ("qwen3_next", 8, 32, None, "float32"),
    "qwen3_5_q4_g64": ("qwen3_5", 4, 64, None, "float32"),
    "qwen3_5_q8_g32": ("qwen3_5", 8, 32, None, "float32"),
    "qwen3_5_moe_q4_g64": ("qwen3_5_moe", 4, 64, None, "float32"),
    "qwen3_5_moe_q8_g32": ("qwen3_5_moe", 8, 32, None, "float32"),
    # No --dtype: mlx-lm casts to text_config.dtype (bf16), all but A_log.
    "qwen3_5_moe_q4_g64_default_dtype": ("qwen3_5_moe", 4, 64, None, None),
}


def fnv1a64(data: bytes) -> str:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def read_safetensors(path: Path):
    """name → (dtype, shape, raw bytes), without numpy (it has no bf16)."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    return {k: (v["dtype"], v["shape"], raw[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]])
            for k, v in header.items()}


def prepare(tiny: str, dst: Path):
    shutil.copytree(TINY / tiny, dst)
    vocab = {f"t{i}": i for i in range(256)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "t1", "eos_token": "t2", "unk_token": "t0"}))
    cfg = json.loads((dst / "config.json").read_text())
    if "text_config" not in cfg:
        rp = cfg.get("rope_parameters", {})
        for k in ("rope_theta", "partial_rotary_factor"):
            if k in rp and k not in cfg:
                cfg[k] = rp[k]
        if "num_local_experts" in cfg and "num_experts" not in cfg:
            cfg["num_experts"] = cfg["num_local_experts"]
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))


def run(cmd):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(map(str, cmd))} failed:\n{r.stderr[-2000:]}")
    return r.stdout


def f32_model(path: Path):
    model, _ = load(str(path))
    model.update(tree_map_with_path(
        lambda _, v: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v, model.parameters()))
    return model


def mlx_run(model, ids, prompt):
    logits = np.array(model(mx.array(ids)[None])[0].astype(mx.float32))
    cache = make_prompt_cache(model)
    out = model(mx.array(prompt)[None], cache=cache)[0, -1]
    toks = []
    for _ in range(GREEDY_NEW):
        t = int(mx.argmax(out).item())
        toks.append(t)
        out = model(mx.array([[t]]), cache=cache)[0, -1]
    return logits, toks


def config_differences(a: dict, b: dict):
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def check(case, tiny, bits, group, recipe, dtype, tmp: Path):
    src, ref, ours = tmp / f"{case}-src", tmp / f"{case}-ref", tmp / f"{case}-ours"
    prepare(tiny, src)
    cvt = [sys.executable, "-m", "mlx_lm", "convert", "--hf-path", src, "--mlx-path", ref, "-q",
           "--q-bits", bits, "--q-group-size", group]
    qnt = [QINFER, "quantize", "--model", src, "--out", ours, "--bits", bits, "--group-size", group]
    if dtype:
        cvt += ["--dtype", dtype]
        qnt += ["--dtype", dtype]
    if recipe:
        cvt += ["--quant-predicate", recipe]
        qnt += ["--mixed", recipe]
    run(cvt)
    run(qnt)

    rt, ot = read_safetensors(ref / "model.safetensors"), read_safetensors(ours / "model.safetensors")
    differing = sorted(k for k in set(rt) | set(ot) if rt.get(k) != ot.get(k))
    rcfg, ocfg = (json.loads((d / "config.json").read_text()) for d in (ref, ours))
    rindex, oindex = (json.loads((d / "model.safetensors.index.json").read_text()) for d in (ref, ours))

    ref_json = json.loads((TINY / tiny / "reference.json").read_text())
    ids, prompt = ref_json["input_ids"], ref_json["greedy"]["prompt"]
    mlx_ours, greedy_ours = mlx_run(f32_model(ours), ids, prompt)
    mlx_ref, greedy_ref = mlx_run(f32_model(ref), ids, prompt)
    qpath = tmp / f"{case}.npy"
    run([QINFER, "score", "--model", ours, "--tokens", ",".join(map(str, ids)), "--logits-out", qpath])
    q_logits = np.load(qpath)
    gen = json.loads(run([QINFER, "generate", "--model", ours, "--tokens", ",".join(map(str, prompt)),
                          "--max-tokens", GREEDY_NEW, "--ignore-eos", "--json"]))
    result = {
        "case": case, "source": f"tests/fixtures/tiny/{tiny}", "bits": bits, "group_size": group,
        "recipe": recipe, "dtype": dtype,
        "tensors": len(rt),
        "tensors_byte_equal": not differing, "differing_tensors": differing,
        "quantization_block_equal": rcfg.get("quantization") == ocfg.get("quantization"),
        "config_keys_differing": config_differences(rcfg, ocfg),
        "index_equal": rindex == oindex,
        "max_abs_logit_diff_mlx_lm_on_ours_vs_mlx_lm_on_ref": float(np.abs(mlx_ours - mlx_ref).max()),
        "max_abs_logit_diff_qinfer_vs_mlx_lm_on_ours": float(np.abs(q_logits - mlx_ours).max()),
        "max_abs_logit_diff_vs_unquantized_transformers": float(np.abs(mlx_ours - np.load(TINY / tiny / "logits.npy")).max()),
        "greedy_mlx_lm_ours_equals_ref": greedy_ours == greedy_ref,
        "greedy_qinfer_equals_mlx_lm": gen["tokens"] == greedy_ours,
        "mlx_lm_greedy": greedy_ours,
    }
    expected = {
        "source": tiny, "bits": bits, "group_size": group, "recipe": recipe, "dtype": dtype,
        "quantization": rcfg["quantization"],
        "tensors": [[k, rt[k][0], rt[k][1], fnv1a64(rt[k][2])] for k in sorted(rt)],
    }
    return result, expected


def write_fixture(expected: dict):
    """One tensor per line: small diffs when mlx-lm changes."""
    lines = ["{", f' "generator": "scripts/verify_quantize_mlx_moe.py (mlx {mx.__version__}, '
                  f'mlx-lm {mlx_lm.__version__})",', ' "hash": "FNV-1a 64 of the stored bytes",', ' "cases": {']
    for i, (case, e) in enumerate(expected.items()):
        head = {k: v for k, v in e.items() if k != "tensors"}
        lines.append(f'  "{case}": {json.dumps(head)[:-1]}, "tensors": [')
        lines += [f"   {json.dumps(t)}" + ("," if j + 1 < len(e["tensors"]) else "") for j, t in enumerate(e["tensors"])]
        lines.append("  ]}" + ("," if i + 1 < len(expected) else ""))
    lines += [" }", "}"]
    FIXTURE.write_text("\n".join(lines) + "\n")


def main():
    mx.set_default_device(mx.cpu)
    results, expected = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for case, (tiny, bits, group, recipe, dtype) in CASES.items():
            r, e = check(case, tiny, bits, group, recipe, dtype, Path(tmp))
            results.append(r)
            expected[case] = e
            print(json.dumps({k: v for k, v in r.items() if k != "mlx_lm_greedy"}), flush=True)
    write_fixture(expected)
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    data["moe_hybrid"] = {
        "script": "scripts/verify_quantize_mlx_moe.py", "mlx_version": mx.__version__,
        "mlx_lm_version": mlx_lm.__version__,
        "note": "REF = mlx_lm.convert of the same scratch copy of the fixture; logits computed in f32",
        "results": results,
    }
    RESULTS.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
