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


@functools.lru_cache(maxsize=None)
def _oracle(path, prompt, n, q, min_loops, delay=False):
    ref, seq, toks, exits = _ref(path), list(prompt), [], None
    for _ in range(n):
        logits, exits = ref.forward_q_exit(seq, q, min_loops, delay=delay)
        toks.append(int(logits[-1].argmax()))
        seq.append(toks[-1])
    return toks, exits  # exits: per position of prompt + all but the last generated token


def _engine(path, **kw):
    args = dict(dtype="float32", device="cpu", skip_tokenizer_init=True, kv_layout="last_exited", page_size=4,
                long_prefill_token_threshold=8, max_num_batched_tokens=24)
    args.update(kw)
    return LLMEngine(path, **args)


def _compare_exits(got: dict[int, int], want: list[int]) -> int:
    """Exit depths the engine recorded against the oracle's; returns how many were compared. A
    prompt chunk still climbing when its request ends (the last chunk exited early and sampled the
    only token asked for) never leaves the core, so it has nothing to compare."""
    for pos, d in got.items():
        if pos < len(want):
            assert d == want[pos], (pos, d, want[pos])
    return sum(pos < len(want) for pos in got)


def _run(engine, reqs):
    """Run `reqs` to completion; (finished outputs, exit depth per request and position). Also
    keeps `engine.exit_states[(request, position)]`, the state the coda read, across calls."""
    for rid, prompt, p, prio in reqs:
        engine.add_request(rid, prompt, p, priority=prio)
    if not hasattr(engine, "exit_states"):
        runner, orig = engine.runner, engine.runner._coda
        engine.exit_states, engine.exit_log, engine.masked_loops = {}, {}, []

        def record(rows):  # exit depth and exit state of every position as the rows leave the core
            for seq, span in rows:
                if span.exit is None:
                    continue
                # loops the row ran after its last token had left (0: none wasted)
                engine.masked_loops.append(span.depth - int(span.exit.depth.max()))
                for i, d in enumerate(span.exit.depth.tolist()):
                    engine.exit_log.setdefault(seq.request_id, {})[span.start + i] = d
                    engine.exit_states[(seq.request_id, span.start + i)] = span.exit.hidden[i].clone()
            return orig(rows)

        runner._coda = record
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.num_free_pages == engine.num_pages
    assert engine.swap_space is None or engine.swap_space.used_bytes == 0
    return done, {rid: engine.exit_log.get(rid, {}) for rid, *_ in reqs}


PREEMPT = dict(num_kv_pages=8, swap_space_bytes=48 << 10)  # swap while it fits, recompute otherwise
RECOMPUTE = dict(num_kv_pages=8, swap_space_bytes=0)


@pytest.mark.parametrize("q,min_loops", [(0.5, 1), (0.7, 2), (0.9, 1)])
@pytest.mark.parametrize("kw", [dict(), PREEMPT, RECOMPUTE, dict(
    enable_wavefront_prefill=False, enable_mixed_batching=False, long_prefill_token_threshold=3),
    dict(PREEMPT, async_exit=True)],
    ids=["default", "preempt", "recompute", "phase-separated", "async-preempt"])
def test_q_exit_matches_oracle(ckpt, q, min_loops, kw):
    """Exit depth of every prompt and generated position, and the greedy tokens, equal the fp32
    token-by-token oracle, under loop-level batching, chunked (wavefront) prefill and preemption."""
    rng = random.Random(int(q * 10) + min_loops)
    reqs = []
    for i in range(10):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 20))]
        p = SamplingParams(temperature=0, max_tokens=rng.randint(1, 6), ignore_eos=True, exit_threshold=q,
                           min_loops=min_loops)
        reqs.append((f"r{i}", prompt, p, rng.randint(0, 1)))
    engine = _engine(ckpt, **kw)
    done, exits = _run(engine, reqs)
    spread, compared, total, sampled = set(), 0, 0, {}
    for rid, prompt, p, _ in reqs:
        want, want_exits = _oracle(ckpt, tuple(prompt), p.max_tokens, q, min_loops)
        for d in want_exits[len(prompt) - 1:]:  # the state each generated token was sampled from
            sampled[d] = sampled.get(d, 0) + 1
        assert done[rid].outputs[0].token_ids == want, rid
        compared += _compare_exits(exits[rid], want_exits)
        total += len(want_exits)
        spread |= set(exits[rid].values())
    assert compared >= 0.9 * total, (compared, total)
    assert len(spread) >= 2, "the workload should exit at several depths"
    st = engine.stats()
    if "num_kv_pages" in kw:
        assert st.num_preemptions > 0
    if kw.get("swap_space_bytes") == 0:
        assert st.num_recompute_preemptions > 0 and st.num_swap_preemptions == 0
    assert st.last_num_rows >= 1 and max(st.exit_depth_counts) <= 3
    # Every plainly sampled token is counted once, at the depth its logits came from.
    assert st.sample_depth_counts == sampled and st.num_generation_tokens == sum(sampled.values())


def _workload(seed: int, n: int, q: float | None, max_tokens: int = 6, **extra):
    rng = random.Random(seed)
    return [(f"r{i}", [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 20))],
             SamplingParams(temperature=0, max_tokens=rng.randint(1, max_tokens), ignore_eos=True, exit_threshold=q,
                            **extra), rng.randint(0, 1)) for i in range(n)]


