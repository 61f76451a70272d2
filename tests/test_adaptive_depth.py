"""Ouro's learned-gate early exit (Q-exit) against the plain token-by-token oracle."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from rlt_serve.engine.llm_engine import LLMEngine
from rlt_serve.reference import ReferenceModel
from rlt_serve.sampling_params import SamplingParams
from rlt_serve.testing import write_random_checkpoint

VOCAB = 384


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # A gate bias near zero spreads exits over every loop.
    path = write_random_checkpoint(str(tmp_path_factory.mktemp("qexit") / "ouro"), "ouro", seed=13)
    return path


@functools.lru_cache(maxsize=None)
def _ref(path: str) -> ReferenceModel:
    return ReferenceModel.from_pretrained(path)


def _oracle(path, prompt, n, q, min_loops):
    ref, seq, toks, exits = _ref(path), list(prompt), [], None
    for _ in range(n):
        logits, exits = ref.forward_q_exit(seq, q, min_loops)
        toks.append(int(logits[-1].argmax()))
        seq.append(toks[-1])
    return toks, exits  # exits: per position of prompt + all but the last generated token


def _engine(path, **kw):
    args = dict(dtype="float32", device="cpu", skip_tokenizer_init=True, kv_layout="last_exited", page_size=4,
                long_prefill_token_threshold=8, max_num_batched_tokens=24)
    args.update(kw)
    return LLMEngine(path, **args)


def _run(engine, reqs):
    for rid, prompt, p, prio in reqs:
        engine.add_request(rid, prompt, p, priority=prio)
    done, exits = {}, {}
    runner = engine.runner
    orig = runner._coda

    def record(rows):  # exit depth of every position as the rows leave the core
        for seq, span in rows:
            for i, d in enumerate(span.exit.depth.tolist()):
                exits.setdefault(seq.request_id, {})[span.start + i] = d
        return orig(rows)

    runner._coda = record
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.num_free_pages == engine.num_pages
    assert engine.swap_space is None or engine.swap_space.used_bytes == 0
    return done, exits


@pytest.mark.parametrize("q,min_loops", [(0.5, 1), (0.7, 2), (0.9, 1)])
@pytest.mark.parametrize("kw", [dict(), dict(num_kv_pages=8, swap_space_bytes=48 << 10), dict(
    enable_wavefront_prefill=False, enable_mixed_batching=False, long_prefill_token_threshold=3)],
    ids=["default", "preempt", "phase-separated"])
def test_q_exit_matches_oracle(ckpt, q, min_loops, kw):
    rng = random.Random(int(q * 10) + min_loops)
    reqs = []
    for i in range(10):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 20))]
        p = SamplingParams(temperature=0, max_tokens=rng.randint(1, 6), ignore_eos=True, exit_threshold=q,
                           min_loops=min_loops)
        reqs.append((f"r{i}", prompt, p, rng.randint(0, 1)))
    engine = _engine(ckpt, **kw)
    done, exits = _run(engine, reqs)
    spread = set()
    for rid, prompt, p, _ in reqs:
        want, want_exits = _oracle(ckpt, prompt, p.max_tokens, q, min_loops)
        assert done[rid].outputs[0].token_ids == want, rid
        got = [exits[rid][pos] for pos in range(len(want_exits))]
        assert got == want_exits, rid
        spread |= set(got)
    assert len(spread) >= 2, "the workload should exit at several depths"
    if "num_kv_pages" in kw:
        assert engine.stats().num_preemptions > 0


def test_threshold_one_is_fixed_depth(ckpt):
    prompt = list(range(20, 35))
    fixed = _engine(ckpt)
    fixed.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1))
    one = _engine(ckpt)
    one.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1,
                                                exit_threshold=1.0))
    outs = []
    for e in (fixed, one):
        while e.has_unfinished_requests():
            outs += [o for o in e.step() if o.finished]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == _ref(ckpt).greedy(prompt, 6)[0]


def test_exited_tokens_stop_consuming_compute(ckpt):
    """Row tokens with early exit are fewer than at fixed depth for the same decode."""
    prompt = list(range(40, 52))
    counts = {}
    for q in (None, 0.5):
        e = _engine(ckpt)
        e.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, exit_threshold=q))
        while e.has_unfinished_requests():
            e.step()
        counts[q] = e.stats().num_row_tokens
    assert counts[0.5] < counts[None], counts


def test_adaptive_depth_rejections(ckpt, tmp_path):
    with pytest.raises(ValueError, match="last_exited"):
        _engine(ckpt, kv_layout="separate").add_request("a", [5], SamplingParams(exit_threshold=0.5))
    nb = write_random_checkpoint(str(tmp_path / "nb"), "nanbeige")
    with pytest.raises(ValueError, match="exit gate"):
        _engine(nb).add_request("a", [5], SamplingParams(exit_threshold=0.5))
    with pytest.raises(ValueError, match="min_loops"):
        _engine(ckpt).add_request("a", [5], SamplingParams(min_loops=2))


def test_delayed_exit_has_the_synchronous_semantics(ckpt):
    """Delayed exit computes one extra loop per early-exiting row but keeps tokens and exit depths."""
    rng = random.Random(21)
    reqs = [(f"r{i}", [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 16))],
             SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, exit_threshold=0.6), 0) for i in range(8)]
    results = {}
    for delayed in (False, True):
        engine = _engine(ckpt, delayed_exit=delayed)
        done, exits = _run(engine, reqs)
        results[delayed] = ({k: v.outputs[0].token_ids for k, v in done.items()}, exits, engine.stats())
    (tok_s, ex_s, st_s), (tok_d, ex_d, st_d) = results[False], results[True]
    assert tok_s == tok_d and ex_s == ex_d
    assert st_d.num_row_tokens > st_s.num_row_tokens  # the extra loop is computed
