"""Prefill/decode handoff between two in-process engines on the same checkpoint.

A "local copy" transport moves each reported chunk by torch indexing as soon as it is reported,
so transfers interleave with later chunks' compute. Outputs must equal one engine running the same
requests (same seeds), and every page and state slot must come back on both sides.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

from rlt_serve.engine.block_manager import OutOfPages
from rlt_serve.engine.handoff import KVChunk, Reservation, StaleGeneration
from rlt_serve.engine.llm_engine import LLMEngine
from rlt_serve.sampling_params import SamplingParams
from rlt_serve.testing import write_random_checkpoint

VOCAB = 384
BASE = dict(page_size=4, num_kv_pages=160, max_num_batched_tokens=32, long_prefill_token_threshold=8)


@functools.lru_cache(maxsize=None)
def _checkpoint(root: str, family: str) -> str:
    return write_random_checkpoint(f"{root}/{family}", family, seed=7)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("pd"))
    return lambda family: _checkpoint(root, family)


def _engine(path: str, **kw) -> LLMEngine:
    return LLMEngine(path, dtype="float32", device="cpu", skip_tokenizer_init=True, **{**BASE, **kw})


def _workload(seed: int, n: int) -> list[dict]:
    rng = random.Random(seed)
    system = [rng.randrange(3, VOCAB) for _ in range(13)]
    reqs = []
    for i in range(n):
        tail = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 19))]
        reqs.append(dict(id=f"r{i}", prompt=system + tail if i % 3 else tail, max_tokens=rng.randint(1, 9),
                         seed=1000 + i, greedy=i % 2 == 0))
    return reqs


def _params(r: dict, **extra) -> SamplingParams:
    temp = dict(temperature=0.0) if r["greedy"] else dict(temperature=0.9, top_p=0.95)
    return SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True, seed=r["seed"], logprobs=1, **temp, **extra)


def _single(path: str, reqs: list[dict], engine_kw: dict, **extra) -> dict[str, tuple]:
    eng = _engine(path, **engine_kw)
    for r in reqs:
        eng.add_request(r["id"], r["prompt"], _params(r, **extra))
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = _result(out)
    assert eng.num_free_pages == eng.num_pages
    return done


def _result(out) -> tuple:
    c = out.outputs[0]
    lps = [next(iter(t.values())).logprob for t in c.logprobs] if c.logprobs else None
    return tuple(c.token_ids), c.finish_reason, lps


def _assert_same(got: dict, want: dict) -> None:
    """Tokens and finish reasons exactly; logprobs within fp32 noise (the first token's logits
    come from a batch of a different composition than in the single engine)."""
    assert got.keys() == want.keys()
    for rid in want:
        assert got[rid][:2] == want[rid][:2], rid
        assert got[rid][2] == pytest.approx(want[rid][2], abs=1e-4), rid


def copy_chunk(src: LLMEngine, dst: LLMEngine, chunk: KVChunk, res: Reservation) -> None:
    """The local-copy transport: every plane of the chunk's pages, K and V."""
    dst_pages = res.page_ids[chunk.first_page : chunk.first_page + len(chunk.page_ids)]
    s = torch.tensor(chunk.page_ids, dtype=torch.long)
    d = torch.tensor(dst_pages, dtype=torch.long)
    dst.runner.kv.raw_k[:, d] = src.runner.kv.raw_k[:, s]  # stored bytes, any kv_cache_dtype
    dst.runner.kv.raw_v[:, d] = src.runner.kv.raw_v[:, s]


class PD:
    """Drives a prefill engine and a decode engine like the two workers would."""

    def __init__(self, pre: LLMEngine, dec: LLMEngine, via_slot: bool = False) -> None:
        self.pre, self.dec, self.via_slot = pre, dec, via_slot
        self.live: dict[str, Reservation] = {}
        self.pages_sent: dict[str, int] = {}
        self.done: dict[str, tuple] = {}

    def submit(self, rid: str, prompt: list[int], params: SamplingParams) -> Reservation:
        res = self.dec.reserve_remote_prefill(rid, prompt, params)
        self.pre.add_prefill_request(rid, prompt, params, skip_tokens=res.num_cached_tokens, seed=res.seed)
        self.live[rid] = res
        self.pages_sent[rid] = 0
        return res

    def step(self) -> None:
        assert not [o for o in self.pre.step() if o.finished], "prefill requests produce no outputs"
        for chunk in self.pre.pop_kv_chunks():
            res = self.live[chunk.request_id]
            assert self.dec.check_generation(chunk.request_id, res.generation)
            copy_chunk(self.pre, self.dec, chunk, res)
            self.pages_sent[chunk.request_id] += len(chunk.page_ids)
            assert self.dec.commit_kv_chunk(chunk.request_id, res.generation, chunk.first_page,
                                            len(chunk.page_ids), chunk.last)
            assert self.dec.remote_prefill_ready(chunk.request_id) == chunk.last
            if chunk.last:
                state = chunk.final_state.clone()
                if self.via_slot:  # what a transport does: the state rides in the registered slot buffer
                    self.dec.handoff.state_buffer[res.state_slot] = state
                    state = None
                self.dec.activate_remote_prefill(chunk.request_id, res.generation, state, chunk.model_state)
                assert self.pre.release_prefill(chunk.request_id)
                del self.live[chunk.request_id]
        for out in self.dec.step():
            if out.finished:
                assert out.request_id not in self.done, "a request finished twice"
                self.done[out.request_id] = _result(out)

    def busy(self) -> bool:
        return bool(self.live) or self.pre.has_unfinished_requests() or self.dec.has_unfinished_requests()


