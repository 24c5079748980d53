#!/usr/bin/env python3
"""Records transformers' sampling distributions for qinfer's sampler test
(crates/qinfer/tests/sampler_transformers.rs): tests/fixtures/sampler/cases.json.

For each case, random float32 logits, a context and a parameter set go
through the logits processors transformers' own `generate` builds for
do_sample=True (GenerationMixin._get_logits_processor on a tiny randomly
initialised Llama, so the list and its order are transformers', not ours:
RepetitionPenaltyLogitsProcessor, then TemperatureLogitsWarper,
TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, each only when
enabled); the distribution it samples from, softmax of the processed
scores (float32, as `generate` computes it), is written with the inputs.

Cases whose top-p or min-p cut falls within 1e-4 (relative) of a token's
cumulative mass or probability are redrawn, so float32 rounding order cannot
move a cut; logits are continuous random values, so top-k has no ties
(transformers keeps every token tied with the k-th, qinfer exactly k).

Usage: python scripts/make_sampler_fixtures.py   (needs torch, transformers, numpy;
CI never runs it: the output is committed.) The committed cases.json was made
with transformers 5.25.0, torch 2.15.0, numpy 2.4.6 (it records the first two);
rerunning reproduces it byte for byte.
"""
import json
import os

import numpy as np
import torch
import transformers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, LogitsProcessorList

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OUT = os.path.join(REPO, "tests/fixtures/sampler/cases.json")

# (name, vocab, logit std, params, context length)
CASES = [
    ("softmax_only", 256, 2.0, dict(temperature=1.0), 0),
    ("temperature_0_7", 256, 2.0, dict(temperature=0.7), 0),
    ("temperature_1_8", 256, 3.0, dict(temperature=1.8), 0),
    ("top_k_20", 256, 2.0, dict(temperature=1.3, top_k=20), 0),
    ("top_k_1", 256, 2.0, dict(temperature=2.0, top_k=1), 0),
    ("top_p_0_9", 256, 2.5, dict(temperature=0.8, top_p=0.9), 0),
    ("top_p_0_3", 256, 1.5, dict(temperature=1.0, top_p=0.3), 0),
    ("min_p_0_05", 256, 2.0, dict(temperature=1.0, min_p=0.05), 0),
    ("min_p_0_3", 256, 1.0, dict(temperature=1.2, min_p=0.3), 0),
    ("repetition_1_3", 256, 2.0, dict(temperature=1.0, repetition_penalty=1.3), 40),
    ("repetition_2_0_top_p", 256, 1.0, dict(temperature=0.9, repetition_penalty=2.0, top_p=0.5), 60),
    ("all_processors", 256, 2.0,
     dict(temperature=0.9, repetition_penalty=1.1, top_k=50, top_p=0.95, min_p=0.02), 30),
    ("large_vocab_top_k_top_p", 4096, 3.0, dict(temperature=0.6, top_k=40, top_p=0.8), 0),
    ("large_vocab_top_p_min_p", 4096, 3.0, dict(temperature=1.5, top_p=0.5, min_p=0.1, repetition_penalty=1.2), 100),
]


def generation_config(params):
    # GenerationConfig's own defaults (top_k=50, ...) are overridden so only
    # what the case names is enabled, as qinfer's SamplingParams defaults do.
    return GenerationConfig(
        do_sample=True,
        temperature=params.get("temperature", 1.0),
        top_k=params.get("top_k", 0),
        top_p=params.get("top_p", 1.0),
        min_p=params.get("min_p") or None,
        repetition_penalty=params.get("repetition_penalty", 1.0),
    )


def processors(model, params, context):
    gc = generation_config(params)
    return model._get_logits_processor(
        generation_config=gc,
        input_ids_seq_length=context.shape[1],
        encoder_input_ids=context,
        prefix_allowed_tokens_fn=None,
        logits_processor=LogitsProcessorList(),
        device="cpu",
        model_kwargs={"attention_mask": torch.ones_like(context)},
    )


def main():
    torch.manual_seed(0)
    rng = np.random.default_rng(20250601)
    out = []
    for name, vocab, std, params, ctx_len in CASES:
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1)
        model = LlamaForCausalLM(cfg).eval()
        for attempt in range(100):
            logits = (rng.standard_normal(vocab) * std).astype(np.float32)
            context = rng.integers(0, vocab, size=ctx_len)
            if ctx_len:
                # Repeats, and penalized tokens among the likeliest (positive
                # and negative logits alike).
                top = np.argsort(-logits)[:8]
                context = np.concatenate([context, top, top[:3], np.argsort(logits)[:4]])
            ids = torch.tensor(context, dtype=torch.long).reshape(1, -1)
            procs = processors(model, params, ids)
            scores = torch.tensor(logits).reshape(1, -1)
            for p in procs:
                scores = p(ids, scores)
            probs = torch.softmax(scores, dim=-1)[0].numpy()
            # The same chain without top-p and min-p, to see how close its cuts are.
            pre = {k: v for k, v in params.items() if k not in ("top_p", "min_p")}
            s0 = torch.tensor(logits).reshape(1, -1)
            for p in processors(model, pre, ids):
                s0 = p(ids, s0)
            p0 = np.sort(torch.softmax(s0, dim=-1)[0].numpy().astype(np.float64))[::-1]
            clear = True
            if params.get("top_p", 1.0) < 1.0:
                cum = np.cumsum(p0)
                clear &= bool(np.min(np.abs(cum - params["top_p"])) > 1e-4 * params["top_p"])
            if params.get("min_p"):
                kept = p0[p0 > 0]
                # min-p sees the top-p-truncated distribution; its ratios are those of p0.
                ratio = kept / kept[0]
                clear &= bool(np.min(np.abs(ratio - params["min_p"])) > 1e-4 * params["min_p"])
            if clear:
                break
        else:
            raise SystemExit(f"{name}: no case with clear cuts in 100 draws")
        support = [[int(i), float(probs[i])] for i in np.nonzero(probs)[0]]
        out.append({
            "name": name,
            "params": {
                "temperature": float(params.get("temperature", 1.0)),
                "top_k": int(params.get("top_k", 0)),
                "top_p": float(params.get("top_p", 1.0)),
                "min_p": float(params.get("min_p", 0.0)),
                "repetition_penalty": float(params.get("repetition_penalty", 1.0)),
            },
            "processors": [type(p).__name__ for p in procs],
            "context": [int(t) for t in context],
            # float32 values written as the float64 that equals them exactly.
            "logits": [float(x) for x in logits],
            "support": support,
        })
        print(f"{name}: {[type(p).__name__ for p in procs]}, {len(support)} tokens kept, "
              f"top p {max(p for _, p in support):.4f}")
    with open(OUT, "w") as f:
        json.dump({
            "generator": "scripts/make_sampler_fixtures.py",
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "note": "support: [token id, probability] for every token the processed distribution "
                    "gives a nonzero probability (softmax of the processed float32 scores); "
                    "every other token has probability 0.",
            "cases": out,
        }, f, indent=None, separators=(",", ":"))
        f.write("\n")
    print("wrote", os.path.relpath(OUT, REPO))


if __name__ == "__main__":
    main()
