#!/usr/bin/env bash
# Regenerates the llama.cpp reference fixtures for the default model
# (SmolLM2-135M-Instruct, Q4_1 GGUF):
#
#   tests/fixtures/smollm2/tokenize.json    llama-tokenize ids for tricky texts
#   tests/fixtures/smollm2/greedy.json      greedy (argmax) continuations, 64 tokens
#   tests/fixtures/smollm2/greedy_fa_off_kv_f32.json  the same with flash attention off, f32 KV cache
#   tests/fixtures/smollm2/logits.json      metadata for the .npy files + top-5 rows
#   tests/fixtures/smollm2/logits_*.npy     teacher-forced float32 logits [n_tokens, n_vocab]
#   tests/fixtures/smollm2/perplexity.json  llama-perplexity -c 512 on the text below
#   tests/fixtures/text/gpl3_excerpt.txt    first lines of the GPL-3 text (verbatim)
#
# This documents how the fixtures were made; CI never runs it (it needs a
# llama.cpp build, which is kept outside the repository and never committed).
#
# Usage:
#   scripts/llamacpp_reference.sh [LLAMACPP_BIN] [MODEL]
# Environment (all optional):
#   LLAMACPP_ROOT  where llama.cpp is built          (default /work/llamacpp)
#   LLAMACPP_SRC   llama.cpp source tree (headers)  (default $LLAMACPP_ROOT/src)
#   LLAMACPP_BIN   dir with llama-* and libllama.so (default $LLAMACPP_ROOT/build/bin)
#   MODEL          GGUF path (default ~/.cache/qinfer/models/SmolLM2-135M-Instruct.Q4_1.gguf)
#   THREADS        CPU threads for llama.cpp        (default 2)
#   BUILD=1        (re)build llama.cpp first; also done when LLAMACPP_BIN has no llama-perplexity
#
# llama.cpp comes from the llama-cpp-python sdist on PyPI (vendor/llama.cpp);
# the fixtures in the repo were made with llama-cpp-python 0.3.36, which
# vendors ggml-org/llama.cpp commit 0c1e57098bba43ac29e6e3b677cdceebdd22334f.
# Needs: cmake, gcc/g++, python3 with numpy.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LLAMACPP_ROOT="${LLAMACPP_ROOT:-/work/llamacpp}"
LLAMACPP_SRC="${LLAMACPP_SRC:-$LLAMACPP_ROOT/src}"
LLAMACPP_BIN="${1:-${LLAMACPP_BIN:-$LLAMACPP_ROOT/build/bin}}"
MODEL="${2:-${MODEL:-$HOME/.cache/qinfer/models/SmolLM2-135M-Instruct.Q4_1.gguf}}"
THREADS="${THREADS:-2}"
LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"

build_llamacpp() {
  mkdir -p "$LLAMACPP_ROOT"
  cd "$LLAMACPP_ROOT"
  local sdist="llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
  if [ ! -f "$sdist" ]; then
    # --no-binary only for llama-cpp-python itself: its build deps come as wheels.
    python3 -m pip download --no-deps --no-binary llama-cpp-python \
      "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d .
  fi
  if [ ! -d "llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION" ]; then
    tar xzf "$sdist"
  fi
  ln -sfn "llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp" src
  command -v cmake >/dev/null || python3 -m pip install cmake
  # LLAMA_CURL no longer exists at this commit (downloads use OpenSSL or nothing);
  # it is passed anyway so the same line works on older trees.
  cmake -S src -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DGGML_CCACHE=OFF
  cmake --build build -j"$(nproc)" --target \
    llama-completion llama-perplexity llama-bench llama-tokenize llama-simple
  cd "$REPO"
}

if [ "${BUILD:-0}" = 1 ] || [ ! -x "$LLAMACPP_BIN/llama-perplexity" ]; then
  build_llamacpp
fi
[ -s "$MODEL" ] || { echo "model not found: $MODEL (run scripts/fetch_default_model.sh)" >&2; exit 1; }

