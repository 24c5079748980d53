#!/usr/bin/env python3
"""FP8 oracle fixtures: tests/fixtures/fp8/<case>/.

Takes the committed tiny transformers fixtures (tests/fixtures/tiny/<arch>/,
bf16) and converts them to block-FP8 checkpoints in Qwen's layout
(`quantization_config` `{"quant_method": "fp8", "fmt": "e4m3",
"weight_block_size": [bm, bn], "activation_scheme": "dynamic"}`, E4M3 weights
with an f32 `weight_scale_inv` per block):

* Which tensors: every 2-D `.weight` of a linear layer of the decoder (and MTP)
  layers, and fused expert stacks (`experts.gate_up_proj`, `experts.down_proj`);
  not embeddings, `lm_head`, norms, MoE routers (`mlp.gate`),
  `shared_expert_gate`, GDN's `in_proj_a/b/ba`, conv1d or the vision tower
  (listed in `modules_to_not_convert`).
* How: matrices whose rows and columns divide by the block go through
  transformers' own `Fp8Quantize` (what its FP8 quantizer runs, so
  `qinfer quantize --format fp8` is checked against it byte for byte). In the
  `edge` cases the others are quantized too, with partial edge blocks as
  Qwen's released checkpoints have them: the same formula over the block's
  values that exist (`quantize_edge`). Without `edge` they stay bf16, as
  transformers leaves them.

References, in float32 with eager attention (and the float64 truth of the
same weights, logits_f64.npy): the checkpoint is loaded by
transformers itself (`FineGrainedFP8Config(dequantize=True)`, its CPU path:
weights dequantized as `Fp8Dequantize` does), and the script checks that the
loaded weights equal the dequantization `f32(q) · scale_inv` computed here.
Teacher-forced logits (logits.npy) on the tiny fixture's input ids, and a
24-token greedy continuation with eos disabled (reference.json).

    /work/refvenv/bin/python scripts/make_fixtures_fp8.py [--only CASE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers.integrations.finegrained_fp8 import Fp8Quantize  # noqa: E402

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import make_fixtures as mf  # noqa: E402
import make_fixtures_hybrid as mh  # noqa: E402

TINY = ROOT / "tests" / "fixtures" / "tiny"
OUT = ROOT / "tests" / "fixtures" / "fp8"
FP8_MAX = 448.0

# case: (tiny source, [bm, bn], edge, description)
CASES = {
    "qwen3_b32": ("qwen3", [32, 32], False, "Qwen3, 32x32 blocks (every matrix divides: transformers' Fp8Quantize)"),
    "qwen3_b128_edge": ("qwen3", [128, 128], True,
                        "Qwen3, Qwen's 128x128 blocks on 64..192-wide matrices: every block a partial edge"),
    "qwen3_moe_b16x32": ("qwen3_moe", [16, 32], False, "Qwen3-MoE per-expert layout, 16x32 blocks, router bf16"),
    "qwen3_next_b48_edge": ("qwen3_next", [48, 48], True,
                            "Qwen3-Next hybrid, 48x48 blocks (partial edges), routers and in_proj_ba bf16"),
    "qwen3_5_b32": ("qwen3_5", [32, 32], False, "Qwen3.5 hybrid (hub layout with vision tower), 32x32 blocks"),
    "qwen3_5_moe_b48x32_edge": ("qwen3_5_moe", [48, 32], True,
                                "Qwen3.5-MoE fused experts [E, 2I, H]: 48-row blocks end inside gate|up (I = 32)"),
    "qwen3_moe_ct_channel": ("qwen3_moe", "channel", True,
                             "Qwen3-MoE as compressed-tensors FP8 (llm-compressor's FP8_DYNAMIC: per-channel weight_scale)"),
    "qwen3_ct_tensor": ("qwen3", "tensor", True, "Qwen3 as compressed-tensors FP8 with one weight_scale per matrix"),
}

KEEP = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight", "shared_expert_gate", "in_proj_a.", "in_proj_b.",
        "in_proj_ba.", "conv1d", "visual.", "A_log", "dt_bias", "mtp.fc.")


class _Quantizer:
    """The part of transformers' FP8 quantizer that `Fp8Quantize` reads."""

    def __init__(self, block):
        self.quantization_config = transformers.FineGrainedFP8Config(weight_block_size=block)


