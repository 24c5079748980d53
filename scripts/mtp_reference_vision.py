#!/usr/bin/env python3
"""Float64 reference of Qwen3.5's multi-token-prediction head over a prompt with images.

    /work/venv/bin/python scripts/mtp_reference_vision.py

The head's math is scripts/mtp_reference.py's (written from vLLM's qwen3_5_mtp / spec-decode
semantics); what a prompt with images adds, as vLLM's Qwen3_5MTP (SupportsMultiModal) and its
proposer run it:

* MTP slot i takes the *input embedding* of token i+1 as the target saw it: for an image token
  that is the vision tower's output for it (vLLM gathers the multimodal embeddings shifted by one
  computed token for the drafter), for other tokens the embedding table's row;
* every slot takes the target's multimodal rotary position of row i (temporal, height, width),
  and each chained draft step advances all three components of the last prompt row's by one.

The fixture is tests/fixtures/vision/qwen3_5 (scripts/make_fixtures_vision.py), prompt
`two_images`, with the processor's own pixel values. Its checkpoint has no head, so a random
dense one (make_fixtures_hybrid.fake_mtp, seed below) is written beside it as mtp.safetensors
with a model.safetensors.index.json naming both shards (the hub layout); re-running
make_fixtures_vision.py removes them, and this script writes them again.

Writes tests/fixtures/vision/qwen3_5/{mtp.safetensors, model.safetensors.index.json, mtp.json,
mtp_logits.npy}. Deterministic: running twice gives byte-identical files.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


mr = _load("mtp_reference")
mh = mr.mh
mv = _load("make_fixtures_vision")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402

CASE = "qwen3_5"
PROMPT = "two_images"
SEED = 7707
K_DRAFT = 3


def head_weights(d: Path, tc: dict) -> dict:
    """The random dense head, written as its own shard with an index naming both."""
    out = mh.fake_mtp(SimpleNamespace(**tc), SEED, moe=False)
    mh.write_st(d / "mtp.safetensors", out)
    with safe_open(str(d / "model.safetensors"), "np") as f:
        names = {k: "model.safetensors" for k in f.keys()}
    names.update({k: "mtp.safetensors" for k in out})
    index = {
        "metadata": {"note": "the multi-token-prediction head (mtp.*, random, scripts/mtp_reference_vision.py) in a shard of its own"},
        "weight_map": dict(sorted(names.items())),
    }
    (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return {k: v.to(torch.float64).numpy() for k, v in out.items()}


def target(d: Path, ids: list[int], names: list[str]):
    """The target in float64: its final-norm hidden states, logits, the input embeddings its
    text model took (image tokens: the tower's output) and the positions it rotated by."""
    model, _ = mh.load_ref(d, mh.CASES[CASE])
    model = model.to(torch.float64)
    grids = json.loads((mv.OUT / "images" / "reference.json").read_text())["grids"]
    pixels = {n: np.load(mv.OUT / "images" / f"{n.split('.')[0]}.pixels.npy").astype(np.float64) for n in names}
    kw = mv.model_inputs(ids, names, pixels, grids)
    captured = {}
    lm = mh.text_model(model)
    h1 = lm.register_forward_pre_hook(lambda m, a, k: captured.update(k), with_kwargs=True)
    h2 = lm.norm.register_forward_hook(lambda m, i, o: captured.update(post=o))
    with mh.true_float64(model), torch.no_grad():
        out = model(**kw)
    h1.remove()
    h2.remove()
    pos = captured["position_ids"][:, 0]  # [3 or 4, T]: the last three are temporal, height, width
    return dict(
        post=captured["post"][0].numpy(),
        logits=out.logits[0].numpy(),
        inputs=captured["inputs_embeds"][0].numpy(),
        positions=pos[-3:].T.numpy().astype(np.int64),
    )


def run(W, cfg, ids, t, g, k, variant=None):
    """Prefill over the prompt slots (multimodal inputs and positions), then k chained drafts."""
    v = variant or {}
    T = len(ids)
    head = mr.MTPHead(W, cfg)
    toks = list(ids[1:]) + [g]
    inputs = np.concatenate([t["inputs"][1:], head.embed[[g]]], 0)
    if v.get("token_inputs"):
        inputs = None
    pos = t["positions"] if not v.get("positions_1d") else np.arange(T)
    y, _, logits = head.step(toks, t["post"], pos, inputs)
    drafts, chain_logits, fb = [int(np.argmax(logits[-1]))], [logits[-1]], y[-1]
    last = t["positions"][-1]
    for j in range(1, k):
        p = (last + j)[None, :] if not v.get("positions_1d") else np.array([T - 1 + j])
        yj, _, lj = head.step([drafts[-1]], fb[None], p)
        drafts.append(int(np.argmax(lj[0])))
        chain_logits.append(lj[0])
        fb = yj[0]
    return dict(logits=logits, drafts=drafts, chain_logits=np.stack(chain_logits))


def main() -> None:
    d = mv.OUT / CASE
    cfg = json.loads((d / "config.json").read_text())
    tc = cfg["text_config"]
    ref = json.loads((d / "reference.json").read_text())["prompts"][PROMPT]
    ids, names = [int(x) for x in ref["ids"]], list(ref["images"])
    W = mr.read_f64(d / "model.safetensors", lambda k: not k.startswith("model.visual."))
    W.update(head_weights(d, tc))
    t = target(d, ids, names)
    want_pos = np.array(ref["positions"]).T
    if not np.array_equal(t["positions"], want_pos):
        raise RuntimeError("the target's rotary positions are not reference.json's")
    g = int(np.argmax(t["logits"][-1]))
    if g != ref["greedy"][0]:
        raise RuntimeError(f"float64 greedy token {g} is not the float32 reference's {ref['greedy'][0]}")
    res = run(W, cfg, ids, t, g, K_DRAFT)
    T = len(ids)
    margins = [mr.top2_margin(r) for r in res["logits"]]
    chain_margins = [mr.top2_margin(r) for r in res["chain_logits"]]
    image_token = cfg["image_token_id"]
    contrasts = {}
    for label, variant in (
        ("image rows take the placeholder token's embedding", {"token_inputs": True}),
        ("one-dimensional positions", {"positions_1d": True}),
    ):
        alt = run(W, cfg, ids, t, g, K_DRAFT, variant)
        contrasts[label] = {
            "prefill_logits_max_abs_diff": float(np.abs(alt["logits"] - res["logits"]).max()),
            "chain_drafts": alt["drafts"],
        }
    np.save(d / "mtp_logits.npy", res["logits"].astype("<f4"))
    out = {
        "case": f"vision/{CASE}",
        "description": "MTP head over a prompt with images, float64 (scripts/mtp_reference_vision.py): slot i = "
        "token ids[i+1] (last slot = the target's greedy g) with its input as the target took it (image tokens: "
        "the vision tower's output), the target's final-norm hidden state of row i, and row i's multimodal "
        "rotary position; chain step j feeds draft j-1, the previous step's output after mtp.norm, and the last "
        "row's three positions plus j. Full logits of every slot in mtp_logits.npy (float32 [T, vocab]).",
        "prompt": PROMPT,
        "images": names,
        "input_ids": ids,
        "image_rows": [i for i in range(T) if ids[i] == image_token],
        "mtp_weights": "mtp.safetensors (generated by this script: fake_mtp(moe=False), seed %d)" % SEED,
        "target": {"greedy_next_token": g, "greedy_top2_margin": mr.top2_margin(t["logits"][-1])},
        "mtp_prefill": {"argmax": [int(np.argmax(r)) for r in res["logits"]], "top2_margin": margins},
        "chain": {"k": K_DRAFT, "drafts": res["drafts"], "top2_margin": chain_margins,
                  "logits": [mr.fl(r) for r in res["chain_logits"]]},
        "wrong_semantics": contrasts,
        "torch_version": torch.__version__,
        "transformers_version": importlib.metadata.version("transformers"),
    }
    (d / "mtp.json").write_text(json.dumps(out, indent=1) + "\n")
    mh.log(f"vision {CASE}: g={g} drafts={res['drafts']} min margin prefill {min(margins):.3g} chain "
           f"{min(chain_margins):.3g}; contrasts {json.dumps(contrasts)}")


if __name__ == "__main__":
    main()
