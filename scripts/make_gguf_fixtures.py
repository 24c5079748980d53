#!/usr/bin/env python3
"""GGUF fixtures with llama.cpp as the oracle, for every tensor type qinfer computes with.

    /work/venv/bin/python scripts/make_gguf_fixtures.py [--llamacpp /work/llamacpp]

1. A tiny Qwen3 model made with transformers whose rows are whole K-quant
   super-blocks (hidden 256, intermediate 512, 4 heads x 64, 2 kv heads,
   1 layer, vocab 256, tied embeddings), random O(1) weights rounded to bf16
   (as scripts/make_fixtures.py does), with a 256-token byte-level BPE tokenizer.
2. llama.cpp's convert_hf_to_gguf.py turns it into an F16 GGUF, and
   llama-quantize --pure into each quantized type.
3. llama.cpp's logits for a fixed token sequence (scripts/llamacpp/qinfer_ref.c,
   teacher-forced, flash attention off, f32 KV cache, 2 threads) go next to
   each GGUF: logits.npy without repacked CPU layouts (-norepack: the plain
   ggml_vec_dot_* kernels), logits_repack.npy with llama.cpp's default repacking.

4. The hybrid transformers fixtures with their MTP heads as BF16 GGUFs
   (tests/fixtures/gguf_mtp/, `--only mtp`: the converter alone, no build).

Outputs tests/fixtures/gguf_quant/<TYPE>/{model.gguf, logits.npy, logits_repack.npy} and
tests/fixtures/gguf_quant/reference.json (input ids, tensor types per file,
llama.cpp commit). Needs a llama.cpp build with llama-quantize; the
qinfer_ref helper is compiled from scripts/llamacpp/qinfer_ref.c.

The converter identifies BPE pre-tokenizers by hashing the token ids of a
probe text; a 256-token byte vocabulary matches no known hash, so the
conversion runs in-process with `get_vocab_base_pre` answering "qwen2" (the
tokenizer only names the pre-tokenizer; weights and metadata are unaffected).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "gguf_quant"

# llama-quantize ftype per ggml type; with --pure the ftype's base type is used for every tensor.
FTYPES = {
    "Q4_0": "Q4_0",
    "Q4_1": "Q4_1",
    "Q5_0": "Q5_0",
    "Q5_1": "Q5_1",
    "Q8_0": "Q8_0",
    "Q2_K": "Q2_K",
    "Q3_K": "Q3_K_S",
    "Q4_K": "Q4_K_S",
    "Q5_K": "Q5_K_S",
    "Q6_K": "Q6_K",
}
SEED = 5150
N_TOKENS = 32
# What llama-cpp-python 0.3.36 vendors (scripts/llamacpp_reference.sh): its
# sdist's llama.cpp is no git checkout.
LLAMA_CPP_COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """O(1)-scale random weights rounded to bf16, as scripts/make_fixtures.py."""
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        z = torch.randn(tuple(p.shape), generator=g, dtype=torch.float32)
        if name.endswith("embed_tokens.weight"):
            w = z
        elif "norm" in name:
            w = 1.0 + 0.3 * z
        elif len(p.shape) in (2, 3):
            # Matrices and stacked experts [E, out, in].
            w = z * (2.0 / math.sqrt(p.shape[-1]))
        else:
            raise RuntimeError(f"unexpected parameter {name}")
        with torch.no_grad():
            p.copy_(w.to(torch.bfloat16).to(torch.float32))


def make_model(dir_: Path) -> None:
    cfg = Qwen3Config(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )
    cfg.dtype = torch.bfloat16
    torch.manual_seed(SEED)
    model = Qwen3ForCausalLM(cfg).eval()
    randomize_(model, SEED)
    model.to(torch.bfloat16).save_pretrained(dir_)
    save_tokenizer(dir_)


def save_tokenizer(dir_: Path, spare: int = 0) -> None:
    """`spare` ids stay free for tokens that transformers' tokenizer class adds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # llama.cpp requires BPE merges: 248 byte tokens (0xf8..0xff never occur in
    # UTF-8) and 8 merged tokens make up the 256 ids.
    b2u = bytes_to_unicode()
    vocab = {b2u[i]: i for i in range(248)}
    merges = [("Ġ", "t"), ("h", "e"), ("i", "n"), ("r", "e"), ("o", "n"), ("Ġ", "a"), ("e", "r"), ("a", "t")]
    merges = merges[: len(merges) - spare]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(dir_)


CONVERT = """
import sys
sys.path[:0] = [{src!r}, {src!r} + "/gguf-py"]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", {model!r}, "--outfile", {out!r}, "--outtype", {outtype!r}, *{extra!r}]
convert_hf_to_gguf.main()
"""


