#!/usr/bin/env python3
"""Float64 "truth" logits for the MLX-quantized fixtures (tests/fixtures/mlx/<case>/logits_f64.npy).

The f32 references in logits.npy are mlx-lm's own float32 forward, so comparing qinfer to them
mixes two float32 rounding errors. This script evaluates *the same quantized model* exactly:

1. every quantized tensor of the fixture's model.safetensors is dequantized in float64 from the
   stored words/scales/biases (w = scale * q + bias, with its own bit unpacking, checked against
   mx.dequantize), every other tensor is widened to float64;
2. the tensors are mapped back to the Hugging Face hub layout of the tiny source fixture (undoing
   mlx-lm's sanitize: conv1d axes, the +1 folded into zero-centred RMSNorm weights, stacked or
   split experts, the language_model prefix); the mapping is validated on the unquantized
   conversion, which must give back the tiny fixture's tensors bit for bit;
3. the logits come from `numpy_forward` of scripts/make_fixtures_hybrid.py, an independent float64
   numpy forward written from the math (shares no code with mlx-lm, transformers or qinfer), and
   are cross-checked against transformers run in float64 throughout (its float32 islands, i.e.
   RMSNorms, GDN kernels, attention softmax, RoPE tables and router softmax, patched to float64).
   Before any fixture is touched, the same two routes are compared on the unquantized tiny
   fixture and must agree to ~1e-9 relative.

Writes logits_f64.npy (float64, [T, vocab]) next to logits.npy and records in reference.json
`checks.float64_truth`: max |logit| of the truth, max |mlx-lm f32 - truth| for the full sequence
and for mlx-lm's cached one-token-at-a-time forward, and the numpy-vs-transformers agreement.
Nothing here comes from qinfer.

    /work/venv/bin/python scripts/mlx_f64_truth.py [--only CASE]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_spec = importlib.util.spec_from_file_location("make_fixtures_hybrid", ROOT / "scripts" / "make_fixtures_hybrid.py")
mh = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mh)  # also imports make_fixtures.py (determinism knobs)

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from mlx_lm.utils import load_model  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

TINY = ROOT / "tests" / "fixtures" / "tiny"
MLX = ROOT / "tests" / "fixtures" / "mlx"

# Hybrid (Gated DeltaNet) cases: the ones whose f32 references disagree by more than 1e-4.
CASES = {
    "qwen3_5_q4_g32": "qwen3_5",
    "qwen3_5_q8_g64": "qwen3_5",
    "qwen3_5_moe_q4_g32": "qwen3_5_moe",
    "qwen3_next_q4_g32": "qwen3_next",
}

# Zero-centred RMSNorm weights into which mlx-lm's sanitize folds the +1.
NORM_SUFFIXES = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)

# Independence cross-check tolerance (numpy vs transformers, both float64), relative to max |logit|.
MAX_ROUTE_REL = 1e-12


# ---------------------------------------------------------------------------
# Dequantization (float64, own bit unpacking)
# ---------------------------------------------------------------------------


def unpack(words: np.ndarray, bits: int) -> np.ndarray:
    """uint32 words [..., n] -> unsigned values [..., 32n/bits]: a little-endian bit stream,
    value i in bits [i*bits, (i+1)*bits) (values straddle words for 3/5/6 bits)."""
    w = np.ascontiguousarray(words.astype("<u4"))
    b = np.unpackbits(w.view(np.uint8), axis=-1, bitorder="little")
    b = b.reshape(*words.shape[:-1], -1, bits).astype(np.int64)
    return (b << np.arange(bits, dtype=np.int64)).sum(-1)


def dequant(words, scales, biases, bits: int, group: int) -> np.ndarray:
    q = unpack(words, bits).astype(np.float64)
    n_in = q.shape[-1]
    if scales.shape[-1] * group != n_in:
        raise RuntimeError(f"shape mismatch: {words.shape} {scales.shape} bits {bits} group {group}")
    q = q.reshape(*q.shape[:-1], n_in // group, group)
    w = scales.astype(np.float64)[..., None] * q + biases.astype(np.float64)[..., None]
    return w.reshape(*w.shape[:-2], n_in)


def read_tensors(path: Path) -> dict:
    out = {}
    with safe_open(str(path), "pt") as f:
        for k in f.keys():
            t = f.get_tensor(k)
            out[k] = t.numpy() if t.dtype == torch.uint32 else t.to(torch.float64).numpy()
    return out


def dequantize_fixture(case_dir: Path) -> tuple[dict, float]:
    """MLX names -> float64 weights; also the max relative gap to mx.dequantize (float32)."""
    cfg = json.loads((case_dir / "config.json").read_text())
    qcfg = cfg["quantization"]
    raw = read_tensors(case_dir / "model.safetensors")
    out, worst = {}, 0.0
    for k, v in raw.items():
        if k.endswith((".scales", ".biases")):
            continue
        base = k[: -len(".weight")] if k.endswith(".weight") else None
        if base is not None and base + ".scales" in raw:
            over = qcfg.get(base, {})
            bits, group = over.get("bits", qcfg["bits"]), over.get("group_size", qcfg["group_size"])
            w = dequant(v, raw[base + ".scales"], raw[base + ".biases"], bits, group)
            ref = np.array(
                mx.dequantize(
                    mx.array(v),
                    mx.array(raw[base + ".scales"].astype(np.float32)),
                    mx.array(raw[base + ".biases"].astype(np.float32)),
                    group_size=group,
                    bits=bits,
                )
            ).astype(np.float64)
            worst = max(worst, float(np.abs(ref - w).max() / max(np.abs(w).max(), 1e-30)))
            out[k] = w
        else:
            out[k] = v
    return out, worst


# ---------------------------------------------------------------------------
# mlx-lm layout -> Hugging Face hub layout of the tiny source fixture
# ---------------------------------------------------------------------------


def to_hub(mlx_weights: dict, src: str) -> dict:
    vl = src in ("qwen3_5", "qwen3_5_moe")
    out = {}
    stacked = {}
    for k, v in mlx_weights.items():
        v = np.asarray(v, dtype=np.float64)
        if vl:
            if k.startswith("language_model.model."):
                k = "model.language_model." + k[len("language_model.model.") :]
            elif k.startswith("language_model.lm_head."):
                k = k[len("language_model.") :]
            else:
                raise RuntimeError(f"unexpected {k}")
        if "conv1d.weight" in k:  # mlx [C, K, 1] -> torch [C, 1, K]
            v = np.swapaxes(v, 1, 2)
        if k.endswith(NORM_SUFFIXES) and v.ndim == 1:
            v = v - 1.0  # exact: the stored value is (1 + w) rounded to float32, w a bf16 value
        m = re.match(r"^(.*\.mlp)\.switch_mlp\.(gate|up|down)_proj\.weight$", k)
        if m:
            stacked.setdefault(m.group(1), {})[m.group(2)] = v
            continue
        out[k] = v
    for prefix, parts in stacked.items():
        if src == "qwen3_5_moe":  # fused [E, 2I, H] (gate rows first) and [E, H, I]
            out[f"{prefix}.experts.gate_up_proj"] = np.concatenate([parts["gate"], parts["up"]], axis=1)
            out[f"{prefix}.experts.down_proj"] = parts["down"]
        else:  # per-expert tensors
            for n, t in parts.items():
                for e in range(t.shape[0]):
                    out[f"{prefix}.experts.{e}.{n}_proj.weight"] = t[e]
    return out


def hub_reference(src: str) -> dict:
    """The tiny fixture's tensors (float64), without the parts mlx-lm drops (vision, mtp)."""
    t = read_tensors(TINY / src / "model.safetensors")
    return {k: v for k, v in t.items() if not k.startswith(("mtp.", "model.visual."))}


