"""Huginn-0125 on the shared row mechanism: golden outputs of the official code, the dense oracle
under random batching, exit criteria, cache strategies, scheduling features, chat and tokens."""

from __future__ import annotations

import functools
import json
import random

import pytest
import torch
from safetensors.torch import load_file

from rlt_serve import LLM, SamplingParams
from rlt_serve.config import ConfigError
from rlt_serve.engine.kv_cache import KVCache
from rlt_serve.engine.llm_engine import LLMEngine
from rlt_serve.reference_huginn import HuginnReference
from rlt_serve.testing import write_random_checkpoint

ATOL = 1e-4
VOCAB = 384
ZERO = {"init_scale": 0.0}


@functools.lru_cache(maxsize=None)
def _checkpoint(root: str, seed: int, **overrides) -> str:
    name = "-".join(f"{k}{v}" for k, v in sorted(overrides.items())) or "default"
    return write_random_checkpoint(f"{root}/huginn-{seed}-{name}", "huginn", seed=seed, **overrides)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("huginn"))
    return lambda seed=5, **kw: _checkpoint(root, seed, **{"block_size": 512, **kw})


@functools.lru_cache(maxsize=None)
def _ref(path: str, zero: bool) -> HuginnReference:
    return HuginnReference.from_pretrained(path, hf_overrides=ZERO if zero else None)


def _engine(path: str, zero: bool = False, **kw) -> LLMEngine:
    return LLMEngine(path, dtype="float32", device="cpu", skip_tokenizer_init=True,
                     hf_overrides=ZERO if zero else None, **kw)


def _run(engine: LLMEngine, reqs: list[dict], record_exits: bool = False) -> tuple[dict, dict]:
    """Drive requests (arrival step, optional abort step) to completion; returns finished outputs
    and, when asked, the depth each position of each request left the core at."""
    exits: dict[str, dict[int, int]] = {}
    if record_exits:
        coda = engine.runner._coda

        def record(rows):
            for seq, span in rows:
                depths = span.exit.depth.tolist() if span.exit is not None else [span.depth] * span.num_tokens
                exits.setdefault(seq.request_id, {}).update(zip(range(span.start, span.end), depths))
            return coda(rows)

        engine.runner._coda = record
    pending = sorted(reqs, key=lambda r: r.get("arrival", 0))
    done: dict[str, object] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].get("arrival", 0) <= step:
            r = pending.pop(0)
            engine.add_request(r["id"], r["prompt"], r["params"], priority=r.get("priority", 0))
        for r in reqs:
            if r.get("abort_at") == step:
                engine.abort_request(r["id"])
        for out in engine.step():
            if out.finished:
                assert out.request_id not in done, "a request finished twice"
                done[out.request_id] = out
        step += 1
        assert step < 50000, "engine did not finish"
    assert engine.num_free_pages == engine.num_pages, "pages leaked"
    assert engine.swap_space is None or engine.swap_space.used_bytes == 0
    return done, exits