# The helper: plain llama.h C API (tokenize / greedy argmax / teacher-forced logits).
HELPER="$LLAMACPP_ROOT/qinfer_ref"
gcc -O2 -Wall -I "$LLAMACPP_SRC/include" -I "$LLAMACPP_SRC/ggml/include" \
  "$REPO/scripts/llamacpp/qinfer_ref.c" -o "$HELPER" \
  -L "$LLAMACPP_BIN" -lllama -Wl,-rpath,"$LLAMACPP_BIN"

# "Exact" reference model: all tensors dequantized to F32 (same weight values as MODEL).
# llama.cpp on it with -fa off and an f32 KV cache does plain float32 math, without the Q8
# activation quantization that its Q4_1/Q8_0 kernels use.
MODEL_F32="${MODEL_F32:-$LLAMACPP_ROOT/$(basename "$MODEL" .gguf).dequant-f32.gguf}"
if [ ! -s "$MODEL_F32" ]; then
  PYTHONPATH="$LLAMACPP_SRC/gguf-py" python3 "$REPO/scripts/llamacpp/dequant_gguf_f32.py" "$MODEL" "$MODEL_F32.part"
  mv "$MODEL_F32.part" "$MODEL_F32"
fi

export REPO LLAMACPP_SRC LLAMACPP_BIN MODEL MODEL_F32 THREADS HELPER LLAMA_CPP_PYTHON_VERSION
exec python3 - <<'PY'
import ast, hashlib, json, os, re, subprocess, tempfile
import numpy as np

REPO = os.environ["REPO"]
BIN = os.environ["LLAMACPP_BIN"]
SRC = os.environ["LLAMACPP_SRC"]
MODEL = os.environ["MODEL"]
MODEL_F32 = os.environ["MODEL_F32"]
EXACT = ["-fa", "off", "-kv", "f32"]  # with MODEL_F32: exact float32 math
THREADS = int(os.environ["THREADS"])
HELPER = os.environ["HELPER"]
FIX = os.path.join(REPO, "tests/fixtures/smollm2")
TXT = os.path.join(REPO, "tests/fixtures/text")
os.makedirs(FIX, exist_ok=True)
os.makedirs(TXT, exist_ok=True)
TMP = tempfile.mkdtemp(prefix="qinfer_ref_")


def run(cmd, **kw):
    return subprocess.run(cmd, check=True, capture_output=True, **kw)


def write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=True, indent=1)
        f.write("\n")
    print("wrote", os.path.relpath(path, REPO))


# ---------------------------------------------------------------- version info
_v = run([f"{BIN}/llama-completion", "--version"])
ver_out = _v.stderr.decode() + _v.stdout.decode()
m = re.search(r"version: (\S+) \(build (\d+), commit (\w+)\)", ver_out)
commit = None
try:
    commit = run(["git", "-C", SRC, "rev-parse", "HEAD"]).stdout.decode().strip()
except Exception:
    pass
VERSION = {
    "llama_cpp_commit": commit or (m.group(3) if m else "unknown"),
    "llama_cpp_build_info": m.group(0) if m else ver_out.strip(),
    "source": "PyPI sdist llama-cpp-python==%s (vendor/llama.cpp)" % os.environ["LLAMA_CPP_PYTHON_VERSION"],
    "build": "cmake Release, CPU only, GGML_NATIVE=ON, LLAMA_OPENSSL=OFF, BUILD_SHARED_LIBS=ON",
}
VERSION_STR = "llama.cpp %s (llama-cpp-python %s)" % (
    (commit or "unknown")[:10], os.environ["LLAMA_CPP_PYTHON_VERSION"])
h = hashlib.sha256()
with open(MODEL, "rb") as f:
    for blk in iter(lambda: f.read(1 << 20), b""):
        h.update(blk)
MODEL_INFO = {"file": os.path.basename(MODEL), "sha256": h.hexdigest()}


# ---------------------------------------------------------------- tokenizer
def tokenize(text, parse_special=True):
    """llama-tokenize on the exact bytes of text (read verbatim with -f; --no-escape)."""
    p = os.path.join(TMP, "tok.txt")
    with open(p, "wb") as f:
        f.write(text.encode("utf-8"))
    cmd = [f"{BIN}/llama-tokenize", "-m", MODEL, "-f", p, "--ids", "--no-bos",
           "--no-escape", "--log-disable"]
    if not parse_special:
        cmd.append("--no-parse-special")
    out = run(cmd).stdout.decode().strip().splitlines()[-1]
    ids = ast.literal_eval(out)
    if parse_special and "\0" not in text:
        # cross-check against llama_tokenize(add_special=false, parse_special=true)
        ids2 = json.loads(run([HELPER, "-m", MODEL, "tokenize", text]).stdout)
        assert ids == ids2, (text, ids, ids2)
    return ids


