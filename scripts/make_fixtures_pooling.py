#!/usr/bin/env python3
"""Tiny pooling checkpoints and their references: tests/fixtures/pooling/.

    /work/venv-ref/bin/python scripts/make_fixtures_pooling.py

Requirements: scripts/requirements-fixtures.txt plus sentence-transformers
(6.3.0 made the committed files). CPU only, float32 throughout.

* qwen3_embedding_{last,mean,cls}/ -- a random 2-layer Qwen3 saved the way
  Qwen3-Embedding is (sentence-transformers layout: the bare Qwen3Model
  weights, modules.json, 1_Pooling, 2_Normalize, prompts), differing only in
  the pooling mode; reference.json holds SentenceTransformer.encode outputs
  (one text per batch) for documents and for queries with the "query" prompt.
* qwen3_reranker/ -- a random 2-layer Qwen3ForCausalLM (tied head) whose
  vocabulary has single "yes" and "no" tokens; reference.json holds the
  Qwen3-Reranker model card's scores (the formatted prompt, then
  softmax over the last position's [no, yes] logits, P(yes)).

The tokenizer is a byte-level BPE over the 256 byte symbols plus merges for
"yes" and "no" and Qwen's special tokens (the embedding one appends
<|endoftext|> to every input, as Qwen3-Embedding's does).
"""

import json
import os
import shutil
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from sentence_transformers import SentenceTransformer, models  # noqa: E402
from tokenizers import Tokenizer, decoders, pre_tokenizers, processors  # noqa: E402
from tokenizers.models import BPE  # noqa: E402
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM, Qwen3Model  # noqa: E402

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "pooling"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
TEXTS = [
    "The capital of France is Paris.",
    "Gravity is a force that attracts two bodies towards each other.",
    "qinfer runs Qwen models on CPUs and GPUs — vite, très vite!",
    "a",
    "Beijing is the capital of China, and it has been for centuries; it is also one of the largest cities in the world.",
]
QUERIES = ["What is the capital of China?", "Explain gravity"]


def tokenizer(append_eos: bool) -> PreTrainedTokenizerFast:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges = [("y", "e"), ("ye", "s"), ("n", "o")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    eos = tok.token_to_id("<|endoftext|>")
    if append_eos:
        tok.post_processor = processors.TemplateProcessing(
            single="$A <|endoftext|>", pair="$A <|endoftext|> $B <|endoftext|>", special_tokens=[("<|endoftext|>", eos)]
        )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.padding_side = "left"
    return fast


def config(vocab: int) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        eos_token_id=vocab - 3,
        pad_token_id=vocab - 3,
    )


def randomize(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def embedding_models() -> None:
    tok = tokenizer(append_eos=True)
    base = OUT / "_base"
    shutil.rmtree(base, ignore_errors=True)
    model = Qwen3Model(config(len(tok)))
    randomize(model, 4601)
    model.save_pretrained(base, safe_serialization=True)
    tok.save_pretrained(base)
    cfg = json.loads((base / "config.json").read_text())
    cfg["architectures"] = ["Qwen3ForCausalLM"]  # as Qwen3-Embedding's config says
    (base / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for mode in ("lasttoken", "mean", "cls"):
        name = {"lasttoken": "last", "mean": "mean", "cls": "cls"}[mode]
        out = OUT / f"qwen3_embedding_{name}"
        shutil.rmtree(out, ignore_errors=True)
        transformer = models.Transformer(str(base), max_seq_length=512)
        pooling = models.Pooling(64, pooling_mode=mode)
        st = SentenceTransformer(
            modules=[transformer, pooling, models.Normalize()],
            prompts={"query": QUERY_PROMPT, "document": ""},
            device="cpu",
        )
        st.save(str(out))
        (out / "README.md").unlink()  # sentence-transformers' generated model card
        st = SentenceTransformer(str(out), device="cpu")
        docs = st.encode(TEXTS, batch_size=1, convert_to_numpy=True, normalize_embeddings=False)
        queries = st.encode(QUERIES, prompt_name="query", batch_size=1, convert_to_numpy=True)
        ids = [tok(t)["input_ids"] for t in TEXTS]
        ref = {
            "what": f"SentenceTransformer({out.name}).encode(texts, batch_size=1), float32; pooling {mode}, normalized",
            "texts": TEXTS,
            "input_ids": ids,
            "embeddings": docs.astype(np.float64).tolist(),
            "queries": QUERIES,
            "query_prompt": QUERY_PROMPT,
            "query_embeddings": queries.astype(np.float64).tolist(),
        }
        write_json(out / "reference.json", ref)
        print(out.name, docs.shape, queries.shape)
    shutil.rmtree(base)


RERANK_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def reranker() -> None:
    tok = tokenizer(append_eos=False)
    out = OUT / "qwen3_reranker"
    shutil.rmtree(out, ignore_errors=True)
    model = Qwen3ForCausalLM(config(len(tok)))
    randomize(model, 4602)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    pairs = [(q, d) for q in QUERIES for d in TEXTS]
    scores, ids = [], []
    for q, d in pairs:
        text = RERANK_PREFIX + f"<Instruct>: {RERANK_INSTRUCTION}\n<Query>: {q}\n<Document>: {d}" + RERANK_SUFFIX
        x = tok(text, return_tensors="pt")
        with torch.no_grad():
            last = model(**x).logits[0, -1]
        pair = torch.stack([last[no], last[yes]]).log_softmax(-1)
        scores.append(float(pair[1].exp()))
        ids.append(x["input_ids"][0].tolist())
    ref = {
        "what": "Qwen3-Reranker's model-card scoring with transformers, float32: P(yes) over [no, yes] at the last position",
        "yes_id": yes,
        "no_id": no,
        "instruction": RERANK_INSTRUCTION,
        "pairs": [{"query": q, "document": d} for q, d in pairs],
        "input_ids": ids,
        "scores": scores,
    }
    write_json(out / "reference.json", ref)
    print(out.name, scores)


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    embedding_models()
    reranker()
