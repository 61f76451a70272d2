"""Self-speculative decoding: shallow drafts verified by resuming them to full depth."""

from __future__ import annotations

import functools
import random

import pytest

from rlt_serve.config import ConfigError
from rlt_serve.engine.llm_engine import LLMEngine
from rlt_serve.sampling_params import SamplingParams
from rlt_serve.testing import write_random_checkpoint

VOCAB = 384


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    return {f: write_random_checkpoint(str(root / f), f, seed=17) for f in ("ouro", "nanbeige")}


def _requests(n: int = 32):
    rng = random.Random(2)
    return [(f"r{i}", [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 30))], rng.randint(1, 14),
             rng.randint(0, 1)) for i in range(n)]


def _run(path: str, **kw):
    args = dict(dtype="float32", device="cpu", skip_tokenizer_init=True, page_size=4, long_prefill_token_threshold=8,
                max_num_batched_tokens=32)
    args.update(kw)
    engine = LLMEngine(path, **args)
    for rid, prompt, n, prio in _requests():
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0),
                           priority=prio)
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                assert o.request_id not in done
                done[o.request_id] = o
    assert engine.num_free_pages == engine.num_pages
    assert engine.swap_space is None or engine.swap_space.used_bytes == 0
    return {k: v.outputs[0].token_ids for k, v in done.items()}, engine.stats(), done


@functools.lru_cache(maxsize=None)
def _baseline(path: str):
    return _run(path)[0]


CASES = [("ouro", k, d) for k in (1, 2, 4, 8) for d in (1, 2, 3)] + [("nanbeige", k, 1) for k in (1, 2, 4, 8)]


@pytest.mark.parametrize("family,k,depth", CASES)
def test_greedy_speculation_is_token_identical(ckpts, family, k, depth):
    path = ckpts[family]
    # A pool of ~3 requests forces preemption (swap and recompute) while drafts are in flight.
    got, st, done = _run(path, num_speculative_tokens=k, speculative_draft_depth=depth, num_kv_pages=24,
                         swap_space_bytes=64 << 10)
    assert got == _baseline(path)
    assert st.num_spec_drafts > 0 and st.num_spec_draft_tokens >= st.num_spec_accepted_tokens
    assert st.num_preemptions > 0
    for o in done.values():  # one logprob entry per committed token
        assert len(o.outputs[0].logprobs) == len(o.outputs[0].token_ids)


def test_speculation_core_call_accounting(ckpts):
    """One request: every draft token costs d_s core calls and every verify round D - d_s more;
    no shallow loop is recomputed by the verify row."""
    path = ckpts["ouro"]
    prompt = [random.Random(5).randrange(3, VOCAB) for _ in range(10)]
    outs = {}
    for k in (0, 4):
        e = LLMEngine(path, dtype="float32", device="cpu", skip_tokenizer_init=True, num_speculative_tokens=k,
                      speculative_draft_depth=3)
        e.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        out = None
        while e.has_unfinished_requests():
            out = next((o for o in e.step() if o.finished), out)
        outs[k] = (out.outputs[0].token_ids, e.stats())
    assert outs[0][0] == outs[4][0]
    st = outs[4][1]
    prefill = 4  # one chunk through 4 loops
    assert st.num_core_calls == prefill + 3 * st.num_spec_draft_tokens + 1 * st.num_spec_drafts
    assert len(outs[4][0]) == 24


def test_speculation_rejections(ckpts):
    path = ckpts["ouro"]
    with pytest.raises(ConfigError, match="speculative_draft_depth"):
        LLMEngine(path, device="cpu", skip_tokenizer_init=True, num_speculative_tokens=2, speculative_draft_depth=4)
    with pytest.raises(ConfigError, match="shared"):
        LLMEngine(path, device="cpu", skip_tokenizer_init=True, num_speculative_tokens=2, kv_layout="shared",
                  long_prefill_token_threshold=1, enable_wavefront_prefill=False)
