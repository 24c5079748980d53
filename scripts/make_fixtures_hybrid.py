#!/usr/bin/env python3
"""Tiny-model oracle fixtures for the MoE / hybrid (Gated DeltaNet) Qwen architectures.

    /work/venv/bin/python scripts/make_fixtures_hybrid.py                 # all cases
    /work/venv/bin/python scripts/make_fixtures_hybrid.py --only qwen3_5  # one case (repeatable)

Writes tests/fixtures/tiny/<case>/ for the cases in CASES below (qwen3_moe, qwen3_moe_norm,
qwen3_next, qwen3_5, qwen3_5_gdn128, qwen3_5_moe), with the same file set and reference.json schema as
scripts/make_fixtures.py (whose helpers it imports; that script and its outputs are unchanged).

Differences from make_fixtures.py:

* Weight init knows the new parameter kinds (A_log, dt_bias, depthwise conv1d, fused 3-D expert
  tensors, router / shared-expert gates) and the two RMSNorm conventions: the zero-centred
  `x * (1 + w)` norms of Qwen3-Next / Qwen3.5 get w = 0.3·N(0,1) (effective scale 1 + 0.3·N),
  every plain `x * w` norm (Qwen3-MoE norms, the GDN gated norm `linear_attn.norm`, vision
  LayerNorms) gets w = 1 + 0.3·N(0,1).
* model.safetensors is written in the Hugging Face *hub* layout of the published checkpoints:
  per-expert `mlp.experts.N.{gate,up,down}_proj.weight` for Qwen3-MoE / Qwen3-Next (what
  save_pretrained writes), fused `mlp.experts.gate_up_proj` / `mlp.experts.down_proj` for
  Qwen3.5-MoE (rewritten here), Qwen3.5 saved as the multimodal *ForConditionalGeneration
  (text under `model.language_model.`, a tiny vision tower under `model.visual.`), plus fake
  multi-token-prediction tensors `mtp.*` that transformers ignores.  Every rewritten file is
  reloaded by transformers and must give bit-identical weights and logits.
* Seeds are also re-drawn until every MoE routing decision is robust (gap between the k-th and
  (k+1)-th router logit >= MIN_ROUTER_GAP on all forwards used for the references) and the float32
  reference is within MAX_TRUE_F64_DIFF of a float64 computation (see `true_float64`).
* Hybrid cases record `linear_layers` / `full_attention_layers`, and check that a token-by-token
  cached forward (recurrent GDN kernel + conv state) matches the full-sequence (chunked) forward.
* Every case is also checked against `numpy_forward`, an independent float64 numpy forward written
  from the math (GDN core from scripts/gdn_reference.py) that reads only config.json and
  model.safetensors.

Deterministic: running twice gives byte-identical files.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_spec = importlib.util.spec_from_file_location("make_fixtures", ROOT / "scripts" / "make_fixtures.py")
mf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mf)  # sets the determinism knobs before torch is used
_spec = importlib.util.spec_from_file_location("gdn_reference", ROOT / "scripts" / "gdn_reference.py")
gdn_reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gdn_reference)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    GenerationConfig,
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

log = mf.log
write_json = mf.write_json
TINY_DIR = mf.TINY_DIR
BOS_ID, EOS_ID, VOCAB, HIDDEN = mf.BOS_ID, mf.EOS_ID, mf.VOCAB, mf.HIDDEN
GREEDY_PROMPT_LEN, GREEDY_NEW_TOKENS, MIN_GREEDY_MARGIN = (
    mf.GREEDY_PROMPT_LEN,
    mf.GREEDY_NEW_TOKENS,
    mf.MIN_GREEDY_MARGIN,
)
MAX_TRUE_F64_DIFF = 1e-4  # float32 reference logits vs (mostly) float64 logits, absolute
MIN_ROUTER_GAP = 1e-3  # router logits: k-th minus (k+1)-th largest, over all reference forwards

COMMON = dict(mf.COMMON)

# RMSNorm classes computing x * (1 + w) (weights stored zero-centred).
ZERO_CENTERED_NORMS = {"Qwen3NextRMSNorm", "Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm"}

ROPE_NEXT = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}
# head_dim 32 * partial 0.25 = 8 rotary dims = 4 frequencies = 2 (t) + 1 (h) + 1 (w).
ROPE_35 = dict(ROPE_NEXT, mrope_section=[2, 1, 1], mrope_interleaved=True)

GDN = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=24,
    linear_conv_kernel_dim=4,
)
# Gated DeltaNet head sizes of the published Qwen3.5 models (128 / 128), 2 value heads per key head.
GDN_128 = dict(
    linear_num_key_heads=1,
    linear_num_value_heads=2,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
)

VISION = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
    in_channels=3,
    out_hidden_size=HIDDEN,
    num_position_embeddings=16,
)
MM_TOKENS = dict(image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253)

LIN, FULL = "linear_attention", "full_attention"


def text_kwargs(extra: dict) -> dict:
    kw = dict(COMMON)
    kw.update(extra)
    return kw


CASES = {
    "qwen3_moe": dict(
        kind="causal",
        cls=(Qwen3MoeConfig, Qwen3MoeForCausalLM),
        kwargs=dict(
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            norm_topk_prob=False,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        # transformers 5 writes the expert count as "num_local_experts" (attribute_map); the published
        # Qwen3-MoE config.json files say "num_experts": this case uses the hub key, qwen3_moe_norm keeps
        # what transformers writes.
        config_renames={"num_local_experts": "num_experts"},
        n_tokens=24,
        base_seed=7007,
        desc="Qwen3-MoE: 3 layers, GQA 4/2, head_dim 16, 8 experts top-2 (moe_intermediate 32), "
        "norm_topk_prob false (top-k softmax probabilities used unrenormalised), mlp_only_layers [1] "
        "(layer 1 is a dense SwiGLU MLP, intermediate 96), untied. Per-expert hub tensor names.",
    ),
    "qwen3_moe_norm": dict(
        kind="causal",
        cls=(Qwen3MoeConfig, Qwen3MoeForCausalLM),
        kwargs=dict(
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=3,
            decoder_sparse_step=2,
            mlp_only_layers=[],
            norm_topk_prob=True,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        n_tokens=24,
        base_seed=8008,
        desc="Qwen3-MoE: 4 layers, 8 experts top-3, norm_topk_prob true (top-k probabilities "
        "renormalised to sum 1), decoder_sparse_step 2 and mlp_only_layers [] so layer i is MoE iff "
        "(i+1) % 2 == 0 (layers 1, 3; layers 0, 2 dense, intermediate 96), tied embeddings.",
    ),
    "qwen3_next": dict(
        kind="causal",
        cls=(Qwen3NextConfig, Qwen3NextForCausalLM),
        kwargs=dict(
            num_hidden_layers=4,
            layer_types=[LIN, LIN, LIN, FULL],
            full_attention_interval=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            tie_word_embeddings=False,
            rope_parameters=ROPE_NEXT,
            **GDN,
        ),
        n_tokens=80,
        base_seed=9009,
        desc="Qwen3-Next: 4 layers [linear, linear, linear, full]; gated full attention 4/2 heads, "
        "head_dim 32, partial rotary 0.25 (8 of 32 dims), q_proj packs [query|gate] per head; GDN "
        "2 key heads x 16, 4 value heads x 24, conv kernel 4, fused in_proj_qkvz / in_proj_ba; MoE on "
        "every layer (8 experts top-2, renormalised) + shared expert (48) with sigmoid gate; all "
        "RMSNorms x*(1+w) except the GDN gated norm; untied. 80 tokens > GDN chunk 64.",
    ),
    "qwen3_5": dict(
        kind="vl",
        cls=(Qwen3_5Config, Qwen3_5ForConditionalGeneration),
        kwargs=dict(
            num_hidden_layers=4,
            layer_types=[LIN, LIN, LIN, FULL],
            full_attention_interval=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            intermediate_size=96,
            tie_word_embeddings=True,
            rope_parameters=ROPE_35,
            mtp_num_hidden_layers=1,
            mtp_use_dedicated_embeddings=False,
            **GDN,
        ),
        tie=True,
        f32_params=(".linear_attn.A_log", ".linear_attn.norm.weight"),
        n_tokens=80,
        base_seed=10010,
        desc="Qwen3.5 dense in the hub layout: Qwen3_5ForConditionalGeneration (nested config, text "
        "weights under model.language_model., a tiny vision tower under model.visual., fake mtp.* "
        "tensors), tied embeddings. Text: 4 layers [linear, linear, linear, full], GDN 2 key heads x 16 "
        "/ 4 value heads x 24 with separate in_proj_qkv / in_proj_z / in_proj_b / in_proj_a, gated "
        "attention 4/2 x 32, partial rotary 0.25 with interleaved mrope_section [2,1,1] (text-only "
        "positions are equal on t/h/w, so this is plain 1-D RoPE), dense SwiGLU 96. Mixed dtypes like the "
        "published files: linear_attn.A_log and linear_attn.norm.weight are F32 (full precision), the rest "
        "BF16. Logits are text-only; Qwen3_5ForCausalLM (AutoModelForCausalLM) on the same file gives "
        "identical logits.",
    ),
    "qwen3_5_moe": dict(
        kind="vl",
        cls=(Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration),
        kwargs=dict(
            num_hidden_layers=4,
            layer_types=[LIN, FULL, LIN, FULL],
            full_attention_interval=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=8,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
            rope_parameters=ROPE_35,
            mtp_num_hidden_layers=1,
            mtp_use_dedicated_embeddings=False,
            **GDN,
        ),
        tie=False,
        f32_params=(".linear_attn.A_log", ".linear_attn.norm.weight"),
        n_tokens=80,
        base_seed=11011,
        desc="Qwen3.5-MoE in the hub layout: Qwen3_5MoeForConditionalGeneration (text under "
        "model.language_model., tiny vision tower, fake mtp.*), experts stored FUSED "
        "(mlp.experts.gate_up_proj [E, 2I, H] gate rows first, mlp.experts.down_proj [E, H, I]), "
        "8 experts top-2 (always renormalised) + shared expert 48 with sigmoid gate on every layer, "
        "4 layers [linear, full, linear, full], untied. linear_attn.A_log / linear_attn.norm.weight stored as "
        "F32 (full precision), the rest BF16. Logits are text-only.",
    ),
}

# qwen3_5 with the Gated DeltaNet head sizes of the published Qwen3.5 models.
CASES["qwen3_5_gdn128"] = dict(
    CASES["qwen3_5"],
    kwargs={**CASES["qwen3_5"]["kwargs"], **GDN_128},
    base_seed=10110,
    desc="Qwen3.5 dense as qwen3_5 (hub layout: Qwen3_5ForConditionalGeneration, text weights under "
    "model.language_model., tiny vision tower under model.visual., fake mtp.* tensors, tied "
    "embeddings, 4 layers [linear, linear, linear, full], gated attention 4/2 x 32, partial rotary "
    "0.25 with interleaved mrope_section [2,1,1], dense SwiGLU 96, hidden 64, A_log / "
    "linear_attn.norm.weight F32, the rest BF16) but with the Gated DeltaNet head sizes of the "
    "published Qwen3.5 models: 1 key head x 128 / 2 value heads x 128 (2 value heads per key head; "
    "key dim 128, value dim 256, conv channels 512, conv kernel 4), separate in_proj_qkv / in_proj_z / "
    "in_proj_b / in_proj_a. 80 tokens > GDN chunk 64. Logits are text-only.",
)


# ---------------------------------------------------------------------------
# Model construction
# ---------------------------------------------------------------------------


def make_config(spec: dict):
    cfg_cls, _ = spec["cls"]
    if spec["kind"] == "causal":
        cfg = cfg_cls(**text_kwargs(spec["kwargs"]))
    else:
        cfg = cfg_cls(
            text_config=text_kwargs(spec["kwargs"]),
            vision_config=dict(VISION),
            tie_word_embeddings=spec["tie"],
            **MM_TOKENS,
        )
        cfg.text_config.dtype = torch.bfloat16
    cfg.dtype = torch.bfloat16
    return cfg


def text_config(cfg):
    return getattr(cfg, "text_config", cfg)


def text_model(model):
    """The decoder stack (Qwen3MoeModel / Qwen3NextModel / Qwen3_5*TextModel)."""
    inner = model.model
    return getattr(inner, "language_model", inner)


def randomize_(model: torch.nn.Module, seed: int, keep_f32: tuple[str, ...] = ()) -> None:
    """O(1)-scale random weights, rounded to bf16 (kept in float32) except names ending in keep_f32."""
    g = torch.Generator().manual_seed(seed)
    owner = {}
    for mname, mod in model.named_modules():
        for pname, _ in mod.named_parameters(recurse=False):
            owner[f"{mname}.{pname}" if mname else pname] = type(mod).__name__
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        shape = tuple(p.shape)
        z = torch.randn(shape, generator=g, dtype=torch.float32)
        cls = owner[name]
        if name.endswith("embed_tokens.weight"):
            w = z
        elif name.endswith(".A_log"):
            # A = exp(A_log) in [0.05, 1): decays exp(-A * softplus(.)) from ~0.02 to ~1.
            u = torch.rand(shape, generator=g, dtype=torch.float32)
            w = torch.log(0.05 + 0.95 * u)
        elif name.endswith(".dt_bias"):
            w = 0.5 * z
        elif cls in ZERO_CENTERED_NORMS:
            w = 0.3 * z
        elif "norm" in cls.lower() or "norm" in name.rsplit(".", 2)[-2]:
            if name.endswith(".bias"):
                w = 0.3 * z
            else:
                w = 1.0 + 0.3 * z
        elif name.endswith(".bias"):
            w = 0.3 * z
        elif name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            w = z * (2.0 / math.sqrt(shape[-1]))  # [E, out, in]
        elif len(shape) >= 2:
            w = z * (2.0 / math.sqrt(math.prod(shape[1:])))
        else:
            raise RuntimeError(f"unexpected parameter {name} {shape} ({cls})")
        if not name.endswith(keep_f32):
            w = w.to(torch.bfloat16).to(torch.float32)
        with torch.no_grad():
            p.copy_(w)


class RouterProbe:
    """Records the smallest gap between the k-th and (k+1)-th router logit over all forwards."""

    def __init__(self, model):
        self.min_gap = math.inf
        self.hits = {}
        self.handles = []
        for name, mod in model.named_modules():
            if type(mod).__name__.endswith("TopKRouter"):
                self.handles.append(mod.register_forward_hook(self._hook(name, mod.top_k)))

    def _hook(self, name, k):
        def fn(mod, inp, out):
            logits = out[0].detach().to(torch.float64)
            top = torch.topk(logits, k + 1, dim=-1).values
            self.min_gap = min(self.min_gap, float((top[:, k - 1] - top[:, k]).min()))
            idx = out[2].reshape(-1).tolist()
            h = self.hits.setdefault(name, set())
            h.update(idx)

        return fn

    def reset(self):
        self.min_gap = math.inf
        self.hits = {}

    def remove(self):
        for h in self.handles:
            h.remove()

    @property
    def active(self):
        return bool(self.handles)


def hf_greedy(model, prompt: torch.Tensor, n: int):
    """make_fixtures.hf_greedy, also for the nested multimodal configs (eos lives in text_config)."""
    if hasattr(model.config, "eos_token_id"):
        return mf.hf_greedy(model, prompt, n)
    tc = model.config.text_config
    saved = (model.generation_config.eos_token_id, tc.eos_token_id)
    model.generation_config.eos_token_id = None
    tc.eos_token_id = None
    try:
        with torch.no_grad():
            out = model.generate(
                prompt[None],
                attention_mask=torch.ones_like(prompt)[None],
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                eos_token_id=None,
                pad_token_id=0,
                temperature=None,
                top_p=None,
                top_k=None,
            )
    finally:
        model.generation_config.eos_token_id, tc.eos_token_id = saved
    return out[0, prompt.shape[0]:].tolist()


class true_float64:
    """Context manager: make the modeling module of `model` compute in the model's dtype throughout.

    transformers upcasts to float32 inside the RMSNorms, the GDN gated norm, the GDN kernels
    (torch_chunk/recurrent_gated_delta_rule) and the eager attention softmax, so a model loaded in
    float64 is not a float64 reference. Inside this context those pieces are replaced by
    dtype-preserving versions (the GDN core by a plain per-token recurrence). RoPE cos/sin and the
    router softmax stay float32 as in transformers.
    """

    def __init__(self, model):
        self.mod = sys.modules[type(model).__module__]
        self.saved = []

    def _set(self, obj, attr, value):
        self.saved.append((obj, attr, getattr(obj, attr)))
        setattr(obj, attr, value)

    def __enter__(self):
        mod = self.mod
        for fn in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
            if hasattr(mod, fn):
                self._set(mod, fn, _gdn_recurrent_any_dtype)
        if hasattr(mod, "eager_attention_forward"):
            self._set(mod, "eager_attention_forward", _eager_attention_any_dtype)
        for name in dir(mod):
            obj = getattr(mod, name)
            if not isinstance(obj, type) or not issubclass(obj, torch.nn.Module):
                continue
            if name.endswith("RMSNormGated"):
                self._set(obj, "forward", _gated_norm_forward)
            elif name.endswith("RMSNorm") and name in ZERO_CENTERED_NORMS:
                self._set(obj, "forward", _zero_centered_norm_forward)
            elif name.endswith("RMSNorm"):
                self._set(obj, "forward", _plain_norm_forward)
        return self

    def __exit__(self, *exc):
        for obj, attr, value in reversed(self.saved):
            setattr(obj, attr, value)
        return False


def _rms(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _gated_norm_forward(self, hidden_states, gate):
    return self.weight * _rms(hidden_states, self.variance_epsilon) * torch.nn.functional.silu(gate)


def _zero_centered_norm_forward(self, x):
    return _rms(x, self.eps) * (1.0 + self.weight)


def _plain_norm_forward(self, hidden_states):
    return self.weight * _rms(hidden_states, self.variance_epsilon)


def _eager_attention_any_dtype(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    n_rep = module.num_key_value_groups
    key = key.repeat_interleave(n_rep, dim=1)
    value = value.repeat_interleave(n_rep, dim=1)
    w = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        w = w + attention_mask
    w = torch.softmax(w, dim=-1)
    return torch.matmul(w, value).transpose(1, 2).contiguous(), w


def _gdn_recurrent_any_dtype(
    query, key, value, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False, **kw
):
    nk, nv = key.shape[2], value.shape[2]
    if nk != nv:
        query = query.repeat_interleave(nv // nk, dim=2)
        key = key.repeat_interleave(nv // nk, dim=2)
    q, k, v, b, d = (x.transpose(1, 2) for x in (query, key, value, beta, g))
    if use_qk_l2norm_in_kernel:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q / math.sqrt(q.shape[-1])
    bsz, nh, seq, dk = k.shape
    state = (
        torch.zeros(bsz, nh, dk, v.shape[-1], dtype=v.dtype) if initial_state is None else initial_state.to(v.dtype)
    )
    o = torch.zeros_like(v)
    for t in range(seq):
        state = state * d[:, :, t].exp()[..., None, None]
        delta = (v[:, :, t] - (state * k[:, :, t, :, None]).sum(-2)) * b[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        o[:, :, t] = (state * q[:, :, t, :, None]).sum(-2)
    return o.transpose(1, 2).contiguous(), (state if output_final_state else None)


def true_f64_logits(model, ids: list[int]) -> np.ndarray:
    m64 = copy.deepcopy(model).to(torch.float64)
    with true_float64(m64), torch.no_grad():
        return m64(torch.tensor(ids)[None]).logits[0].numpy()


def forward_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids)[None]).logits[0].to(torch.float32).numpy()


def stepwise_cached_logits(model, ids: list[int]) -> np.ndarray:
    """One token per forward with the model's cache (recurrent GDN + conv-state update path)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    rows = []
    with torch.no_grad():
        for t, tok in enumerate(ids):
            out = model(
                input_ids=torch.tensor([[tok]]),
                attention_mask=torch.ones(1, t + 1, dtype=torch.long),
                position_ids=torch.tensor([[t]]),
                cache=cache,
                use_cache=True,
            )
            cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
            rows.append(out.logits[0, -1].to(torch.float32).numpy())
    return np.stack(rows)


