#!/usr/bin/env python3
"""A Qwen3.5 GGUF and its vision projector as llama.cpp's converter writes them, with
transformers' outputs for the same checkpoint.

    /work/venv/bin/python scripts/make_gguf_vision_fixtures.py [--llamacpp /work/llamacpp]

The checkpoint is the vision fixture tests/fixtures/vision/qwen3_5 (scripts/make_fixtures_vision.py)
with one change: its tower's rotary base set to 10000, Qwen3.5's published value, because the
projector file has no field for it (llama.cpp's clip.cpp fixes it; the fixture's own 100 could not
be told from it). Its converter runs twice, as llama.cpp publishes such a model:

* model.gguf  -- `convert_hf_to_gguf.py --outtype bf16 --no-mtp` (the text model; the fixture's
                 matrices are bf16 values, so nothing is rounded);
* mmproj.gguf -- `convert_hf_to_gguf.py --outtype f32 --mmproj` (the tower).

and transformers (float32, eager attention, the processor's own pixel values from
tests/fixtures/vision/images) gives vision_<image>.npy (each image's merged tower output) and, for
the fixture's `two_images` prompt, the logits at every position (logits_two_images.npy) and 8
greedy tokens (reference.json).

Writes tests/fixtures/gguf_vision/qwen35/. Needs the llama.cpp source only (no build).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


mv = _load("make_fixtures_vision")
mg = _load("make_gguf_fixtures")
mh = mv.mh

import numpy as np  # noqa: E402
import torch  # noqa: E402

OUT = ROOT / "tests" / "fixtures" / "gguf_vision" / "qwen35"
TOWER_ROPE_THETA = 10000.0
PROMPT = "two_images"


def save_bpe_tokenizer(dir_: Path) -> None:
    """A byte-level BPE over the fixture's 256 ids with Qwen's chat and vision markers at the ids
    its config names: GGUF tokenizers (llama.cpp's and qinfer's) need BPE merges, which the
    fixture's word-level tokenizer has none of. Ids 0-239 are bytes, 240-242 chat role words,
    243-253 the special tokens, 254-255 two merges."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    b2u = mg.bytes_to_unicode()
    vocab = {b2u[i]: i for i in range(240)}
    vocab.update(mv.WORDS)
    vocab.update(mv.SPECIALS)
    merges = [("Ġ", "t"), ("h", "e")]
    for n, (a, b) in enumerate(merges):
        vocab[a + b] = 254 + n
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in mv.SPECIALS])
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (dir_ / f).unlink(missing_ok=True)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>").save_pretrained(dir_)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llamacpp", default="/work/llamacpp", help="root with src/ (llama.cpp's source)")
    args = ap.parse_args()
    src = Path(args.llamacpp) / "src"
    tmp = Path(tempfile.mkdtemp(prefix="qinfer_gguf_vision_"))
    ckpt = tmp / "qwen3_5"
    shutil.copytree(mv.OUT / "qwen3_5", ckpt)
    # The MTP head's shard (scripts/mtp_reference_vision.py) is not this fixture's concern.
    for extra in ("mtp.safetensors", "model.safetensors.index.json", "mtp.json", "mtp_logits.npy"):
        (ckpt / extra).unlink(missing_ok=True)
    save_bpe_tokenizer(ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["vision_config"]["rope_parameters"]["rope_theta"] = TOWER_ROPE_THETA
    (ckpt / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    mg.convert(src, ckpt, OUT / "model.gguf", "bf16", ("--no-mtp",))
    mg.convert(src, ckpt, OUT / "mmproj.gguf", "f32", ("--mmproj",))

    ref_in = json.loads((mv.OUT / "qwen3_5" / "reference.json").read_text())["prompts"][PROMPT]
    grids = json.loads((mv.OUT / "images" / "reference.json").read_text())["grids"]
    names = list(ref_in["images"])
    pixels = {n: np.load(mv.OUT / "images" / f"{n.split('.')[0]}.pixels.npy") for n in grids}
    model, info = mh.load_ref(ckpt, mh.CASES["qwen3_5"])
    if info.get("missing_keys"):
        raise RuntimeError(f"missing keys on reload: {info['missing_keys']}")
    with torch.no_grad():
        for img in names:
            kw = mv.model_inputs([mv.IMAGE_TOKEN], [img], pixels, grids)
            feats = model.model.get_image_features(kw["pixel_values"], kw["image_grid_thw"]).pooler_output[0]
            np.save(OUT / f"vision_{img.split('.')[0]}.npy", feats.to(torch.float32).numpy())
        ids = [int(x) for x in ref_in["ids"]]
        kw = mv.model_inputs(ids, names, pixels, grids)
        np.save(OUT / f"logits_{PROMPT}.npy", model(**kw).logits[0].to(torch.float32).numpy())
        greedy = mv.greedy(model, kw)
    ref = {
        "checkpoint": "tests/fixtures/vision/qwen3_5 with vision_config.rope_parameters.rope_theta = %g" % TOWER_ROPE_THETA,
        "llama_cpp_commit": mg.LLAMA_CPP_COMMIT,
        "converter": {"model.gguf": "--outtype bf16 --no-mtp", "mmproj.gguf": "--outtype f32 --mmproj"},
        "prompt": PROMPT,
        "ids": ids,
        "images": names,
        "greedy": greedy,
        "transformers": "float32, eager attention, the processor's pixel values",
    }
    (OUT / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")
    shutil.rmtree(tmp)
    mh.log(f"gguf_vision qwen35: greedy {greedy}")


if __name__ == "__main__":
    main()
