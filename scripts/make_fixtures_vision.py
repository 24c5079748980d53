#!/usr/bin/env python3
"""Image-input oracle fixtures for Qwen3.5 (dense and MoE) with a vision tower.

    /work/venv/bin/python scripts/make_fixtures_vision.py

Writes tests/fixtures/vision/:

* images/: five small images made here from a seeded RNG (PNG, RGBA PNG with transparency,
  JPEG, lossless WebP, and one large enough to be scaled down), and for each the pixel values and
  grid that transformers' Qwen2VL image processor (the one Qwen3.5 checkpoints name) produces with
  the preprocessor_config.json written beside the models (patch 4, merge 2, temporal patch 2, the
  pixel bounds below). The processor is transformers' PIL backend: the torchvision backend needs a
  torchvision built for the installed torch, and both implement PIL's antialiased bicubic resize.
* qwen3_5/, qwen3_5_moe/: tiny random Qwen3_5(Moe)ForConditionalGeneration checkpoints in the
  hub layout (the text and vision configs of scripts/make_fixtures_hybrid.py, with a 2-block
  vision tower and rope bases low enough that every multimodal-RoPE section moves the logits),
  and reference.json + .npy files from transformers in float32 (eager attention):
  - vision_<image>.npy: the vision tower's merged output for each image alone;
  - prompt `two_images` (text, image a, text, image c, text): the multimodal position ids, the
    logits at every position, and 8 greedy tokens;
  - `chat` and `chat_later_turn`: a chat through a word-level tokenizer and a chat template
    written here (saved beside the model), the image in the first or in a later user turn,
    with transformers' greedy answer;
  - prompt `later_image` (a long text turn, then image e): the last position's logits and 8
    greedy tokens; prompt `text_only`: 8 greedy tokens (for batches mixing both kinds).

The MTP head's files beside qwen3_5/ (mtp.safetensors, model.safetensors.index.json, mtp.json,
mtp_logits.npy) come from scripts/mtp_reference_vision.py: run it after this script, which
removes them.

Deterministic: running twice gives byte-identical files.
"""

from __future__ import annotations

import copy
import importlib.util
import io
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("make_fixtures_hybrid", ROOT / "scripts" / "make_fixtures_hybrid.py")
mh = importlib.util.module_from_spec(_spec)
sys.modules["make_fixtures_hybrid"] = mh
_spec.loader.exec_module(mh)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402

OUT = ROOT / "tests" / "fixtures" / "vision"
IMAGE_TOKEN, VISION_START, VISION_END = 250, 252, 253
GREEDY = 8
# Smallest gap between the top two logits a greedy step may have: ten times the bound
# tests/vision_model.rs puts on text rows' logits (float32 sums in another order).
MIN_MARGIN = 2e-3

# Bounds chosen so that one image is scaled up (below min_pixels) and one down (above max_pixels).
PROCESSOR = dict(
    patch_size=4,
    temporal_patch_size=2,
    merge_size=2,
    size={"shortest_edge": 256, "longest_edge": 4096},
    image_mean=[0.5, 0.5, 0.5],
    image_std=[0.5, 0.5, 0.5],
)
VISION = dict(mh.VISION, depth=2, rope_parameters={"rope_type": "axial", "rope_theta": 100.0})
TEXT_ROPE = dict(
    rope_type="default", rope_theta=100.0, partial_rotary_factor=0.5, mrope_section=[4, 2, 2], mrope_interleaved=True
)


