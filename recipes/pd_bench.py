"""1 prefill + 1 decode worker against one `both` worker, over the real HTTP server.

    python recipes/pd_bench.py --model DIR [--num-prompts 8,64 --concurrency 1,16 --input-len 1024 --output-len 128]
        [--launch-args "--dtype bfloat16 --num-kv-pages 2000"] [--pd-args "--kv-transport nixl"] [--json out.json]

For each setup it starts `rlt-serve launch` (both: `--workers 1`; PD: `--prefill 1 --decode 1`,
two processes sharing the visible GPU), waits for /health, sends the same streaming requests
(random prompt ids, greedy, ignore_eos) at each concurrency (one launch serves them all) and
measures, per request, TTFT and inter-token latency from SSE arrival times (p50, p90, p99), plus
throughput over the run; for PD it reads the transfer counters from
/metrics (bytes sent, writes, summed write time, per-request transfer time). The client is the
standard library only, so it runs where the server's wheels are all that is installed.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _launch(model: str, args: list[str], timeout: float) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "rlt_serve.cli", "launch", "--model", model, "--served-model-name", "m",
           "--port", "0", *args]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    url: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            sys.stderr.write("  | " + line)
            m = re.search(r"serving .* at (http://\S+)", line)
            if m:
                url.append(m.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(timeout) or not url:
        _stop(proc)
        raise RuntimeError(f"launch did not start: {' '.join(cmd)}")
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if _get(url[0], "/health")[0] == 200:
                return proc, url[0]
        except OSError:
            pass
        time.sleep(0.5)
    _stop(proc)
    raise RuntimeError("server never became healthy")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def write_bench_tokenizer(model: str, vocab: int) -> None:
    """A random checkpoint has no tokenizer; the router needs one that decodes every id to some
    text (ids past a tokenizer's vocabulary decode to nothing, and a token without text would be
    missing from the SSE stream): one word per id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins the words with spaces
    tok.save(os.path.join(model, "tokenizer.json"))


def _conn(base: str) -> http.client.HTTPConnection:
    u = urlparse(base)
    return http.client.HTTPConnection(u.hostname, u.port, timeout=600)


def _get(base: str, path: str) -> tuple[int, str]:
    c = _conn(base)
    c.request("GET", path)
    r = c.getresponse()
    return r.status, r.read().decode()


def _metrics(base: str) -> dict[str, float]:
    out = {}
    for line in _get(base, "/metrics")[1].splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def _sum(m: dict[str, float], name: str, **labels: str) -> float:
    return sum(v for k, v in m.items() if k.split("{")[0] == name and all(f'{a}="{b}"' in k for a, b in labels.items()))


def _one(base: str, prompt: list[int], output_len: int) -> dict:
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
                       "ignore_eos": True, "stream": True}).encode()  # fmt: skip
    c = _conn(base)
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:500]!r}")
    stamps: list[float] = []
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise RuntimeError(chunk["error"]["message"])
        if chunk["choices"] and chunk["choices"][0].get("text"):
            stamps.append(time.perf_counter())
    return {"ttft": stamps[0] - t0, "itl": [b - a for a, b in zip(stamps, stamps[1:])], "e2e": time.perf_counter() - t0,
            "tokens": len(stamps)}  # fmt: skip


