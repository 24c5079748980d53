#!/usr/bin/env python3
"""float64 numpy forward pass of a llama-architecture GGUF (SmolLM2-135M), for calibration only.

Dequantizes the GGUF weights exactly (gguf-py from the llama.cpp tree) and runs the
plain transformer math in float64 -- no activation quantization, no f16 KV cache, no
flash attention. Used by scripts/llamacpp_reference.sh to validate the "exact" reference (llama.cpp run on
an all-F32 dequantized copy of the GGUF with flash attention off and an f32 KV cache).

Usage: numpy_ref.py MODEL.gguf IDS(comma-separated) OUT.npy   (needs numpy; PYTHONPATH=<llama.cpp>/gguf-py)
"""
import sys

import numpy as np
import gguf


def load(path):
    r = gguf.GGUFReader(path)
    kv = {}
    for k, f in r.fields.items():
        try:
            kv[k] = f.contents()
        except Exception:
            pass
    w = {}
    for t in r.tensors:
        a = gguf.quants.dequantize(t.data, t.tensor_type)
        w[t.name] = np.asarray(a, dtype=np.float64).reshape([int(x) for x in reversed(t.shape.tolist())])
    return kv, w


def forward(kv, w, ids):
    arch = kv["general.architecture"]
    n_layer = int(kv[f"{arch}.block_count"])
    n_head = int(kv[f"{arch}.attention.head_count"])
    n_head_kv = int(kv[f"{arch}.attention.head_count_kv"])
    eps = float(kv[f"{arch}.attention.layer_norm_rms_epsilon"])
    base = float(kv[f"{arch}.rope.freq_base"])
    emb = w["token_embd.weight"]  # [n_vocab, n_embd]
    n_embd = emb.shape[1]
    hd = n_embd // n_head
    T = len(ids)

    def rms(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g

    # llama.cpp LLAMA_ROPE_TYPE_NORM: rotate adjacent pairs (x[2i], x[2i+1])
    pos = np.arange(T)[:, None]
    inv = base ** (-np.arange(0, hd, 2) / hd)
    ang = pos * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

    def rope(x):  # [T, H, hd]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x0 * cos - x1 * sin
        out[..., 1::2] = x0 * sin + x1 * cos
        return out

    mask = np.triu(np.full((T, T), -np.inf), 1)
    x = emb[np.array(ids)]
    for l in range(n_layer):
        p = f"blk.{l}."
        h = rms(x, w[p + "attn_norm.weight"])
        q = (h @ w[p + "attn_q.weight"].T).reshape(T, n_head, hd)
        k = (h @ w[p + "attn_k.weight"].T).reshape(T, n_head_kv, hd)
        v = (h @ w[p + "attn_v.weight"].T).reshape(T, n_head_kv, hd)
        q, k = rope(q), rope(k)
        rep = n_head // n_head_kv
        att = np.empty((T, n_head, hd))
        for hh in range(n_head):
            kh = hh // rep
            s = q[:, hh, :] @ k[:, kh, :].T / np.sqrt(hd) + mask
            s = np.exp(s - s.max(-1, keepdims=True))
            s /= s.sum(-1, keepdims=True)
            att[:, hh, :] = s @ v[:, kh, :]
        x = x + att.reshape(T, n_embd) @ w[p + "attn_output.weight"].T
        h = rms(x, w[p + "ffn_norm.weight"])
        g = h @ w[p + "ffn_gate.weight"].T
        u = h @ w[p + "ffn_up.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ w[p + "ffn_down.weight"].T
    x = rms(x, w["output_norm.weight"])
    out_w = w.get("output.weight", emb)
    return x @ out_w.T


if __name__ == "__main__":
    model, ids, out = sys.argv[1], [int(t) for t in sys.argv[2].split(",")], sys.argv[3]
    kv, w = load(model)
    np.save(out, forward(kv, w, ids))
