"""Self-speculative decoding: shallow drafts verified by resuming them to full depth."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from rlt_serve.config import ConfigError
from rlt_serve.engine.llm_engine import LLMEngine
from rlt_serve.sampling_params import SamplingParams
from rlt_serve.testing import write_random_checkpoint

VOCAB = 384


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    paths = {f: write_random_checkpoint(str(root / f), f, seed=17) for f in ("ouro", "nanbeige")}
    # Loops that barely move the state: drafts agree often, so acceptance is high and ragged.
    paths["ouro-agree"] = write_random_checkpoint(str(root / "agree"), "ouro", seed=17, update_scale=0.03)
    return paths


def _requests(n: int = 32):
    rng = random.Random(2)
    return [(f"r{i}", [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 30))], rng.randint(1, 14),
             rng.randint(0, 1)) for i in range(n)]


def _run(path: str, num_requests: int = 32, **kw):
    args = dict(dtype="float32", device="cpu", skip_tokenizer_init=True, page_size=4, long_prefill_token_threshold=8,
                max_num_batched_tokens=32)
    args.update(kw)
    engine = LLMEngine(path, **args)
    for rid, prompt, n, prio in _requests(num_requests):
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
CASES += [("ouro-agree", k, d) for k, d in ((2, 1), (4, 2), (8, 3), (8, 1))]


@pytest.mark.parametrize("family,k,depth", CASES)
def test_greedy_speculation_is_token_identical(ckpts, family, k, depth):
    path = ckpts[family]
    # A pool of ~3 requests forces preemption (swap and recompute) while drafts are in flight.
    got, st, done = _run(path, num_speculative_tokens=k, speculative_draft_depth=depth, num_kv_pages=24,
                         swap_space_bytes=64 << 10)
    assert got == _baseline(path)
    assert st.num_spec_drafts > 0 and st.num_spec_draft_tokens >= st.num_spec_accepted_tokens
    assert st.num_preemptions > 0
    # Metrics: per-position acceptance adds up and falls with the position; rounds per draft depth.
    per_pos = st.spec_accepted_per_pos
    assert sum(per_pos) == st.num_spec_accepted_tokens and len(per_pos) <= k
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))
    assert st.spec_draft_depth_counts == {depth: st.num_spec_drafts}
    assert set(st.exit_depth_counts) == {3 if family.startswith("ouro") else 1}  # drafts do not "exit"
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


def _exact_joint(ref, prompt: list[int], n: int = 3) -> dict[tuple[int, ...], float]:
    """P(first n tokens) at temperature 1, from a reference model, by enumerating prefixes."""
    joint = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for prefix, pr in joint.items():
            probs = torch.softmax(ref.forward(prompt + list(prefix)).logits[-1].double(), -1).tolist()
            for t, q in enumerate(probs):
                nxt[prefix + (t,)] = pr * q
        joint = nxt
    return joint


def _chi_square_p(engine: LLMEngine, prompt: list[int], exact: dict[tuple[int, ...], float], n: int = 20000) -> float:
    """Draw the first three tokens of `n` seeded requests (1000 at a time); Pearson's chi-square
    p-value of their counts against the exact joint, cells with expectation < 5 pooled."""
    counts: dict[tuple[int, ...], int] = {}
    for batch in range(0, n, 1000):
        for s in range(batch, batch + 1000):
            engine.add_request(str(s), prompt, SamplingParams(temperature=1.0, seed=s, max_tokens=3, ignore_eos=True))
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    key = tuple(o.outputs[0].token_ids)
                    counts[key] = counts.get(key, 0) + 1
    st = engine.stats()
    assert st.num_spec_accepted_tokens > 0 and st.num_spec_accepted_tokens < st.num_spec_draft_tokens
    assert engine.num_free_pages == engine.num_pages
    cells, small_obs, small_exp = [], 0, 0.0
    for key, pr in exact.items():
        e = pr * n
        if e < 5:
            small_obs, small_exp = small_obs + counts.get(key, 0), small_exp + e
        else:
            cells.append((counts.get(key, 0), e))
    if small_exp > 0:
        cells.append((small_obs, small_exp))
    chi2 = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                            torch.tensor(chi2 / 2, dtype=torch.float64)))
    print(f"chi2={chi2:.1f} dof={dof} p={p_value:.3f} accepted {st.num_spec_accepted_tokens}/{st.num_spec_draft_tokens}")
    return p_value


TINY = dict(vocab_size=6, hidden_size=32, num_attention_heads=2, intermediate_size=64)
SAMPLING = dict(dtype="float32", device="cpu", skip_tokenizer_init=True, max_num_seqs=1000, max_num_batched_tokens=4096,
                enable_prefix_caching=True, num_kv_pages=4000, page_size=4)


def test_sampling_speculation_preserves_the_distribution(tmp_path):
    """20,000 seeded samples of the first three tokens match the exact distribution (chi-square)."""
    from rlt_serve.reference import ReferenceModel

    path = write_random_checkpoint(str(tmp_path / "tiny"), "ouro", seed=3, num_key_value_heads=2, **TINY)
    prompt = [1, 4, 2]
    exact = _exact_joint(ReferenceModel.from_pretrained(path), prompt)
    engine = LLMEngine(path, num_speculative_tokens=2, speculative_draft_depth=1, **SAMPLING)
    assert _chi_square_p(engine, prompt, exact) > 0.01


def test_huginn_sampling_speculation_preserves_the_distribution(tmp_path):
    """The same for Huginn at 4 steps with 2-step drafts (zero initial state, so the exact joint is
    a function of the prompt): drafts' coda K/V is rewritten by the verify row."""
    from rlt_serve.reference_huginn import HuginnReference

    path = write_random_checkpoint(str(tmp_path / "tinyh"), "huginn", seed=3, vocab_size=6, n_embd=32, n_heads=2,
                                   intermediate_size=64, mean_recurrence=4, n_layers_in_prelude=1,
                                   n_layers_in_recurrent_block=1, n_layers_in_coda=1, block_size=64)
    prompt = [1, 4, 2]
    exact = _exact_joint(HuginnReference.from_pretrained(path, hf_overrides={"init_scale": 0.0}), prompt)
    engine = LLMEngine(path, num_speculative_tokens=2, speculative_draft_depth=2, hf_overrides={"init_scale": 0.0},
                       **SAMPLING)
    assert _chi_square_p(engine, prompt, exact) > 0.01


