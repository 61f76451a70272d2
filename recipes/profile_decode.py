"""Where a decode step's time goes: kernel table (torch.profiler) and host time per step.

    python3 recipes/profile_decode.py CKPT [concurrency ...]

Prefills `concurrency` random 512-token prompts, then profiles 8 steady decode steps.
"""

from __future__ import annotations

import random
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from rlt_serve.bench import free_device_memory
from rlt_serve.engine.llm_engine import LLMEngine
from rlt_serve.sampling_params import SamplingParams


def main() -> None:
    ckpt = sys.argv[1]
    for c in [int(a) for a in sys.argv[2:]] or [1]:
        e = LLMEngine(ckpt, dtype="bfloat16", device="cuda", skip_tokenizer_init=True, max_num_seqs=c,
                      max_model_len=1024, max_num_batched_tokens=16384, long_prefill_token_threshold=2048)
        rng = random.Random(0)
        p = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, detokenize=False)
        for i in range(c):
            e.add_request(f"r{i}", [rng.randrange(3, 30000) for _ in range(512)], p)
        while any(not s.decoding for s in e.scheduler.running) or e.scheduler.waiting:
            e.step()
        for _ in range(3):
            e.step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(8):
            e.step()
        torch.cuda.synchronize()
        step_ms = (time.perf_counter() - t0) / 8 * 1e3
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(8):
                e.step()
            torch.cuda.synchronize()
        ka = prof.key_averages()
        cuda_total = sum(k.self_device_time_total for k in ka) / 8 / 1e3
        print(f"\n=== c={c}: {step_ms:.2f} ms/step wall, {cuda_total:.2f} ms/step device (kernels)")
        print(ka.table(sort_by="self_device_time_total", row_limit=18, max_name_column_width=60))
        e = None
        free_device_memory(torch.device("cuda"))


if __name__ == "__main__":
    main()