def smooth_image(rng, w: int, h: int, channels: int) -> np.ndarray:
    """Gradients plus noise: enough structure that resampling matters, values across 0..255."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    out = np.empty((h, w, channels), dtype=np.float64)
    for c in range(channels):
        fx, fy, ph = rng.uniform(0.05, 0.4), rng.uniform(0.05, 0.4), rng.uniform(0, 6.3)
        out[..., c] = 128 + 90 * np.sin(fx * x + fy * y + ph) + rng.normal(0, 25, size=(h, w))
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


def make_images(rng) -> dict[str, bytes]:
    imgs = {}

    def save(name, arr, fmt, **kw):
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format=fmt, **kw)
        imgs[name] = buf.getvalue()

    save("a.png", smooth_image(rng, 45, 30, 3), "PNG")
    rgba = smooth_image(rng, 16, 12, 4)
    rgba[..., 3] = np.where(rgba[..., 3] < 60, 0, np.where(rgba[..., 3] > 200, 255, rgba[..., 3]))
    save("b.png", rgba, "PNG")
    save("c.webp", smooth_image(rng, 70, 50, 3), "WEBP", lossless=True)
    save("d.jpg", smooth_image(rng, 23, 61, 3), "JPEG", quality=90)
    save("e.png", smooth_image(rng, 130, 90, 3), "PNG")
    return imgs


def process(processor, data: bytes):
    out = processor(images=[Image.open(io.BytesIO(data))], return_tensors="pt")
    return out["pixel_values"].to(torch.float32).numpy(), [int(x) for x in out["image_grid_thw"][0]]


def image_tokens(grid) -> int:
    return grid[0] * grid[1] * grid[2] // (PROCESSOR["merge_size"] ** 2)


def with_images(parts, grids) -> list[int]:
    """Token ids: ints as they are, an image name as vision_start, its pads, vision_end."""
    ids = []
    for p in parts:
        if isinstance(p, str):
            ids += [VISION_START] + [IMAGE_TOKEN] * image_tokens(grids[p]) + [VISION_END]
        else:
            ids += p
    return ids


def model_inputs(ids, names, pixels, grids):
    t = torch.tensor([ids])
    kw = dict(input_ids=t, mm_token_type_ids=(t == IMAGE_TOKEN).to(torch.int32))
    if names:
        kw["pixel_values"] = torch.cat([torch.from_numpy(pixels[n]) for n in names])
        kw["image_grid_thw"] = torch.tensor([grids[n] for n in names])
    return kw


def greedy(model, kw, eos=()) -> list[int]:
    """Greedy decoding as full forwards: each step the argmax of the model's logits at the last
    position of the whole sequence so far (positions from `get_rope_index` over all of it).
    `generate()` is not used: with an image after earlier text turns its steps disagree with
    the model's own full forward (transformers 5.24), which is the reference here."""
    ids = kw["input_ids"]
    out = []
    for _ in range(GREEDY):
        step = dict(kw, input_ids=ids, mm_token_type_ids=(ids == IMAGE_TOKEN).to(torch.int32))
        top = torch.topk(model(**step).logits[0, -1], 2)
        margin = float(top.values[0] - top.values[1])
        if margin < MIN_MARGIN:
            raise RuntimeError(f"greedy step {len(out)}: margin {margin:.2g} is too small to compare against")
        t = int(top.indices[0])
        out.append(t)
        if t in eos:
            break
        ids = torch.cat([ids, torch.tensor([[t]])], dim=1)
    return out


def build_case(name: str, pixels, grids, rng) -> dict:
    spec = copy.deepcopy(mh.CASES[name])
    spec["kwargs"]["rope_parameters"] = TEXT_ROPE
    out = OUT / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    mh.VISION.clear()
    mh.VISION.update(VISION)
    seed = spec["base_seed"] * 100 + 77
    torch.manual_seed(seed)
    cfg = mh.make_config(spec)
    _, model_cls = spec["cls"]
    model = model_cls(cfg).to(torch.float32).eval()
    model.set_attn_implementation("eager")
    keep_f32 = spec.get("f32_params", ())
    mh.randomize_(model, seed, keep_f32)
    f32_values = {k: p.detach().clone() for k, p in model.named_parameters() if keep_f32 and k.endswith(keep_f32)}
    model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(str(out))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    del model
    st_path = out / "model.safetensors"
    tensors = mh.read_st(st_path)
    if name == "qwen3_5_moe":
        tensors = mh.fuse_experts(tensors, state)
    tensors.update(f32_values)
    mh.write_st(st_path, tensors)
    Qwen2VLImageProcessorPil(**PROCESSOR).save_pretrained(str(out))

    model, info = mh.load_ref(out, spec)
    if info.get("missing_keys"):
        raise RuntimeError(f"{name}: missing keys on reload: {info['missing_keys']}")
    ref = {"case": name, "prompts": {}}
    with torch.no_grad():
        for img in pixels:
            kw = model_inputs([IMAGE_TOKEN], [img], pixels, grids)
            feats = model.model.get_image_features(kw["pixel_values"], kw["image_grid_thw"]).pooler_output[0]
            np.save(out / f"vision_{img.split('.')[0]}.npy", feats.to(torch.float32).numpy())

        text = lambda n: [int(x) for x in rng.integers(3, 250, size=n)]  # noqa: E731
        prompts = {
            "two_images": ([text(5), "a.png", text(4), "c.webp", text(6)], ["a.png", "c.webp"]),
            "later_image": ([text(40), "e.png", text(3)], ["e.png"]),
            "text_only": ([text(12)], []),
            "small_images": ([text(2), "b.png", text(1), "d.jpg", text(2)], ["b.png", "d.jpg"]),
        }
        for pname, (parts, names) in prompts.items():
            ids = with_images(parts, grids)
            kw = model_inputs(ids, names, pixels, grids)
            logits = model(**kw).logits[0].to(torch.float32).numpy()
            entry = {"ids": ids, "images": names, "greedy": greedy(model, kw)}
            if names:
                pos, delta = model.model.get_rope_index(
                    kw["input_ids"], kw["mm_token_type_ids"], image_grid_thw=kw["image_grid_thw"]
                )
                entry["positions"] = pos[:, 0].tolist()
                entry["rope_delta"] = int(delta[0, 0])
            if pname == "two_images":
                np.save(out / f"logits_{pname}.npy", logits)
            else:
                np.save(out / f"logits_{pname}.npy", logits[-1:])
            ref["prompts"][pname] = entry
            mh.log(f"  {name} {pname}: {len(ids)} tokens, greedy {entry['greedy']}")
    if name == "qwen3_5":
        with torch.no_grad():
            ref["chat"] = chat_reference(out, model, Qwen2VLImageProcessorPil(**PROCESSOR))
            # The image in a later turn, after a user and an assistant text turn.
            earlier = [{"role": "user", "content": "w9 w10 w11"}, {"role": "assistant", "content": "w12 w13"}]
            ref["chat_later_turn"] = chat_reference(out, model, Qwen2VLImageProcessorPil(**PROCESSOR), earlier)
        mh.log(f"  {name} chat: {ref['chat']['greedy']} {ref['chat']['greedy_text']!r}")
    mh.write_json(out / "reference.json", ref)
    return ref