def test_sampling_speculation_is_seed_deterministic(ckpts):
    path = ckpts["ouro"]
    rng = random.Random(9)
    prompt = [rng.randrange(3, VOCAB) for _ in range(12)]
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=42, max_tokens=16, ignore_eos=True)
    outs = []
    for extra, pages in ((0, None), (6, None), (6, 12)):  # alone, in a batch, in a batch with preemption
        e = LLMEngine(path, dtype="float32", device="cpu", skip_tokenizer_init=True, num_speculative_tokens=3,
                      speculative_draft_depth=2, page_size=4, num_kv_pages=pages, swap_space_bytes=0)
        e.add_request("t", prompt, params, priority=1)
        for i in range(extra):
            e.add_request(f"o{i}", [rng.randrange(3, VOCAB) for _ in range(20)],
                          SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True), priority=0)
        got = None
        while e.has_unfinished_requests():
            got = next((o for o in e.step() if o.finished and o.request_id == "t"), got)
        outs.append((got.outputs[0].token_ids, e.stats().num_preemptions))
        assert e.num_free_pages == e.num_pages
    assert outs[0][0] == outs[1][0] == outs[2][0]
    assert outs[2][1] > 0


def _easy_ouro(path: str) -> str:
    """An Ouro checkpoint whose loops barely change the state and whose head reads the token back,
    so shallow drafts agree with the full depth."""
    from safetensors.torch import load_file, save_file

    w = load_file(f"{path}/model.safetensors")
    for key in w:
        if key.endswith(("input_layernorm_2.weight", "post_attention_layernorm_2.weight")):
            w[key] = w[key] * 1e-4
    w["lm_head.weight"] = w["model.embed_tokens.weight"] * 10
    save_file(w, f"{path}/model.safetensors", metadata={"format": "pt"})
    return path


def _decode_calls(path: str, **kw) -> tuple[int, list[int], object]:
    e = LLMEngine(path, dtype="float32", device="cpu", skip_tokenizer_init=True, **kw)
    prompt = [random.Random(1).randrange(3, VOCAB) for _ in range(6)]
    e.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    out = None
    while e.has_unfinished_requests():
        out = next((o for o in e.step() if o.finished), out)
    return e.stats().num_core_calls, out.outputs[0].token_ids, e.stats()


def test_adaptive_speculation_switches_on_and_off(tmp_path):
    hard = write_random_checkpoint(str(tmp_path / "hard"), "ouro", seed=17)
    easy = _easy_ouro(write_random_checkpoint(str(tmp_path / "easy"), "ouro", seed=17))
    spec = dict(num_speculative_tokens=8, speculative_adaptive=True)
    for path, name in ((easy, "easy"), (hard, "hard")):
        plain_calls, plain_toks, _ = _decode_calls(path)
        calls, toks, st = _decode_calls(path, **spec)
        assert toks == plain_toks
        print(f"{name}: core calls plain={plain_calls} adaptive={calls} accepted "
              f"{st.num_spec_accepted_tokens}/{st.num_spec_draft_tokens}")
        if name == "easy":
            assert calls < 0.7 * plain_calls
        else:  # drafts rarely agree: speculation switches itself off after a few rounds
            assert calls < 1.15 * plain_calls


# -- Huginn: drafts at fewer recurrence steps, the coda's K/V rewritten by the verify row ------------
HUGINN_STEPS = 8


@pytest.fixture(scope="module")
def huginn(tmp_path_factory):
    return write_random_checkpoint(str(tmp_path_factory.mktemp("spec") / "huginn"), "huginn", seed=5,
                                   mean_recurrence=HUGINN_STEPS, block_size=512)


@functools.lru_cache(maxsize=None)
def _huginn_baseline(path: str):
    return _run(path, num_requests=16)[0]


@pytest.mark.parametrize("k,depth", [(1, 2), (2, 3), (4, 4), (8, 2), (4, 3)])
def test_huginn_greedy_speculation_is_token_identical(huginn, k, depth):
    """Huginn at 8 steps (random initial states keyed by seed and position): drafts at 2-4 steps,
    verified from there to 8. A draft's coda K/V, written from its shallow state, is overwritten by
    the verify row's full-depth coda at the same position before a committed token reads it, and
    rejected positions (prelude, core and coda planes) lie past the committed prefix, rewritten
    before they are read, so tokens equal plain decoding, with preemption (swap and recompute) on."""
    got, st, done = _run(huginn, num_requests=16, num_speculative_tokens=k, speculative_draft_depth=depth,
                         num_kv_pages=16, swap_space_bytes=64 << 10)
    assert got == _huginn_baseline(huginn)
    assert st.num_spec_drafts > 0 and 0 < st.num_spec_accepted_tokens < st.num_spec_draft_tokens
    assert st.num_swap_preemptions > 0 and st.num_recompute_preemptions > 0
    for o in done.values():
        assert len(o.outputs[0].logprobs) == len(o.outputs[0].token_ids)