def mlx_unquantized(src: str) -> dict:
    """mlx-lm's conversion of the tiny fixture before quantization (as make_fixtures_mlx.py)."""
    raw = json.loads((TINY / src / "config.json").read_text())
    extra = None
    if "rope_theta" not in raw and "rope_parameters" in raw and "text_config" not in raw:
        rp = raw["rope_parameters"]
        extra = {k: rp[k] for k in ("rope_theta", "partial_rotary_factor") if k in rp}
    model, _ = load_model(TINY / src, lazy=False, model_config=extra)
    return {k: np.array(v.astype(mx.float32)).astype(np.float64) for k, v in tree_flatten(model.parameters())}


def check_mapping(src: str) -> int:
    """Round trip: mlx-lm's unquantized conversion mapped back must give the tiny fixture's
    tensors bit for bit, except that mlx-lm's sanitize adds the +1 of the zero-centred norms in
    the checkpoint's dtype (bf16), so those come back as bf16(1 + w) - 1."""
    got, want = to_hub(mlx_unquantized(src), src), hub_reference(src)
    if sorted(got) != sorted(want):
        raise RuntimeError(f"{src}: mapped names differ: {sorted(set(got) ^ set(want))}")
    rounded = 0
    for k in want:
        w = want[k]
        if k.endswith(NORM_SUFFIXES) and w.ndim == 1:
            w = torch.from_numpy(1.0 + w).to(torch.bfloat16).to(torch.float64).numpy() - 1.0
            rounded += int((w != want[k]).sum())
        if got[k].shape != w.shape or not np.array_equal(got[k], w):
            raise RuntimeError(f"{src}: mapped {k} differs from the tiny fixture")
    return rounded


