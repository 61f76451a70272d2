"""Scheduling and KV features over the one row mechanism, each against the dense reference.

Axes: preemption storm, prefix caching, wavefront chunked prefill (WCPB), mixed prefill/decode
batching and KV layout; every workload mixes priorities and shares prompt prefixes.
"""

from __future__ import annotations

import functools
import itertools
import random

import pytest
import torch

from rlt_serve.engine.llm_engine import LLMEngine
from rlt_serve.reference import ReferenceModel
from rlt_serve.sampling_params import SamplingParams
from rlt_serve.testing import write_random_checkpoint

VOCAB = 384


@functools.lru_cache(maxsize=None)
def _checkpoint(family: str, tmp_root: str, **overrides) -> str:
    return write_random_checkpoint(f"{tmp_root}/{family}", family, seed=5, **overrides)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("sched"))
    return lambda family: _checkpoint(family, root, max_position_embeddings=4096)


def _workload(seed: int, n: int = 64) -> list[dict]:
    rng = random.Random(seed)
    system = [rng.randrange(3, VOCAB) for _ in range(24)]
    reqs = []
    for i in range(n):
        tail = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 24))]
        prompt = system + tail if rng.random() < 0.6 else tail
        reqs.append(dict(id=f"r{i}", prompt=prompt, max_tokens=rng.randint(1, 12), priority=rng.randint(0, 2),
                         arrival=rng.randint(0, 40)))
    return reqs


@functools.lru_cache(maxsize=None)
def _oracle(path: str, prompt: tuple[int, ...], n: int) -> tuple[list[int], torch.Tensor]:
    return ReferenceModel.from_pretrained(path).greedy(list(prompt), n)


def _run(engine: LLMEngine, reqs: list[dict], params_for=None) -> dict[str, object]:
    pending = sorted(reqs, key=lambda r: r["arrival"])
    done: dict[str, object] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0]["arrival"] <= step:
            r = pending.pop(0)
            p = params_for(r) if params_for else SamplingParams(temperature=0, max_tokens=r["max_tokens"],
                                                                 ignore_eos=True, logprobs=0)
            engine.add_request(r["id"], r["prompt"], p, priority=r["priority"])
        for out in engine.step():
            if out.finished:
                assert out.request_id not in done, "a request finished twice"
                done[out.request_id] = out
        step += 1
        assert step < 50000
    return done


def _assert_pools_full(engine: LLMEngine) -> None:
    assert engine.num_free_pages == engine.num_pages
    assert engine.swap_space is None or engine.swap_space.used_bytes == 0
    assert not engine.scheduler.running and not engine.scheduler.waiting


AXES = list(itertools.product([False, True], [False, True], [False, True], [False, True], ["separate", "last_exited"]))


@pytest.mark.parametrize("family", ["ouro", "nanbeige"])
@pytest.mark.parametrize("storm,prefix,wcpb,mixed,layout", AXES)
def test_features_match_reference(ckpt, family, storm, prefix, wcpb, mixed, layout):
    path = ckpt(family)
    reqs = _workload(seed=1)
    kw = dict(page_size=8, long_prefill_token_threshold=8, max_num_batched_tokens=48, max_num_seqs=16)
    if storm:  # a pool that holds about two requests; a swap space for a few pages only
        kw.update(num_kv_pages=10, swap_space_bytes=160 << 10)
    engine = LLMEngine(path, dtype="float32", device="cpu", skip_tokenizer_init=True, kv_layout=layout,
                       enable_prefix_caching=prefix, enable_wavefront_prefill=wcpb, enable_mixed_batching=mixed, **kw)
    done = _run(engine, reqs)
    for r in reqs:
        want, _ = _oracle(path, tuple(r["prompt"]), r["max_tokens"])
        assert done[r["id"]].outputs[0].token_ids == want, r["id"]
    _assert_pools_full(engine)
    st = engine.stats()
    if storm:
        assert st.num_preemptions >= 50, st
        assert st.num_swap_preemptions > 0 and st.num_recompute_preemptions > 0, st
    if prefix:
        assert st.prefix_cache_hits > 0