def detok(ids):
    return run([HELPER, "-m", MODEL, "detok", ",".join(map(str, ids))]).stdout


TOK_TEXTS = [
    ("english", "The quick brown fox jumps over the lazy dog. It's 5 o'clock, isn't it?"),
    ("cjk", "你好，世界！今天天气很好。"),
    ("emoji_zwj", "👩\u200d👩\u200d👧 🚀🔥"),
    ("whitespace", "a   b\t\t c\n\n\nd   "),
    ("digits", "1234567 3.14159"),
    ("code", 'fn main() {\n    println!("hi");\n}'),
    ("special_tokens", "<|im_start|>user\nhi<|im_end|>\n"),
    ("accented", "Crème brûlée à Noël"),
    ("empty", ""),
]
tok_cases = [{"name": n, "text": t, "ids": tokenize(t)} for n, t in TOK_TEXTS]
tok_cases.append({"name": "special_tokens_unparsed", "text": TOK_TEXTS[6][1],
                  "parse_special": False, "ids": tokenize(TOK_TEXTS[6][1], parse_special=False)})
write_json(os.path.join(FIX, "tokenize.json"), {
    "llama_cpp_version": VERSION_STR, "llama_cpp": VERSION, "model": MODEL_INFO,
    "tool": "llama-tokenize -m MODEL -f FILE --ids --no-bos --no-escape (file read verbatim)",
    "add_bos": False,
    "parse_special": True,
    "notes": "tokenizer.ggml.add_bos_token is false for this model, so --no-bos changes nothing. "
             "Special tokens (<|im_start|> etc.) are parsed as in llama.cpp prompts unless a case "
             "says parse_special=false. Every case was cross-checked against "
             "llama_tokenize(add_special=false, parse_special=true).",
    "cases": tok_cases,
})


# ---------------------------------------------------------------- greedy
def greedy(ids, n, threads=THREADS, model=MODEL, opts=()):
    out = run([HELPER, "-m", model, "-t", str(threads), "-c", "512", *opts, "greedy",
               ",".join(map(str, ids)), str(n)]).stdout
    return json.loads(out)


def completion_text(prompt_text, n):
    """llama-completion with greedy settings; used only as a cross-check of the helper."""
    r = subprocess.run([f"{BIN}/llama-completion", "-m", MODEL, "-p", prompt_text, "--no-escape",
                        "-n", str(n), "--temp", "0", "--top-k", "1", "--repeat-penalty", "1.0",
                        "--ignore-eos", "-no-cnv", "-t", str(THREADS), "-s", "0", "-c", "512",
                        "--no-display-prompt", "--simple-io", "--no-warmup", "-sp"],
                       capture_output=True, stdin=subprocess.DEVNULL)
    return r.stdout