# ---------------------------------------------------------------------------
# safetensors post-processing
# ---------------------------------------------------------------------------


def read_st(path: Path) -> dict:
    out = {}
    with safe_open(str(path), "pt") as f:
        for k in f.keys():
            out[k] = f.get_tensor(k)
    return out


def write_st(path: Path, tensors: dict) -> None:
    save_file({k: tensors[k].contiguous() for k in sorted(tensors)}, str(path), metadata={"format": "pt"})
    path.chmod(0o644)


def fuse_experts(tensors: dict, state: dict) -> dict:
    """Per-expert hub names -> fused `mlp.experts.gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I]."""
    import re

    pat = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
    groups: dict[str, dict] = {}
    out = {}
    for k, v in tensors.items():
        m = pat.match(k)
        if m:
            groups.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = v
        else:
            out[k] = v
    if not groups:
        raise RuntimeError("expected per-expert tensors from save_pretrained")
    for prefix, parts in groups.items():
        n = len(parts["gate"])
        gate = torch.stack([parts["gate"][e] for e in range(n)])
        up = torch.stack([parts["up"][e] for e in range(n)])
        down = torch.stack([parts["down"][e] for e in range(n)])
        gate_up = torch.cat([gate, up], dim=1)
        # Must equal the model's own parameter (layout check: gate rows first, then up rows).
        for name, t in ((f"{prefix}.gate_up_proj", gate_up), (f"{prefix}.down_proj", down)):
            if not torch.equal(state[name].to(torch.bfloat16), t):
                raise RuntimeError(f"fused {name} differs from the model parameter")
            out[name] = t
    return out