def _run_pd(path: str, reqs: list[dict], pre_kw: dict, dec_kw: dict, concurrent: int = 4, via_slot=False,
            **extra) -> tuple[dict, PD]:
    pd = PD(_engine(path, **pre_kw), _engine(path, **dec_kw), via_slot)
    pending, steps = list(reqs), 0
    while pending or pd.busy():
        while pending and len(pd.live) < concurrent:
            try:
                pd.submit(pending[0]["id"], pending[0]["prompt"], _params(pending[0], **extra))
            except OutOfPages:  # the decode pool is busy: retried after a step, as the router would
                assert pd.busy()
                break
            pending.pop(0)
        pd.step()
        steps += 1
        assert steps < 5000
    _assert_pools(pd.pre)
    _assert_pools(pd.dec)
    return pd.done, pd


def _assert_pools(eng: LLMEngine) -> None:
    assert eng.num_free_pages == eng.num_pages
    assert eng.handoff.num_free_state_slots == len(eng.handoff.state_buffer)
    assert not eng.has_unfinished_requests() and not eng.scheduler.running and not eng.scheduler.waiting


CASES = [
    ("ouro", {}),
    ("ouro", dict(enable_prefix_caching=False)),
    ("ouro", dict(enable_wavefront_prefill=False, long_prefill_token_threshold=5)),
    ("nanbeige", {}),
    ("nanbeige", dict(enable_prefix_caching=False, enable_mixed_batching=False)),
    ("huginn", {}),
    ("huginn", dict(enable_prefix_caching=False, long_prefill_token_threshold=3)),
    ("huginn", dict(huginn_cache="compress-s2", long_prefill_token_threshold=1, enable_wavefront_prefill=False)),
    ("ouro", dict(kv_cache_dtype="fp8")),
    ("huginn", dict(kv_cache_dtype="fp8_e5m2")),
]


@pytest.mark.parametrize("family,kw", CASES)
def test_pd_equals_single_engine(ckpt, family, kw):
    path = ckpt(family)
    reqs = _workload(CASES.index((family, kw)), 10)
    want = _single(path, reqs, kw)
    got, pd = _run_pd(path, reqs, kw, kw, via_slot=bool(kw))
    _assert_same(got, want)


def test_decode_side_speculation_preemption_and_adaptive_exit(ckpt):
    """After the handoff the decode side is an ordinary engine: self-speculation, preemption under
    a small pool (swap and recompute), and Ouro's early exit with last_exited KV."""
    path = ckpt("ouro")
    reqs = _workload(3, 10)
    for kw, counter in ((dict(num_speculative_tokens=2, speculative_draft_depth=1), "num_spec_drafts"),
                        (dict(num_kv_pages=24, swap_space_bytes=1 << 22), "num_swap_preemptions"),
                        (dict(num_kv_pages=24, swap_space_bytes=0), "num_recompute_preemptions")):
        want = _single(path, reqs, kw)
        got, pd = _run_pd(path, reqs, {}, kw, concurrent=3)
        _assert_same(got, want)
        assert getattr(pd.dec.stats(), counter) > 0, counter
    adaptive = dict(kv_layout="last_exited")
    want = _single(path, reqs, adaptive, exit_threshold=0.6)
    got, _ = _run_pd(path, reqs, adaptive, adaptive, exit_threshold=0.6)
    _assert_same(got, want)


def test_prefill_side_small_pool(ckpt):
    """Prefill requests take their whole prompt's pages at admission (they cannot be preempted
    once a chunk is out), so a small prefill pool queues them instead of deadlocking."""
    path = ckpt("nanbeige")
    reqs = _workload(5, 10)
    want = _single(path, reqs, {})
    got, pd = _run_pd(path, reqs, dict(num_kv_pages=12), {}, concurrent=6)
    _assert_same(got, want)
    assert pd.pre.stats().num_preemptions == 0


