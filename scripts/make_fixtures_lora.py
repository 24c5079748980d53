#!/usr/bin/env python3
"""LoRA adapter fixtures: random (non-zero) PEFT adapters on the tiny models
of tests/fixtures/tiny, with references computed by peft + transformers in
float32.

    /work/venv-ref/bin/python scripts/make_fixtures_lora.py

Requirements: scripts/requirements-fixtures.txt plus `peft`.

For each case, tests/fixtures/lora/<case>/ holds:

* adapter_config.json, adapter_model.safetensors: the adapter as
  `PeftModel.save_pretrained` writes it (the base model is
  tests/fixtures/tiny/<base>);
* mlx/adapter_config.json, mlx/adapters.safetensors: the same weights in
  mlx-lm's adapter format (`lora_a` = Aᵀ, `lora_b` = Bᵀ, one `scale`), for
  the cases whose scaling one number can express;
* tests/fixtures/lora_gguf/smollm2_q4_1: an adapter on a llama GGUF whose
  q/k rows llama.cpp permuted (see make_gguf_llama);
* logits.npy: float32 logits of reference.json's input_ids through the
  adapted model (eager attention), and the greedy continuation of its
  prompt, with the smallest top-1/top-2 margin seen.

Deterministic: running twice gives the same files.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "fixtures" / "tiny"
OUT = ROOT / "tests" / "fixtures" / "lora"

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]

# (case, base, target modules, extra LoraConfig fields, adapter dtype)
CASES = [
    ("qwen3_all", "qwen3", ATTN + MLP, {}, torch.float32),
    # Only some projections of each stacked group; rsLoRA and a per-module rank.
    ("qwen3_partial", "qwen3", ["q_proj", "v_proj", "up_proj", "down_proj"],
     {"use_rslora": True, "rank_pattern": {"up_proj": 2}, "alpha_pattern": {"v_proj": 3.0}}, torch.float32),
    # Biased q/k/v; the adapter stored in bf16 as most published adapters are.
    ("qwen2_bf16", "qwen2", ATTN + MLP, {}, torch.bfloat16),
    # Attention only on a MoE base (its routed experts keep their weights).
    ("qwen3_moe_attn", "qwen3_moe", ATTN, {}, torch.float32),
    # The hybrid: Gated DeltaNet's projections, attention and MLP.
    ("qwen3_5_hybrid", "qwen3_5",
     ATTN + MLP + ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"], {}, torch.float32),
    ("qwen3_next_hybrid", "qwen3_next",
     ATTN + ["in_proj_qkvz", "in_proj_ba", "out_proj"], {}, torch.float32),
]

RANK = 4
ALPHA = 8.0


def load_base(base: str):
    model = AutoModelForCausalLM.from_pretrained(TINY / base, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def randomize(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_A" in name:
            fan_in = p.shape[1]
            p.data = torch.randn(p.shape, generator=g) / math.sqrt(fan_in)
        elif "lora_B" in name:
            p.data = torch.randn(p.shape, generator=g) * 0.5 / math.sqrt(p.shape[1])


def greedy(model, prompt: list[int], n: int) -> tuple[list[int], float]:
    ids = list(prompt)
    margin = math.inf
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        top = torch.topk(logits, 2)
        margin = min(margin, float(top.values[0] - top.values[1]))
        ids.append(int(top.indices[0]))
    return ids[len(prompt):], margin


def mlx_form(state: dict, scaling: dict) -> dict | None:
    """The adapter in mlx-lm's names, or None when its modules' scalings differ."""
    scales = set(scaling.values())
    if len(scales) != 1:
        return None
    out = {}
    for k, v in state.items():
        stem = k.removeprefix("base_model.model.")
        stem = stem.replace(".default.", ".")
        if ".lora_A." in stem:
            out[stem.replace(".lora_A.weight", ".lora_a")] = v.t().contiguous()
        elif ".lora_B." in stem:
            out[stem.replace(".lora_B.weight", ".lora_b")] = v.t().contiguous()
    return out


def make(case: str, base: str, targets: list[str], extra: dict, dtype, seed: int) -> None:
    ref = json.loads((TINY / base / "reference.json").read_text())
    model = load_base(base)
    # Keep LoRA off the vision tower and the MTP head of the hybrids: qinfer
    # adapts the decoder layers that it runs.
    pattern = r".*(?<!visual\.)(?<!mtp\.)layers\.\d+\.(self_attn|mlp|linear_attn)\.(" + "|".join(targets) + ")"
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=pattern, lora_dropout=0.0,
                        init_lora_weights=False, **extra)
    model = get_peft_model(model, config)
    randomize(model, seed)
    # The adapter's weights as stored (only those: the base's buffers, such
    # as RoPE's inverse frequencies, stay float32).
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = p.data.to(dtype).to(torch.float32)
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([ref["input_ids"]])).logits[0].float().numpy()
    prompt = ref["greedy"]["prompt"]
    new, margin = greedy(model, prompt, len(ref["greedy"]["new_tokens"]))
    d = OUT / case
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    model.save_pretrained(d, safe_serialization=True)
    if dtype != torch.float32:
        from safetensors.torch import load_file
        st = load_file(d / "adapter_model.safetensors")
        save_file({k: v.to(dtype) for k, v in st.items()}, d / "adapter_model.safetensors", metadata={"format": "pt"})
    # save_pretrained writes base_model_name_or_path as the absolute path it loaded.
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = f"tests/fixtures/tiny/{base}"
    if isinstance(cfg.get("target_modules"), list):  # a set in peft: its order varies run to run
        cfg["target_modules"] = sorted(cfg["target_modules"])
    (d / "adapter_config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    readme = d / "README.md"
    if readme.exists():
        readme.unlink()
    np.save(d / "logits.npy", logits.astype(np.float32))
    scaling = {}
    for name, module in model.named_modules():
        if hasattr(module, "scaling") and isinstance(module.scaling, dict) and "default" in module.scaling:
            scaling[name] = module.scaling["default"]
    state = {k: v.detach().to(torch.float32) for k, v in model.state_dict().items() if "lora_" in k}
    mlx = mlx_form(state, scaling)
    if mlx is not None:
        (d / "mlx").mkdir()
        save_file(mlx, d / "mlx" / "adapters.safetensors")
        layers = model.base_model.model.config.get_text_config().num_hidden_layers
        (d / "mlx" / "adapter_config.json").write_text(json.dumps({
            "fine_tune_type": "lora",
            "num_layers": layers,
            "lora_parameters": {"rank": RANK, "scale": next(iter(scaling.values())), "dropout": 0.0,
                                # Paths inside a layer, as linear_to_lora_layers matches them.
                                "keys": sorted({".".join(k.split(".")[3:-1]) for k in mlx})},
        }, indent=2, sort_keys=True) + "\n")
    (d / "reference.json").write_text(json.dumps({
        "case": case,
        "base": f"tiny/{base}",
        "input_ids": ref["input_ids"],
        "logits": {"file": "logits.npy", "dtype": "float32", "shape": list(logits.shape)},
        "greedy": {"prompt": prompt, "new_tokens": new, "min_top2_margin": round(margin, 5)},
        "adapter_dtype": str(dtype).removeprefix("torch."),
        "modules": len(scaling),
        "seed": seed,
        "peft_version": __import__("peft").__version__,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
    }, indent=1) + "\n")
    print(f"{case}: {len(scaling)} modules, greedy margin {margin:.4f}, mlx form {'yes' if mlx else 'no'}")


SMOLLM2 = Path.home() / ".cache" / "qinfer" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_OUT = ROOT / "tests" / "fixtures" / "lora_gguf" / "smollm2_q4_1"
GGUF_INPUT = [1, 9690, 314, 253, 5356, 7543, 28, 2366, 35904, 30, 378, 1115]
GGUF_ROWS = [0, 5, 11]


def make_gguf_llama() -> None:
    """An adapter on a llama GGUF (SmolLM2-135M-Instruct Q4_1, fetched by
    scripts/fetch_default_model.sh), whose q/k rows llama.cpp's converter
    permuted: transformers reads the GGUF back into Hugging Face's order
    (blocks decoded to float32) and peft applies the adapter there."""
    if not SMOLLM2.exists():
        print(f"skipping smollm2_q4_1: {SMOLLM2} is missing (scripts/fetch_default_model.sh)")
        return
    model = AutoModelForCausalLM.from_pretrained(SMOLLM2.parent, gguf_file=SMOLLM2.name, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=ATTN, lora_dropout=0.0, init_lora_weights=False)
    model = get_peft_model(model, config)
    randomize(model, 7100)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = p.data.to(torch.bfloat16).to(torch.float32)
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([GGUF_INPUT])).logits[0, GGUF_ROWS].float().numpy()
        with model.disable_adapter():
            base = model(torch.tensor([GGUF_INPUT])).logits[0, GGUF_ROWS].float().numpy()
    shutil.rmtree(GGUF_OUT, ignore_errors=True)
    GGUF_OUT.mkdir(parents=True)
    model.save_pretrained(GGUF_OUT, safe_serialization=True)
    from safetensors.torch import load_file
    st = load_file(GGUF_OUT / "adapter_model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in st.items()}, GGUF_OUT / "adapter_model.safetensors",
              metadata={"format": "pt"})
    cfg = json.loads((GGUF_OUT / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = SMOLLM2.name
    cfg["target_modules"] = sorted(cfg["target_modules"])
    (GGUF_OUT / "adapter_config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    if (GGUF_OUT / "README.md").exists():
        (GGUF_OUT / "README.md").unlink()
    np.save(GGUF_OUT / "logits.npy", logits.astype(np.float32))
    np.save(GGUF_OUT / "base_logits.npy", base.astype(np.float32))
    (GGUF_OUT / "reference.json").write_text(json.dumps({
        "base": SMOLLM2.name,
        "input_ids": GGUF_INPUT,
        "rows": GGUF_ROWS,
        "logits": {"file": "logits.npy", "shape": list(logits.shape), "with": "the adapter"},
        "base_logits": {"file": "base_logits.npy", "shape": list(base.shape), "with": "no adapter"},
        "adapter_dtype": "bfloat16",
        "note": "transformers decodes the GGUF's blocks to float32 and undoes llama.cpp's q/k row permutation",
        "peft_version": __import__("peft").__version__,
        "transformers_version": transformers.__version__,
    }, indent=1) + "\n")
    print(f"smollm2_q4_1: adapter moves logits by {float(np.abs(logits - base).max()):.3f}")


MLX_OUT = ROOT / "tests" / "fixtures" / "lora_mlx"


def make_mlx() -> None:
    """mlx-lm's own reading of the mlx-lm form: tests/fixtures/lora/qwen3_all/mlx
    loaded by `mlx_lm.load(adapter_path=...)` onto the MLX-quantized tiny Qwen3
    (tests/fixtures/mlx/qwen3_mixed_3_6, whose mixed bits keep its q/k/v
    projections apart), logits with the adapter and without."""
    try:
        import mlx.core as mx
        import mlx_lm
    except ImportError:
        print("skipping lora_mlx: mlx-lm is not installed")
        return
    base = ROOT / "tests" / "fixtures" / "mlx" / "qwen3_mixed_3_6"
    adapter = OUT / "qwen3_all" / "mlx"
    ids = json.loads((base / "reference.json").read_text())["input_ids"]
    plain, _ = mlx_lm.load(str(base))
    tuned, _ = mlx_lm.load(str(base), adapter_path=str(adapter))
    run = lambda m: np.array(m(mx.array([ids]))[0].astype(mx.float32))
    d = MLX_OUT / "qwen3_mixed_3_6"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    np.save(d / "logits.npy", run(tuned))
    np.save(d / "base_logits.npy", run(plain))
    (d / "reference.json").write_text(json.dumps({
        "base": "mlx/qwen3_mixed_3_6",
        "adapter": "lora/qwen3_all/mlx",
        "input_ids": ids,
        "mlx_lm_version": mlx_lm.__version__,
        "mlx_version": mx.__version__,
    }, indent=1) + "\n")
    print(f"lora_mlx: adapter moves logits by {float(np.abs(run(tuned) - run(plain)).max()):.3f}")


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for i, (case, base, targets, extra, dtype) in enumerate(CASES):
        make(case, base, targets, extra, dtype, 7000 + i)
    make_gguf_llama()
    make_mlx()


if __name__ == "__main__":
    main()