def fake_mtp(cfg, seed: int, moe: bool) -> dict:
    """Random multi-token-prediction head with the real Qwen3.5 hub names (ignored by transformers)."""
    tc = text_config(cfg)
    H, hd, nh, nkv = tc.hidden_size, tc.head_dim, tc.num_attention_heads, tc.num_key_value_heads
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "mtp.fc.weight": (H, 2 * H),
        "mtp.pre_fc_norm_embedding.weight": (H,),
        "mtp.pre_fc_norm_hidden.weight": (H,),
        "mtp.norm.weight": (H,),
        "mtp.layers.0.input_layernorm.weight": (H,),
        "mtp.layers.0.post_attention_layernorm.weight": (H,),
        "mtp.layers.0.self_attn.q_proj.weight": (2 * nh * hd, H),
        "mtp.layers.0.self_attn.k_proj.weight": (nkv * hd, H),
        "mtp.layers.0.self_attn.v_proj.weight": (nkv * hd, H),
        "mtp.layers.0.self_attn.o_proj.weight": (H, nh * hd),
        "mtp.layers.0.self_attn.q_norm.weight": (hd,),
        "mtp.layers.0.self_attn.k_norm.weight": (hd,),
    }
    if moe:
        E, I, S = tc.num_experts, tc.moe_intermediate_size, tc.shared_expert_intermediate_size
        shapes.update(
            {
                "mtp.layers.0.mlp.gate.weight": (E, H),
                "mtp.layers.0.mlp.experts.gate_up_proj": (E, 2 * I, H),
                "mtp.layers.0.mlp.experts.down_proj": (E, H, I),
                "mtp.layers.0.mlp.shared_expert.gate_proj.weight": (S, H),
                "mtp.layers.0.mlp.shared_expert.up_proj.weight": (S, H),
                "mtp.layers.0.mlp.shared_expert.down_proj.weight": (H, S),
                "mtp.layers.0.mlp.shared_expert_gate.weight": (1, H),
            }
        )
    else:
        I = tc.intermediate_size
        shapes.update(
            {
                "mtp.layers.0.mlp.gate_proj.weight": (I, H),
                "mtp.layers.0.mlp.up_proj.weight": (I, H),
                "mtp.layers.0.mlp.down_proj.weight": (H, I),
            }
        )
    out = {}
    for name in sorted(shapes):
        z = torch.randn(shapes[name], generator=g, dtype=torch.float32)
        w = 0.3 * z if len(shapes[name]) == 1 else z * (2.0 / math.sqrt(shapes[name][-1]))
        out[name] = w.to(torch.bfloat16)
    return out