def _run(base: str, prompts: list[list[int]], output_len: int, concurrency: int) -> dict:
    before = _metrics(base)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: _one(base, p, output_len), prompts))
    wall = time.perf_counter() - t0
    time.sleep(1.5)  # workers send their metrics once a second: let the last counts arrive
    after = _metrics(base)

    def delta(name: str, **labels: str) -> float:
        return _sum(after, name, **labels) - _sum(before, name, **labels)

    ttft = sorted(r["ttft"] for r in results)
    itl = sorted(x for r in results for x in r["itl"])

    def pct(xs: list[float], q: float) -> float:
        return 1e3 * xs[round(q * (len(xs) - 1))] if xs else 0.0

    out = {
        "requests": len(results), "wall_s": wall,
        "output_tok_s": sum(r["tokens"] for r in results) / wall,
        "ttft_p50_ms": 1e3 * statistics.median(ttft), "ttft_p90_ms": pct(ttft, 0.9), "ttft_p99_ms": pct(ttft, 0.99),
        "itl_p50_ms": 1e3 * statistics.median(itl) if itl else 0.0, "itl_p90_ms": pct(itl, 0.9),
        "itl_p99_ms": pct(itl, 0.99),
    }  # fmt: skip
    sent = delta("rlt:kv_transfer_bytes_total", direction="sent")
    if sent:
        writes = delta("rlt:kv_transfer_write_seconds_count")
        write_s = delta("rlt:kv_transfer_write_seconds_sum")
        req_n = delta("rlt:kv_transfer_request_seconds_count", role="prefill")
        req_s = delta("rlt:kv_transfer_request_seconds_sum", role="prefill")
        out.update(
            kv_bytes_sent=sent, kv_writes=writes, kv_GiB_s_per_write=sent / write_s / 2**30 if write_s else 0.0,
            kv_GiB_s_over_run=sent / wall / 2**30, prefill_transfer_ms_mean=1e3 * req_s / req_n if req_n else 0.0,
            handoff_ms_mean=1e3 * delta("rlt:pd_handoff_seconds_sum") / max(1.0, delta("rlt:pd_handoff_seconds_count")),
            transfer_failures=delta("rlt:kv_transfer_failures_total"), pd_failures=delta("rlt:pd_failures_total"),
        )  # fmt: skip
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--num-prompts", default="64", help="per concurrency (comma-separated, or one for all)")
    p.add_argument("--concurrency", default="16", help="comma-separated: each is measured on the same launch")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--warmup", type=int, default=4, help="unmeasured requests first")
    p.add_argument("--launch-args", default="", help="for both setups (dtype, pages, ...)")
    p.add_argument("--both-args", default="--workers 1")
    p.add_argument("--pd-args", default="--prefill 1 --decode 1 --kv-transport nixl")
    p.add_argument("--setups", default="both,pd")
    p.add_argument("--load-timeout", type=float, default=900.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    with open(os.path.join(args.model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    if not os.path.exists(os.path.join(args.model, "tokenizer.json")):
        write_bench_tokenizer(args.model, vocab)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    counts = [int(n) for n in args.num_prompts.split(",")]
    counts = counts * len(concurrencies) if len(counts) == 1 else counts
    if len(counts) != len(concurrencies):
        p.error("--num-prompts needs one value, or one per --concurrency")
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(args.input_len)] for _ in range(max(counts))]
    results: dict[str, dict] = {}
    failed = False
    for name in args.setups.split(","):
        extra = shlex.split(args.launch_args) + shlex.split(args.both_args if name == "both" else args.pd_args)
        print(f"== {name}: rlt-serve launch {' '.join(extra)}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:  # one setup failing still leaves the other's numbers (a device run is precious)
            proc, base = _launch(args.model, extra, args.load_timeout)
        except RuntimeError as e:
            print(f"== {name}: FAILED: {e}", file=sys.stderr, flush=True)
            failed = True
            continue
        print(f"== {name}: healthy after {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
        try:
            _run(base, prompts[: args.warmup], args.output_len, max(concurrencies))
            for c, n in zip(concurrencies, counts):
                results[f"{name} c={c}"] = _run(base, prompts[:n], args.output_len, c)
                print(f"== {name} c={c}: {json.dumps(results[f'{name} c={c}'])}", file=sys.stderr, flush=True)
        except (RuntimeError, OSError) as e:
            print(f"== {name}: FAILED: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            failed = True
        finally:
            _stop(proc)
    first = ["ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms", "itl_p90_ms", "output_tok_s", "handoff_ms_mean"]
    seen = {k for r in results.values() for k in r}
    keys = [k for k in first if k in seen] + sorted(seen - set(first))
    print("| metric | " + " | ".join(results) + " |")
    print("|---|" + "---|" * len(results))
    for k in keys:
        print(f"| {k} | " + " | ".join(f"{r[k]:.4g}" if k in r else "-" for r in results.values()) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
