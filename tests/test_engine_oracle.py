"""The engine against the dense reference: random arrivals, aborts, chunking, budgets and pages."""

from __future__ import annotations

import random

import pytest
import torch

from rlt_serve.engine.llm_engine import LLMEngine
from rlt_serve.reference import ReferenceModel
from rlt_serve.sampling_params import SamplingParams

LOGPROB_ATOL = 1e-4

# (page_size, chunk = long_prefill_token_threshold, token budget, pages or None)
CONFIGS = [
    (16, 64, 128, None),
    (1, 7, 16, None),
    (16, 13, 40, 16),  # tight pool: forces preemption by recomputation
    (1, 200, 256, None),
]


def _drive(engine: LLMEngine, requests: list[dict], rng: random.Random) -> dict[str, list]:
    """Run to completion; returns every RequestOutput with finished=True, per request id."""
    finished: dict[str, list] = {}
    pending = sorted(requests, key=lambda r: r["arrival"])
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0]["arrival"] <= step:
            r = pending.pop(0)
            engine.add_request(r["id"], r["prompt"], r["params"])
        for r in requests:
            if r.get("abort_at") == step:
                engine.abort_request(r["id"])
        for out in engine.step():
            if out.finished:
                finished.setdefault(out.request_id, []).append(out)
        step += 1
        assert step < 20000, "engine did not finish"
    return finished


@pytest.mark.parametrize("family", ["ouro", "nanbeige"])
@pytest.mark.parametrize("page_size,chunk,budget,pages", CONFIGS)
def test_engine_matches_reference(tmp_checkpoint, family, page_size, chunk, budget, pages):
    path = tmp_checkpoint(family, seed=7)
    ref = ReferenceModel.from_pretrained(path)
    rng = random.Random(f"{family}-{page_size}-{chunk}-{budget}")
    vocab = ref.config.vocab_size
    requests = []
    for i in range(32):
        n = rng.randint(1, 200)
        r = {
            "id": f"r{i}",
            "prompt": [rng.randrange(3, vocab) for _ in range(n)],
            "params": SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 10), ignore_eos=True, logprobs=2),
            "arrival": rng.randint(0, 60),
        }
        if rng.random() < 0.2:
            r["abort_at"] = r["arrival"] + rng.randint(0, 30)
        requests.append(r)
    engine = LLMEngine(
        path,
        dtype="float32",
        device="cpu",
        skip_tokenizer_init=True,
        page_size=page_size,
        long_prefill_token_threshold=chunk,
        max_num_batched_tokens=budget,
        num_kv_pages=pages,
        max_num_seqs=16,
    )
    finished = _drive(engine, requests, rng)
    assert engine.num_free_pages == engine.num_pages, "pages leaked"
    assert set(finished) == {r["id"] for r in requests}
    compared = 0
    for r in requests:
        outs = finished[r["id"]]
        assert len(outs) == 1, f"{r['id']} finished {len(outs)} times"
        c = outs[0].outputs[0]
        if c.finish_reason == "abort":
            continue
        assert c.finish_reason == "length"
        want, logits = ref.greedy(r["prompt"], len(c.token_ids))
        assert c.token_ids == want, r["id"]
        ref_lp = torch.log_softmax(logits.double(), -1)
        for k, (tok, table) in enumerate(zip(c.token_ids, c.logprobs)):
            assert abs(table[tok].logprob - ref_lp[k, tok].item()) < LOGPROB_ATOL
        compared += 1
    assert compared >= 16
    if pages is not None:
        assert engine.scheduler.num_preemptions > 0, "the tight pool should have forced preemption"


@pytest.mark.parametrize(
    "family,overrides",
    [
        ("ouro", dict(num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, head_dim=24, total_ut_steps=3)),
        ("ouro", dict(num_hidden_layers=1, hidden_size=48, num_attention_heads=2, num_key_value_heads=2, total_ut_steps=5,
                     vocab_size=300)),
        ("nanbeige", dict(num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, head_dim=16)),
        ("nanbeige", dict(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=40, num_loops=3)),
    ],
)
def test_other_shapes_match_reference(tmp_checkpoint, family, overrides):
    path = tmp_checkpoint(family, seed=11, **overrides)
    ref = ReferenceModel.from_pretrained(path)
    engine = LLMEngine(path, dtype="float32", device="cpu", skip_tokenizer_init=True, page_size=4,
                       long_prefill_token_threshold=5, max_num_batched_tokens=12)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, ref.config.vocab_size) for _ in range(n)] for n in (1, 9, 23)]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    for i, p in enumerate(prompts):
        assert done[str(i)].outputs[0].token_ids == ref.greedy(p, 6)[0]
    assert engine.num_free_pages == engine.num_pages


def test_mixed_depths_in_one_batch(tmp_checkpoint):
    """Ouro requests at different num_loops share core calls; each matches the reference at its depth."""
    path = tmp_checkpoint("ouro", seed=3)
    ref = ReferenceModel.from_pretrained(path)
    engine = LLMEngine(path, dtype="float32", device="cpu", skip_tokenizer_init=True, max_loops=6, page_size=8)
    rng = random.Random(9)
    cases = [(loops, [rng.randrange(3, 384) for _ in range(rng.randint(2, 30))]) for loops in (1, 2, 4, 6, 3)]
    for i, (loops, p) in enumerate(cases):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, num_loops=loops))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    for i, (loops, p) in enumerate(cases):
        assert done[str(i)].outputs[0].token_ids == ref.greedy(p, 5, num_loops=loops)[0], loops
    assert engine.num_free_pages == engine.num_pages