# A word-level tokenizer over the tiny vocabulary, with Qwen's chat and vision markers as
# special tokens at the ids the config names, and a chat template that renders image parts as
# Qwen3.5's does (`<|vision_start|><|image_pad|><|vision_end|>` per image, in place).
SPECIALS = {
    "<|endoftext|>": 243,
    "<|im_start|>": 244,
    "<|im_end|>": 245,
    "<|image_pad|>": IMAGE_TOKEN,
    "<|video_pad|>": 251,
    "<|vision_start|>": VISION_START,
    "<|vision_end|>": VISION_END,
}
WORDS = {"user": 240, "assistant": 241, "system": 242}
CHAT_TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{%- if message.content is string %}{{ message.content }}"
    "{%- else %}{%- for item in message.content %}"
    "{%- if item.type == 'image' or 'image' in item %}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif item.type == 'text' %}{{ item.text }}{%- endif %}"
    "{%- endfor %}{%- endif %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
CHAT_TEXT = "w5 w17 w33 w2"


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(256) if i not in SPECIALS.values() and i not in WORDS.values()}
    vocab.update(WORDS)
    vocab.update(SPECIALS)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": [t for t in SPECIALS if t not in ("<|im_end|>", "<|endoftext|>")]})
    fast.chat_template = CHAT_TEMPLATE
    for t, i in SPECIALS.items():
        assert fast.convert_tokens_to_ids(t) == i, t
    return fast


def chat_reference(out: Path, model, processor, earlier=()) -> dict:
    """The chat template with an image, its marker widened as Qwen3VLProcessor widens it
    (`replace_image_token`: one `<|image_pad|>` per merged token), then greedy tokens.
    (The processor class itself wants a video processor, which needs torchvision.)"""
    tok = make_tokenizer()
    tok.save_pretrained(str(out))
    image = Image.open(OUT / "images" / "a.png")
    messages = list(earlier) + [
        {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": CHAT_TEXT}]}
    ]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    pixels = processor(images=[image], return_tensors="pt")
    n = int(pixels["image_grid_thw"][0].prod()) // PROCESSOR["merge_size"] ** 2
    assert text.count("<|image_pad|>") == 1
    text = text.replace("<|image_pad|>", "<|image_pad|>" * n)
    ids = torch.tensor([tok(text)["input_ids"]])
    kw = dict(
        input_ids=ids,
        mm_token_type_ids=(ids == IMAGE_TOKEN).to(torch.int32),
        pixel_values=pixels["pixel_values"],
        image_grid_thw=pixels["image_grid_thw"],
    )
    eos = [2, SPECIALS["<|im_end|>"]]
    new = greedy(model, kw, eos)
    return {
        "earlier": list(earlier),
        "image": "a.png",
        "text": CHAT_TEXT,
        "rendered": text.replace("<|image_pad|>" * n, "<|image_pad|>"),
        "ids": [int(x) for x in kw["input_ids"][0]],
        "greedy": new,
        "greedy_text": tok.decode([t for t in new if t not in eos]),
    }


def main() -> None:
    torch.manual_seed(0)
    rng = np.random.default_rng(4242)
    shutil.rmtree(OUT, ignore_errors=True)
    (OUT / "images").mkdir(parents=True)
    images = make_images(rng)
    processor = Qwen2VLImageProcessorPil(**PROCESSOR)
    pixels, grids = {}, {}
    for name, data in images.items():
        (OUT / "images" / name).write_bytes(data)
        pixels[name], grids[name] = process(processor, data)
        np.save(OUT / "images" / f"{name.split('.')[0]}.pixels.npy", pixels[name])
        mh.log(f"  {name}: grid {grids[name]}, {pixels[name].shape}")
    mh.write_json(OUT / "images" / "reference.json", {"grids": grids, "processor": PROCESSOR})
    for case in ("qwen3_5", "qwen3_5_moe"):
        build_case(case, pixels, grids, np.random.default_rng(7))


if __name__ == "__main__":
    main()
