"""Where a decode step's time goes: kernel table (torch.profiler) and host time per step.

    [KV_CACHE_DTYPE=fp8] [ASYNC_SCHEDULING=1] python3 recipes/profile_decode.py CKPT [concurrency ...]
    PREFILL=512 python3 recipes/profile_decode.py CKPT   (time to first token of one prompt instead)

Prefills `concurrency` random 512-token prompts, then profiles 8 steady decode steps. With PDL
kernels overlap, so summed kernel times overstate the step; the second table charges each kernel
only the time it extends the GPU timeline past everything that started before it (and counts the
idle gaps), which adds up to the device span of the steps. The host line is the profiled wall time
less the time the host thread spent inside CUDA synchronize calls and device-to-pageable copies (which
block until the copy is done): the host work per step. PREFILL=N profiles one N-token prompt to its
first token (fresh tokens each time, so prefix caching never hits) with the same tables per prompt.
"""

from __future__ import annotations

import cProfile
import json
import os
import pstats
import random
import re
import sys
import tempfile
import time
from collections import defaultdict
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from rlt_serve.bench import free_device_memory, start_decoding
from rlt_serve.engine.llm_engine import LLMEngine
from rlt_serve.sampling_params import SamplingParams


_KINDS = [("gemv_reduce", "_reduce_kernel"), ("gemv", "_gemv_kernel"), ("attention", "attention|decode_mha"),
          ("combine", "combine"), ("write_kv", "write_kv"), ("norm", "norm"), ("rope", "rope"),
          ("silu", "silu"), ("cublas", "gemm|gemv|cutlass|sm90")]


def _kind(name: str) -> str:
    return next((k for k, pat in _KINDS if re.search(pat, name)), "other")


def print_timeline(prof: profile, steps: int, wall_us: float) -> None:
    """Marginal device time per kernel kind: what each adds to the timeline once overlaps are removed."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    kernels = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") == "kernel")
    if not kernels:
        print("no kernel events in the trace")
        return
    marginal: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    idle, frontier = 0.0, kernels[0][0]
    for start, end, name in kernels:
        kind = _kind(name)
        if start > frontier:
            idle += start - frontier
        marginal[kind] += max(0.0, end - max(start, frontier))
        count[kind] += 1
        frontier = max(frontier, end)
    span = kernels[-1][1] - kernels[0][0]
    # a device-to-host copy into pageable memory blocks inside cudaMemcpyAsync (the synchronous engine's
    # read); other copy calls return at once, so only those whose device copy is one count as waiting
    blocking = {e.get("args", {}).get("correlation") for e in events
                if e.get("cat") == "gpu_memcpy" and "DtoH" in e["name"] and "Pageable" in e["name"]} - {None}
    waits = sum(e["dur"] for e in events if e.get("cat") == "cuda_runtime" and (
        "Synchronize" in e["name"] or ("Memcpy" in e["name"] and e.get("args", {}).get("correlation") in blocking)))
    print(f"timeline: {span / steps / 1e3:.3f} ms/step device span, {idle / steps / 1e3:.3f} ms/step idle")
    print(f"host: {(wall_us - waits) / steps / 1e3:.3f} ms/step outside synchronize and blocking copy calls "
          f"({waits / steps / 1e3:.3f} ms/step waiting)")
    print(f"{'kind':<12}{'calls/step':>11}{'ms/step':>9}{'us/call':>9}")
    for kind, t in sorted(marginal.items(), key=lambda kv: -kv[1]):
        print(f"{kind:<12}{count[kind] / steps:>11.0f}{t / steps / 1e3:>9.3f}{t / count[kind]:>9.2f}")


def print_host_profile(run: Callable[[], None], times: int, sort: str = "tottime", lines: int = 25) -> None:
    """The Python functions the host spends `times` calls of `run` in (cProfile inflates each call,
    so read the ranking, not the absolute times)."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(times):
        run()
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats(sort).print_stats(lines)


def profile_prefill(ckpt: str, prompt_len: int, runs: int = 3) -> None:
    """Time to first token of one `prompt_len`-token prompt: wall, device span, idle and kernels."""
    e = LLMEngine(ckpt, dtype="bfloat16", device="cuda", skip_tokenizer_init=True, max_num_seqs=1,
                  max_model_len=prompt_len + 16, max_num_batched_tokens=16384, long_prefill_token_threshold=2048)
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)

    def first_token(i: int) -> None:
        e.add_request(f"p{i}", [rng.randrange(3, e.model_config.vocab_size) for _ in range(prompt_len)], params)
        while e.has_unfinished_requests():
            e.step()
        torch.cuda.synchronize()

    for i in range(2):  # compiles the shapes
        first_token(i)
    walls = []
    for i in range(5):
        t0 = time.perf_counter()
        first_token(10 + i)
        walls.append((time.perf_counter() - t0) * 1e3)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for i in range(runs):
            first_token(20 + i)
        wall_us = (time.perf_counter() - t0) * 1e6
    print(f"\n=== one {prompt_len}-token prompt to its first token: {sorted(walls)[2]:.2f} ms wall (median of 5)")
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))
    print("(per prompt below: 'step' = one prompt's prefill)")
    print_timeline(prof, steps=runs, wall_us=wall_us)
    ids = iter(range(30, 30 + runs))
    print_host_profile(lambda: first_token(next(ids)), runs, sort="cumulative", lines=45)


def main() -> None:
    ckpt = sys.argv[1]
    if os.environ.get("PREFILL"):
        profile_prefill(ckpt, int(os.environ["PREFILL"]))
        return
    for c in [int(a) for a in sys.argv[2:]] or [1]:
        e = LLMEngine(ckpt, dtype="bfloat16", device="cuda", skip_tokenizer_init=True, max_num_seqs=c,
                      max_model_len=1024, max_num_batched_tokens=16384, long_prefill_token_threshold=2048,
                      kv_cache_dtype=os.environ.get("KV_CACHE_DTYPE", "auto"),
                      async_scheduling=os.environ.get("ASYNC_SCHEDULING") == "1")
        rng = random.Random(0)
        p = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, detokenize=False)
        start_decoding(e, [[rng.randrange(3, 30000) for _ in range(512)] for _ in range(c)], p, "r")
        for _ in range(3):
            e.step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(8):
            e.step()
        torch.cuda.synchronize()
        step_ms = (time.perf_counter() - t0) / 8 * 1e3
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(8):
                e.step()
            torch.cuda.synchronize()
            wall_us = (time.perf_counter() - t0) * 1e6
        ka = prof.key_averages()
        cuda_total = sum(k.self_device_time_total for k in ka) / 8 / 1e3
        kv = e.engine_config.kv_cache_dtype
        print(f"\n=== c={c}, KV {kv}: {step_ms:.2f} ms/step wall, {cuda_total:.2f} ms/step device (kernels)")
        print(ka.table(sort_by="self_device_time_total", row_limit=18, max_name_column_width=60))
        print_timeline(prof, steps=8, wall_us=wall_us)
        print_host_profile(e.step, 8)
        e = None
        free_device_memory(torch.device("cuda"))


if __name__ == "__main__":
    main()
