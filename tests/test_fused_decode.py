"""Fused decode steps (every loop of a fixed-depth decode token in one step) change only how
steps are cut, never tokens or logprobs: compared with loop-level decode on all families, with
mixed batching, chunked prefill and preemption, and for mixed per-request depths."""

from __future__ import annotations

import random

import pytest

from rlt_serve.engine.llm_engine import LLMEngine
from rlt_serve.sampling_params import SamplingParams


def _run(path: str, fuse: bool, requests: list[tuple[list[int], SamplingParams]], **kw):
    e = LLMEngine(path, dtype="float32", device="cpu", skip_tokenizer_init=True, fuse_decode_loops=fuse, **kw)
    for i, (prompt, params) in enumerate(requests):
        e.add_request(f"r{i}", prompt, params)
    done = {}
    while e.has_unfinished_requests():
        for o in e.step():
            if o.finished:
                done[o.request_id] = o
    assert e.num_free_pages == e.num_pages
    out = {}
    for rid, o in done.items():
        c = o.outputs[0]
        chosen = [round(table[tok].logprob, 4) for tok, table in zip(c.token_ids, c.logprobs)]
        out[rid] = (c.token_ids, chosen)
    return out, e.stats()


@pytest.mark.parametrize("family", ["ouro", "nanbeige", "huginn"])
def test_fused_decode_equals_loop_level(tmp_checkpoint, family):
    path = tmp_checkpoint(family)
    rng = random.Random(3)
    reqs = []
    for i in range(10):
        prompt = [rng.randrange(3, 100) for _ in range(rng.randrange(2, 30))]
        params = SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=rng.randrange(3, 12),
                                ignore_eos=True, logprobs=1)
        reqs.append((prompt, params))
    kw = dict(num_kv_pages=12, page_size=4, max_num_batched_tokens=24, long_prefill_token_threshold=8)
    fused, st = _run(path, True, reqs, **kw)
    plain, st_plain = _run(path, False, reqs, **kw)
    assert fused == plain
    assert st.num_fused_decode_steps > 0 and st_plain.num_fused_decode_steps == 0
    assert st.num_preemptions > 0  # the small pool forces preemption in the fused run too
    assert st.num_cuda_graph_replays == 0  # CPU: the fused step runs eagerly


def test_fused_decode_mixed_depths(tmp_checkpoint):
    """Requests at different loop counts fuse in separate groups of the same step."""
    path = tmp_checkpoint("huginn")
    reqs = [([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, num_loops=n, logprobs=0))
            for n in (2, 3, 2, 4)]
    fused, _ = _run(path, True, reqs)
    plain, _ = _run(path, False, reqs)
    assert fused == plain
