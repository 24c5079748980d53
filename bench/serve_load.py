"""Load and soak for `qinfer serve` (127.0.0.1 only, bounded in time).

C concurrent streaming clients send chat requests with random prompt and
output lengths for DURATION seconds; a share of them cancel mid-stream and a
share send malformed requests. At the end: zero unexpected errors, zero KV
blocks held and no request running (read from /metrics), and the server's
resident memory after warm-up against the end. Prints and writes a JSON
report: requests/s, output tok/s, TTFT and TPOT p50/p99.

    python bench/serve_load.py --qinfer target/release/qinfer [--model PATH]
        [--concurrency 64] [--duration 600] [--cancel 0.1] [--malformed 0.05]
        [--out bench/results/serve-load.json] [-- extra serve flags]

Needs the `openai` package (pip install openai).
"""

import argparse
import json
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai

WORDS = "the sea river mountain city light night story song garden winter summer bridge road".split()


def percentile(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--qinfer", required=True)
    ap.add_argument("--model")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--duration", type=float, default=600)
    ap.add_argument("--cancel", type=float, default=0.10)
    ap.add_argument("--malformed", type=float, default=0.05)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--out")
    ap.add_argument("serve_args", nargs="*")
    a = ap.parse_args()

    cmd = [a.qinfer, "serve", "--port", "0", *(["--model", a.model] if a.model else []), *a.serve_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        m = re.search(r"listening on (http://[0-9.:]+)", proc.stderr.readline())
        assert m, "the server printed no address"
        url = m.group(1)
        threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
        while True:
            try:
                if urllib.request.urlopen(url + "/health").status == 200:
                    break
            except urllib.error.HTTPError:
                time.sleep(0.2)
        name = json.load(urllib.request.urlopen(url + "/v1/models"))["data"][0]["id"]
        report = run(a, url, name, proc.pid)
        report["command"] = " ".join(cmd)
        print(json.dumps(report, indent=1))
        if a.out:
            with open(a.out, "w") as f:
                json.dump(report, f, indent=1)
        if report["unexpected_errors"] or report["end"]["kv_blocks_used"] or report["end"]["num_requests_running"]:
            sys.exit(1)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def metrics(url):
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    return {k: float(v) for k, v in re.findall(r"^qinfer:(\w+) (\S+)$", text, re.M)}


def run(a, url, name, pid):
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    lock = threading.Lock()
    stats = {"ok": 0, "cancelled": 0, "malformed_answered_4xx": 0, "unexpected_errors": [], "ttft": [], "tpot": [], "tokens": 0}
    stop_at = time.time() + a.duration
    rss = {}

    def one(rng):
        kind = rng.random()
        if kind < a.malformed:
            body = rng.choice([b"{not json", b'{"messages": "x"}', b'{"messages": [{"role": "user", "content": "x"}], "temperature": -1}'])
            req = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={"content-type": "application/json"})
            try:
                urllib.request.urlopen(req)
                with lock:
                    stats["unexpected_errors"].append("a malformed request was accepted")
            except urllib.error.HTTPError as e:
                with lock:
                    if 400 <= e.code < 500:
                        stats["malformed_answered_4xx"] += 1
                    else:
                        stats["unexpected_errors"].append(f"malformed request answered {e.code}")
            return
        cancel = kind < a.malformed + a.cancel
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 200)))
        max_tokens = rng.randint(8, a.max_output)
        t0 = time.time()
        first = None
        n = 0
        try:
            stream = client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": f"Write about: {prompt}"}], max_tokens=max_tokens,
                temperature=0.8, stream=True, stream_options={"include_usage": True})
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    if first is None:
                        first = time.time()
                if chunk.usage:
                    n = chunk.usage.completion_tokens
                if cancel and first is not None and time.time() - first > 0.2:
                    stream.close()
                    with lock:
                        stats["cancelled"] += 1
                    return
            end = time.time()
            with lock:
                stats["ok"] += 1
                stats["tokens"] += n
                if first is not None:
                    stats["ttft"].append(first - t0)
                    if n > 1:
                        stats["tpot"].append((end - first) / (n - 1))
        except Exception as e:  # every failure of a well-formed request is unexpected
            with lock:
                stats["unexpected_errors"].append(repr(e)[:300])

    def worker(seed):
        rng = random.Random(seed)
        while time.time() < stop_at:
            one(rng)

    t0 = time.time()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(a.concurrency)]
    [t.start() for t in threads]
    time.sleep(min(30, a.duration / 4))
    rss["after_warmup_kib"] = rss_kib(pid)
    [t.join() for t in threads]
    elapsed = time.time() - t0
    time.sleep(1)
    rss["end_kib"] = rss_kib(pid)
    end = metrics(url)
    return {
        "concurrency": a.concurrency,
        "duration_s": round(elapsed, 1),
        "requests_ok": stats["ok"],
        "requests_cancelled": stats["cancelled"],
        "malformed_answered_4xx": stats["malformed_answered_4xx"],
        "unexpected_errors": stats["unexpected_errors"],
        "requests_per_s": round((stats["ok"] + stats["cancelled"]) / elapsed, 2),
        "output_tok_per_s_completed": round(stats["tokens"] / elapsed, 1),
        "ttft_s": {"p50": percentile(stats["ttft"], 50), "p99": percentile(stats["ttft"], 99)},
        "tpot_s": {"p50": percentile(stats["tpot"], 50), "p99": percentile(stats["tpot"], 99)},
        "rss": rss,
        "end": {k: end.get(k) for k in ("kv_blocks_used", "num_requests_running", "num_requests_waiting",
                                        "request_aborted_total", "request_success_total", "generation_tokens_total")},
    }


if __name__ == "__main__":
    main()
