"""Async scheduling changes when the host reads tokens, never which tokens: async on and off give
equal tokens, finish reasons and (fp32) logprobs under a randomised workload with staggered
arrivals, mixed lengths, stop ids, seeded sampling, preemption (swap and recompute) and aborts,
and every page comes back. Steps that need host-side tokens fall back, counted."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from rlt_serve.engine.llm_engine import LLMEngine
from rlt_serve.sampling_params import SamplingParams

VOCAB = 384  # the tiny random checkpoints' vocabulary
POOL = dict(num_kv_pages=12, page_size=4, max_num_batched_tokens=24, long_prefill_token_threshold=8)


@dataclass
class Req:
    prompt: list[int]
    params: SamplingParams
    arrive: int  # step index at which the request is added
    abort_after: int | None  # abort once this many output tokens were returned


def _workload(seed: int, n: int = 12) -> list[Req]:
    rng = random.Random(seed)
    stops = rng.sample(range(3, VOCAB), 40)  # ~10% of the vocabulary: some requests stop early
    reqs = []
    for i in range(n):
        params = SamplingParams(
            temperature=0.0 if i % 3 == 0 else rng.choice([0.7, 1.0]),
            top_k=rng.choice([0, 20]), top_p=rng.choice([1.0, 0.9]), seed=100 + i,
            max_tokens=rng.randrange(2, 14), min_tokens=rng.choice([0, 0, 2]),
            stop_token_ids=stops if i % 2 else None, ignore_eos=True,
            logprobs=rng.choice([None, 0, 2]), prompt_logprobs=1 if i == 4 else None,
        )  # fmt: skip
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 26))]
        if i % 4 == 1:  # a shared prefix (hits when its pages survive the tiny pool)
            prompt = (reqs[-1].prompt + prompt)[:25]
        arrive = reqs[-1].arrive + 6 if i % 4 == 1 else rng.randrange(0, 10)  # after its prefix is computed
        reqs.append(Req(prompt, params, arrive, rng.randrange(1, 4) if i % 5 == 2 else None))
    return reqs


def _drive(path: str, async_: bool, reqs: list[Req], device: str = "cpu",
           setup: Callable[[LLMEngine], None] | None = None, **kw) -> tuple[dict, LLMEngine]:  # fmt: skip
    """Run the workload; aborts follow what the client has seen, as a real client's would."""
    e = LLMEngine(path, dtype="float32", device=device, skip_tokenizer_init=True, async_scheduling=async_, **kw)
    if setup is not None:
        setup(e)
    done, seen, step = {}, {}, 0
    last_arrival = max(r.arrive for r in reqs)
    while step <= last_arrival or e.has_unfinished_requests():
        for i, r in enumerate(reqs):
            if r.arrive == step:
                e.add_request(f"r{i}", r.prompt, r.params)
        for o in e.step():
            assert o.request_id not in done, f"{o.request_id} ended twice"
            seen[o.request_id] = len(o.outputs[0].token_ids)
            if o.finished:
                done[o.request_id] = o
        for i, r in enumerate(reqs):
            rid = f"r{i}"
            if r.abort_after is not None and rid not in done and seen.get(rid, 0) >= r.abort_after:
                e.abort_request(rid)
        step += 1
        assert step < 500
    assert len(done) == len(reqs)
    assert e.num_free_pages == e.num_pages  # no page leaked by a discarded token or an abort
    assert not e.scheduler.running and not e.scheduler.waiting
    if e.swap_space is not None:
        assert e.swap_space.used_bytes == 0
    return done, e