# -- golden outputs of the official code ---------------------------------------------------------
@pytest.mark.parametrize("steps", [4, 6])
@pytest.mark.parametrize(
    "engine_args",
    [dict(page_size=16), dict(page_size=1, long_prefill_token_threshold=4, max_num_batched_tokens=6)],
    ids=["page16", "page1-chunk4"],
)
def test_golden_through_llm(golden_dir, steps, engine_args):
    path = golden_dir / "huginn_s"
    G = load_file(str(path / "golden.safetensors"))
    llm = LLM(model=str(path), dtype="float32", device="cpu", skip_tokenizer_init=True, hf_overrides=ZERO,
              max_logprobs=VOCAB, max_loops=6, **engine_args)
    model = llm.llm_engine.runner.model
    head, seen = model.compute_logits, []
    model.compute_logits = lambda h: seen.append(head(h)) or seen[-1]
    for i in (0, 1):
        seen.clear()
        ids, key = G[f"p{i}/input_ids"].tolist(), f"p{i}/steps{steps}"
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=5, prompt_logprobs=VOCAB,
                                num_loops=steps)
        out = llm.generate({"prompt_token_ids": ids}, params)[0]
        c = out.outputs[0]
        assert c.token_ids == G[f"{key}/gen_ids"].tolist()
        prefill = torch.cat(seen)[: len(ids)]  # the prompt's coda calls cover positions 0..S-1 in order
        torch.testing.assert_close(prefill, G[f"{key}/prefill_logits"], atol=ATOL, rtol=0)
        ref_gen = torch.log_softmax(G[f"{key}/gen_logits"].double(), -1)
        for k, table in enumerate(c.logprobs):
            top = ref_gen[k].topk(5)
            for tok, val in zip(top.indices.tolist(), top.values.tolist()):
                assert abs(table[tok].logprob - val) < ATOL, (k, tok)
        ref_prompt = torch.log_softmax(G[f"{key}/prefill_logits"].double(), -1)
        for t in range(1, len(ids)):
            got = torch.tensor([out.prompt_logprobs[t][v].logprob for v in range(VOCAB)], dtype=torch.float64)
            torch.testing.assert_close(got, ref_prompt[t - 1], atol=ATOL, rtol=0)
    assert llm.llm_engine.num_free_pages == llm.llm_engine.num_pages


def test_reference_reproduces_golden(golden_dir):
    path = golden_dir / "huginn_s"
    G = load_file(str(path / "golden.safetensors"))
    ref = HuginnReference.from_pretrained(str(path), hf_overrides=ZERO)
    for steps in (4, 6):
        for i in (0, 1):
            ids, key = G[f"p{i}/input_ids"].tolist(), f"p{i}/steps{steps}"
            out = ref.forward(ids, steps)
            torch.testing.assert_close(out.logits, G[f"{key}/prefill_logits"], atol=ATOL, rtol=0)
            torch.testing.assert_close(out.latents, G[f"{key}/prefill_latents"], atol=ATOL, rtol=0)
            tokens, logits = ref.greedy(ids, 10, steps)
            assert tokens == G[f"{key}/gen_ids"].tolist()
            torch.testing.assert_close(logits, G[f"{key}/gen_logits"], atol=ATOL, rtol=0)
            gen = ref.generate(ids, 10, steps)  # the token-by-token path, "full" cache
            assert gen.tokens == tokens
            torch.testing.assert_close(gen.logits, logits, atol=ATOL, rtol=0)


def test_random_checkpoint_writer_is_the_golden_checkpoint(golden_dir, tmp_path):
    """Official key names, shapes, parameter order and init: seed 3 rebuilds `huginn_s` bit for bit."""
    path = write_random_checkpoint(str(tmp_path / "h"), "huginn", seed=3)
    got, want = load_file(f"{path}/model.safetensors"), load_file(str(golden_dir / "huginn_s" / "model.safetensors"))
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    cfg = json.loads((golden_dir / "huginn_s" / "config.json").read_text())
    mine = json.loads(open(f"{path}/config.json").read())
    for k in ("n_embd", "n_heads", "n_layers", "mean_recurrence", "rope_base", "head_dim", "padded_vocab_size"):
        assert mine[k] == cfg[k], k


# -- the dense oracle ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides,loops",
    [
        (dict(n_layers_in_recurrent_block=1, n_embd=48, n_heads=2, mean_recurrence=3, vocab_size=320), (1, 3, 5)),
        (dict(n_layers_in_prelude=1, n_layers_in_recurrent_block=3, n_layers_in_coda=1, n_heads=8), (2, 5)),
        (dict(n_layers_in_coda=3, n_heads=2, intermediate_size=96, mean_recurrence=7, qk_bias=False), (7, 2)),
    ],
)
def test_other_shapes_match_reference(ckpt, overrides, loops):
    """Different core depths, head counts and step counts, mixed in one batch (each row at its own r)."""
    path = ckpt(seed=11, **overrides)
    ref = _ref(path, True)
    engine = _engine(path, zero=True, page_size=4, long_prefill_token_threshold=5, max_num_batched_tokens=12,
                     max_loops=max(max(loops), ref.config.num_loops))
    rng = random.Random(5)
    reqs = [dict(id=f"{n}-{r}", prompt=[rng.randrange(3, ref.config.vocab_size - 32) for _ in range(n)],
                 params=SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, num_loops=r))
            for n in (1, 9, 23) for r in loops]
    done, _ = _run(engine, reqs)
    for r in reqs:
        assert done[r["id"]].outputs[0].token_ids == ref.greedy(r["prompt"], 5, r["params"].num_loops)[0], r["id"]


