#!/usr/bin/env python3
"""A random PEFT LoRA adapter for a bench config's shape (for timing
adapters on random-weight models; its numbers mean nothing):

    python3 bench/random_lora.py bench/configs/qwen3-8b.json OUT_DIR [--rank 16] [--targets q,k,v,o,gate,up,down]

Writes OUT_DIR/adapter_config.json and OUT_DIR/adapter_model.safetensors
(bf16) as peft's save_pretrained lays them out. Needs numpy only.
"""

import argparse
import json
from pathlib import Path

import numpy as np
import struct

ap = argparse.ArgumentParser()
ap.add_argument("config")
ap.add_argument("out")
ap.add_argument("--rank", type=int, default=16)
ap.add_argument("--targets", default="q,k,v,o,gate,up,down")
a = ap.parse_args()
cfg = json.loads(Path(a.config).read_text())
h, inter = cfg["hidden_size"], cfg["intermediate_size"]
hd = cfg.get("head_dim", h // cfg["num_attention_heads"])
q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
shapes = {  # module: (path, in, out)
    "q": ("self_attn.q_proj", h, q),
    "k": ("self_attn.k_proj", h, kv),
    "v": ("self_attn.v_proj", h, kv),
    "o": ("self_attn.o_proj", q, h),
    "gate": ("mlp.gate_proj", h, inter),
    "up": ("mlp.up_proj", h, inter),
    "down": ("mlp.down_proj", inter, h),
}
targets = a.targets.split(",")
rng = np.random.default_rng(0)
tensors = {}
for layer in range(cfg["num_hidden_layers"]):
    for t in targets:
        path, n_in, n_out = shapes[t]
        pre = f"base_model.model.model.layers.{layer}.{path}"
        # bf16 bits of small values (numpy has no bf16: keep the high halves).
        for name, shape, scale in [("lora_A", (a.rank, n_in), n_in**-0.5), ("lora_B", (n_out, a.rank), 0.01)]:
            x = (rng.standard_normal(shape, dtype=np.float32) * scale).view(np.uint32) >> 16
            tensors[f"{pre}.{name}.weight"] = x.astype(np.uint16)
out = Path(a.out)
out.mkdir(parents=True, exist_ok=True)
cfg_out = {
    "peft_type": "LORA",
    "r": a.rank,
    "lora_alpha": 2 * a.rank,
    "target_modules": [shapes[t][0].split(".")[1] for t in targets],
    "lora_dropout": 0.0,
    "bias": "none",
    "task_type": "CAUSAL_LM",
}
(out / "adapter_config.json").write_text(json.dumps(cfg_out, indent=1))
# The safetensors layout: a little-endian header length, the JSON header, the data.
header, blobs, at = {}, [], 0
for name, x in tensors.items():
    b = x.tobytes()
    header[name] = {"dtype": "BF16", "shape": list(x.shape), "data_offsets": [at, at + len(b)]}
    blobs.append(b)
    at += len(b)
head = json.dumps(header).encode()
head += b" " * (-len(head) % 8)
with open(out / "adapter_model.safetensors", "wb") as f:
    f.write(struct.pack("<Q", len(head)) + head)
    for b in blobs:
        f.write(b)
print(f"{len(tensors)} tensors, rank {a.rank}, {targets} -> {out}")
