"""On the device: the exit readback through pinned memory and events, and self-speculation.

Run with `pytest -m gpu tests/test_gpu_depth.py`. The CPU suite covers the semantics; what only a
CUDA device exercises is the non-blocking copy + event path of asynchronous/delayed exit, and the
runner's tensors living on the device.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_adaptive_depth import PREEMPT, VOCAB, _oracle, _outputs, _run, _workload

from rlt_serve.engine.llm_engine import LLMEngine
from rlt_serve.engine.exit_policy import ExitReadback
from rlt_serve.sampling_params import SamplingParams
from rlt_serve.testing import write_random_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_random_checkpoint(str(tmp_path_factory.mktemp("gpu_depth") / "ouro"), "ouro", seed=13)


def _cuda_engine(path, **kw):
    args = dict(dtype="float32", device="cuda", skip_tokenizer_init=True, kv_layout="last_exited", page_size=4,
                long_prefill_token_threshold=8, max_num_batched_tokens=24, attention_backend="torch",
                num_kv_pages=1024)  # a fixed pool: tests build two engines at once, and free memory is not 90%
    args.update(kw)
    return LLMEngine(path, **args)


@pytest.fixture(autouse=True)
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def test_exit_readback_is_non_blocking_and_exact():
    flags = torch.tensor([True, False, True], device="cuda")
    rb = ExitReadback(flags)
    assert rb._host.is_pinned() and rb._event is not None
    assert [rb.get(i) for i in range(3)] == [True, False, True]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_q_exit_on_device_matches_the_oracle(ckpt, mode):
    """Exit depths and greedy tokens on CUDA, read back synchronously or through pinned memory,
    equal the fp32 CPU oracle's (tolerance: a gate within rounding of q could flip; seeds are fixed)."""
    reqs = _workload(21, 10, 0.6)
    engine = _cuda_engine(ckpt, async_exit=mode == "async", **PREEMPT)
    done, exits = _run(engine, reqs)
    for rid, prompt, p, _ in reqs:
        want, want_exits = _oracle(ckpt, tuple(prompt), p.max_tokens, 0.6, 1)
        assert done[rid].outputs[0].token_ids == want, rid
        assert all(want_exits[pos] == d for pos, d in exits[rid].items() if pos < len(want_exits)), rid


def test_async_exit_equals_sync_on_device(ckpt):
    reqs = _workload(7, 8, 0.6, logprobs=1)
    got = {}
    for mode in ("sync", "async"):
        engine = _cuda_engine(ckpt, async_exit=mode == "async", enable_wavefront_prefill=False)
        outs, exits = {}, {}
        for r in reqs:  # one by one: both policies run the same shapes, so results are bit-identical
            done, ex = _run(engine, [r])
            outs |= _outputs(done)
            exits |= ex
        got[mode] = (outs, exits, engine.exit_states)
    (o_s, e_s, h_s), (o_a, e_a, h_a) = got["sync"], got["async"]
    assert o_s == o_a and e_s == e_a
    assert all(torch.equal(h_s[k], h_a[k]) for k in h_s)


def test_delayed_exit_on_device_matches_the_delayed_oracle(ckpt):
    reqs = _workload(5, 8, 0.6)
    engine = _cuda_engine(ckpt, delayed_exit=True)
    done, exits = _run(engine, reqs)
    for rid, prompt, p, _ in reqs:
        want, want_exits = _oracle(ckpt, tuple(prompt), p.max_tokens, 0.6, 1, delay=True)
        assert done[rid].outputs[0].token_ids == want, rid


@pytest.mark.parametrize("family,k,depth", [("ouro", 4, 2), ("nanbeige", 4, 1), ("huginn", 4, 2)])
def test_greedy_speculation_on_device(tmp_path, family, k, depth):
    extra = dict(mean_recurrence=6) if family == "huginn" else {}
    path = write_random_checkpoint(str(tmp_path / family), family, seed=17, update_scale=0.03 if family != "huginn"
                                   else None, **extra)  # fmt: skip
    rng = random.Random(3)
    reqs = [(f"r{i}", [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 30))], rng.randint(1, 14)) for i in range(16)]
    outs = {}
    for spec in (0, k):
        e = LLMEngine(path, dtype="float32", device="cuda", skip_tokenizer_init=True, page_size=4, num_kv_pages=24,
                      num_speculative_tokens=spec, speculative_draft_depth=depth)
        for rid, prompt, n in reqs:
            e.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        done = {}
        while e.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].token_ids for o in e.step() if o.finished})
        assert e.num_free_pages == e.num_pages
        outs[spec] = done
    assert outs[0] == outs[k]