CHAT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
CHAT_SHORT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
PROMPTS = [
    ("chat_capital_france", CHAT),
    ("raw_quick_brown_fox", "The quick brown fox"),
    ("raw_fibonacci_code", "def fibonacci(n):\n"),
]
N_NEW = 64
greedy_cases = []
for name, text in PROMPTS:
    pids = tokenize(text)
    g = greedy(pids, N_NEW)
    new = g["new_ids"]
    fe = g["first_eog"]
    case = {
        "name": name,
        "prompt_text": text,
        "prompt_ids": pids,
        "new_ids": new,
        "text": detok(new).decode("utf-8", errors="replace"),
        "first_eog_index": fe,
        "text_until_eog": detok(new[:fe] if fe >= 0 else new).decode("utf-8", errors="replace"),
        "margins": [round(x, 4) for x in g["margins"]],
    }
    # cross-check with llama-completion --ignore-eos (identical only up to the first EOG:
    # --ignore-eos bans EOG tokens, the helper feeds the argmax EOG back instead)
    ct = completion_text(text, N_NEW)
    ref = detok(new[:fe] if fe >= 0 else new)
    # (llama-completion prints a trailing newline or two after the generated text)
    case["llama_completion_agrees"] = ct.startswith(ref) and (fe >= 0 or ct[len(ref):].strip() == b"")
    # thread-count check
    case["same_with_1_thread"] = greedy(pids, N_NEW, threads=1)["new_ids"] == new
    # exact float32 math on the same weights (see logits.json); an engine that dequantizes
    # to f32 and does not quantize activations should follow this one
    ge = greedy(pids, N_NEW, model=MODEL_F32, opts=EXACT)
    agree = 0
    while agree < N_NEW and ge["new_ids"][agree] == new[agree]:
        agree += 1
    case["exact_f32"] = {
        "new_ids": ge["new_ids"],
        "text": detok(ge["new_ids"]).decode("utf-8", errors="replace"),
        "first_eog_index": ge["first_eog"],
        "margins": [round(x, 4) for x in ge["margins"]],
        "common_prefix_with_new_ids": agree,
    }
    greedy_cases.append(case)

write_json(os.path.join(FIX, "greedy.json"), {
    "llama_cpp_version": VERSION_STR, "llama_cpp": VERSION, "model": MODEL_INFO,
    "threads": THREADS,
    "method": "scripts/llamacpp/qinfer_ref.c greedy: prompt decoded in one llama_decode batch "
              "(n_ctx=n_batch=n_ubatch=512), then one token per llama_decode; next token = argmax of "
              "llama_get_logits_ith (ties -> lowest id). No sampler, no repeat penalty, no BOS added "
              "(add_bos_token=false). EOS/EOG does NOT stop generation: the argmax token is fed "
              "back even when it is <|im_end|>/<|endoftext|>; first_eog_index is the index in new_ids "
              "of the first EOG token (-1 if none), text_until_eog the text before it. "
              "margins[i] = top1 - top2 logit at step i (small margins = fragile steps). "
              "llama_completion_agrees: llama-completion --temp 0 --top-k 1 --repeat-penalty 1.0 "
              "--ignore-eos produced the same text (up to the first EOG). "
              "exact_f32: the same greedy loop run on an all-F32 dequantized copy of the model with "
              "flash attention off and an f32 KV cache (exact float32 math on the same weights, no Q8 "
              "activation quantization); common_prefix_with_new_ids = number of leading tokens equal "
              "to new_ids.",
    "cases": greedy_cases,
})


# ---------------------------------------------------------------- logits
def logits(ids, path, threads=THREADS, model=MODEL, opts=()):
    out = run([HELPER, "-m", model, "-t", str(threads), "-c", "512", *opts, "logits",
               ",".join(map(str, ids)), path]).stdout
    return json.loads(out)


def load(ids, **kw):
    p = os.path.join(TMP, "l.npy")
    logits(ids, p, **kw)
    return np.load(p)


def lse(a):
    a = a.astype(np.float64)
    m = a.max(1, keepdims=True)
    return (np.log(np.exp(a - m).sum(1, keepdims=True)) + m)[:, 0]


def topk_rows(a, k):
    idx = np.argsort(-a, axis=1, kind="stable")[:, :k]
    return {"top_ids": idx.tolist(),
            "top_logits": [[round(float(a[r, j]), 4) for j in row] for r, row in enumerate(idx)],
            "logsumexp": [round(float(x), 4) for x in lse(a)]}


def diff_stats(a, ref):
    """a vs ref: logit max/mean abs diff, argmax agreement, KL(ref || a) per row (nats)."""
    la = a.astype(np.float64) - lse(a)[:, None]
    lr = ref.astype(np.float64) - lse(ref)[:, None]
    kl = (np.exp(lr) * (lr - la)).sum(1)
    return {"max_abs": round(float(np.abs(a - ref).max()), 4),
            "mean_abs": round(float(np.abs(a - ref).mean()), 5),
            "argmax_agree": round(float((a.argmax(1) == ref.argmax(1)).mean()), 4),
            "kl_mean": round(float(kl.mean()), 6), "kl_max": round(float(kl.max()), 6)}