# (page_size, chunk, token budget, pages or None)
CONFIGS = [(16, 64, 128, None), (1, 7, 16, None), (16, 13, 40, 12), (1, 200, 256, None)]


@pytest.mark.parametrize("init", ["zero", "seeded"])
@pytest.mark.parametrize("page_size,chunk,budget,pages", CONFIGS)
def test_random_batching_matches_reference(ckpt, init, page_size, chunk, budget, pages):
    """Random arrivals, aborts, chunk sizes and pages; the seeded init draws each token's state
    from (request seed, position), so batching and preemption cannot change it."""
    path, zero = ckpt(), init == "zero"
    ref = _ref(path, zero)
    rng = random.Random(f"{init}-{page_size}-{chunk}-{budget}")
    reqs = []
    for i in range(16):
        r = dict(id=f"r{i}", prompt=[rng.randrange(3, VOCAB - 32) for _ in range(rng.randint(1, 120))],
                 params=SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 8), ignore_eos=True, logprobs=2,
                                       seed=1000 + i),
                 arrival=rng.randint(0, 40))
        if rng.random() < 0.2:
            r["abort_at"] = r["arrival"] + rng.randint(0, 20)
        reqs.append(r)
    engine = _engine(path, zero, page_size=page_size, long_prefill_token_threshold=chunk,
                     max_num_batched_tokens=budget, num_kv_pages=pages, max_num_seqs=8)
    done, _ = _run(engine, reqs)
    compared = 0
    for r in reqs:
        c = done[r["id"]].outputs[0]
        if c.finish_reason == "abort":
            continue
        want, logits = ref.greedy(r["prompt"], len(c.token_ids), seed=r["params"].seed)
        assert c.token_ids == want, r["id"]
        ref_lp = torch.log_softmax(logits.double(), -1)
        for k, (tok, table) in enumerate(zip(c.token_ids, c.logprobs)):
            assert abs(table[tok].logprob - ref_lp[k, tok].item()) < ATOL
        compared += 1
    assert compared >= 8
    if pages is not None:
        assert engine.stats().num_preemptions > 0


# -- adaptive exit -------------------------------------------------------------------------------
# Thresholds that spread exits over several steps of this checkpoint (r = 8).
CRITERIA = [("kl", 1e-3), ("minp-kl", 1e-3), ("entropy-diff", 5e-4), ("latent-diff", 0.2), ("cosine", 0.03),
            ("argmax-stability", 3)]


def _exit_case(path, criterion, threshold, seed, n=5, **extra):
    rng = random.Random(f"{criterion}-{seed}")
    reqs = []
    for i in range(n):
        params = SamplingParams(temperature=0, max_tokens=rng.randint(2, 7), ignore_eos=True, exit_criterion=criterion,
                                exit_threshold=threshold, seed=i, **extra)
        reqs.append(dict(id=f"x{i}", prompt=[rng.randrange(3, VOCAB - 32) for _ in range(rng.randint(1, 14))],
                         params=params, arrival=rng.randint(0, 6), priority=rng.randint(0, 1)))
    return reqs


def _check_exits(path, reqs, done, exits):
    ref, depths = _ref(path, False), set()
    for r in reqs:
        p = r["params"]
        gen = ref.generate(r["prompt"], p.max_tokens, cache="latest-m4", criterion=p.exit_criterion,
                           threshold=p.exit_threshold, min_loops=p.min_loops or 1, check_interval=p.exit_check_interval,
                           seed=p.seed)
        assert done[r["id"]].outputs[0].token_ids == gen.tokens, r["id"]
        got = [exits[r["id"]][pos] for pos in range(len(gen.exit_steps))]
        assert got == gen.exit_steps, r["id"]  # token by token, prompt positions included
        if p.exit_criterion != "argmax-stability":  # keep clear of float ties at the threshold
            assert all(abs(v - p.exit_threshold) > 1e-3 * p.exit_threshold for c in gen.checks for _, v in c)
        depths |= set(got[len(r["prompt"]):])
    return depths