def _assert_same(a: dict, b: dict, tol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for rid in a:
        x, y = a[rid].outputs[0], b[rid].outputs[0]
        assert (x.token_ids, x.finish_reason, x.stop_reason) == (y.token_ids, y.finish_reason, y.stop_reason), rid
        if x.logprobs is not None:
            for tok, tx, ty in zip(x.token_ids, x.logprobs, y.logprobs):
                assert tx.keys() == ty.keys() and tx[tok].rank == ty[tok].rank, rid
                assert max(abs(tx[t].logprob - ty[t].logprob) for t in tx) < tol, rid  # batch order only
            assert abs(x.cumulative_logprob - y.cumulative_logprob) < 10 * tol
        px, py = a[rid].prompt_logprobs, b[rid].prompt_logprobs
        assert (px is None) == (py is None)
        if px is not None:
            assert [p and p.keys() for p in px] == [p and p.keys() for p in py]


@pytest.mark.parametrize(
    "family,kw",
    [
        ("ouro", {}),
        ("ouro", dict(swap_space_bytes=0)),  # preemption by recomputation: pending tokens recomputed
        ("ouro", dict(fuse_decode_loops=False)),  # loop-level decode: the token feeds a depth-0 row
        ("ouro", dict(max_model_len=30)),  # "length" at the model length, one token allocated ahead
        ("nanbeige", {}),
        ("huginn", {}),
    ],
)
def test_async_equals_sync(tmp_checkpoint, family, kw):
    path = tmp_checkpoint(family)
    reqs = _workload(7)
    got, e = _drive(path, True, reqs, **POOL, **kw)
    want, _ = _drive(path, False, reqs, **POOL, **kw)
    _assert_same(got, want)
    st = e.stats()
    reasons = {o.outputs[0].finish_reason for o in got.values()}
    assert reasons == {"stop", "length", "abort"}
    assert st.num_preemptions > 0
    if kw.get("swap_space_bytes") == 0:
        assert st.num_recompute_preemptions > 0
    else:
        assert st.num_swap_preemptions > 0
    assert e.async_step.num_readbacks > 0 and e.async_step.num_sync_steps == 0


def test_prefix_cache_registers_generated_pages_as_sync(tmp_checkpoint):
    """Pages completed by a token that was in flight are registered once it is read, so a later
    prompt that continues a finished request's output hits the same pages as synchronously."""
    path = tmp_checkpoint("ouro")
    base = list(range(10, 27))  # 17 tokens: generated tokens fill pages 5 and 6 (page_size 4)
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    res = {}
    for async_ in (False, True):
        e = LLMEngine(path, dtype="float32", device="cpu", skip_tokenizer_init=True, async_scheduling=async_,
                      num_kv_pages=64, page_size=4)  # fmt: skip
        e.add_request("a", base, params)
        outs = {}
        while e.has_unfinished_requests():
            outs.update({o.request_id: o for o in e.step() if o.finished})
        follow = base + outs["a"].outputs[0].token_ids
        e.add_request("b", follow, params)
        while e.has_unfinished_requests():
            outs.update({o.request_id: o for o in e.step() if o.finished})
        st = e.stats()
        res[async_] = (outs["a"].outputs[0].token_ids, outs["b"].outputs[0].token_ids, st.prefix_cache_hits)
        assert e.num_free_pages == e.num_pages
    assert res[True] == res[False]
    assert res[True][2] >= 24  # the prompt's 4 full pages and 2 pages of generated tokens


def test_tokens_arrive_one_step_late_and_extra_token_is_discarded(tmp_checkpoint):
    """The pipeline is real: a token is returned by the step after the one that drew it, and a
    request that stops has one more step run for it whose token nobody sees."""
    path = tmp_checkpoint("ouro")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    runs = {}
    for async_ in (False, True):
        e = LLMEngine(path, dtype="float32", device="cpu", skip_tokenizer_init=True, async_scheduling=async_)
        e.add_request("a", [5, 6, 7], params)
        counts, tokens = [], None
        while e.has_unfinished_requests():
            outs = e.step()
            counts.append([len(o.outputs[0].token_ids) for o in outs])
            tokens = next((o.outputs[0].token_ids for o in outs if o.finished), tokens)
        runs[async_] = (counts, e.stats().num_core_calls, e.num_free_pages == e.num_pages, tokens)
    (sync_counts, sync_calls, sync_free, sync_tokens), (a_counts, a_calls, a_free, a_tokens) = runs[False], runs[True]
    assert sync_counts[-4:] == [[1], [2], [3], [4]]  # after the prompt's loops, one token per step
    assert a_counts == [[]] + sync_counts
    assert a_calls == sync_calls + e.model_config.num_loops  # the discarded (fused) decode step
    assert a_tokens == sync_tokens and sync_free and a_free


def test_stop_strings_and_text(tmp_path):
    """Detokenisation and stop strings run on the resolved tokens exactly as synchronously."""
    from rlt_serve.demo import make_demo

    path = make_demo(str(tmp_path / "demo"))
    out = {}
    for async_ in (False, True):
        e = LLMEngine(path, dtype="float32", device="cpu", async_scheduling=async_)
        full = SamplingParams(temperature=1.0, seed=11, max_tokens=30, ignore_eos=True)
        e.add_request("full", [5, 6, 7, 8], full)
        res = {}
        while e.has_unfinished_requests():
            res.update({o.request_id: o for o in e.step() if o.finished})
        text = res["full"].outputs[0].text
        stop = text[10:13]
        e.add_request("cut", [5, 6, 7, 8], SamplingParams(temperature=1.0, seed=11, max_tokens=30, ignore_eos=True,
                                                          stop=[stop]))  # fmt: skip
        while e.has_unfinished_requests():
            res.update({o.request_id: o for o in e.step() if o.finished})
        c = res["cut"].outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason == stop and c.text == text[: text.find(stop)]
        out[async_] = (text, c.text, c.token_ids)
        assert e.num_free_pages == e.num_pages
    assert out[True] == out[False]


def test_fallback_for_speculation_and_early_exit(tmp_checkpoint):
    """Steps whose previous tokens are needed on the host run synchronously, with the reason kept,
    and give the synchronous tokens."""
    path = tmp_checkpoint("ouro")
    reqs = [([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)),
            ([9, 10], SamplingParams(temperature=0.8, seed=3, max_tokens=5, ignore_eos=True, logprobs=0))]  # fmt: skip
    for kw, adaptive in ((dict(num_speculative_tokens=2), False), (dict(kv_layout="last_exited"), True)):
        outs, engines = {}, {}
        for async_ in (False, True):
            e = LLMEngine(path, dtype="float32", device="cpu", skip_tokenizer_init=True, async_scheduling=async_, **kw)
            for i, (prompt, params) in enumerate(reqs):
                if adaptive and i == 0:
                    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0,
                                            exit_threshold=0.5)  # fmt: skip
                e.add_request(f"r{i}", prompt, params)
            res = {}
            while e.has_unfinished_requests():
                res.update({o.request_id: o.outputs[0].token_ids for o in e.step() if o.finished})
            outs[async_], engines[async_] = res, e
            assert e.num_free_pages == e.num_pages
        assert outs[True] == outs[False]
        a = engines[True].async_step
        assert a.num_sync_steps > 0 and a.last_fallback is not None
        assert ("speculative" in a.last_fallback) if not adaptive else ("early exit" in a.last_fallback)