MAX_T = 16
fox = next(c for c in greedy_cases if c["name"] == "raw_quick_brown_fox")
short_ids = tokenize(CHAT_SHORT)
short_new = greedy(short_ids, MAX_T)["new_ids"]
LOGIT_CASES = [
    ("fox", fox["prompt_ids"] + fox["new_ids"], len(fox["prompt_ids"])),
    ("chat", short_ids + short_new, len(short_ids)),
]
logit_meta = []
for name, seq, n_prompt in LOGIT_CASES:
    seq = seq[:MAX_T]
    path = os.path.join(FIX, f"logits_{name}.npy")
    info = logits(seq, path)
    a = np.load(path)
    assert a.dtype == np.float32 and a.shape == (len(seq), info["n_vocab"])
    d1 = float(np.abs(load(seq, threads=1) - a).max())
    exact = load(seq, model=MODEL_F32, opts=EXACT)
    # validate the exact reference against an independent float64 numpy forward pass
    pn = os.path.join(TMP, "np.npy")
    subprocess.run(["python3", os.path.join(REPO, "scripts/llamacpp/numpy_ref.py"), MODEL,
                    ",".join(map(str, seq)), pn], check=True,
                   env=dict(os.environ, PYTHONPATH=os.path.join(SRC, "gguf-py")))
    f64 = np.load(pn)
    logit_meta.append({
        "name": name, "file": os.path.basename(path), "text": detok(seq).decode("utf-8", "replace"),
        "ids": seq, "n_prompt_ids": n_prompt, "shape": list(a.shape), "dtype": "float32",
        "argmax": info["argmax"],
        "max_abs_diff_vs_1_thread": d1,
        "vs_exact_f32": diff_stats(a, exact),
        "fa_off_vs_exact_f32": diff_stats(load(seq, opts=["-fa", "off"]), exact),
        "fa_off_kv_f32_vs_exact_f32": diff_stats(load(seq, opts=EXACT), exact),
        "prompt_only_batch_vs_this": diff_stats(load(seq[:n_prompt])[:n_prompt], a[:n_prompt])
            if n_prompt < len(seq) else None,
        "exact_f32_vs_numpy_f64_max_abs": round(float(np.abs(exact - f64).max()), 6),
        "exact_f32": topk_rows(exact, 16),
    })
    print("wrote", os.path.relpath(path, REPO), a.shape)

# top-5 (teacher-forced, all positions) for the longer greedy sequences: checks larger
# positions without storing full rows.
topk = []
for c in greedy_cases:
    seq = c["prompt_ids"] + c["new_ids"]
    a = load(seq)
    exact = load(seq, model=MODEL_F32, opts=EXACT)
    topk.append({
        "name": c["name"], "ids": seq,
        "llama_cpp": topk_rows(a, 5),
        "exact_f32": topk_rows(exact, 5),
        "llama_cpp_vs_exact_f32": diff_stats(a, exact),
    })

write_json(os.path.join(FIX, "logits.json"), {
    "llama_cpp_version": VERSION_STR, "llama_cpp": VERSION, "model": MODEL_INFO,
    "threads": THREADS,
    "method": "scripts/llamacpp/qinfer_ref.c logits: all ids in ONE llama_decode batch with "
              "logits requested for every position (teacher forcing), positions 0..n-1, no BOS. "
              "Row i of the .npy = logits after consuming ids[0..=i] (predicts ids[i+1]). "
              ".npy files are little-endian float32, C order, shape [n_tokens, n_vocab=49152]. "
              "Each sequence is a prompt followed by llama.cpp's greedy continuation. "
              "max_abs_diff_vs_1_thread: the same run with 1 thread instead of %d. "
              "IMPORTANT: llama.cpp's quantized kernels round activations to Q8 blocks before "
              "every Q4_1/Q8_0 matmul, and this small model amplifies that rounding, so its logits "
              "are ~0.2 (mean) / ~2-3 (max) logits away from exact math on the same weights; "
              "even llama.cpp's own flash-attention on/off or the batch the tokens are decoded in "
              "changes logits by as much. exact_f32 = llama.cpp run on an all-F32 dequantized copy "
              "of the model (scripts/llamacpp/dequant_gguf_f32.py) with flash attention off and an "
              "f32 KV cache: plain float32 math, validated against an independent float64 numpy "
              "forward pass (scripts/llamacpp/numpy_ref.py; exact_f32_vs_numpy_f64_max_abs). Its "
              "top-16 ids/logits and row logsumexp are stored per position. diff_stats: "
              "max_abs/mean_abs logit differences, argmax_agree fraction, kl_mean/kl_max = "
              "KL(reference || this) in nats per position." % THREADS,
    "cases": logit_meta,
    "topk_method": "same teacher-forced batch over prompt_ids+new_ids of each greedy.json case "
                   "(llama.cpp's Q4_1 new_ids), with MODEL (llama_cpp) and with the exact F32 "
                   "reference (exact_f32); top-5 ids (descending logit, ties -> lower id) and their "
                   "logits per position, plus logsumexp of each row (log-probs = logit - logsumexp).",
    "topk": topk,
})