@pytest.mark.parametrize("criterion,threshold", CRITERIA)
def test_exit_criteria_match_oracle(ckpt, criterion, threshold):
    path = ckpt(mean_recurrence=8)
    reqs = _exit_case(path, criterion, threshold, seed=1)
    engine = _engine(path, huginn_cache="latest-m4", page_size=4, long_prefill_token_threshold=5,
                     max_num_batched_tokens=16)
    done, exits = _run(engine, reqs, record_exits=True)
    assert len(_check_exits(path, reqs, done, exits)) >= 2, "exits should spread over several steps"


@pytest.mark.parametrize(
    "criterion,threshold,extra,engine_args",
    [
        ("kl", 1e-3, dict(min_loops=3, exit_check_interval=2), dict(num_kv_pages=8, swap_space_bytes=80 << 10)),
        ("latent-diff", 0.2, dict(min_loops=2), dict(num_kv_pages=7, swap_space_bytes=0)),
        ("entropy-diff", 4e-4, dict(exit_check_interval=3), dict(async_exit=True, enable_mixed_batching=False)),
    ],
    ids=["swap+recompute", "recompute", "delayed-phase-separated"],
)
def test_exit_criteria_under_preemption_and_policies(ckpt, criterion, threshold, extra, engine_args):
    """A recomputed request replays its generated positions' recorded exit steps, so it continues
    exactly as without preemption; min_loops / check interval gate the checks as officially."""
    path = ckpt(mean_recurrence=8)
    reqs = _exit_case(path, criterion, threshold, seed=2, n=8, **extra)
    engine = _engine(path, huginn_cache="latest-m4", page_size=4, long_prefill_token_threshold=5,
                     max_num_batched_tokens=16, **engine_args)
    done, exits = _run(engine, reqs, record_exits=True)
    _check_exits(path, reqs, done, exits)
    if "num_kv_pages" in engine_args:
        st = engine.stats()
        assert st.num_recompute_preemptions > 0, st
        assert (st.num_swap_preemptions > 0) == bool(engine_args["swap_space_bytes"]), st


def test_exited_tokens_stop_consuming_compute(ckpt):
    path = ckpt(mean_recurrence=8)
    counts = {}
    for crit, thr in ((None, None), ("kl", 1e-3)):
        engine = _engine(path, huginn_cache="latest-m4")
        engine.add_request("a", list(range(40, 52)), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                                    exit_criterion=crit, exit_threshold=thr))
        _run(engine, [])
        counts[crit] = engine.stats().num_row_tokens
    assert counts["kl"] < counts[None], counts


def test_exit_rejections(ckpt, tmp_path):
    path = ckpt()
    with pytest.raises(ValueError, match="latest-m4"):
        _engine(path).add_request("a", [5], SamplingParams(exit_criterion="kl"))
    with pytest.raises(ValueError, match="exit_criterion"):
        SamplingParams(exit_criterion="bogus")
    with pytest.raises(ValueError, match="whole number"):
        SamplingParams(exit_criterion="argmax-stability", exit_threshold=2.5)
    with pytest.raises(ValueError, match="exit_check_interval"):
        SamplingParams(exit_check_interval=2)
    with pytest.raises(ValueError, match="set exit_criterion"):
        _engine(path).add_request("a", [5], SamplingParams(exit_threshold=0.5))
    assert SamplingParams(exit_criterion="argmax-stability").exit_threshold is None  # the official "auto" (5)
    ouro = write_random_checkpoint(str(tmp_path / "ouro"), "ouro")
    with pytest.raises(ValueError, match="Huginn"):
        LLMEngine(ouro, device="cpu", skip_tokenizer_init=True, kv_layout="last_exited").add_request(
            "a", [5], SamplingParams(exit_criterion="kl"))
    with pytest.raises(ValueError, match="max_loops"):
        _engine(path).add_request("a", [5], SamplingParams(num_loops=5))  # default max_loops = mean_recurrence