def test_huginn_exit_criterion(ckpt):
    path = ckpt("huginn")
    reqs = _workload(4, 6)
    kw = dict(huginn_cache="latest-m4")
    want = _single(path, reqs, kw, exit_criterion="latent-diff", exit_threshold=0.5)
    got, _ = _run_pd(path, reqs, kw, kw, exit_criterion="latent-diff", exit_threshold=0.5)
    _assert_same(got, want)


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_decode_prefix_hit_shrinks_transfer(ckpt, family):
    path = ckpt(family)
    rng = random.Random(9)
    prefix = [rng.randrange(3, VOCAB) for _ in range(17)]
    reqs = [dict(id=f"q{i}", prompt=prefix + [rng.randrange(3, VOCAB) for _ in range(3 + i)], max_tokens=4,
                 seed=77, greedy=i == 0) for i in range(2)]
    want = _single(path, reqs, {})
    pd = PD(_engine(path, enable_prefix_caching=False), _engine(path))
    sent = []
    for r in reqs:  # one after the other: the second finds the first's received pages cached
        res = pd.submit(r["id"], r["prompt"], _params(r))
        sent.append((res.num_cached_tokens, -(-len(r["prompt"]) // 4)))
        while pd.busy():
            pd.step()
    _assert_same(pd.done, want)
    assert sent[0][0] == 0 and pd.pages_sent["q0"] == sent[0][1]
    assert sent[1][0] == 16 and pd.pages_sent["q1"] == sent[1][1] - 4
    _assert_pools(pd.pre)
    _assert_pools(pd.dec)


def _prefill_until(pd: PD, rid: str, cond) -> None:
    for _ in range(200):
        if cond():
            return
        pd.step()
    raise AssertionError(f"{rid}: condition never reached")


def test_abort_in_every_phase_restores_pools(ckpt):
    path = ckpt("ouro")
    prompt = list(range(3, 40))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, seed=1)
    pre, dec = _engine(path), _engine(path)
    free_pre, free_dec = pre.num_free_pages, dec.num_free_pages

    def fresh() -> PD:
        return PD(pre, dec)

    # decode side, reserved: nothing sent yet
    pd = fresh()
    pd.dec.reserve_remote_prefill("a", prompt, params)
    assert dec.num_free_pages < free_dec
    dec.abort_request("a")
    dec.abort_request("a")  # a second abort is a no-op
    assert [o.outputs[0].finish_reason for o in dec.step()] == ["abort"]
    assert dec.num_free_pages == free_dec

    # prefill queued (never scheduled) and decode reserved
    pd = fresh()
    pd.submit("b", prompt, params)
    pre.abort_request("b")
    dec.abort_request("b")
    pd.live.clear()
    assert pre.num_free_pages == free_pre and not pre.has_unfinished_requests()
    assert dec.step()[0].finished and dec.num_free_pages == free_dec

    # prefilling with chunks already sent (pinned), decode has received some of them
    pd = fresh()
    pd.submit("c", prompt, params)
    chunks: list[KVChunk] = []
    while not chunks:
        pre.step()
        chunks = pre.pop_kv_chunks()
    assert not chunks[-1].last and pre.scheduler.running[0].transfer_pinned
    res = pd.live["c"]
    for ch in chunks:
        copy_chunk(pre, dec, ch, res)
        assert dec.commit_kv_chunk("c", res.generation, ch.first_page, len(ch.page_ids))
    with pytest.raises(ValueError, match="never committed"):
        dec.activate_remote_prefill("c", res.generation)
    pre.abort_request("c")
    dec.abort_request("c")
    assert pre.release_prefill("c") is False  # already freed, exactly once
    assert pre.num_free_pages == free_pre and not pre.pop_kv_chunks()
    dec.step()
    assert dec.num_free_pages == free_dec

    # prefill done (pages held for the transfer), decode received everything but not activated
    pd = fresh()
    pd.submit("d", prompt, params)
    last = None
    while last is None:
        pre.step()
        for ch in pre.pop_kv_chunks():
            copy_chunk(pre, dec, ch, pd.live["d"])
            dec.commit_kv_chunk("d", pd.live["d"].generation, ch.first_page, len(ch.page_ids))
            last = ch if ch.last else None
    assert not pre.has_unfinished_requests() and pre.num_free_pages < free_pre
    pre.abort_request("d")
    assert pre.num_free_pages == free_pre
    dec.abort_request("d")
    assert dec.step()[0].outputs[0].finish_reason == "abort" and dec.num_free_pages == free_dec

    # activated but first token not sampled yet, then decoding
    for when in ("activated", "decoding"):
        pd = fresh()
        pd.submit("e", prompt, params)
        _prefill_until(pd, "e", lambda: "e" not in pd.live)
        if when == "decoding":
            pd.step()
            assert dec.has_unfinished_requests() and "e" not in pd.done
        dec.abort_request("e")
        outs = [o for o in dec.step() if o.finished]
        assert "e" in pd.done or [o.outputs[0].finish_reason for o in outs] == ["abort"]
        assert dec.num_free_pages == free_dec and pre.num_free_pages == free_pre
    _assert_pools(pre)
    _assert_pools(dec)


def test_stale_generation_is_refused(ckpt):
    path = ckpt("nanbeige")
    dec = _engine(path)
    params = SamplingParams(temperature=0, max_tokens=3, seed=2)
    old = dec.reserve_remote_prefill("x", list(range(3, 20)), params)
    dec.abort_request("x")
    dec.step()
    new = dec.reserve_remote_prefill("x", list(range(3, 20)), params)
    assert new.generation > old.generation
    assert not dec.check_generation("x", old.generation) and dec.check_generation("x", new.generation)
    assert dec.commit_kv_chunk("x", old.generation, 0, 1) is False
    with pytest.raises(StaleGeneration):
        dec.activate_remote_prefill("x", old.generation)
    dec.abort_request("x")
    dec.step()
    assert dec.num_free_pages == dec.num_pages


def test_rejections(ckpt):
    path = ckpt("ouro")
    pre, dec = _engine(path), _engine(path, num_kv_pages=4)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        dec.reserve_remote_prefill("p", [5, 6, 7], SamplingParams(prompt_logprobs=1))
    with pytest.raises(ValueError, match="prompt_logprobs"):
        pre.add_prefill_request("p", [5, 6, 7], SamplingParams(prompt_logprobs=1))
    with pytest.raises(ValueError, match="skip_tokens"):
        pre.add_prefill_request("p", [5, 6, 7, 8, 9], SamplingParams(), skip_tokens=3)
    dec.reserve_remote_prefill("a", list(range(3, 13)), SamplingParams())
    with pytest.raises(OutOfPages):
        dec.reserve_remote_prefill("b", list(range(20, 30)), SamplingParams())
    dec.abort_request(["a", "b"])
    assert len(dec.step()) == 1
    _assert_pools(dec)
    pre.add_prefill_request("p", [5, 6, 7], SamplingParams())
    with pytest.raises(ValueError, match="already running"):
        pre.add_prefill_request("p", [5, 6, 7], SamplingParams())
    with pytest.raises(ValueError, match="not finished"):
        pre.release_prefill("p")
    pre.abort_request("p")
    _assert_pools(pre)


def test_held_pages_make_queued_requests_wait(ckpt):
    """A pool full of pages held for transfers is not a dead end: queued work waits for the
    release instead of the engine giving up."""
    path = ckpt("ouro")
    for side in ("prefill", "decode"):
        eng = _engine(path, num_kv_pages=8)
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, seed=3)
        if side == "prefill":
            eng.add_prefill_request("held", list(range(3, 23)), params)  # 5 of 8 pages
            while eng.has_unfinished_requests():
                eng.step()
        else:
            eng.reserve_remote_prefill("held", list(range(3, 23)), params)
        eng.pop_kv_chunks()
        eng.add_prefill_request("queued", list(range(30, 45)), params)  # its 4 pages do not fit yet
        for _ in range(3):
            assert eng.step() == [] and not eng.pop_kv_chunks()
        eng.release_prefill("held") if side == "prefill" else eng.abort_request("held")
        chunks = []
        while eng.has_unfinished_requests():
            eng.step()
            chunks += eng.pop_kv_chunks()
        assert chunks[-1].request_id == "queued" and chunks[-1].last
        assert eng.release_prefill("queued")
        _assert_pools(eng)


def test_refusal_after_the_prefill_job_ended_is_counted() -> None:
    """A write is posted and forgotten, so the refusal of a job's last chunk may arrive after the
    job finished: the writer still counts it as stale (it was only counted while the job lived,
    which made test_reservation_never_activated_expires flaky)."""
    from types import SimpleNamespace

    from workers.prefill import PrefillRole
    from workers.transfer import KVLayout, TransferNotif, encode_notif

    counted: list[str] = []
    refusal = encode_notif(TransferNotif("refused", "gone", 3, 0, True))
    agent = SimpleNamespace(notifications=lambda: [("d0", refusal)])
    metrics = SimpleNamespace(count_transfer_failure=counted.append, set_in_flight=lambda *a: None)
    role = PrefillRole("p0", SimpleNamespace(), agent, lambda msg: None, metrics, 1 << 20, 5.0,
                       KVLayout(8, 16, 1024, 64))  # fmt: skip
    role.pump()
    assert counted == ["stale"] and role.jobs == {}