# ---------------------------------------------------------------- perplexity
GPL = "/usr/share/common-licenses/GPL-3"
lines = open(GPL, encoding="utf-8").read().split("\n")
# smallest paragraph-aligned prefix with >= 4*512 + 64 tokens (after llama-perplexity
# strips the single trailing newline) -> exactly 4 chunks of 512
N_CTX, MIN_TOKENS = 512, 4 * 512 + 64
excerpt = None
for n in range(1, len(lines)):
    if lines[n].strip() != "":
        continue
    cand = "\n".join(lines[:n]) + "\n"
    if len(tokenize(cand[:-1], parse_special=False)) >= MIN_TOKENS:
        excerpt = cand
        n_lines = n
        break
assert excerpt is not None
txt_path = os.path.join(TXT, "gpl3_excerpt.txt")
with open(txt_path, "w", encoding="utf-8") as f:
    f.write(excerpt)
print("wrote", os.path.relpath(txt_path, REPO), len(excerpt.encode()), "bytes")

ppl_tokens = tokenize(excerpt[:-1], parse_special=False)
r = subprocess.run([f"{BIN}/llama-perplexity", "-m", MODEL, "-f", txt_path, "-c", str(N_CTX),
                    "-t", str(THREADS)], capture_output=True, stdin=subprocess.DEVNULL)
log = r.stdout.decode() + "\n" + r.stderr.decode()
with open(os.path.join(TMP, "perplexity.log"), "w") as f:
    f.write(log)
assert r.returncode == 0, log[-3000:]
mc = re.search(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+), batch_size=(\d+), n_seq=(\d+)", log)
mf = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", log)
chunks = [float(x) for x in re.findall(r"\[\d+\]([0-9.]+),", log)]
n_chunks = int(mc.group(1))
assert n_chunks == 4, n_chunks
first = N_CTX // 2

# independent re-computation from teacher-forced logits (validates the description below)
nll = []
for c in range(n_chunks):
    seq = ppl_tokens[c * N_CTX:(c + 1) * N_CTX]
    p = os.path.join(TMP, "chunk.npy")
    logits(seq, p)
    a = np.load(p).astype(np.float64)
    for pos in range(first, N_CTX - 1):
        row = a[pos]
        lse = np.log(np.exp(row - row.max()).sum()) + row.max()
        nll.append(lse - row[seq[pos + 1]])
nll = np.array(nll)
ppl_check = float(np.exp(nll.mean()))

# the same perplexity run with exact float32 math (F32 copy, no flash attention, f32 KV)
r2 = subprocess.run([f"{BIN}/llama-perplexity", "-m", MODEL_F32, "-f", txt_path, "-c", str(N_CTX),
                     "-t", str(THREADS), "-fa", "off", "-ctk", "f32", "-ctv", "f32"],
                    capture_output=True, stdin=subprocess.DEVNULL)
log2 = r2.stdout.decode() + "\n" + r2.stderr.decode()
assert r2.returncode == 0, log2[-3000:]
mf2 = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", log2)