def test_adaptive_speculation_pipelines_while_off(tmp_checkpoint):
    """With adaptive K configured, steps the controller keeps plain run pipelined; a step where it
    starts a round, and the round's draft and verify steps, run synchronously. Greedy tokens equal
    plain synchronous decoding (self-speculation is lossless for greedy) and every page returns."""
    path = tmp_checkpoint("ouro")
    rng = random.Random(3)
    reqs = [Req([rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 20))],
                SamplingParams(temperature=0.0, max_tokens=rng.randrange(6, 16), ignore_eos=True, logprobs=0),
                rng.randrange(0, 8), 4 if i == 3 else None) for i in range(8)]  # fmt: skip
    want, _ = _drive(path, False, reqs, **POOL)

    def every_fifth_step(e: LLMEngine) -> None:  # the controller's decision made deterministic
        spec = e.scheduler.spec
        spec.choose = lambda batch=1: (2, 1) if spec._steps % 5 == 0 else (0, 1)

    got, e = _drive(path, True, reqs, setup=every_fifth_step, **POOL, num_speculative_tokens=2,
                    speculative_adaptive=True)  # fmt: skip
    _assert_same(got, want)
    a, st = e.async_step, e.stats()
    assert a.num_readbacks > 0 and a.num_sync_steps > 0 and "speculative" in a.last_fallback
    assert st.num_spec_drafts > 0  # rounds ran between the pipelined steps


def test_paused_speculation_schedules_plain_rows(tmp_checkpoint):
    """An asynchronous step never starts a round, even if the controller's answer changed since
    the fallback check (the batch moved): its rows are plain decode rows."""
    e = LLMEngine(tmp_checkpoint("ouro"), dtype="float32", device="cpu", skip_tokenizer_init=True,
                  num_speculative_tokens=2, speculative_adaptive=True)  # fmt: skip
    e.scheduler.spec.choose = lambda batch=1: (2, 1)
    e.add_request("a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    while not any(seq.decoding for seq in e.scheduler.running):
        e.step()
    assert e.scheduler.wants_speculation()
    e.scheduler.spec_paused = True
    rows = e.scheduler.schedule().rows
    assert rows and all(span.kind == "normal" for _, span in rows)


def test_async_after_fallback_resumes_pipelining(tmp_checkpoint):
    """An early-exit request arriving mid-run forces synchronous steps while it lives; pipelining
    resumes after it ends, and the other requests' tokens equal the synchronous run's."""
    path = tmp_checkpoint("ouro")
    plain = SamplingParams(temperature=0.9, seed=5, max_tokens=20, ignore_eos=True, logprobs=0)
    exit_p = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, exit_threshold=0.5)
    outs = {}
    for async_ in (False, True):
        e = LLMEngine(path, dtype="float32", device="cpu", skip_tokenizer_init=True, async_scheduling=async_,
                      kv_layout="last_exited")  # fmt: skip
        e.add_request("plain", [3, 4, 5, 6], plain)
        res, step = {}, 0
        while e.has_unfinished_requests():
            if step == 4:
                e.add_request("exit", [7, 8], exit_p)
            res.update({o.request_id: o.outputs[0].token_ids for o in e.step() if o.finished})
            step += 1
        outs[async_] = res
        assert e.num_free_pages == e.num_pages
    assert outs[True] == outs[False]
    a = e.async_step
    assert a.num_sync_steps > 0 and a.num_readbacks > 5


def test_bench_async_scheduling_flag(tmp_path, capsys):
    """`rlt-serve bench --async-scheduling` runs the pipelined engine and says so."""
    from rlt_serve.cli import main

    path = str(tmp_path / "tiny")
    main(["make-random-checkpoint", "--shape", "tiny", path, "--dtype", "float32"])
    out_json = tmp_path / "bench.json"
    argv = ["bench", "--model", path, "--concurrency", "2", "--num-prompts", "3", "--input-len", "12", "--output-len",
            "4", "--runs", "1", "--warmup", "0", "--skip-reference", "--async-scheduling", "--json", str(out_json)]  # fmt: skip
    assert main(argv) == 0
    assert "; async scheduling" in capsys.readouterr().out
    result = json.loads(out_json.read_text())
    assert result["config"]["async_scheduling"] is True
    assert all(r["output_tokens"] == 12 for r in result["runs"])