# ---------------------------------------------------------------------------
# Independent numpy float64 forward (from model.safetensors + config.json only)
# ---------------------------------------------------------------------------
# Written from the math, sharing no code with transformers; it also documents the hub layouts:
# q_proj rows per head [query(hd) | gate(hd)]; in_proj_qkvz rows per key head
# [q(dk) | k(dk) | v(r*dv) | z(r*dv)], in_proj_ba rows per key head [b(r) | a(r)] (r = nv/nk);
# conv1d over channels [q all heads | k all heads | v all heads]; fused experts gate rows first.

def np_rms(x, w, eps, zero_centered):
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return y * ((1.0 + w) if zero_centered else w)


def np_silu(x):
    return x / (1.0 + np.exp(-x))


def np_sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def np_rope(x, inv_freq):
    """x [T, heads, head_dim]; rotates the first 2*len(inv_freq) dims (NeoX halves), passes the rest."""
    rd = 2 * len(inv_freq)
    f = np.arange(x.shape[0], dtype=np.float64)[:, None] * inv_freq[None, :]
    cos = np.cos(np.concatenate([f, f], -1))[:, None, :]
    sin = np.sin(np.concatenate([f, f], -1))[:, None, :]
    xr, xp = x[..., :rd], x[..., rd:]
    rot = np.concatenate([-xr[..., rd // 2 :], xr[..., : rd // 2]], -1)
    return np.concatenate([xr * cos + rot * sin, xp], -1)


def np_attn(x, W, p, c, zero_centered, gated, inv_freq):
    T = x.shape[0]
    nh, nkv, hd, eps = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["rms_norm_eps"]
    q = x @ W[p + "q_proj.weight"].T
    if gated:  # q_proj rows per head: [query (hd) | gate (hd)]
        q = q.reshape(T, nh, 2 * hd)
        q, gate = q[..., :hd], q[..., hd:].reshape(T, nh * hd)
    else:
        q = q.reshape(T, nh, hd)
    k = (x @ W[p + "k_proj.weight"].T).reshape(T, nkv, hd)
    v = (x @ W[p + "v_proj.weight"].T).reshape(T, nkv, hd)
    q = np_rope(np_rms(q, W[p + "q_norm.weight"], eps, zero_centered), inv_freq)
    k = np_rope(np_rms(k, W[p + "k_norm.weight"], eps, zero_centered), inv_freq)
    r = nh // nkv
    out = np.zeros((T, nh, hd))
    causal = np.triu(np.full((T, T), -np.inf), 1)
    for h in range(nh):
        s = q[:, h] @ k[:, h // r].T / np.sqrt(hd) + causal
        s = np.exp(s - s.max(-1, keepdims=True))
        out[:, h] = (s / s.sum(-1, keepdims=True)) @ v[:, h // r]
    out = out.reshape(T, nh * hd)
    if gated:
        out = out * np_sigmoid(gate)
    return out @ W[p + "o_proj.weight"].T


def np_gdn(x, W, p, c, fused):
    T = x.shape[0]
    nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv, K = c["linear_key_head_dim"], c["linear_value_head_dim"], c["linear_conv_kernel_dim"]
    r = nv // nk
    if fused:  # Qwen3-Next: rows grouped per key head
        qkvz = (x @ W[p + "in_proj_qkvz.weight"].T).reshape(T, nk, 2 * dk + 2 * r * dv)
        q, k, v, z = np.split(qkvz, [dk, 2 * dk, 2 * dk + r * dv], -1)
        ba = (x @ W[p + "in_proj_ba.weight"].T).reshape(T, nk, 2 * r)
        b, a = ba[..., :r].reshape(T, nv), ba[..., r:].reshape(T, nv)
        mixed = np.concatenate([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], -1)
        z = z.reshape(T, nv, dv)
    else:  # Qwen3.5: separate projections, in_proj_qkv rows [q all heads | k all heads | v all heads]
        mixed = x @ W[p + "in_proj_qkv.weight"].T
        z = (x @ W[p + "in_proj_z.weight"].T).reshape(T, nv, dv)
        b = x @ W[p + "in_proj_b.weight"].T
        a = x @ W[p + "in_proj_a.weight"].T
    # Causal depthwise conv (zero left padding), weight [C, 1, K]: y[t] = sum_j w[:, j] * x[t - (K-1) + j].
    cw = W[p + "conv1d.weight"][:, 0, :]
    pad = np.concatenate([np.zeros((K - 1, mixed.shape[1])), mixed], 0)
    conv = np_silu(sum(pad[j : j + T] * cw[:, j] for j in range(K)))
    q, k, v = np.split(conv, [nk * dk, 2 * nk * dk], -1)
    o = gdn_reference.gdn_core(
        q.reshape(T, nk, dk), k.reshape(T, nk, dk), v.reshape(T, nv, dv), a, b, W[p + "A_log"], W[p + "dt_bias"]
    )[0]
    # Gated RMSNorm per value head: plain weight (not 1+w), then * silu(z).
    o = np_rms(o, W[p + "norm.weight"], c["rms_norm_eps"], False) * np_silu(z)
    return o.reshape(T, nv * dv) @ W[p + "out_proj.weight"].T


def np_mlp(x, W, p):
    return (np_silu(x @ W[p + "gate_proj.weight"].T) * (x @ W[p + "up_proj.weight"].T)) @ W[p + "down_proj.weight"].T


def np_moe(x, W, p, c, always_norm):
    k = c["num_experts_per_tok"]
    logits = x @ W[p + "gate.weight"].T
    pr = np.exp(logits - logits.max(-1, keepdims=True))
    pr /= pr.sum(-1, keepdims=True)
    idx = np.argsort(-pr, -1)[:, :k]
    wt = np.take_along_axis(pr, idx, -1)
    if always_norm or c.get("norm_topk_prob"):
        wt = wt / wt.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    fused = (p + "experts.gate_up_proj") in W
    for t in range(x.shape[0]):
        for j in range(k):
            e = idx[t, j]
            if fused:  # gate_up_proj [E, 2I, H]: gate rows first; down_proj [E, H, I]
                gu = W[p + "experts.gate_up_proj"][e] @ x[t]
                half = gu.shape[0] // 2
                y = W[p + "experts.down_proj"][e] @ (np_silu(gu[:half]) * gu[half:])
            else:
                q = f"{p}experts.{e}."
                y = W[q + "down_proj.weight"] @ (
                    np_silu(W[q + "gate_proj.weight"] @ x[t]) * (W[q + "up_proj.weight"] @ x[t])
                )
            out[t] += wt[t, j] * y
    if (p + "shared_expert_gate.weight") in W:
        out += np_sigmoid(x @ W[p + "shared_expert_gate.weight"].T) * np_mlp(x, W, p + "shared_expert.")
    return out


def numpy_forward(out: Path, ids: list[int]) -> np.ndarray:
    cfg = json.loads((out / "config.json").read_text(encoding="utf-8"))
    W = {}
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        for k in f.keys():
            if not k.startswith(("mtp.", "model.visual.")):
                W[k] = f.get_tensor(k).to(torch.float64).numpy()
    c = cfg.get("text_config", cfg)
    pre = "model.language_model." if "text_config" in cfg else "model."
    mt = cfg["model_type"]
    zc = gated = mt != "qwen3_moe"  # x*(1+w) norms and gated attention everywhere except Qwen3-MoE
    rp = c["rope_parameters"]
    rd = int(c["head_dim"] * rp.get("partial_rotary_factor", 1.0))
    inv_freq = 1.0 / rp["rope_theta"] ** (np.arange(0, rd, 2, dtype=np.float64) / rd)
    types = c.get("layer_types") or ["full_attention"] * c["num_hidden_layers"]
    x = W[pre + "embed_tokens.weight"][ids]
    for L in range(c["num_hidden_layers"]):
        p = f"{pre}layers.{L}."
        h = np_rms(x, W[p + "input_layernorm.weight"], c["rms_norm_eps"], zc)
        if types[L] == "linear_attention":
            x = x + np_gdn(h, W, p + "linear_attn.", c, fused=(mt == "qwen3_next"))
        else:
            x = x + np_attn(h, W, p + "self_attn.", c, zc, gated, inv_freq)
        h = np_rms(x, W[p + "post_attention_layernorm.weight"], c["rms_norm_eps"], zc)
        if (p + "mlp.gate.weight") in W:
            x = x + np_moe(h, W, p + "mlp.", c, always_norm=(mt == "qwen3_5_moe"))
        else:
            x = x + np_mlp(h, W, p + "mlp.")
    x = np_rms(x, W[pre + "norm.weight"], c["rms_norm_eps"], zc)
    lm = W.get("lm_head.weight", W[pre + "embed_tokens.weight"])
    return x @ lm.T


# ---------------------------------------------------------------------------
# Reference loading / checks
# ---------------------------------------------------------------------------


def load_ref(out: Path, spec: dict, dtype=torch.float32):
    _, model_cls = spec["cls"]
    model, info = model_cls.from_pretrained(
        str(out), dtype=dtype, attn_implementation="eager", experts_implementation="eager", output_loading_info=True
    )
    model.eval()
    return model, info


def rope_info(model) -> dict:
    rot = text_model(model).rotary_emb
    d = {
        "inv_freq": [float(x) for x in rot.inv_freq.tolist()],
        "attention_scaling": float(rot.attention_scaling),
    }
    if hasattr(rot, "mrope_section"):
        d["mrope_section"] = list(rot.mrope_section)
    return d


def check_mrope_is_1d(model, n: int) -> float:
    """cos/sin of the text rotary embedding for text-only (t=h=w) positions vs plain 1-D RoPE."""
    rot = text_model(model).rotary_emb
    pos = torch.arange(n)
    x = torch.zeros(1, n, 8)
    cos, sin = rot(x, pos.view(1, 1, -1).expand(3, 1, -1))
    freqs = pos[:, None].float() * rot.inv_freq[None, :].float()
    emb = torch.cat([freqs, freqs], dim=-1)
    return max(float((cos[0] - emb.cos()).abs().max()), float((sin[0] - emb.sin()).abs().max()))


def moe_layer_info(model) -> dict:
    tm = text_model(model)
    moe, dense = [], []
    for i, layer in enumerate(tm.layers):
        (moe if hasattr(layer.mlp, "experts") else dense).append(i)
    return {"moe_layers": moe, "dense_mlp_layers": dense}


def build_case(name: str) -> None:
    spec = CASES[name]
    base_seed, n_tokens = spec["base_seed"], spec["n_tokens"]
    out = TINY_DIR / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)

    id_rng = np.random.default_rng(base_seed)
    input_ids = [int(x) for x in id_rng.integers(3, VOCAB, size=n_tokens)]
    prompt = input_ids[:GREEDY_PROMPT_LEN]
    _, model_cls = spec["cls"]
    keep_f32 = spec.get("f32_params", ())

    for attempt in range(50):
        seed = base_seed * 100 + attempt
        torch.manual_seed(seed)
        cfg = make_config(spec)
        model = model_cls(cfg).to(torch.float32).eval()
        model.set_attn_implementation("eager")
        model.set_experts_implementation("eager")
        randomize_(model, seed, keep_f32)
        probe = RouterProbe(model)
        _, margins = mf.manual_greedy(model, torch.tensor(prompt), GREEDY_NEW_TOKENS)
        mem_logits = forward_logits(model, input_ids)
        gap = probe.min_gap
        probe.remove()
        f64 = float(np.abs(true_f64_logits(model, input_ids) - mem_logits).max())
        if min(margins) >= MIN_GREEDY_MARGIN and gap >= MIN_ROUTER_GAP and f64 <= MAX_TRUE_F64_DIFF:
            break
        log(
            f"  {name}: seed {seed} greedy margin {min(margins):.4f}, router gap {gap:.4g}, "
            f"f32 vs f64 {f64:.3g}: retrying"
        )
    else:
        raise RuntimeError(f"{name}: no seed gave a robust greedy continuation")

    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    f32_values = {k: p.detach().clone() for k, p in model.named_parameters() if k.endswith(keep_f32) and keep_f32}
    model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(str(out))
    st_path = out / "model.safetensors"
    st_path.chmod(0o644)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    expected = {k: v.to(torch.float32) for k, v in state.items()}
    expected.update(f32_values)
    cfg = model.config
    del model

    renames = spec.get("config_renames")
    if renames:
        cpath = out / "config.json"
        cj = json.loads(cpath.read_text(encoding="utf-8"))
        for old, new in renames.items():
            cj[new] = cj.pop(old)
        cpath.write_text(json.dumps(cj, indent=2, sort_keys=True) + "\n", encoding="utf-8")

    # ---- hub layout of the safetensors ----
    tensors = read_st(st_path)
    layout_notes = []
    per_expert = [k for k in tensors if ".mlp.experts." in k and k.endswith("_proj.weight")]
    if name in ("qwen3_moe", "qwen3_moe_norm", "qwen3_next"):
        if not per_expert:
            raise RuntimeError(f"{name}: save_pretrained did not write per-expert tensors")
        layout_notes.append("per-expert tensors exactly as written by save_pretrained")
    if name == "qwen3_5_moe":
        tensors = fuse_experts(tensors, state)
        layout_notes.append("per-expert tensors from save_pretrained rewritten as fused gate_up_proj/down_proj")
    if spec["kind"] == "vl":
        mtp = fake_mtp(cfg, seed + 1, moe=(name == "qwen3_5_moe"))
        tensors.update(mtp)
        layout_notes.append(f"{len(mtp)} fake mtp.* tensors added (random, ignored by transformers)")
    if f32_values:
        for k, v in f32_values.items():
            if k not in tensors:
                raise RuntimeError(f"{name}: {k} not in the saved file")
            tensors[k] = v
        layout_notes.append(
            f"{len(f32_values)} tensors stored as F32 with full float32 precision (not bf16-rounded), like the "
            "published Qwen3.5 files: " + ", ".join(f"*{s}" for s in keep_f32)
        )
    if spec["kind"] == "vl":
        write_st(st_path, tensors)

    # ---- reference computations from the saved bf16 files, in float32 ----
    ref_model, info = load_ref(out, spec)
    missing = sorted(info.get("missing_keys", []))
    if missing:
        raise RuntimeError(f"{name}: missing keys on reload: {missing}")
    loaded = ref_model.state_dict()
    for k, v in expected.items():
        if not torch.equal(loaded[k], v):
            raise RuntimeError(f"{name}: reloaded {k} differs from the saved bf16 weights")

    probe = RouterProbe(ref_model)
    logits = forward_logits(ref_model, input_ids)
    np.save(out / "logits.npy", np.ascontiguousarray(logits, dtype=np.float32))
    reload_diff = float(np.abs(logits - mem_logits).max())
    if reload_diff != 0.0:
        raise RuntimeError(f"{name}: reloaded-file logits differ from the in-memory model by {reload_diff}")

    greedy = hf_greedy(ref_model, torch.tensor(prompt), GREEDY_NEW_TOKENS)
    manual, margins = mf.manual_greedy(ref_model, torch.tensor(prompt), GREEDY_NEW_TOKENS)
    if len(greedy) != GREEDY_NEW_TOKENS:
        raise RuntimeError(f"{name}: generate returned {len(greedy)} tokens")
    if greedy != manual:
        raise RuntimeError(f"{name}: generate (cache) {greedy} != full re-forward {manual}")

    checks = {
        "generate_matches_no_cache_greedy": True,
        "greedy_min_top2_margin": round(min(margins), 6),
        "reload_logits_max_abs_diff_vs_in_memory_model": reload_diff,
    }
    if probe.active:
        checks["router_min_topk_logit_gap"] = round(probe.min_gap, 6)
        checks["router_distinct_experts_hit_per_layer"] = {
            k.split(".layers.")[1].split(".")[0]: len(v) for k, v in sorted(probe.hits.items())
        }
    probe.remove()

    tc = text_config(ref_model.config)
    checks["layer_types"] = list(getattr(tc, "layer_types", None) or ["full_attention"] * tc.num_hidden_layers)
    linear_layers = [i for i, t in enumerate(checks["layer_types"]) if t == LIN]
    full_layers = [i for i, t in enumerate(checks["layer_types"]) if t == FULL]
    checks.update(moe_layer_info(ref_model))

    if linear_layers:
        step = stepwise_cached_logits(ref_model, input_ids)
        d = float(np.abs(step - logits).max())
        checks["stepwise_cached_vs_full_logits_max_abs_diff"] = float(f"{d:.3e}")
        if d > 2e-3:
            raise RuntimeError(f"{name}: cached stepwise logits differ from full forward by {d}")

    if spec["kind"] == "vl":
        checks["mrope_text_only_vs_1d_rope_cos_sin_max_abs_diff"] = check_mrope_is_1d(ref_model, n_tokens)
        causal = AutoModelForCausalLM.from_pretrained(
            str(out), dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
        )
        causal.eval()
        checks["text_only_causal_lm_class"] = type(causal).__name__
        cl = forward_logits(causal, input_ids)
        cdiff = float(np.abs(cl - logits).max())
        checks["causal_lm_vs_conditional_generation_logits_max_abs_diff"] = cdiff
        if cdiff > 1e-5:
            raise RuntimeError(f"{name}: {type(causal).__name__} logits differ by {cdiff}")
        cg = hf_greedy(causal, torch.tensor(prompt), GREEDY_NEW_TOKENS)
        checks["causal_lm_greedy_matches"] = cg == greedy
        if cg != greedy:
            raise RuntimeError(f"{name}: causal-LM greedy differs")
        del causal

    # float64 cross-check of the float32 reference.  Note: transformers' GDN kernels
    # (torch_chunk/recurrent_gated_delta_rule) and the gated norm compute in float32 even here.
    m64, _ = load_ref(out, spec, dtype=torch.float64)
    with torch.no_grad():
        logits64 = m64(torch.tensor(input_ids)[None]).logits[0].to(torch.float64).numpy()
    manual64, _ = mf.manual_greedy(m64, torch.tensor(prompt), GREEDY_NEW_TOKENS)
    checks["float64_logits_max_abs_diff"] = float(f"{float(np.abs(logits64 - logits).max()):.3e}")
    checks["float64_greedy_matches"] = manual64 == greedy
    true64 = float(np.abs(true_f64_logits(ref_model, input_ids) - logits).max())
    checks["float64_true_logits_max_abs_diff"] = float(f"{true64:.3e}")
    if true64 > MAX_TRUE_F64_DIFF:
        raise RuntimeError(f"{name}: float32 reference is {true64} from float64")
    npd = float(np.abs(numpy_forward(out, input_ids) - logits).max())
    checks["numpy_float64_independent_logits_max_abs_diff"] = float(f"{npd:.3e}")
    if npd > 2 * MAX_TRUE_F64_DIFF:
        raise RuntimeError(f"{name}: independent numpy forward differs from the reference by {npd}")
    if manual64 != greedy:
        raise RuntimeError(f"{name}: float64 greedy differs from float32 greedy")
    del m64

    reference = {
        "case": name,
        "description": spec["desc"],
        "input_ids": input_ids,
        "logits": {"file": "logits.npy", "dtype": "float32", "shape": list(logits.shape)},
        "greedy": {
            "prompt": prompt,
            "new_tokens": greedy,
            "eos_disabled": True,
            "do_sample": False,
        },
        "eos_disabled": True,
        "rope": rope_info(ref_model),
        "linear_layers": linear_layers,
        "full_attention_layers": full_layers,
        "checks": checks,
        "safetensors_layout": "; ".join(layout_notes) if layout_notes else "as written by save_pretrained",
        "weights": "random O(1): embeddings N(0,1); x*(1+w) RMSNorms w=0.3N; plain x*w norms (incl. GDN "
        "gated norm) 1+0.3N; biases 0.3N; linear/conv/expert weights N(0,(2/sqrt(fan_in))^2); "
        "A_log=log(U(0.05,1)); dt_bias 0.5N; rounded to bf16 (except tensors stored as F32, see "
        "safetensors_layout); references computed in float32 from the "
        "saved bf16 weights, attn_implementation=eager, experts_implementation=eager",
        "seed": seed,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
    }
    if not linear_layers:
        del reference["linear_layers"], reference["full_attention_layers"]
    write_json(out / "reference.json", reference)
    log(f"  {name}: seed {seed}, greedy {greedy}, checks {json.dumps(checks)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", choices=list(CASES), help="build only these cases")
    args = ap.parse_args()
    log(f"transformers {transformers.__version__}, torch {torch.__version__}")
    TINY_DIR.mkdir(parents=True, exist_ok=True)
    for name in args.only or CASES:
        log(f"tiny/{name}")
        build_case(name)


if __name__ == "__main__":
    sys.exit(main())