# -- cache strategies ----------------------------------------------------------------------------
def test_compress_bounds_kv_bytes_per_token(ckpt, capsys):
    """compress-s{k} keeps P + k + C planes whatever r is; full keeps P + R*r + C (R = 2 here)."""
    path, report = ckpt(), {}
    for cache in ("full", "latest-m4", "compress-s4", "compress-s8"):
        for r in (4, 8, 32):
            kw = dict(long_prefill_token_threshold=1, enable_wavefront_prefill=False) if "compress" in cache else {}
            runner = _engine(path, zero=True, huginn_cache=cache, max_loops=r, num_kv_pages=4, **kw).runner
            kv = runner.kv
            measured = (kv.k.numel() + kv.v.numel()) * kv.k.element_size() // (kv.num_pages * kv.page_size)
            assert measured == KVCache.bytes_per_token(kv.num_planes, 4, 16, torch.float32)
            report[cache, r] = measured
    print("KV bytes/token (fp32, 4 heads x 16):", report)
    assert report["compress-s4", 4] == report["compress-s4", 32] == 2 * (2 + 4 + 2) * 4 * 16 * 4
    assert report["compress-s8", 8] == report["compress-s8", 32]
    assert report["full", 32] == report["latest-m4", 32] == 2 * (2 + 2 * 32 + 2) * 4 * 16 * 4


@pytest.mark.parametrize("cache", ["compress-s2", "compress-s4"])
def test_compress_matches_oracle(ckpt, cache):
    """Token by token: an earlier token is read at its latest step with the same ring slot."""
    path = ckpt(mean_recurrence=5)
    ref = _ref(path, True)
    rng = random.Random(cache)
    reqs = [dict(id=f"c{i}", prompt=[rng.randrange(3, VOCAB - 32) for _ in range(rng.randint(1, 10))],
                 params=SamplingParams(temperature=0, max_tokens=rng.randint(1, 5), ignore_eos=True, logprobs=1),
                 arrival=i) for i in range(6)]
    engine = _engine(path, zero=True, huginn_cache=cache, long_prefill_token_threshold=1,
                     enable_wavefront_prefill=False, page_size=4)
    done, _ = _run(engine, reqs)
    shift = 0.0
    for r in reqs:
        c, n = done[r["id"]].outputs[0], r["params"].max_tokens
        gen = ref.generate(r["prompt"], n, cache=cache)
        assert c.token_ids == gen.tokens, r["id"]
        want = torch.log_softmax(gen.logits.double(), -1)
        for k, (tok, table) in enumerate(zip(c.token_ids, c.logprobs)):
            assert abs(table[tok].logprob - want[k, tok].item()) < ATOL
        shift = max(shift, (gen.logits - ref.greedy(r["prompt"], n)[1]).abs().max().item())
    assert shift > 1e-2, "a ring of slots changes the semantics (earlier tokens read at other steps)"


def test_latest_m4_at_fixed_depth_is_full(ckpt):
    path = ckpt()
    prompt = [random.Random(3).randrange(3, VOCAB - 32) for _ in range(20)]
    outs = []
    for cache in ("full", "latest-m4"):
        done, _ = _run(_engine(path, zero=True, huginn_cache=cache),
                       [dict(id="a", prompt=prompt, params=SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))])
        outs.append(done["a"].outputs[0].token_ids)
    assert outs[0] == outs[1] == _ref(path, True).generate(prompt, 6, cache="latest-m4").tokens


