"""Paired decode timing of environment variants: which kernel option pays end to end.

    python3 recipes/decode_variants.py CKPT "" "RLT_QKV_EPILOGUE=0" "RLT_PDL=0" [--rounds 2] [--concurrency 64]

Each variant is a space-separated list of NAME=VALUE settings ("" is the defaults). Per variant
and round a fresh engine (graphs captured under that variant) prefills `--concurrency` random
512-token prompts (KV_CACHE_DTYPE=fp8 in a variant stores float8 KV) and times 5 windows of 30
synchronous decode steps; the median window is its ms/step.
Variants alternate within each round, so drift on the machine hits all of them alike. Standalone
kernel benchmarks miss what matters here: under PDL a kernel's weight reads overlap the
previous kernel's latency, which only the whole step shows.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch

from rlt_serve.bench import free_device_memory, start_decoding
from rlt_serve.engine.llm_engine import LLMEngine
from rlt_serve.sampling_params import SamplingParams


def ms_per_step(ckpt: str, concurrency: int = 1, windows: int = 5, steps: int = 30) -> float:
    e = LLMEngine(ckpt, dtype="bfloat16", device="cuda", skip_tokenizer_init=True, max_num_seqs=concurrency,
                  max_model_len=1024, max_num_batched_tokens=max(2048, min(16384, 512 * concurrency)),
                  kv_cache_dtype=os.environ.get("KV_CACHE_DTYPE", "auto"))  # fmt: skip
    try:
        p = SamplingParams(temperature=0.0, max_tokens=windows * steps + 20, ignore_eos=True, detokenize=False)
        rng = random.Random(0)
        start_decoding(e, [[rng.randrange(3, 30000) for _ in range(512)] for _ in range(concurrency)], p, "r")
        for _ in range(5):
            e.step()
        times = []
        for _ in range(windows):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                e.step()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) / steps * 1e3)
    finally:  # a variant that fails still gives its memory back to the next
        del e
        free_device_memory(torch.device("cuda"))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=1, help="decode rows (each a 512-token prompt)")
    args = ap.parse_args()
    base = dict(os.environ)
    results: dict[str, list[float]] = {v: [] for v in args.variants}
    for rnd in range(args.rounds):
        for v in args.variants:
            os.environ.clear()
            os.environ.update(base)
            os.environ.update(kv.split("=", 1) for kv in v.split())
            try:
                results[v].append(ms_per_step(args.ckpt, args.concurrency))
            except Exception as e:  # a variant that fails to compile or run is reported, not fatal
                print(f"round {rnd} {v}: {type(e).__name__}: {str(e)[:400]}", flush=True)
                results[v].append(float("inf"))
                continue
            print(f"round {rnd} {v or '(defaults)':<40} {results[v][-1]:.3f} ms/step", flush=True)
    os.environ.clear()
    os.environ.update(base)
    first = min(results[args.variants[0]])
    print(f"\n{'variant':<40}{'best ms':>9}{'worst ms':>10}{'vs first':>10}")
    for v, ts in results.items():
        print(f"{v or '(defaults)':<40}{min(ts):>9.3f}{max(ts):>10.3f}{min(ts) / first:>9.3f}x")


if __name__ == "__main__":
    main()
