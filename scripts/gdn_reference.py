#!/usr/bin/env python3
"""Independent float64 reference of the Gated DeltaNet (GDN) recurrence core.

    /work/venv/bin/python scripts/gdn_reference.py            # write tests/fixtures/gdn/, then cross-check
    /work/venv/bin/python scripts/gdn_reference.py --no-check # skip the transformers cross-check

Written from the math in pure numpy (float64); transformers is only used, optionally, afterwards
to cross-check against its `torch_recurrent_gated_delta_rule` / `torch_chunk_gated_delta_rule`
(differences are printed, not stored). Deterministic: fixed seed, byte-identical output.

Core of one linear-attention layer, after the causal conv + SiLU and before the gated norm:

    inputs   q, k [T, nk, dk]   v [T, nv, dv]   a, b [T, nv]   A_log, dt_bias [nv]
    beta_t   = sigmoid(b_t)                                  [nv]
    g_t      = -exp(A_log) * softplus(a_t + dt_bias)         [nv]   (log of the per-step decay)
    q, k     : L2-normalised over dk: x * 1/sqrt(sum(x^2) + 1e-6); then q *= 1/sqrt(dk)
    value head h uses key/query head h // (nv / nk)          (repeat_interleave, not tiling)
    S_h      = 0 [dk, dv]
    per t, per value head h (with kk = k_t[h // r], qq = q_t[h // r]):
        S_h    = S_h * exp(g_t[h])
        kv_mem = kk @ S_h                                    [dv]
        delta  = (v_t[h] - kv_mem) * beta_t[h]
        S_h    = S_h + outer(kk, delta)
        o_t[h] = qq @ S_h                                    [dv]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "gdn"

SEED = 20250717
T, NK, NV, DK, DV = 300, 2, 4, 16, 24
T_MID = 150  # also store the state after the first T_MID tokens (prefill / continue hand-off)
L2_EPS = 1e-6


def make_inputs(seed: int = SEED) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    f32 = np.float32
    return {
        "q": rng.standard_normal((T, NK, DK)).astype(f32),
        "k": rng.standard_normal((T, NK, DK)).astype(f32),
        "v": rng.standard_normal((T, NV, DV)).astype(f32),
        "a": (1.5 * rng.standard_normal((T, NV))).astype(f32),
        "b": (1.5 * rng.standard_normal((T, NV))).astype(f32),
        # A = exp(A_log) spread over [0.02, 1.5]: per-step decays from ~0.99 down to ~0.01.
        "A_log": np.log(np.array([0.02, 0.12, 0.5, 1.5]) * np.exp(0.1 * rng.standard_normal(NV))).astype(f32),
        "dt_bias": (0.5 * rng.standard_normal(NV)).astype(f32),
    }


def softplus(x: np.ndarray) -> np.ndarray:
    # torch.nn.functional.softplus (beta 1, threshold 20): x for x > 20, else log1p(exp(x)).
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def l2norm(x: np.ndarray, eps: float = L2_EPS) -> np.ndarray:
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + eps)


def gdn_core(q, k, v, a, b, A_log, dt_bias, t_mid: int | None = None):
    """float64 gated delta rule; returns (o [T, nv, dv], final state [nv, dk, dv], state after t_mid, g, beta)."""
    q, k, v, a, b, A_log, dt_bias = (np.asarray(x, dtype=np.float64) for x in (q, k, v, a, b, A_log, dt_bias))
    t_len, nk, dk = k.shape
    nv, dv = v.shape[1:]
    r = nv // nk
    beta = sigmoid(b)
    g = -np.exp(A_log)[None, :] * softplus(a + dt_bias[None, :])
    qn = l2norm(q) / np.sqrt(dk)
    kn = l2norm(k)
    state = np.zeros((nv, dk, dv))
    o = np.zeros((t_len, nv, dv))
    mid = None
    for t in range(t_len):
        for h in range(nv):
            kk, qq = kn[t, h // r], qn[t, h // r]
            state[h] *= np.exp(g[t, h])
            kv_mem = kk @ state[h]
            delta = (v[t, h] - kv_mem) * beta[t, h]
            state[h] += np.outer(kk, delta)
            o[t, h] = qq @ state[h]
        if t_mid is not None and t + 1 == t_mid:
            mid = state.copy()
    return o, state, mid, g, beta


def dump_json(obj: dict) -> str:
    """Top-level keys one per line; dict values one entry per line; lists compact."""
    c = lambda x: json.dumps(x, separators=(", ", ": "))  # noqa: E731
    lines = []
    for k, v in obj.items():
        if isinstance(v, dict):
            inner = ",\n".join(f"  {c(kk)}: {c(vv)}" for kk, vv in v.items())
            lines.append(f" {c(k)}: {{\n{inner}\n }}")
        elif isinstance(v, list) and v and isinstance(v[0], str):
            inner = ",\n".join(f"  {c(x)}" for x in v)
            lines.append(f" {c(k)}: [\n{inner}\n ]")
        else:
            lines.append(f" {c(k)}: {c(v)}")
    text = "{\n" + ",\n".join(lines) + "\n}\n"
    assert json.loads(text) == obj
    return text


def save_npy(path: Path, arr: np.ndarray) -> None:
    np.save(path, np.ascontiguousarray(arr, dtype=np.float32))


def build() -> dict[str, np.ndarray]:
    OUT.mkdir(parents=True, exist_ok=True)
    inp = make_inputs()
    o, state, mid, g, beta = gdn_core(**inp, t_mid=T_MID)
    # The continuation from the mid state must reproduce the tail (sanity check of the hand-off).
    files = {}
    for name, arr in inp.items():
        files[name] = arr
    files.update({"o": o, "final_state": state, f"state_t{T_MID}": mid, "g": g, "beta": beta})
    for name, arr in files.items():
        save_npy(OUT / f"{name}.npy", arr)
    ref = {
        "description": "Gated DeltaNet recurrence core, independent float64 numpy reference "
        "(scripts/gdn_reference.py). Inputs are float32; the reference is computed in float64 from "
        "exactly those float32 values; outputs are stored rounded to float32.",
        "seed": SEED,
        "dims": {"T": T, "num_k_heads": NK, "num_v_heads": NV, "k_head_dim": DK, "v_head_dim": DV},
        "inputs": {
            n: {"file": f"{n}.npy", "dtype": "float32", "shape": list(inp[n].shape)}
            for n in ("q", "k", "v", "a", "b", "A_log", "dt_bias")
        },
        "outputs": {
            "o": {"file": "o.npy", "dtype": "float32", "shape": list(o.shape)},
            "final_state": {"file": "final_state.npy", "dtype": "float32", "shape": list(state.shape)},
            f"state_t{T_MID}": {
                "file": f"state_t{T_MID}.npy",
                "dtype": "float32",
                "shape": list(mid.shape),
                "note": f"state after the first {T_MID} tokens (continue from it to get o[{T_MID}:])",
            },
            "g": {"file": "g.npy", "dtype": "float32", "shape": list(g.shape), "note": "intermediate"},
            "beta": {"file": "beta.npy", "dtype": "float32", "shape": list(beta.shape), "note": "intermediate"},
        },
        "semantics": [
            "beta = sigmoid(b); g = -exp(A_log) * softplus(a + dt_bias) (softplus beta 1, threshold 20)",
            "q, k L2-normalised over the head dim: x / sqrt(sum(x^2) + 1e-6); then q *= 1/sqrt(k_head_dim)",
            "value head h reads key/query head h // (num_v_heads / num_k_heads) (repeat_interleave)",
            "state S [num_v_heads, k_head_dim, v_head_dim] starts at 0; per token and value head: "
            "S *= exp(g); kv_mem = k @ S; delta = (v - kv_mem) * beta; S += outer(k, delta); o = q @ S",
            "state layout matches transformers' recurrent state [batch, num_v_heads, k_head_dim, v_head_dim]",
        ],
        "l2norm_eps": L2_EPS,
        "numpy_version": np.__version__,
    }
    (OUT / "reference.json").write_text(dump_json(ref), encoding="utf-8")
    # Hand-off check: restart from the mid state.
    tail = _continue(inp, mid, T_MID)
    assert np.abs(tail - o[T_MID:]).max() < 1e-12
    print(f"wrote {OUT} (|o| max {np.abs(o).max():.3f}, |S| max {np.abs(state).max():.3f})", file=sys.stderr)
    return {"o64": o, "state64": state, **inp}


def _continue(inp, state0, t0):
    q, k, v, a, b = (inp[n][t0:].astype(np.float64) for n in ("q", "k", "v", "a", "b"))
    A_log, dt_bias = inp["A_log"].astype(np.float64), inp["dt_bias"].astype(np.float64)
    r = NV // NK
    beta, g = sigmoid(b), -np.exp(A_log) * softplus(a + dt_bias)
    qn, kn = l2norm(q) / np.sqrt(DK), l2norm(k)
    s = state0.copy()
    o = np.zeros((len(q), NV, DV))
    for t in range(len(q)):
        for h in range(NV):
            s[h] *= np.exp(g[t, h])
            s[h] += np.outer(kn[t, h // r], (v[t, h] - kn[t, h // r] @ s[h]) * beta[t, h])
            o[t, h] = qn[t, h // r] @ s[h]
    return o


def cross_check(res: dict) -> None:
    """Compare with transformers' torch implementations (not stored)."""
    import inspect

    import torch
    import torch.nn.functional as F
    from transformers.models.qwen3_next import modeling_qwen3_next as mq

    x = {n: torch.from_numpy(res[n]).to(torch.float64) for n in ("q", "k", "v", "a", "b", "A_log", "dt_bias")}
    g = -x["A_log"].exp() * F.softplus(x["a"] + x["dt_bias"])
    beta = x["b"].sigmoid()
    args = (x["q"][None], x["k"][None], x["v"][None])
    kw = dict(g=g[None], beta=beta[None], output_final_state=True, use_qk_l2norm_in_kernel=True)

    # transformers casts to float32 inside the kernels; also build float64 copies of their source.
    ns = dict(vars(mq))
    f64 = {}
    for fn in ("torch_recurrent_gated_delta_rule", "torch_chunk_gated_delta_rule"):
        src = inspect.getsource(getattr(mq, fn))
        src = "\n".join(line for line in src.splitlines() if not line.lstrip().startswith("@"))
        exec(src.replace("torch.float32", "torch.float64"), ns)
        f64[fn] = ns[fn]
    for label, fn in (
        ("recurrent (as shipped, float32 inside)", mq.torch_recurrent_gated_delta_rule),
        ("chunk (as shipped, float32 inside)", mq.torch_chunk_gated_delta_rule),
        ("recurrent (float64 source copy)", f64["torch_recurrent_gated_delta_rule"]),
        ("chunk (float64 source copy)", f64["torch_chunk_gated_delta_rule"]),
    ):
        with torch.no_grad():
            o, s = fn(*args, **kw)
        do = float(np.abs(o[0].double().numpy() - res["o64"]).max())
        ds = float(np.abs(s[0].double().numpy() - res["state64"]).max())
        print(f"  transformers {label}: max|o diff| {do:.3e}, max|state diff| {ds:.3e}", file=sys.stderr)
    # The head mapping matters: tiling (value head h -> key head h % nk) instead gives a different result.
    tiled = gdn_core(
        np.tile(res["q"], (1, NV // NK, 1)), np.tile(res["k"], (1, NV // NK, 1)),
        res["v"], res["a"], res["b"], res["A_log"], res["dt_bias"],
    )[0]
    print(f"  (tiled head mapping h % nk would differ by {np.abs(tiled - res['o64']).max():.3e})", file=sys.stderr)
    ro = np.load(OUT / "o.npy").astype(np.float64)
    print(f"  stored float32 o vs float64: {np.abs(ro - res['o64']).max():.3e}", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-check", action="store_true", help="skip the transformers cross-check")
    args = ap.parse_args()
    res = build()
    if not args.no_check:
        cross_check(res)


if __name__ == "__main__":
    main()
