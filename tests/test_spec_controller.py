"""The adaptive speculation controller against a simulated engine with chosen step costs.

The engine's real step times depend on the machine (on the H200 a plain token is one CUDA-graph
replay, a draft or verify loop an eager step); here a fake clock makes the costs exact, so each
test pins what the controller must do at a given cost ratio and acceptance rate.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from rlt_serve.engine.spec_controller import SpecController

D = 4


class FakeEngine:
    """Runs whole rounds for `batch` requests in lockstep (tokens counted per request): plain steps cost `plain`, draft/verify loop steps
    `loop` (verify rows of K tokens `verify_per_token` more per token)."""

    def __init__(self, plain: float, loop: float, accept: float, batch: int = 8, max_k: int = 8,
                 verify_per_token: float = 0.0) -> None:  # fmt: skip
        self.now = 0.0
        self.ctl = SpecController(D, max_k, None, adaptive=True, clock=lambda: self.now)
        self.plain, self.loop, self.accept, self.batch = plain, loop, accept, batch
        self.verify_per_token = verify_per_token
        self.rng = random.Random(0)
        self.spec_time = self.plain_time = 0.0
        self.tokens = 0

    def _step(self, kind: str, tokens: int, cost: float) -> None:
        seq = SimpleNamespace(decoding=True)
        rows = [(seq, SimpleNamespace(kind=kind, num_tokens=tokens)) for _ in range(self.batch)]
        start = self.now
        self.ctl.start_step(rows, start)
        self.now += cost
        self.ctl.end_step()

    def round(self) -> int:
        choices = {self.ctl.choose(self.batch) for _ in range(self.batch)}
        assert len(choices) == 1, choices  # the whole batch moves together
        k, d = choices.pop()
        t0 = self.now
        if k == 0:
            self._step("normal", 1, self.plain)
            self.plain_time += self.now - t0
            self.tokens += 1
            return 0
        for _ in range(k * d):
            self._step("draft", 1, self.loop)
        for _ in range(D - d):
            self._step("verify", k, self.loop + self.verify_per_token * k)
        committed = 0
        for _ in range(self.batch):  # each request's drafts are verified on their own
            kept = 0
            while kept < k and self.rng.random() < self.accept:
                kept += 1
            tested = min(kept + 1, k)  # the first rejected draft is replaced, later ones never tested
            self.ctl.record(d, tested, kept)
            committed += tested
        self.tokens += committed / self.batch
        self.spec_time += self.now - t0
        return k

    def run(self, tokens: int) -> float:
        """Tokens per unit time over `tokens` committed tokens."""
        t0, n0 = self.now, self.tokens
        while self.tokens - n0 < tokens:
            self.round()
        return (self.tokens - n0) / (self.now - t0)


def test_switches_off_for_good_when_a_loop_step_costs_more_than_a_plain_token():
    """The H200 today: a fused plain token (one graph replay) costs less than one eager draft
    loop. One round is tried, then never again: even perfect acceptance could not pay."""
    e = FakeEngine(plain=1.0, loop=1.5, accept=0.95)
    e.run(64)  # warm-up: learns the costs
    spec_before = e.spec_time
    rate = e.run(5000)
    assert e.spec_time == spec_before  # no probing once it cannot pay
    assert rate >= 0.999 / e.plain


def test_speculates_when_loops_are_cheap_and_drafts_agree():
    e = FakeEngine(plain=1.0, loop=0.3, accept=0.9)
    e.run(64)
    rate = e.run(2000)
    assert e.spec_time > 5 * e.plain_time
    assert rate > 1.5 / e.plain  # K*d + D - d loops of 0.3 for up to K tokens


@pytest.mark.parametrize("batch", [1, 8])
def test_speculates_at_moderate_acceptance_when_it_pays(batch):
    """a = 0.7 with loops at 0.25 of a plain token: K=4 at depth 1 commits 2.53 tokens for 1.75
    plain-token costs. Acceptance is estimated as a ratio of sums (unbiased), not a mean of
    per-round ratios, which reads low (drafts after a rejection are never tested); at batch 1 an
    unlucky first round must not rule the depth out (probes are optimistic)."""
    e = FakeEngine(plain=1.0, loop=0.25, accept=0.7, batch=batch)
    e.run(64)
    assert e.run(3000) > 1.3 / e.plain
    assert abs(e.ctl.accept_rate(1) - 0.7) < 0.25  # a decayed estimate of ~10 rounds at batch 1


def test_probes_rarely_when_only_better_acceptance_could_pay():
    """Cheap loops but drafts never agree: speculation is off, re-probed at a doubling interval
    (acceptance may change with the workload), costing only a few percent."""
    e = FakeEngine(plain=1.0, loop=0.3, accept=0.0)
    e.run(64)
    probes_before = e.spec_time
    rate = e.run(5000)
    assert 0 < e.spec_time - probes_before < 0.03 * e.plain_time
    assert rate >= 0.97 / e.plain


def test_large_verify_rows_count_against_long_drafts():
    """At a large batch a verify row of K tokens costs more per step; the controller sees that
    cost per K and still beats plain decoding."""
    e = FakeEngine(plain=1.0, loop=0.2, accept=0.9, batch=64, verify_per_token=0.1)
    e.run(64)
    rate = e.run(2000)
    assert rate > 1.2 / e.plain


def test_fixed_configuration_is_not_adaptive():
    ctl = SpecController(D, 4, 2, adaptive=False)
    assert {ctl.choose(b) for b in (1, 8, 128)} == {(4, 2)}