def quantized_kind(name: str, t: torch.Tensor) -> bool:
    if any(k in name for k in KEEP):
        return False
    if name.endswith(".weight") and t.ndim == 2:
        return True
    return t.ndim == 3 and (name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"))


def quantize_edge(w: torch.Tensor, bm: int, bn: int):
    """Fp8Quantize's formula with partial edge blocks: per block, scale =
    448 / max|w| (1 for all-zero), q = e4m3(clamp(w·scale)), scale_inv = 1/scale."""
    w = w.to(torch.float32)
    *lead, rows, cols = w.shape
    sr, sc = -(-rows // bm), -(-cols // bn)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    inv = torch.empty(*lead, sr, sc, dtype=torch.float32)
    for i in range(sr):
        for j in range(sc):
            blk = w[..., i * bm:(i + 1) * bm, j * bn:(j + 1) * bn]
            amax = blk.abs().amax(dim=(-2, -1))
            safe = torch.where(amax > 0, amax, torch.ones_like(amax))
            scale = torch.where(amax > 0, FP8_MAX / safe, torch.ones_like(amax))
            q[..., i * bm:(i + 1) * bm, j * bn:(j + 1) * bn] = torch.clamp(
                blk * scale[..., None, None], min=-FP8_MAX, max=FP8_MAX).to(torch.float8_e4m3fn)
            inv[..., i, j] = (1.0 / scale).to(torch.float32)
    return q, inv


def quantize_ct(w: torch.Tensor, strategy: str):
    """compressed-tensors' symmetric FP8 weights (llm-compressor's minmax
    observer): scale = max|w| / 448 over each row (`channel`) or the matrix
    (`tensor`), q = e4m3(clamp(w / scale)), dequantized = q · scale."""
    w = w.to(torch.float32)
    if strategy == "channel":
        amax = w.abs().amax(dim=-1, keepdim=True)
    else:
        amax = w.abs().amax(dim=(-2, -1), keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = torch.clamp(w / scale, min=-FP8_MAX, max=FP8_MAX).to(torch.float8_e4m3fn)
    if strategy == "tensor":
        scale = scale.reshape(scale.shape[:-2] + (1,))
    return q, scale


def scale_key(name: str) -> str:
    return name[: -len(".weight")] + ".weight_scale_inv" if name.endswith(".weight") else name + "_scale_inv"


def dequantize(q: torch.Tensor, inv: torch.Tensor, bm: int, bn: int) -> torch.Tensor:
    rows, cols = q.shape[-2:]
    s = inv.repeat_interleave(bm, dim=-2)[..., :rows, :].repeat_interleave(bn, dim=-1)[..., :cols]
    return q.to(torch.float32) * s


def convert(src: Path, dst: Path, block, edge: bool) -> dict[str, torch.Tensor]:
    """Writes the FP8 checkpoint; returns the dequantized f32 value of every quantized tensor."""
    tensors = load_file(str(src / "model.safetensors"))
    if isinstance(block, str):
        return convert_ct(src, dst, block, tensors)
    bm, bn = block
    quantizer = Fp8Quantize(_Quantizer(block))
    out, deq, skipped = {}, {}, []
    for name in sorted(tensors):
        t = tensors[name]
        if not quantized_kind(name, t):
            out[name] = t
            continue
        rows, cols = t.shape[-2:]
        if rows % bm == 0 and cols % bn == 0:
            r = quantizer._quantize_one(name, t)
            q, inv = r[name], r[scale_key(name)]
        elif edge:
            q, inv = quantize_edge(t, bm, bn)
        else:
            out[name] = t
            skipped.append(name)
            continue
        out[name], out[scale_key(name)] = q.contiguous(), inv.contiguous()
        deq[name] = dequantize(q, inv, bm, bn)
    dst.mkdir(parents=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    not_converted = sorted({n.rsplit(".", 1)[0] for n, t in tensors.items()
                            if t.ndim >= 2 and n.endswith(".weight") and n not in deq})
    cfg["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": block,
        "modules_to_not_convert": not_converted,
    }
    (dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    shutil.copy(src / "generation_config.json", dst / "generation_config.json")
    if skipped:
        print(f"    left bf16 (blocks do not divide): {skipped}")
    return deq


def convert_ct(src: Path, dst: Path, strategy: str, tensors) -> dict[str, torch.Tensor]:
    """A compressed-tensors `float-quantized` checkpoint: `X.weight` E4M3 and
    `X.weight_scale` f32 (`[out, 1]` per channel, `[1]` per tensor)."""
    out, deq = {}, {}
    for name in sorted(tensors):
        t = tensors[name]
        if not (quantized_kind(name, t) and t.ndim == 2):
            out[name] = t
            continue
        q, scale = quantize_ct(t, strategy)
        out[name], out[name[: -len(".weight")] + ".weight_scale"] = q.contiguous(), scale.contiguous()
        deq[name] = q.to(torch.float32) * scale.reshape(-1, 1) if strategy == "channel" else q.to(torch.float32) * scale
    dst.mkdir(parents=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "config_groups": {"group_0": {
            "input_activations": {"dynamic": True, "num_bits": 8, "observer": None, "strategy": "token",
                                  "symmetric": True, "type": "float"},
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {"dynamic": False, "num_bits": 8, "observer": "minmax", "strategy": strategy,
                        "symmetric": True, "type": "float", "block_structure": None},
        }},
        "format": "float-quantized",
        "ignore": sorted({n.rsplit(".", 1)[0] for n, t in tensors.items()
                          if t.ndim >= 2 and n.endswith(".weight") and n not in deq}),
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }
    (dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    shutil.copy(src / "generation_config.json", dst / "generation_config.json")
    return deq


def load_fp8(dst: Path):
    """transformers' own load of the FP8 checkpoint, dequantized, in float32."""
    cfg = json.loads((dst / "config.json").read_text())
    cls = getattr(transformers, cfg["architectures"][0])
    model = cls.from_pretrained(
        str(dst), dtype=torch.float32, attn_implementation="eager", experts_implementation="eager",
        quantization_config=transformers.FineGrainedFP8Config(
            weight_block_size=cfg["quantization_config"]["weight_block_size"], dequantize=True),
    )
    model.eval()
    return model


def load_dequantized(src: Path, deq: dict[str, torch.Tensor]):
    """The tiny model with the dequantized FP8 values in place of its weights,
    in float32: transformers' CPU dequantization derives the block from the
    scale grid (rows // grid rows), which is wrong for partial edge blocks, so
    the edge cases are dequantized here with the configured block."""
    with tempfile.TemporaryDirectory() as tmp:
        tensors = load_file(str(src / "model.safetensors"))
        tensors.update({k: v.contiguous() for k, v in deq.items()})
        save_file(tensors, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
        shutil.copy(src / "config.json", Path(tmp) / "config.json")
        cfg = json.loads((src / "config.json").read_text())
        cls = getattr(transformers, cfg["architectures"][0])
        model, info = cls.from_pretrained(
            tmp, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager",
            output_loading_info=True,
        )
        if any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")):
            raise RuntimeError(f"{src}: loading the dequantized weights: {info}")
    model.eval()
    return model


def fused_expert_slice(params: dict, name: str):
    """transformers fuses the hub's per-expert matrices in memory:
    `experts.N.gate_proj` / `up_proj` are rows of `experts.gate_up_proj[N]`
    (gate first), `experts.N.down_proj` is `experts.down_proj[N]`."""
    head, sep, tail = name.partition(".experts.")
    if not sep:
        return None
    n, proj = tail.split(".")[:2]
    if proj == "down_proj":
        t = params.get(f"{head}.experts.down_proj")
        return None if t is None else t[int(n)]
    t = params.get(f"{head}.experts.gate_up_proj")
    if t is None:
        return None
    half = t.shape[1] // 2
    return t[int(n), :half] if proj == "gate_proj" else t[int(n), half:]


def build(case: str) -> None:
    src_name, block, edge, desc = CASES[case]
    src, dst = TINY / src_name, OUT / case
    if dst.exists():
        shutil.rmtree(dst)
    print(f"{case}:")
    deq = convert(src, dst, block, edge)
    if edge:
        model, how = load_dequantized(src, deq), "transformers in float32 on the weights dequantized with the configured block (f32(q) * weight_scale_inv)"
        deq_checked = {}
    else:
        model, how = load_fp8(dst), "transformers from_pretrained(FineGrainedFP8Config(dequantize=True)), float32"
        deq_checked = deq
    # The weights transformers computes with are the dequantized FP8 values.
    params = {k: v for k, v in model.state_dict().items()}
    checked = 0
    for name, want in deq_checked.items():
        if name.startswith("mtp."):
            continue  # transformers does not load the MTP head
        got = params.get(name)
        if got is None:
            got = fused_expert_slice(params, name)
        if got is None:
            raise RuntimeError(f"{case}: transformers has no parameter {name}")
        if got.dtype != torch.float32 or not torch.equal(got, want):
            raise RuntimeError(f"{case}: transformers' {name} differs from f32(q)·scale_inv")
        checked += 1
    ref = json.loads((src / "reference.json").read_text())
    input_ids = ref["input_ids"]
    prompt = ref["greedy"]["prompt"]
    with torch.no_grad():
        logits = model(torch.tensor(input_ids)[None]).logits[0].to(torch.float32).numpy()
    np.save(dst / "logits.npy", np.ascontiguousarray(logits, dtype=np.float32))
    # The float64 truth of the same dequantized model (the hybrids' f32 logits
    # reach ±38, where two correct f32 implementations differ by ~1e-4).
    truth = mh.true_f64_logits(model, input_ids)
    np.save(dst / "logits_f64.npy", np.ascontiguousarray(truth, dtype=np.float64))
    f32_err = float(np.abs(truth - logits).max())
    n = len(ref["greedy"]["new_tokens"])
    greedy = mh.hf_greedy(model, torch.tensor(prompt), n)
    manual, margins = mf.manual_greedy(model, torch.tensor(prompt), n)
    if greedy != manual:
        raise RuntimeError(f"{case}: generate {greedy} != full re-forward {manual}")
    reference = {
        "case": case,
        "description": desc,
        "source": f"tests/fixtures/tiny/{src_name}",
        "scaling": block,
        "input_ids": input_ids,
        "logits": {"file": "logits.npy", "dtype": "float32", "shape": list(logits.shape)},
        "greedy": {"prompt": prompt, "new_tokens": greedy, "eos_disabled": True, "do_sample": False},
        "checks": {
            "quantized_tensors": sorted(deq),
            "transformers_weights_equal_dequantized": checked,
            "generate_matches_no_cache_greedy": True,
            "greedy_min_top2_margin": round(min(margins), 6),
            "float32_logits_max_abs_err_vs_float64": float(f"{f32_err:.3e}"),
        },
        "reference": how + ", eager attention",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
    }
    (dst / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")
    print(f"    {len(deq)} tensors FP8, greedy margin {min(margins):.4f}, f32 vs f64 {f32_err:.2e}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=sorted(CASES))
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    for case in [args.only] if args.only else CASES:
        build(case)


if __name__ == "__main__":
    main()