@pytest.mark.parametrize("swap", [True, False], ids=["swap", "recompute"])
def test_preempted_seeded_request_is_unchanged(ckpt, swap):
    """Temperature-1 sampling with a seed: a preempted request yields its unpreempted tokens."""
    path = ckpt("ouro")
    rng = random.Random(3)
    target = dict(id="t", prompt=[rng.randrange(3, VOCAB) for _ in range(30)], max_tokens=24, priority=1, arrival=0)
    params = lambda r: SamplingParams(temperature=1.0, seed=77 if r["id"] == "t" else None, max_tokens=r["max_tokens"],
                                      ignore_eos=True, logprobs=1)
    kw = dict(dtype="float32", device="cpu", skip_tokenizer_init=True, page_size=4, long_prefill_token_threshold=8,
              max_num_batched_tokens=32, enable_prefix_caching=False, swap_space_bytes=(64 << 20) if swap else 0)
    alone = _run(LLMEngine(path, **kw), [target], params)["t"].outputs[0]
    # High-priority arrivals that need the whole pool force the target out mid-decode, repeatedly.
    others = [dict(id=f"h{i}", prompt=[rng.randrange(3, VOCAB) for _ in range(40)], max_tokens=3, priority=0,
                   arrival=4 + 9 * i) for i in range(6)]
    engine = LLMEngine(path, num_kv_pages=14, **kw)
    got = _run(engine, [target] + others, params)["t"].outputs[0]
    assert engine.stats().num_preemptions > 0
    assert (engine.stats().num_swap_preemptions > 0) == swap
    assert got.token_ids == alone.token_ids
    # Equal up to the float noise of a different batch composition (CPU matmul blocking).
    for a, b in zip(alone.logprobs, got.logprobs):
        tok = next(iter(a))
        assert abs(a[tok].logprob - b[tok].logprob) < 1e-5
    _assert_pools_full(engine)


def test_prefix_cache_hit_rate(ckpt):
    path = ckpt("ouro")
    rng = random.Random(4)
    system = [rng.randrange(3, VOCAB) for _ in range(160)]
    reqs = [dict(id=f"r{i}", prompt=system + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 16))],
                 max_tokens=4, priority=0, arrival=2 * i) for i in range(24)]
    results = {}
    for enabled in (False, True):
        engine = LLMEngine(path, dtype="float32", device="cpu", skip_tokenizer_init=True, page_size=16,
                           enable_prefix_caching=enabled)
        done = _run(engine, reqs)
        results[enabled] = ({k: v.outputs[0].token_ids for k, v in done.items()}, engine.stats())
        _assert_pools_full(engine)
    (out_off, st_off), (out_on, st_on) = results[False], results[True]
    assert out_on == out_off
    hit_rate = st_on.prefix_cache_hits / st_on.prefix_cache_queries
    assert hit_rate > 0.8, hit_rate
    assert st_on.num_row_tokens < 0.3 * st_off.num_row_tokens  # fewer prompt rows computed


def test_wavefront_needs_fewer_core_calls(ckpt):
    """One 2,048-token prompt at 4 loops: counted core calls with and without WCPB."""
    path = ckpt("ouro")
    prompt = [random.Random(6).randrange(3, VOCAB) for _ in range(2048)]
    calls = {}
    for wcpb in (False, True):
        engine = LLMEngine(path, dtype="float32", device="cpu", skip_tokenizer_init=True, page_size=16,
                           long_prefill_token_threshold=256, max_num_batched_tokens=2048, enable_wavefront_prefill=wcpb)
        done = _run(engine, [dict(id="p", prompt=prompt, max_tokens=1, priority=0, arrival=0)])
        calls[wcpb] = (engine.stats().num_core_calls, done["p"].outputs[0].token_ids)
        _assert_pools_full(engine)
    assert calls[True][1] == calls[False][1]
    # phase-separated: 8 chunks x 4 depths = 32 calls; wavefront: 8 + 4 - 1 = 11 calls
    assert calls[False][0] == 32 and calls[True][0] == 11, calls


