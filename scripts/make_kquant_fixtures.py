#!/usr/bin/env python3
"""Random ggml blocks of every quantized type qinfer decodes, with gguf-py's
dequantization of them (the oracle for qinfer's decoders, compared bit for bit).

    /work/venv/bin/python scripts/make_kquant_fixtures.py [--gguf-py DIR]

Writes tests/fixtures/gguf_kquants/<TYPE>.blocks (raw block bytes) and
<TYPE>.f32 (little-endian float32 values, gguf.quants.dequantize). Blocks are
random bytes except the f16 scale fields, which get finite values of both
signs, so every bit of every other field is exercised. Deterministic.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "gguf_kquants"

# Byte offsets of the f16 fields in one block (ggml-common.h).
F16_FIELDS = {
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q8_0": [0],
    "Q2_K": [80, 82],
    "Q3_K": [108],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
}
BLOCKS = 6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf-py", default="/work/llamacpp/src/gguf-py", help="llama.cpp's gguf-py directory")
    args = ap.parse_args()
    sys.path.insert(0, args.gguf_py)
    import gguf  # noqa: PLC0415
    from gguf.quants import dequantize  # noqa: PLC0415

    OUT.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(20261130)
    for name, fields in F16_FIELDS.items():
        qtype = gguf.GGMLQuantizationType[name]
        block_len, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(BLOCKS, block_bytes), dtype=np.uint8)
        for off in fields:
            scale = rng.uniform(-0.05, 0.05, size=BLOCKS).astype(np.float16)
            raw[:, off : off + 2] = scale.view(np.uint8).reshape(BLOCKS, 2)
        values = dequantize(raw.reshape(-1), qtype).astype("<f4")
        assert values.size == BLOCKS * block_len and np.isfinite(values).all()
        (OUT / f"{name}.blocks").write_bytes(raw.tobytes())
        (OUT / f"{name}.f32").write_bytes(values.tobytes())
        print(f"{name}: {BLOCKS} blocks of {block_len} values")


if __name__ == "__main__":
    main()