def test_cache_option_rejections(ckpt, tmp_path):
    path = ckpt()
    with pytest.raises(ConfigError, match="not supported"):
        _engine(path, huginn_cache="compress-r4")
    with pytest.raises(ConfigError, match="multiple of the 2 recurrent layers"):
        _engine(path, huginn_cache="compress-s3", long_prefill_token_threshold=1, enable_wavefront_prefill=False)
    with pytest.raises(ConfigError, match="long_prefill_token_threshold=1"):
        _engine(path, huginn_cache="compress-s4")
    with pytest.raises(ConfigError, match="huginn_cache"):
        _engine(path, kv_layout="last_exited")
    ouro = write_random_checkpoint(str(tmp_path / "ouro"), "ouro")
    with pytest.raises(ConfigError, match="Huginn option"):
        LLMEngine(ouro, device="cpu", skip_tokenizer_init=True, huginn_cache="full")
    with pytest.raises(ConfigError, match="ring"):
        _engine(path, num_speculative_tokens=2, speculative_draft_depth=1, huginn_cache="compress-s4",
                long_prefill_token_threshold=1, enable_wavefront_prefill=False)


# -- scheduling features -------------------------------------------------------------------------
def _workload(seed: int, n: int, same_seed: bool) -> list[dict]:
    rng = random.Random(seed)
    system = [rng.randrange(3, VOCAB - 32) for _ in range(24)]
    reqs = []
    for i in range(n):
        tail = [rng.randrange(3, VOCAB - 32) for _ in range(rng.randint(1, 20))]
        reqs.append(dict(id=f"s{i}", prompt=system + tail if rng.random() < 0.6 else tail, priority=rng.randint(0, 2),
                         arrival=rng.randint(0, 30), params=SamplingParams(
                             temperature=0, max_tokens=rng.randint(1, 8), ignore_eos=True, seed=7 if same_seed else i)))
    return reqs


@pytest.mark.parametrize(
    "storm,prefix,wcpb,mixed",
    [(False, False, False, False), (True, False, False, True), (False, True, True, True), (True, True, False, False),
     (True, True, True, True)],
)
def test_scheduling_features_match_reference(ckpt, storm, prefix, wcpb, mixed):
    """Preemption (swap and recompute), prefix caching, wavefront prefill and mixed batching, with
    the seeded random initial state (all requests share a seed, so prefix pages are reusable)."""
    path = ckpt()
    ref = _ref(path, False)
    reqs = _workload(1, 24, same_seed=True)
    kw = dict(page_size=8, long_prefill_token_threshold=8, max_num_batched_tokens=48, max_num_seqs=16)
    if storm:
        kw.update(num_kv_pages=10, swap_space_bytes=48 << 10)
    engine = _engine(path, enable_prefix_caching=prefix, enable_wavefront_prefill=wcpb, enable_mixed_batching=mixed, **kw)
    done, _ = _run(engine, reqs)
    for r in reqs:
        assert done[r["id"]].outputs[0].token_ids == ref.greedy(r["prompt"], r["params"].max_tokens, seed=7)[0], r["id"]
    st = engine.stats()
    if storm:
        assert st.num_swap_preemptions > 0 and st.num_recompute_preemptions > 0, st
    if prefix:
        assert st.prefix_cache_hits > 0


def test_prefix_cache_salted_by_seed(ckpt):
    """Pages hold K/V of a request's own random states: shared across seeds only at init_scale 0."""
    path = ckpt()
    hits = {}
    for zero in (True, False):
        engine = _engine(path, zero, page_size=8)
        reqs = _workload(3, 12, same_seed=False)
        done, _ = _run(engine, reqs)
        ref = _ref(path, zero)
        for r in reqs:
            assert done[r["id"]].outputs[0].token_ids == ref.greedy(r["prompt"], r["params"].max_tokens,
                                                                    seed=r["params"].seed)[0]
        hits[zero] = engine.stats().prefix_cache_hits
    assert hits[True] > 0 and hits[False] == 0, hits