def _longest_decode_stall(mixed: bool, path: str) -> int:
    engine = LLMEngine(path, dtype="float32", device="cpu", skip_tokenizer_init=True, page_size=16,
                       long_prefill_token_threshold=64, max_num_batched_tokens=96, enable_mixed_batching=mixed)
    rng = random.Random(8)
    for i in range(4):
        engine.add_request(f"d{i}", [rng.randrange(3, VOCAB) for _ in range(8)],
                           SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    while any(len(s.output_token_ids) == 0 for s in engine.scheduler.running + engine.scheduler.waiting):
        engine.step()
    engine.add_request("long", [rng.randrange(3, VOCAB) for _ in range(1024)],
                       SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    decoders = [s for s in engine.scheduler.running if s.request_id.startswith("d")]
    stall, longest = {id(s): 0 for s in decoders}, 0
    long_seq = next(s for s in engine.scheduler.waiting if s.request_id == "long")
    while not long_seq.status.finished:
        progress = lambda s: (len(s.output_token_ids), s.spans[0].depth if s.spans else -1)
        before = {id(s): progress(s) for s in decoders}
        engine.step()
        for s in decoders:
            stall[id(s)] = 0 if progress(s) != before[id(s)] else stall[id(s)] + 1
            longest = max(longest, stall[id(s)])
    engine.abort_request([s.request_id for s in decoders])
    engine.step()
    _assert_pools_full(engine)
    return longest


def test_mixed_batching_keeps_decode_moving(ckpt, capsys):
    path = ckpt("ouro")
    with_mixed, without = _longest_decode_stall(True, path), _longest_decode_stall(False, path)
    print(f"longest decode stall (core calls): mixed={with_mixed} phase-separated={without}")
    assert with_mixed == 0 and without >= 16


def test_unsupported_combinations_are_rejected(ckpt):
    from rlt_serve.config import ConfigError

    path = ckpt("ouro")
    with pytest.raises(ConfigError, match="shared"):
        LLMEngine(path, device="cpu", skip_tokenizer_init=True, kv_layout="shared", long_prefill_token_threshold=8)
    with pytest.raises(ConfigError, match="wavefront"):
        LLMEngine(path, device="cpu", skip_tokenizer_init=True, kv_layout="shared", long_prefill_token_threshold=1)
    with pytest.raises(ConfigError, match="kv_layout"):
        LLMEngine(path, device="cpu", skip_tokenizer_init=True, kv_layout="bogus")


@pytest.mark.parametrize("family", ["ouro", "nanbeige"])
def test_shared_layout_matches_shared_semantics_oracle(ckpt, family):
    path = ckpt(family)
    ref = ReferenceModel.from_pretrained(path)
    rng = random.Random(12)
    reqs = [dict(id=f"s{i}", prompt=[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 12))],
                 max_tokens=rng.randint(1, 5), priority=0, arrival=i) for i in range(8)]
    engine = LLMEngine(path, dtype="float32", device="cpu", skip_tokenizer_init=True, kv_layout="shared",
                       long_prefill_token_threshold=1, enable_wavefront_prefill=False, page_size=4)
    done = _run(engine, reqs)
    differs = 0
    for r in reqs:
        seq, want = list(r["prompt"]), []
        for _ in range(r["max_tokens"]):
            want.append(int(ref.forward_shared_kv(seq)[-1].argmax()))
            seq.append(want[-1])
        assert done[r["id"]].outputs[0].token_ids == want, r["id"]
        differs += want != _oracle(path, tuple(r["prompt"]), r["max_tokens"])[0]
    assert differs > 0, "shared KV should change the semantics on some request"
    _assert_pools_full(engine)


def test_last_exited_fills_deeper_slots(ckpt):
    """A token that leaves the core at depth e leaves slots e+1..D-1 equal to slot e."""
    path = ckpt("ouro")
    engine = LLMEngine(path, dtype="float32", device="cpu", skip_tokenizer_init=True, kv_layout="last_exited",
                       max_loops=4, page_size=4, enable_prefix_caching=False)
    engine.add_request("a", list(range(10, 19)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, num_loops=2))
    seq = engine.scheduler.waiting[0]
    while seq.num_computed < 10:  # prompt plus the first decode token, not yet released
        engine.step()
    kv, ps = engine.runner.kv, engine.runner.kv.page_size
    slots = torch.tensor([seq.page_table[p // ps] * ps + p % ps for p in range(10)])
    k_flat, _ = kv.flat(0)
    for layer in range(len(engine.runner.slots_per_layer)):
        base = kv.plane_base(layer)
        exit_k = k_flat[base + 1, slots]
        assert exit_k.abs().sum() > 0
        for d in (2, 3):
            assert torch.equal(k_flat[base + d, slots], exit_k)
    engine.abort_request("a")
    engine.step()
    _assert_pools_full(engine)