write_json(os.path.join(FIX, "perplexity.json"), {
    "llama_cpp_version": VERSION_STR, "llama_cpp": VERSION, "model": MODEL_INFO,
    "command": "llama-perplexity -m MODEL -f tests/fixtures/text/gpl3_excerpt.txt -c 512 -t %d" % THREADS,
    "text_file": "tests/fixtures/text/gpl3_excerpt.txt",
    "text_source": "first %d lines of /usr/share/common-licenses/GPL-3 (Debian), verbatim, plus a final newline" % n_lines,
    "ppl": float(mf.group(1)),
    "ppl_stderr": float(mf.group(2)),
    "ppl_after_each_chunk": chunks,
    "n_ctx": int(mc.group(2)),
    "n_chunks": n_chunks,
    "batch_size": int(mc.group(3)),
    "n_seq": int(mc.group(4)),
    "threads": THREADS,
    "n_tokens": len(ppl_tokens),
    "tokens_used": n_chunks * N_CTX,
    "add_bos": False,
    "scored_tokens_per_chunk": N_CTX - first - 1,
    "scored_tokens_total": n_chunks * (N_CTX - first - 1),
    "method": "llama-perplexity reads the file and strips ONE trailing newline, tokenizes the whole "
              "text once (add_special=true but the vocab has add_bos_token=false so NO BOS is added "
              "and no token is replaced by BOS; special tokens are not parsed), and cuts it into "
              "n_chunks = n_tokens // n_ctx non-overlapping chunks tokens[i*512:(i+1)*512] (the tail "
              "is dropped). Each chunk is evaluated from an empty KV cache at positions 0..511 (with "
              "the default -b 2048 all 4 chunks go into one batch as 4 sequences, n_seq=4). Only "
              "the second half is scored: logits at positions 256..510 predict tokens 257..511, "
              "i.e. 255 tokens per chunk. PPL = exp(mean NLL) over all scored tokens; '+/-' is "
              "ppl * stddev(NLL)/sqrt(count-1). ppl_after_each_chunk is the running value printed "
              "as [i]value.",
    "ppl_recomputed_from_helper_logits": ppl_check,
    "exact_f32": {
        "command": "llama-perplexity -m <all-F32 dequantized copy> -f ... -c 512 -t %d -fa off -ctk f32 -ctv f32" % THREADS,
        "ppl": float(mf2.group(1)), "ppl_stderr": float(mf2.group(2)),
        "ppl_after_each_chunk": [float(x) for x in re.findall(r"\[\d+\]([0-9.]+),", log2)],
        "note": "same chunks and scoring; exact float32 math on the same weight values",
    },
    "tokens": ppl_tokens,
})
print("PPL", mf.group(1), "+/-", mf.group(2), "check", ppl_check, "exact_f32", mf2.group(1))
PY

# Greedy under llama.cpp's quantized matmuls with f32 attention (flash attention off, f32 KV
# cache): the configuration qinfer's CPU backend reproduces (tests/smollm2_llamacpp.rs).
python3 - "$HELPER" "$MODEL" "$THREADS" "$REPO/tests/fixtures/smollm2" <<'PY'
import json, subprocess, sys
helper, model, threads, fix = sys.argv[1:5]
g = json.load(open(f"{fix}/greedy.json"))
cases = []
for c in g["cases"]:
    ids = ",".join(map(str, c["prompt_ids"]))
    out = subprocess.run([helper, "-m", model, "-t", threads, "-fa", "off", "-kv", "f32", "greedy", ids, "64"],
                         capture_output=True, text=True, check=True)
    ref = json.loads(out.stdout)
    cases.append({"name": c["name"], "prompt_ids": c["prompt_ids"], "new_ids": ref["new_ids"],
                  "margins": ref["margins"], "first_eog_index": ref.get("first_eog", -1)})
json.dump({"llama_cpp_version": g["llama_cpp_version"], "llama_cpp": g["llama_cpp"], "model": g["model"],
           "threads": int(threads),
           "method": "scripts/llamacpp/qinfer_ref.c -fa off -kv f32 greedy IDS 64: llama.cpp with flash "
                     "attention off and an f32 KV cache, so its arithmetic is its Q8_1/Q8_0 activation-quantized "
                     "matmuls plus f32 attention. Prompt decoded in one batch, then one token per llama_decode, "
                     "argmax (ties -> lowest id), EOS not a stop condition. margins[i] = top1 - top2 logit at step i.",
           "cases": cases}, open(f"{fix}/greedy_fa_off_kv_f32.json", "w"), indent=1)
PY
