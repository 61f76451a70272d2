"""Float8 KV storage (`kv_cache_dtype`) against the dense reference that rounds K/V the same way.

The engine stores each token's K/V in 8 bits and every attention read upcasts them, the token's
own keys included; `ReferenceModel(kv_dtype=...)` rounds K/V at the same point, so greedy tokens
and logprobs must match as closely as without quantization. The rounding itself must be visible
(the references with and without it differ), or these tests would prove nothing.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

from rlt_serve.config import ConfigError
from rlt_serve.engine.llm_engine import LLMEngine
from rlt_serve.reference import ReferenceModel
from rlt_serve.reference_huginn import HuginnReference
from rlt_serve.sampling_params import SamplingParams
from rlt_serve.testing import write_random_checkpoint

VOCAB = 384
FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@functools.lru_cache(maxsize=None)
def _checkpoint(family: str, root: str) -> str:
    return write_random_checkpoint(f"{root}/{family}", family, seed=9, max_position_embeddings=4096)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("fp8"))
    return lambda family: _checkpoint(family, root)


def _workload(seed: int, n: int) -> list[dict]:
    rng = random.Random(seed)
    system = [rng.randrange(3, VOCAB - 32) for _ in range(20)]
    reqs = []
    for i in range(n):
        tail = [rng.randrange(3, VOCAB - 32) for _ in range(rng.randint(1, 30))]
        reqs.append(dict(id=f"r{i}", prompt=system + tail if rng.random() < 0.5 else tail,
                         max_tokens=rng.randint(1, 8), arrival=rng.randint(0, 30), priority=rng.randint(0, 1)))
    return reqs


def _run(engine: LLMEngine, reqs: list[dict]) -> dict:
    pending = sorted(reqs, key=lambda r: r["arrival"])
    done: dict = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0]["arrival"] <= step:
            r = pending.pop(0)
            params = SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True, logprobs=1, seed=7)
            engine.add_request(r["id"], r["prompt"], params, priority=r["priority"])
        for out in engine.step():
            if out.finished:
                assert out.request_id not in done, "a request finished twice"
                done[out.request_id] = out.outputs[0]
        step += 1
        assert step < 20000
    assert engine.num_free_pages == engine.num_pages, "pages leaked"
    assert engine.swap_space is None or engine.swap_space.used_bytes == 0, "swap space leaked"
    return done


def _compare(done: dict, reqs: list[dict], greedy) -> None:
    for r in reqs:
        c = done[r["id"]]
        want, logits = greedy(r)
        assert c.token_ids == want, r["id"]
        ref_lp = torch.log_softmax(logits.double(), -1)
        for k, (tok, table) in enumerate(zip(c.token_ids, c.logprobs)):
            assert abs(table[tok].logprob - ref_lp[k, tok].item()) < 1e-4, (r["id"], k)


@pytest.mark.parametrize("kv_cache_dtype", sorted(FP8))
@pytest.mark.parametrize("family,layout", [("ouro", "separate"), ("ouro", "last_exited"), ("nanbeige", "separate")])
def test_fp8_kv_matches_rounding_reference(ckpt, family, layout, kv_cache_dtype):
    """Chunked prompts, prefix caching, preemption by swap and by recompute, all with 8-bit K/V."""
    path = ckpt(family)
    kv_dtype = FP8[kv_cache_dtype]
    ref = ReferenceModel.from_pretrained(path)
    ref8 = ReferenceModel(ref.config, ref.weights, ref.dtype, kv_dtype=kv_dtype)
    reqs = _workload(seed=2, n=24)
    engine = LLMEngine(path, dtype="float32", device="cpu", skip_tokenizer_init=True, kv_cache_dtype=kv_cache_dtype,
                       kv_layout=layout, page_size=8, long_prefill_token_threshold=8, max_num_batched_tokens=48,
                       max_num_seqs=8, num_kv_pages=10, swap_space_bytes=24 << 10)  # fmt: skip
    assert engine.runner.kv.dtype == kv_dtype
    done = _run(engine, reqs)
    st = engine.stats()
    assert st.num_swap_preemptions > 0 and st.num_recompute_preemptions > 0 and st.prefix_cache_hits > 0, st
    _compare(done, reqs, lambda r: ref8.greedy(r["prompt"], r["max_tokens"]))
    # The rounding is not a no-op: the unrounded reference's logits differ.
    p = reqs[0]["prompt"]
    gap = (ref8.forward(p).logits - ref.forward(p).logits).abs().max().item()
    assert gap > 1e-3, gap


def test_fp8_kv_huginn_matches_rounding_reference(ckpt):
    path = ckpt("huginn")
    ref = HuginnReference.from_pretrained(path)
    ref8 = HuginnReference(ref.config, ref.w, ref.dtype, kv_dtype=torch.float8_e4m3fn)
    reqs = _workload(seed=4, n=8)
    engine = LLMEngine(path, dtype="float32", device="cpu", skip_tokenizer_init=True, kv_cache_dtype="fp8",
                       page_size=4, long_prefill_token_threshold=8, max_num_batched_tokens=32, max_num_seqs=4)
    done = _run(engine, reqs)
    _compare(done, reqs, lambda r: ref8.greedy(r["prompt"], r["max_tokens"], seed=7))
    p = reqs[0]["prompt"]
    assert (ref8.forward(p, seed=7).logits - ref.forward(p, seed=7).logits).abs().max() > 1e-3


def test_fp8_pool_holds_more_tokens_and_says_so(ckpt):
    path = ckpt("ouro")
    kw = dict(dtype="float32", device="cpu", skip_tokenizer_init=True, kv_cache_memory_bytes=8 << 20)
    full, fp8 = LLMEngine(path, **kw), LLMEngine(path, kv_cache_dtype="fp8", **kw)
    assert fp8.num_pages == 4 * full.num_pages  # 1 byte per value against fp32's 4
    assert "planes of float8_e4m3fn" in fp8.kv_capacity_report()


def test_fp8_rejections(ckpt):
    path = ckpt("ouro")
    with pytest.raises(ConfigError, match="kv_cache_dtype='int4' is not supported"):
        LLMEngine(path, device="cpu", skip_tokenizer_init=True, kv_cache_dtype="int4")
    with pytest.raises(ConfigError, match="flash-attn"):
        LLMEngine(path, device="cpu", skip_tokenizer_init=True, kv_cache_dtype="fp8", attention_backend="flash-attn")