@pytest.mark.parametrize("swap", [True, False], ids=["swap", "recompute"])
def test_preempted_seeded_request_is_unchanged(ckpt, swap):
    """Temperature-1 sampling, random initial states and a KL exit: preemption changes nothing."""
    path = ckpt(mean_recurrence=6)
    rng = random.Random(3)
    params = SamplingParams(temperature=1.0, seed=77, max_tokens=16, ignore_eos=True, logprobs=1, exit_criterion="kl",
                            exit_threshold=2e-3)
    target = dict(id="t", prompt=[rng.randrange(3, VOCAB - 32) for _ in range(20)], params=params, priority=1)
    kw = dict(huginn_cache="latest-m4", page_size=4, long_prefill_token_threshold=8, max_num_batched_tokens=32,
              enable_prefix_caching=False, swap_space_bytes=(64 << 20) if swap else 0)
    alone = _run(_engine(path, **kw), [target])[0]["t"].outputs[0]
    others = [dict(id=f"h{i}", prompt=[rng.randrange(3, VOCAB - 32) for _ in range(30)], priority=0, arrival=3 + 8 * i,
                   params=SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)) for i in range(5)]
    engine = _engine(path, num_kv_pages=10, **kw)
    got = _run(engine, [target] + others)[0]["t"].outputs[0]
    st = engine.stats()
    assert st.num_preemptions > 0 and (st.num_swap_preemptions > 0) == swap, st
    assert got.token_ids == alone.token_ids
    for a, b in zip(alone.logprobs, got.logprobs):
        tok = next(iter(a))
        assert abs(a[tok].logprob - b[tok].logprob) < 1e-5


# -- chat and tokens -----------------------------------------------------------------------------
SPECIALS = ["<|begin_text|>", "<|end_text|>", "<|begin_header|>", "<|end_header|>", "<|end_turn|>", "<|pad|>"]


def _huginn_tokenizer(out_dir: str) -> None:
    """A word-level tokenizer laid out like Huginn's: specials in the official order at the top
    of the vocabulary (65504.. there, 352.. here), BOS and EOS added by the post-processor."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = "[UNK] hello world you are a helpful assistant what is two plus Huginn user system".split()
    vocab = {w: i for i, w in enumerate(words)} | {t: 352 + i for i, t in enumerate(SPECIALS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIALS)
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_text|> $A <|end_text|>", special_tokens=[("<|begin_text|>", 352), ("<|end_text|>", 353)])
    tok.save(f"{out_dir}/tokenizer.json")
    config = dict(bos_token=SPECIALS[0], eos_token=SPECIALS[1], pad_token=SPECIALS[5], model_max_length=512)
    with open(f"{out_dir}/tokenizer_config.json", "w") as f:
        json.dump(config, f)


def test_chat_template_bos_eos_and_stop_ids(tmp_path):
    path = write_random_checkpoint(str(tmp_path / "h"), "huginn", seed=1, block_size=512, eos_token_id=353)
    _huginn_tokenizer(path)
    llm = LLM(model=path, dtype="float32", device="cpu", hf_overrides=ZERO)
    tok = llm.get_tokenizer()
    hello = tok.token_to_id("hello")
    assert tok.backend.encode("hello").ids == [352, hello, 353]  # the tokenizer adds BOS and EOS
    assert tok.encode("hello") == [352, hello]  # a prompt drops the trailing EOS
    chat = [{"role": "system", "content": " you are a helpful assistant "}, {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "hello world"}, {"role": "user", "content": "what is two plus two"}]
    text = tok.apply_chat_template(chat, add_generation_prompt=True)
    assert text == ("<|begin_text|><|begin_header|>system<|end_header|>\n\nyou are a helpful assistant<|end_turn|>"
                    "<|begin_header|>user<|end_header|>\n\nhello<|end_turn|>"
                    "<|begin_header|>Huginn<|end_header|>\n\nhello world<|end_turn|>"
                    "<|begin_header|>user<|end_header|>\n\nwhat is two plus two<|end_turn|>"
                    "<|begin_header|>Huginn<|end_header|>\n\n")
    assert tok.apply_chat_template(chat[:2], add_generation_prompt=False).endswith("<|end_turn|><|end_text|>")
    assert {352, 353, 356} <= llm.llm_engine.output_processor.eos_token_ids  # begin_text, end_text, end_turn
    out = llm.chat(chat, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, num_loops=2))[0]
    assert out.prompt_token_ids[0] == 352 and out.prompt_token_ids.count(352) == 1
    assert out.prompt_token_ids[-3:] == [354, tok.token_to_id("Huginn"), 355]
    gen = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))[0]
    assert gen.prompt_token_ids == [352, hello, tok.token_to_id("world")]