def test_threshold_one_is_fixed_depth(ckpt):
    """q = 1.0 is fixed depth: same tokens, bit-identical logprobs, the same core calls and row
    tokens, every token leaving at the last loop, in a batch with chunked prefill and preemption."""
    results = []
    for q in (None, 1.0):
        engine = _engine(ckpt, **PREEMPT)
        done, _ = _run(engine, _workload(3, 16, q, logprobs=2))
        outs = {k: (v.outputs[0].token_ids, [{t: lp.logprob for t, lp in e.items()} for e in v.outputs[0].logprobs])
                for k, v in done.items()}
        results.append((outs, engine.stats()))
    (a, st_a), (b, st_b) = results
    assert a == b
    assert st_a.num_preemptions > 0 and st_a.num_preemptions == st_b.num_preemptions
    assert (st_a.num_core_calls, st_a.num_row_tokens) == (st_b.num_core_calls, st_b.num_row_tokens)
    assert set(st_b.exit_depth_counts) == {3}
    prompt = _workload(3, 16, None)[0][1]
    assert a["r0"][0] == _ref(ckpt).greedy(prompt, len(a["r0"][0]))[0]


def _outputs(done):
    return {k: (v.outputs[0].token_ids, [{t: lp.logprob for t, lp in e.items()} for e in v.outputs[0].logprobs])
            for k, v in done.items()}


@pytest.mark.parametrize("batched", [False, True], ids=["one-by-one", "batched-preempt"])
def test_async_exit_is_the_synchronous_policy(ckpt, batched):
    """Exact-policy asynchronous exit: the same exit depths and tokens as the synchronous policy,
    and a finished row runs one masked loop. One request at a time every core call has the same
    shapes in both policies, so the states the coda reads and the logprobs are bit-identical; in a
    batch the async row's extra call changes other calls' batch shapes, so fp32 matmuls agree to
    rounding only (the kernels are not batch-invariant)."""
    reqs = _workload(21, 12, 0.6, logprobs=1)
    results = {}
    for mode in ("sync", "async"):
        # One by one, without wavefront prefill, no two spans of a request share a call either.
        kw = PREEMPT if batched else dict(enable_wavefront_prefill=False)
        engine = _engine(ckpt, async_exit=mode == "async", **kw)
        outs, exits = {}, {}
        for group in [reqs] if batched else [[r] for r in reqs]:
            done, ex = _run(engine, group)
            outs |= _outputs(done)
            exits |= ex
        st = engine.stats()
        assert st.num_preemptions > 0 or not batched
        results[mode] = (outs, exits, engine.exit_states, st.num_row_tokens, st.exit_depth_counts)
    (out_s, ex_s, hs_s, rows_s, cnt_s), (out_a, ex_a, hs_a, rows_a, cnt_a) = results["sync"], results["async"]
    assert ex_s == ex_a and cnt_s == cnt_a
    assert {k: v[0] for k, v in out_s.items()} == {k: v[0] for k, v in out_a.items()}
    assert hs_s.keys() == hs_a.keys()
    assert rows_a > rows_s  # the masked loop is computed
    if not batched:
        assert out_s == out_a
        assert all(torch.equal(hs_s[k], hs_a[k]) for k in hs_s)
    else:
        assert all(torch.allclose(hs_s[k], hs_a[k], atol=1e-5) for k in hs_s)
        for k in out_s:
            for lp_s, lp_a in zip(out_s[k][1], out_a[k][1]):
                assert lp_s.keys() == lp_a.keys() and all(abs(lp_s[t] - lp_a[t]) < 1e-4 for t in lp_s)


@pytest.mark.parametrize("kw", [dict(), RECOMPUTE], ids=["default", "recompute"])
def test_delayed_exit_matches_the_delayed_oracle(ckpt, kw):
    """Delayed exit: a decision after loop t is applied after loop t+1; that loop is real (its K/V
    is what later tokens read, its state gives the logits), so depths and tokens equal the oracle
    that runs one more loop after the rule fires, not the synchronous ones."""
    q, min_loops = 0.6, 1
    reqs = _workload(5, 10, q)
    engine = _engine(ckpt, delayed_exit=True, **kw)
    done, exits = _run(engine, reqs)
    deeper = 0
    for rid, prompt, p, _ in reqs:
        want, want_exits = _oracle(ckpt, tuple(prompt), p.max_tokens, q, min_loops, delay=True)
        assert done[rid].outputs[0].token_ids == want, rid
        _compare_exits(exits[rid], want_exits)
        sync_exits = _oracle(ckpt, tuple(prompt), p.max_tokens, q, min_loops)[1]
        deeper += sum(d > s for d, s in zip(want_exits, sync_exits))
    assert deeper > 0 and min(engine.stats().exit_depth_counts) >= 1  # nobody leaves at loop 0
    # No masked loop: a delayed row finishes in the call its last token leaves (async: one later).
    assert set(engine.masked_loops) == {0}
    exact = _engine(ckpt, async_exit=True, **kw)
    _run(exact, reqs)
    assert set(exact.masked_loops) == {0, 1}
    st = engine.stats()
    if kw:
        assert st.num_recompute_preemptions > 0


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
    with pytest.raises(ValueError, match="choose one"):
        _engine(ckpt, async_exit=True, delayed_exit=True)