def convert(src: Path, model_dir: Path, out: Path, outtype: str, extra: tuple[str, ...] = ()) -> None:
    code = CONVERT.format(src=str(src), model=str(model_dir), out=str(out), outtype=outtype, extra=list(extra))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py {model_dir} failed:\n{r.stderr[-3000:]}")


def make_moe_model(dir_: Path, ids: list[int]) -> np.ndarray:
    """A tiny all-MoE Qwen3-MoE (llama.cpp's qwen3moe has no dense layers and
    always renormalizes the top-k weights); returns transformers' float32 logits."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: PLC0415

    cfg = Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )
    torch.manual_seed(SEED + 1)
    model = Qwen3MoeForCausalLM(cfg).eval()
    randomize_(model, SEED + 1)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float().numpy()
    cfg.dtype = torch.bfloat16
    model.to(torch.bfloat16).save_pretrained(dir_)
    save_tokenizer(dir_)
    return logits, ids


def copy_tiny_fixture(case: str):
    """A committed transformers fixture (tests/fixtures/tiny/<case>) plus a tokenizer."""

    def make(dir_: Path, _ids: list[int]) -> tuple[np.ndarray, list[int]]:
        shutil.copytree(ROOT / "tests" / "fixtures" / "tiny" / case, dir_)
        # Qwen3.5's tokenizer class adds one special token of its own.
        save_tokenizer(dir_, spare=1 if case.startswith("qwen3_5") else 0)
        ref = json.loads((dir_ / "reference.json").read_text())
        return np.load(dir_ / "logits.npy"), ref["input_ids"]

    return make


def build_arch_cases(src: Path, helper: Path, tmp: Path, threads: int, ids: list[int]) -> None:
    """Other architectures as F32 GGUFs: transformers' logits and llama.cpp's.
    qwen3next and qwen35 come from the committed transformers fixtures."""
    out_root = ROOT / "tests" / "fixtures" / "gguf_arch"
    if out_root.exists():
        shutil.rmtree(out_root)
    out_root.mkdir(parents=True)
    cases = (("qwen3moe", make_moe_model), ("qwen3next", copy_tiny_fixture("qwen3_next")),
             ("qwen35", copy_tiny_fixture("qwen3_5")), ("qwen35moe", copy_tiny_fixture("qwen3_5_moe")))
    for case, make in cases:
        model_dir = tmp / case
        dst = out_root / case
        dst.mkdir()
        logits, ids = make(model_dir, ids)
        np.save(dst / "transformers_logits.npy", logits.astype("<f4"))
        # The MTP head is not part of the forward pass compared here.
        convert(src, model_dir, dst / "model.gguf", "f32", () if case == "qwen3moe" else ("--no-mtp",))
        cmd = [str(helper), "-m", str(dst / "model.gguf"), "-t", str(threads), "-c", "512", "-fa", "off",
               "-kv", "f32", "logits", ",".join(map(str, ids)), str(dst / "llamacpp_logits.npy")]
        r = subprocess.run(cmd, capture_output=True, text=True)
        # llama.cpp cannot run every file its converter writes (e.g. qwen3next
        # with key and value head dims that differ): record why.
        errors = [line for line in r.stderr.splitlines() if "error" in line]
        ref = {"input_ids": ids, "config": json.loads((model_dir / "config.json").read_text()),
               "qinfer_ref": "logits IDS, -fa off -kv f32 -t %d -c 512" % threads,
               "llama_cpp": "ok" if r.returncode == 0 else {"failed": errors[:2]}}
        (dst / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")
        log(f"{case}: done")


def build_mtp_cases(src: Path, tmp: Path) -> None:
    """The committed hybrid transformers fixtures with their multi-token-prediction
    heads, as BF16 GGUFs in which llama.cpp's converter keeps the head (its
    default; `blk.{num_hidden_layers}.nextn.*` and the head's decoder layer as
    that block). The fixtures' matrices are bf16 values, so BF16 loses nothing;
    the head's reference is the fixture's own mtp.json (scripts/mtp_reference.py)."""
    from gguf import GGUFReader  # noqa: PLC0415

    out_root = ROOT / "tests" / "fixtures" / "gguf_mtp"
    if out_root.exists():
        shutil.rmtree(out_root)
    out_root.mkdir(parents=True)
    commit = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    for case, tiny in (("qwen3next", "qwen3_next"), ("qwen35", "qwen3_5"), ("qwen35moe", "qwen3_5_moe")):
        model_dir = tmp / f"mtp_{case}"
        copy_tiny_fixture(tiny)(model_dir, [])
        dst = out_root / case
        dst.mkdir()
        convert(src, model_dir, dst / "model.gguf", "bf16")
        reader = GGUFReader(str(dst / "model.gguf"))
        nextn = [t.name for t in reader.tensors if ".nextn." in t.name]
        if not nextn:
            raise RuntimeError(f"{case}: the converter kept no nextn tensors")
        # The head alone, as llama.cpp publishes it beside a target converted
        # with --no-mtp (tests/fixtures/gguf_arch/<case> is that target).
        convert(src, model_dir, dst / "mtp-model.gguf", "bf16", ("--mtp",))
        head_only = [t.name for t in GGUFReader(str(dst / "mtp-model.gguf")).tensors]
        ref = {"tiny_fixture": f"tests/fixtures/tiny/{tiny}", "llama_cpp_commit": commit or LLAMA_CPP_COMMIT,
               "converter": "convert_hf_to_gguf.py --outtype bf16 (MTP kept, the default)", "nextn_tensors": nextn,
               "mtp-model.gguf": {"converter": "convert_hf_to_gguf.py --outtype bf16 --mtp", "tensors": head_only}}
        (dst / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")
        log(f"{case}: {len(nextn)} nextn tensors")


def tensor_types(path: Path, src: Path) -> dict[str, str]:
    sys.path.insert(0, str(src / "gguf-py"))
    from gguf import GGUFReader  # noqa: PLC0415

    return {t.name: t.tensor_type.name for t in GGUFReader(str(path)).tensors}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llamacpp", default="/work/llamacpp", help="root with src/, build/bin/ and qinfer_ref")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", choices=["quant", "arch", "mtp"], help="build only one kind of fixture")
    args = ap.parse_args()
    root = Path(args.llamacpp)
    src, bin_ = root / "src", root / "build" / "bin"
    tmp = Path(tempfile.mkdtemp(prefix="qinfer_gguf_"))
    sys.path.insert(0, str(src / "gguf-py"))
    if args.only in (None, "mtp"):
        # Needs the converter only, not a llama.cpp build.
        build_mtp_cases(src, tmp)
    if args.only == "mtp":
        shutil.rmtree(tmp)
        return
    helper = tmp / "qinfer_ref"
    subprocess.run(["gcc", "-O2", "-I", str(src / "include"), "-I", str(src / "ggml" / "include"),
                    str(ROOT / "scripts" / "llamacpp" / "qinfer_ref.c"), "-o", str(helper), "-L", str(bin_),
                    "-lllama", f"-Wl,-rpath,{bin_}"], check=True)

    rng = np.random.default_rng(SEED)
    ids = [int(v) for v in rng.integers(3, 256, size=N_TOKENS)]
    commit = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()

    model_dir = tmp / "hf"
    make_model(model_dir)
    if args.only in (None, "arch"):
        build_arch_cases(src, helper, tmp, args.threads, ids)
    if args.only == "arch":
        shutil.rmtree(tmp)
        return
    f16 = tmp / "model-f16.gguf"
    convert(src, model_dir, f16, "f16")

    files = {"F16": f16}
    for name, ftype in FTYPES.items():
        out = tmp / f"model-{name}.gguf"
        subprocess.run([str(bin_ / "llama-quantize"), "--pure", str(f16), str(out), ftype], check=True, capture_output=True)
        files[name] = out

    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    cases = {}
    for name, path in files.items():
        dst = OUT / name
        dst.mkdir()
        shutil.copy(path, dst / "model.gguf")
        # Plain vec_dot kernels (-norepack), and the default with weights repacked
        # into llama.cpp's interleaved CPU layouts (other float summation orders).
        for file, extra in (("logits.npy", ["-norepack"]), ("logits_repack.npy", [])):
            cmd = [str(helper), "-m", str(dst / "model.gguf"), "-t", str(args.threads), "-c", "512", "-fa", "off",
                   "-kv", "f32", *extra, "logits", ",".join(map(str, ids)), str(dst / file)]
            info = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        types = tensor_types(dst / "model.gguf", src)
        cases[name] = {"tensor_types": types, "argmax": info["argmax"]}
        log(f"{name}: {sorted(set(types.values()))}")

    ref = {
        "description": "tiny Qwen3 (hidden 256, intermediate 512, 4x64 heads, 2 kv heads, 1 layer, vocab 256, "
        "tied embeddings), converted by convert_hf_to_gguf.py (F16) and llama-quantize --pure",
        "llama_cpp_commit": commit,
        "qinfer_ref": "logits IDS, -fa off -kv f32 -t %d -c 512; logits.npy with -norepack, "
        "logits_repack.npy without" % args.threads,
        "input_ids": ids,
        "cases": cases,
    }
    (OUT / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")
    shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