# ---------------------------------------------------------------------------
# The two float64 forwards
# ---------------------------------------------------------------------------


def write_hub_dir(tmp: Path, src: str, weights: dict) -> Path:
    d = tmp / src
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text((TINY / src / "config.json").read_text())
    save_file({k: np.ascontiguousarray(v) for k, v in sorted(weights.items())}, str(d / "model.safetensors"))
    return d


def _rope_forward_f64(self, x, position_ids):
    c = getattr(self.config, "text_config", self.config)
    rp = c.rope_parameters
    dim = int(c.head_dim * rp.get("partial_rotary_factor", 1.0))
    inv = 1.0 / rp["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if hasattr(self, "mrope_section"):
        pos = position_ids.expand(3, -1, -1) if position_ids.ndim == 2 else position_ids
        freqs = pos[..., None].to(torch.float64) * inv
        cos = self.recomposition_frequencies(freqs.cos() * self.attention_scaling)
        sin = self.recomposition_frequencies(freqs.sin() * self.attention_scaling)
    else:
        freqs = position_ids[..., None].to(torch.float64) * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
    return cos.to(x.dtype), sin.to(x.dtype)


def _router_forward_any_dtype(self, hidden_states):
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = torch.nn.functional.linear(hidden_states, self.weight)
    probs = torch.softmax(logits, dim=-1)
    top, idx = torch.topk(probs, self.top_k, dim=-1)
    if getattr(self, "norm_topk_prob", True):
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top, idx


_tensor_float = torch.Tensor.float


def _float_keeps_f64(self, *args, **kwargs):
    return self if self.dtype == torch.float64 else _tensor_float(self, *args, **kwargs)


class full_float64(mh.true_float64):
    """make_fixtures_hybrid.true_float64 plus float64 RoPE tables and router softmax, and
    `Tensor.float()` made a no-op on float64 tensors (the GDN decay
    `g = -A_log.float().exp() * softplus(a.float() + dt_bias)` is otherwise float32)."""

    def __enter__(self):
        super().__enter__()
        self._set(torch.Tensor, "float", _float_keeps_f64)
        for name in dir(self.mod):
            obj = getattr(self.mod, name)
            if not isinstance(obj, type) or not issubclass(obj, torch.nn.Module):
                continue
            if name.endswith("TextRotaryEmbedding") or (name.endswith("RotaryEmbedding") and "Vision" not in name):
                self._set(obj, "forward", _rope_forward_f64)
            elif name.endswith("TopKRouter"):
                self._set(obj, "forward", _router_forward_any_dtype)
        return self


def transformers_f64(d: Path, ids: list[int]) -> np.ndarray:
    model = AutoModelForCausalLM.from_pretrained(
        str(d), dtype=torch.float64, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    for k, p in model.state_dict().items():
        if p.dtype != torch.float64:
            raise RuntimeError(f"{k} is {p.dtype}")
    with full_float64(model), torch.no_grad():
        return model(torch.tensor(ids)[None]).logits[0].numpy()


def truth(tmp: Path, src: str, weights: dict, ids: list[int]) -> tuple[np.ndarray, float]:
    d = write_hub_dir(tmp, src, weights)
    a = mh.numpy_forward(d, ids)
    b = transformers_f64(d, ids)
    rel = float(np.abs(a - b).max() / np.abs(a).max())
    if rel > MAX_ROUTE_REL:
        raise RuntimeError(f"{src}: numpy and transformers float64 differ by {rel:.3g} relative")
    return a, rel


# ---------------------------------------------------------------------------
# mlx-lm's float32 forwards (as make_fixtures_mlx.py)
# ---------------------------------------------------------------------------


def mlx_logits(case_dir: Path, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    model, _ = load_model(case_dir, lazy=False)
    full = np.array(model(mx.array(ids)[None])[0].astype(mx.float32))
    cache = make_prompt_cache(model)
    steps = [np.array(model(mx.array([[t]]), cache=cache)[0, -1].astype(mx.float32)) for t in ids]
    return full, np.stack(steps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", action="append", choices=list(CASES))
    args = ap.parse_args()
    mx.set_default_device(mx.cpu)
    cases = args.only or list(CASES)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # Validate the mapping and the two float64 routes on the unquantized tiny fixtures.
        for src in sorted({CASES[c] for c in cases}):
            rounded = check_mapping(src)
            ref = json.loads((TINY / src / "reference.json").read_text())
            t, rel = truth(tmp / "unquantized", src, hub_reference(src), ref["input_ids"])
            f32 = np.load(TINY / src / "logits.npy")
            print(
                f"tiny/{src}: mapping exact ({rounded} norm weights bf16-rounded by mlx-lm's +1); numpy vs transformers float64 {rel:.2e} relative; "
                f"transformers f32 reference vs float64 {np.abs(f32 - t).max():.2e}",
                file=sys.stderr,
            )
        for case in cases:
            src, d = CASES[case], MLX / case
            r = json.loads((d / "reference.json").read_text())
            ids = r["input_ids"]
            weights, deq_rel = dequantize_fixture(d)
            if deq_rel > 2**-23:
                raise RuntimeError(f"{case}: dequantization differs from mx.dequantize by {deq_rel}")
            t, rel = truth(tmp / case, src, to_hub(weights, src), ids)
            full, steps = mlx_logits(d, ids)
            stored = np.load(d / "logits.npy")
            if not np.array_equal(stored, full):
                raise RuntimeError(f"{case}: mlx-lm no longer reproduces logits.npy")
            np.save(d / "logits_f64.npy", np.ascontiguousarray(t, dtype=np.float64))
            checks = {
                "file": "logits_f64.npy",
                "max_abs_logit": float(f"{np.abs(t).max():.4g}"),
                "mlx_lm_full_vs_f64_max_abs_diff": float(f"{np.abs(full - t).max():.3e}"),
                "mlx_lm_cached_stepwise_vs_f64_max_abs_diff": float(f"{np.abs(steps - t).max():.3e}"),
                "numpy_vs_transformers_f64_max_rel_diff": float(f"{rel:.3e}"),
                "dequantize_vs_mx_dequantize_max_rel_diff": float(f"{deq_rel:.3e}"),
                "greedy_argmax_matches_f64": bool((np.argmax(t, -1) == np.argmax(full, -1)).all()),
                "method": "weights dequantized in float64 from the stored words/scales/biases, mapped to "
                "the hub layout of the tiny source, numpy float64 forward (make_fixtures_hybrid.numpy_forward), "
                "cross-checked against transformers in float64 throughout",
            }
            r.setdefault("checks", {})["float64_truth"] = checks
            (d / "reference.json").write_text(json.dumps(r, indent=1) + "\n")
            print(f"{case}: {json.dumps(checks)}", file=sys.stderr)


if __name__ == "__main__":
    main()
