"""Sampling: seeds independent of the batch, the filters, stop rules and logprobs."""

from __future__ import annotations

import random

import pytest
import torch

from rlt_serve.engine.llm_engine import LLMEngine
from rlt_serve.engine.sampler import Sampler
from rlt_serve.engine.sequence import Sequence
from rlt_serve.sampling_params import SamplingParams


def _run(engine: LLMEngine, reqs: list[tuple[str, list[int], SamplingParams]]) -> dict:
    for rid, prompt, p in reqs:
        engine.add_request(rid, prompt, p)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.num_free_pages == engine.num_pages
    return done


@pytest.fixture
def engine_factory(tmp_checkpoint):
    path = tmp_checkpoint("ouro", seed=21)

    def make(**kw):
        args = dict(dtype="float32", device="cpu", skip_tokenizer_init=True, page_size=4, max_num_batched_tokens=32,
                    long_prefill_token_threshold=16)
        args.update(kw)
        return LLMEngine(path, **args)

    return make


def test_seeded_sampling_independent_of_batch(engine_factory):
    rng = random.Random(0)
    prompt = [rng.randrange(3, 384) for _ in range(17)]
    target = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    alone = _run(engine_factory(), [("t", prompt, target)])["t"].outputs[0].token_ids
    others = [
        (f"o{i}", [rng.randrange(3, 384) for _ in range(rng.randint(1, 40))],
         SamplingParams(temperature=rng.choice([0.0, 0.7, 1.3]), seed=rng.choice([None, i]), max_tokens=rng.randint(1, 15),
                        ignore_eos=True))
        for i in range(7)
    ]
    batched = _run(engine_factory(max_num_batched_tokens=64), others[:3] + [("t", prompt, target)] + others[3:])
    assert batched["t"].outputs[0].token_ids == alone
    other_seed = _run(engine_factory(), [("t", prompt, target.clone(seed=99))])["t"].outputs[0].token_ids
    assert other_seed != alone


def test_top_k_1_and_greedy_agree(engine_factory):
    prompt = list(range(5, 30))
    greedy = _run(engine_factory(), [("g", prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))])
    topk1 = _run(engine_factory(), [("k", prompt, SamplingParams(temperature=1.0, top_k=1, seed=3, max_tokens=8,
                                                                   ignore_eos=True))])
    assert greedy["g"].outputs[0].token_ids == topk1["k"].outputs[0].token_ids


def test_stop_token_ids_min_tokens_and_length(engine_factory):
    prompt = list(range(40, 60))
    base = _run(engine_factory(), [("b", prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))])
    toks = base["b"].outputs[0].token_ids
    assert base["b"].outputs[0].finish_reason == "length" and len(toks) == 12
    stop_tok = toks[3]
    first = toks.index(stop_tok)
    out = _run(engine_factory(), [("s", prompt, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_tok]))])
    c = out["s"].outputs[0]
    assert c.token_ids == toks[: first + 1] and c.finish_reason == "stop" and c.stop_reason == stop_tok
    # min_tokens masks the stop token until enough tokens exist, so it cannot end the request early.
    out = _run(engine_factory(), [("m", prompt, SamplingParams(temperature=0, max_tokens=12, min_tokens=first + 3,
                                                                 stop_token_ids=[stop_tok]))])
    c = out["m"].outputs[0]
    assert len(c.token_ids) >= first + 3 and stop_tok not in c.token_ids[: first + 2]


def test_logprobs_shape_and_values(engine_factory):
    out = _run(engine_factory(), [("l", list(range(9, 20)), SamplingParams(temperature=0.8, seed=5, max_tokens=6,
                                                                            ignore_eos=True, logprobs=3))])["l"]
    c = out.outputs[0]
    assert len(c.logprobs) == 6
    for tok, table in zip(c.token_ids, c.logprobs):
        assert tok in table and len(table) in (3, 4)
        ranks = sorted(lp.rank for t, lp in table.items() if t != tok or lp.rank <= 3)
        assert ranks[:3] == [1, 2, 3]
        assert all(lp.logprob <= 0 for lp in table.values())
    assert c.cumulative_logprob == pytest.approx(sum(t[tok].logprob for tok, t in zip(c.token_ids, c.logprobs)))


def _fake_seq(params: SamplingParams, seed: int) -> Sequence:
    g = torch.Generator()
    g.manual_seed(seed)
    return Sequence("x", [1], params, 1, g)


def test_sampler_distribution_and_filters():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    sampler = Sampler(lambda seq: set())
    n = 3000

    def freq(params: SamplingParams) -> torch.Tensor:
        counts = torch.zeros(6)
        for s in range(n):
            counts[sampler(logits, [_fake_seq(params, s)])[0].token] += 1
        return counts / n

    f = freq(SamplingParams(temperature=1.0))
    assert torch.allclose(f, torch.softmax(logits[0], -1), atol=0.03)
    f = freq(SamplingParams(temperature=0.5))
    assert torch.allclose(f, torch.softmax(logits[0] / 0.5, -1), atol=0.03)
    probs = torch.softmax(logits[0], -1)  # [0.55, 0.2, 0.12, 0.074, ...]
    f = freq(SamplingParams(top_k=2))
    assert f[2:].sum() == 0 and torch.allclose(f[:2], probs[:2] / probs[:2].sum(), atol=0.03)
    f = freq(SamplingParams(top_p=0.8))  # nucleus: 0.55 + 0.2 + 0.12 reaches 0.8
    assert f[3:].sum() == 0 and f[2] > 0
    f = freq(SamplingParams(min_p=0.3))  # keeps p >= 0.3 * 0.55
    assert f[2:].sum() == 0


def test_min_tokens_masks_eos():
    sampler = Sampler(lambda seq: {0})
    logits = torch.tensor([[5.0, 0.0, -1.0]])
    seq = _fake_seq(SamplingParams(temperature=0, min_tokens=2), 0)
    assert sampler(logits, [seq])[0].token == 1
    seq.output_token_ids.extend([1, 1])
    assert sampler(logits, [seq])[0].token == 0


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(exit_threshold=1.5), "exit_threshold"),
        (dict(min_loops=0), "min_loops"),
        (dict(num_loops=0), "num_loops"),
        (dict(n=2), "n"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_engine_rejects_bad_requests(engine_factory):
    engine = engine_factory()
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request("a", [], SamplingParams())
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("b", [10**6], SamplingParams())
    with pytest.raises(ValueError, match="num_loops"):
        engine.add_request("c", [5], SamplingParams(num_loops=9))
    with pytest.raises(ValueError, match="logprobs"):
        engine.add_request("d", [5], SamplingParams(logprobs=10**4))
    assert not engine.has_unfinished_requests()
