#!/usr/bin/env python3
"""Independent float64 reference of the Qwen3-Next / Qwen3.5 multi-token-prediction (MTP) head.

    /work/venv/bin/python scripts/mtp_reference.py                 # all three cases
    /work/venv/bin/python scripts/mtp_reference.py --only qwen3_5  # one case (repeatable)

transformers does not run the `mtp.*` layers, so the MTP math here is written from the semantics of
vLLM's MTP model files and its spec-decode proposer (see docs/mtp_notes.md); it reads only the
fixture's config.json and model.safetensors (plus, for qwen3_next, mtp.safetensors, see below).
The target model's hidden states come from transformers (the tensor vLLM hands to the MTP head:
the output of the final `norm`, i.e. what `lm_head` is applied to).

Writes, per case, tests/fixtures/tiny/<case>/:

* mtp.json        -- documented reference values (schema in the "fields" entry of the file itself)
* mtp_logits.npy  -- float32 [n_tokens, vocab]: MTP prefill logits for every prompt position
* mtp.safetensors -- qwen3_next only: that fixture's model.safetensors has no mtp.* tensors (the
                     hybrid fixture script adds fake ones only to the Qwen3.5 cases), so random
                     MoE mtp.* tensors are generated here (fake_mtp of make_fixtures_hybrid.py,
                     seed = reference.json seed + 1, split into the per-expert hub names that the
                     published Qwen3-Next checkpoints use). If model.safetensors ever gains mtp.*
                     tensors they are used instead and this file is not written. With it comes
                     model.safetensors.index.json naming both shards, as hub checkpoints do.

Semantics (vLLM, method "mtp"; T prompt tokens t_0..t_{T-1}, target post-norm hidden h_0..h_{T-1},
g = target greedy token after t_{T-1}):

* MTP slot i (i < T) = token t_{i+1} (t_T := g) fused with h_i, RoPE position i; the MTP layer's
  causal attention sees slots 0..i (its own KV cache, filled during the prompt "prefill").
* x = fc([rms_e(embed(tok)) , rms_h(h)])  (embedding half first), one full-attention decoder layer
  (input_layernorm, gated attention, post_attention_layernorm, MLP or MoE), y = mtp.norm(x);
  logits = lm_head(y) with the target's lm_head (tied: the target's embed_tokens).
* chain: d_1 = argmax logits(slot T-1); draft step j >= 2 feeds token d_{j-1}, hidden y of the
  previous MTP step (after mtp.norm), position T-2+j, attending to all earlier MTP slots.

Deterministic: running twice gives byte-identical files.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent

_spec = importlib.util.spec_from_file_location("make_fixtures_hybrid", ROOT / "scripts" / "make_fixtures_hybrid.py")
mh = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mh)  # also loads make_fixtures.py, which sets the determinism knobs

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402

np_rms, np_silu, np_sigmoid, np_mlp = mh.np_rms, mh.np_silu, mh.np_sigmoid, mh.np_mlp

CASES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
K_DRAFT = 3
FULL_LOGIT_ROWS = "first, middle (T//2) and last prompt slot"


# ---------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------


def read_f64(path: Path, keep) -> dict:
    W = {}
    with safe_open(str(path), "pt") as f:
        for k in f.keys():
            if keep(k):
                W[k] = f.get_tensor(k).to(torch.float64).numpy()
    return W


def make_qwen3_next_mtp(d: Path, cfg: dict, seed: int) -> dict:
    """Random MoE mtp.* tensors (bf16) for the qwen3_next fixture, per-expert hub names."""
    fused = mh.fake_mtp(SimpleNamespace(**cfg), seed, moe=True)
    out = {}
    for k, v in fused.items():
        if k.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H], gate rows first
            pre, half = k[: -len("gate_up_proj")], v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{pre}{e}.gate_proj.weight"] = v[e, :half].clone()
                out[f"{pre}{e}.up_proj.weight"] = v[e, half:].clone()
        elif k.endswith("mlp.experts.down_proj"):  # [E, H, I]
            pre = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{pre}{e}.down_proj.weight"] = v[e].clone()
        else:
            out[k] = v
    mh.write_st(d / "mtp.safetensors", out)
    # The hub layout: an index naming both shards, so loaders find the head.
    with safe_open(str(d / "model.safetensors"), "np") as f:
        names = {k: "model.safetensors" for k in f.keys()}
    names.update({k: "mtp.safetensors" for k in out})
    index = {
        "metadata": {"note": "the hub layout: the multi-token-prediction head (mtp.*, written by scripts/mtp_reference.py) in a shard of its own"},
        "weight_map": dict(sorted(names.items())),
    }
    (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return out


def load_weights(d: Path, cfg: dict, seed: int) -> tuple[dict, str]:
    W = read_f64(d / "model.safetensors", lambda k: not k.startswith("model.visual."))
    if any(k.startswith("mtp.") for k in W):
        return W, "model.safetensors"
    tc = cfg.get("text_config", cfg)
    gen = make_qwen3_next_mtp(d, tc, seed + 1)
    W.update({k: v.to(torch.float64).numpy() for k, v in gen.items()})
    return W, "mtp.safetensors (generated by this script: fake_mtp(moe=True), seed = reference seed + 1)"


# ---------------------------------------------------------------------------
# MTP head (float64 numpy)
# ---------------------------------------------------------------------------


def rope(x, pos, inv_freq, mrope_section=None):
    """x [T, heads, hd]; NeoX halves on the first 2*len(inv_freq) dims, explicit positions: [T],
    or [T, 3] (temporal, height, width) with Qwen3.5's interleaved multimodal sections, where
    frequency j takes the height position if j % 3 == 1 and j < 3 * section[1], the width
    position if j % 3 == 2 and j < 3 * section[2], else the temporal one."""
    rd = 2 * len(inv_freq)
    pos = np.asarray(pos, dtype=np.float64)
    if pos.ndim == 2:
        comp = np.zeros(len(inv_freq), dtype=int)
        for c in (1, 2):
            comp[c : 3 * mrope_section[c] : 3] = c
        f = pos[:, comp] * inv_freq[None, :]
    else:
        f = pos[:, None] * inv_freq[None, :]
    cos = np.cos(np.concatenate([f, f], -1))[:, None, :]
    sin = np.sin(np.concatenate([f, f], -1))[:, None, :]
    xr, xp = x[..., :rd], x[..., rd:]
    rot = np.concatenate([-xr[..., rd // 2 :], xr[..., : rd // 2]], -1)
    return np.concatenate([xr * cos + rot * sin, xp], -1)


class MTPHead:
    """One MTP layer with its own KV cache. `step` appends a block of slots (causal within it)."""

    def __init__(self, W: dict, cfg: dict, variant: dict | None = None):
        self.W, self.c = W, cfg.get("text_config", cfg)
        self.v = variant or {}
        pre = "model.language_model." if "text_config" in cfg else "model."
        self.embed = W[pre + "embed_tokens.weight"]
        self.lm_head = W.get("lm_head.weight", self.embed)
        c = self.c
        rp = c["rope_parameters"]
        rd = int(c["head_dim"] * rp.get("partial_rotary_factor", 1.0))
        self.inv_freq = 1.0 / rp["rope_theta"] ** (np.arange(0, rd, 2, dtype=np.float64) / rd)
        self.mrope_section = rp.get("mrope_section")
        if self.mrope_section is not None and not rp.get("mrope_interleaved", True):
            raise NotImplementedError("only Qwen3.5's interleaved multimodal sections")
        self.eps = c["rms_norm_eps"]
        self.renorm = bool(c.get("norm_topk_prob", True))  # vLLM: renormalize=getattr(cfg, "norm_topk_prob", True)
        self.K = np.zeros((0, c["num_key_value_heads"], c["head_dim"]))
        self.V = np.zeros_like(self.K)
        self.router_gaps: list[float] = []

    def norm(self, x, name):
        return np_rms(x, self.W[name], self.eps, True)  # zero-centred x * (1 + w) everywhere

    def attn(self, x, pos):
        W, c, p = self.W, self.c, "mtp.layers.0.self_attn."
        T, nh, nkv, hd = x.shape[0], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        qg = (x @ W[p + "q_proj.weight"].T).reshape(T, nh, 2 * hd)  # per head [query | gate]
        q, gate = qg[..., :hd], qg[..., hd:].reshape(T, nh * hd)
        k = (x @ W[p + "k_proj.weight"].T).reshape(T, nkv, hd)
        v = (x @ W[p + "v_proj.weight"].T).reshape(T, nkv, hd)
        q = rope(np_rms(q, W[p + "q_norm.weight"], self.eps, True), pos, self.inv_freq, self.mrope_section)
        k = rope(np_rms(k, W[p + "k_norm.weight"], self.eps, True), pos, self.inv_freq, self.mrope_section)
        n0 = self.K.shape[0]
        self.K = np.concatenate([self.K, k], 0)
        self.V = np.concatenate([self.V, v], 0)
        S = self.K.shape[0]
        mask = np.zeros((T, S))
        mask[:, n0:] = np.triu(np.full((T, T), -np.inf), 1)  # old slots all visible, causal in block
        r = nh // nkv
        out = np.zeros((T, nh, hd))
        for h in range(nh):
            s = q[:, h] @ self.K[:, h // r].T / np.sqrt(hd) + mask
            s = np.exp(s - s.max(-1, keepdims=True))
            out[:, h] = (s / s.sum(-1, keepdims=True)) @ self.V[:, h // r]
        out = out.reshape(T, nh * hd) * np_sigmoid(gate)
        return out @ W[p + "o_proj.weight"].T

    def moe(self, x):
        W, c, p = self.W, self.c, "mtp.layers.0.mlp."
        k = c["num_experts_per_tok"]
        # The router's gap between the k-th and the next expert (near-ties).
        srt = -np.sort(-(x @ W[p + "gate.weight"].T), -1)
        self.router_gaps += [float(g) for g in srt[:, k - 1] - srt[:, k]]
        return mh.np_moe(x, W, p, c, self.renorm)

    def step(self, tokens, hidden, pos, inputs=None):
        """tokens [T], hidden [T, H] (target post-norm hidden, or previous MTP output), pos [T] or
        [T, 3]; `inputs` [T, H]: the rows' input embeddings where given (a prompt's image tokens
        take the vision tower's output, as the target's rows do), else looked up by token."""
        emb = self.embed[np.asarray(tokens)] if inputs is None else np.asarray(inputs)
        e = self.norm(emb, "mtp.pre_fc_norm_embedding.weight")
        h = self.norm(np.asarray(hidden), "mtp.pre_fc_norm_hidden.weight")
        cat = np.concatenate([h, e] if self.v.get("swap_concat") else [e, h], -1)
        x = cat @ self.W["mtp.fc.weight"].T
        x = x + self.attn(self.norm(x, "mtp.layers.0.input_layernorm.weight"), pos)
        hn = self.norm(x, "mtp.layers.0.post_attention_layernorm.weight")
        x = x + (self.moe(hn) if "mtp.layers.0.mlp.gate.weight" in self.W else np_mlp(hn, self.W, "mtp.layers.0.mlp."))
        y = self.norm(x, "mtp.norm.weight")
        return y, x, y @ self.lm_head.T  # (post-norm output, pre-norm residual, logits)


def run_mtp(W, cfg, ids, hid, g, k, variant=None):
    """Prefill over the prompt slots, then a greedy chain of k drafts. Returns a dict of arrays."""
    v = variant or {}
    T = len(ids)
    head = MTPHead(W, cfg, v)
    off = 1 if v.get("positions_plus_one") else 0  # a uniform shift: RoPE is relative, must not matter
    toks = list(ids[1:]) + [g]
    y, x, logits = head.step(toks, hid, np.arange(T) + off)
    drafts, chain_logits, chain_y, chain_in = [int(np.argmax(logits[-1]))], [logits[-1]], [y[-1]], []
    fb = x[-1] if v.get("chain_prenorm_feedback") else y[-1]
    for j in range(1, k):
        pos = T - 1 + off + (0 if v.get("chain_position_not_advanced") else j)
        chain_in.append({"token": drafts[-1], "position": int(pos - off)})
        yj, xj, lj = head.step([drafts[-1]], fb[None], np.array([pos]))
        drafts.append(int(np.argmax(lj[0])))
        chain_logits.append(lj[0])
        chain_y.append(yj[0])
        fb = xj[0] if v.get("chain_prenorm_feedback") else yj[0]
    return dict(
        toks=toks, y=y, logits=logits, drafts=drafts, chain_logits=np.stack(chain_logits),
        chain_y=np.stack(chain_y), chain_in=chain_in, router_gaps=head.router_gaps,
    )


def full_recompute(W, cfg, ids, hid, g, res):
    """No-cache check: one causal forward over prompt slots + chain slots must equal the cached run."""
    T = len(ids)
    toks = list(ids[1:]) + [g] + res["drafts"][:-1]
    hids = np.concatenate([hid, res["chain_y"][:-1]], 0)
    _, _, logits = MTPHead(W, cfg).step(toks, hids, np.arange(len(toks)))
    ref = np.concatenate([res["logits"], res["chain_logits"][1:]], 0)
    return float(np.abs(logits - ref).max()), T


# ---------------------------------------------------------------------------
# Target hidden states from transformers
# ---------------------------------------------------------------------------


def target_hidden(d: Path, name: str, ids: list[int]):
    """Post-final-norm hidden states (what vLLM's Qwen3NextModel.forward returns), f32 and f64."""
    spec = mh.CASES[name]
    model, _ = mh.load_ref(d, spec)  # float32, eager, from the bf16 file
    res = {}
    for tag, m in (("f32", model), ("f64", copy.deepcopy(model).to(torch.float64))):
        captured = {}
        norm = mh.text_model(m).norm
        hook = norm.register_forward_hook(lambda mod, inp, out: captured.update(pre=inp[0], post=out))
        ctx = mh.true_float64(m) if tag == "f64" else None
        try:
            if ctx:
                ctx.__enter__()
            with torch.no_grad():
                out = m(torch.tensor(ids)[None], output_hidden_states=True)
        finally:
            if ctx:
                ctx.__exit__(None, None, None)
            hook.remove()
        hs_last = out.hidden_states[-1][0]
        post = captured["post"][0]
        if not torch.equal(hs_last, post):
            raise RuntimeError(f"{name}/{tag}: hidden_states[-1] is not the final-norm output")
        lm = m.lm_head.weight.detach()
        lm_diff = float((post @ lm.T - out.logits[0]).abs().max())
        if lm_diff > (1e-4 if tag == "f32" else 1e-10):
            raise RuntimeError(f"{name}/{tag}: lm_head(final-norm output) != logits ({lm_diff})")
        res[tag] = dict(
            post=post.double().numpy(), pre=captured["pre"][0].double().numpy(), logits=out.logits[0].double().numpy()
        )
    return res


# ---------------------------------------------------------------------------
# Case
# ---------------------------------------------------------------------------


def top2_margin(row) -> float:
    s = np.sort(row)
    return float(s[-1] - s[-2])


def fl(a) -> list:
    return [float(x) for x in np.asarray(a).ravel()]


def build(name: str) -> None:
    d = mh.TINY_DIR / name
    cfg = json.loads((d / "config.json").read_text(encoding="utf-8"))
    ref = json.loads((d / "reference.json").read_text(encoding="utf-8"))
    ids = [int(x) for x in ref["input_ids"]]
    T = len(ids)
    W, mtp_source = load_weights(d, cfg, int(ref["seed"]))

    th = target_hidden(d, name, ids)
    hid = th["f64"]["post"]
    tlog = th["f64"]["logits"]
    g = int(np.argmax(tlog[-1]))
    fixture_logits = np.load(d / "logits.npy")
    if int(np.argmax(fixture_logits[-1])) != g:
        raise RuntimeError(f"{name}: f64 target greedy token differs from logits.npy")
    np_logits = mh.numpy_forward(d, ids)  # independent numpy target forward (reads no mtp.*)
    lm = W.get("lm_head.weight", W[("model.language_model." if "text_config" in cfg else "model.") + "embed_tokens.weight"])
    numpy_vs_hidden = float(np.abs(np_logits - hid @ lm.T).max())
    if numpy_vs_hidden > 1e-4:
        raise RuntimeError(f"{name}: numpy target forward vs transformers hidden: {numpy_vs_hidden}")

    res = run_mtp(W, cfg, ids, hid, g, K_DRAFT)
    recompute_diff, _ = full_recompute(W, cfg, ids, hid, g, res)
    if recompute_diff > 1e-10:
        raise RuntimeError(f"{name}: cached MTP chain != full recompute ({recompute_diff})")
    res32 = run_mtp(W, cfg, ids, th["f32"]["post"], g, K_DRAFT)

    # Wrong semantics, to show the fixture tells them apart (max-abs logit change, argmax agreement).
    def contrast(r):
        return {
            "prefill_logits_max_abs_diff": float(np.abs(r["logits"] - res["logits"]).max()),
            "prefill_argmax_agreement": float(np.mean(r["logits"].argmax(-1) == res["logits"].argmax(-1))),
            "chain_logits_max_abs_diff": float(np.abs(r["chain_logits"] - res["chain_logits"]).max()),
            "chain_drafts": r["drafts"],
        }

    variants = {
        "swap_concat (hidden half first)": run_mtp(W, cfg, ids, hid, g, K_DRAFT, {"swap_concat": True}),
        "target hidden before the final norm": run_mtp(W, cfg, ids, th["f64"]["pre"], g, K_DRAFT),
        "all positions + 1 (uniform shift; RoPE is relative so this must not matter)": run_mtp(
            W, cfg, ids, hid, g, K_DRAFT, {"positions_plus_one": True}
        ),
        "chain steps reuse position T-1 (position not advanced)": run_mtp(
            W, cfg, ids, hid, g, K_DRAFT, {"chain_position_not_advanced": True}
        ),
        "chain feeds MTP output before mtp.norm": run_mtp(W, cfg, ids, hid, g, K_DRAFT, {"chain_prenorm_feedback": True}),
    }

    L = res["logits"]
    rows = [0, T // 2, T - 1]
    margins = [top2_margin(r) for r in L]
    chain_margins = [top2_margin(r) for r in res["chain_logits"]]
    np.save(d / "mtp_logits.npy", np.ascontiguousarray(L, dtype=np.float32))

    out = {
        "case": name,
        "description": (
            "MTP (multi-token prediction) head reference, float64 numpy (scripts/mtp_reference.py), semantics of "
            "vLLM qwen3_next_mtp.py / qwen3_5_mtp.py + v1/spec_decode/eagle.py (method mtp); see docs/mtp_notes.md."
        ),
        "fields": {
            "mtp_weights": "where the mtp.* tensors were read from",
            "input_ids": "the prompt = reference.json input_ids (T tokens)",
            "target": "target model: greedy next token g after the prompt (argmax of its last-position logits) and "
            "its top-2 margin; hidden = final-norm output (input of lm_head) from transformers, float64 "
            "(make_fixtures_hybrid.true_float64), rows listed in hidden_rows; per-position max|h| and L2 norm",
            "mtp_prefill": "slot i = (token mtp_input_ids[i] = input_ids[i+1], last slot = g) fused with target hidden of "
            "position i, RoPE position positions[i] = i, causal attention over slots 0..i. logits_rows: full float64 "
            "logits of slots `rows`; argmax / top2_margin / max_abs: per slot 0..T-1; full logits of all slots in "
            "mtp_logits.npy (float32 [T, vocab]); output_rows: the MTP output after mtp.norm for `rows`",
            "chain": "k greedy drafts: drafts[0] = argmax of prefill slot T-1; step j>=1 input = token drafts[j-1], "
            "hidden = MTP output (after mtp.norm) of the previous step, position T-1+j, attending all earlier "
            "slots; logits[j] full float64 logits, outputs[j] the step's MTP output after mtp.norm",
            "checks": "self-checks and sensitivities (see keys)",
            "wrong_semantics": "what changes if a convention is flipped (for test design)",
        },
        "mtp_weights": mtp_source,
        "input_ids": ids,
        "target": {
            "greedy_next_token": g,
            "greedy_top2_margin": top2_margin(tlog[-1]),
            "hidden_rows": rows,
            "hidden": [fl(hid[r]) for r in rows],
            "hidden_max_abs": [float(np.abs(h).max()) for h in hid],
            "hidden_l2": [float(np.linalg.norm(h)) for h in hid],
        },
        "mtp_prefill": {
            "mtp_input_ids": [int(t) for t in res["toks"]],
            "positions": list(range(T)),
            "rows": rows,
            "rows_are": FULL_LOGIT_ROWS,
            "logits_rows": [fl(L[r]) for r in rows],
            "output_rows": [fl(res["y"][r]) for r in rows],
            "argmax": [int(x) for x in L.argmax(-1)],
            "top2_margin": margins,
            "max_abs": [float(np.abs(r).max()) for r in L],
            "logits_file": "mtp_logits.npy",
        },
        "chain": {
            "k": K_DRAFT,
            "first_input": {"token": g, "position": T - 1, "hidden": "target hidden of position T-1"},
            "step_inputs": [
                dict(ci, hidden="MTP output (after mtp.norm) of the previous step") for ci in res["chain_in"]
            ],
            "drafts": res["drafts"],
            "top2_margin": chain_margins,
            "logits": [fl(r) for r in res["chain_logits"]],
            "outputs": [fl(r) for r in res["chain_y"]],
        },
        "checks": {
            "numpy_target_logits_vs_lm_head_of_hidden_max_abs_diff": numpy_vs_hidden,
            "target_hidden_f32_vs_f64_max_abs_diff": float(np.abs(th["f32"]["post"] - hid).max()),
            "cached_chain_vs_full_recompute_max_abs_diff": recompute_diff,
            "mtp_logits_with_f32_target_hidden_max_abs_diff": float(np.abs(res32["logits"] - L).max()),
            "mtp_chain_with_f32_target_hidden": res32["drafts"],
            "min_prefill_top2_margin": min(margins),
            "min_chain_top2_margin": min(chain_margins),
            "min_router_gap": min(res["router_gaps"]) if res["router_gaps"] else None,
        },
        "wrong_semantics": {k: contrast(v) for k, v in variants.items()},
        "torch_version": torch.__version__,
        "transformers_version": mh.transformers.__version__,
    }
    mh.write_json(d / "mtp.json", out)
    mh.log(
        f"  {name}: g={g} drafts={res['drafts']} min margin prefill {min(margins):.4f} chain "
        f"{min(chain_margins):.4f}, router gap {out['checks']['min_router_gap']}, numpy diff {numpy_vs_hidden:.2e}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", choices=list(CASES))
    args = ap.parse_args()
    for name in args.only or CASES:
        mh.log(f"mtp {name}")
        build(name)


if __name__ == "__main__":
    sys.exit(main())
