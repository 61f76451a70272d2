"""The depth sweep's speedup is paired: rounds interleave the modes, and a mode's speedup is the
median over rounds of its throughput over the baseline's in the same round. Checked against fake
engines on a fake clock whose host speed drifts from round to round."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlt_serve import bench, bench_depth
from rlt_serve.bench import BenchConfig
from rlt_serve.engine.llm_engine import EngineStats


class Clock:
    """Fake perf_counter. A run starts when an idle engine gets a request; run n runs at host
    speed `drifts[(n // per_round) % len(drifts)]`, so the speed changes between rounds only."""

    def __init__(self, drifts: list[float], per_round: int) -> None:
        self.t, self.runs, self.drifts, self.per_round = 0.0, 0, drifts, per_round
        self.order: list[str] = []  # engine of each run, in the order they ran

    def __call__(self) -> float:
        return self.t

    @property
    def round(self) -> int:
        return ((self.runs - 1) // self.per_round) % len(self.drifts)

    @property
    def drift(self) -> float:
        return self.drifts[self.round]


class FakeEngine:
    """One token per request per step; a step costs `step_s(exit_threshold)` times the drift."""

    def __init__(self, name: str, clock: Clock, step_s, calls_per_token) -> None:
        self.name, self.clock, self.step_s, self.calls_per_token = name, clock, step_s, calls_per_token
        self.model_config = SimpleNamespace(vocab_size=1000)
        self.device = torch.device("cpu")
        self.reqs: dict[str, list] = {}
        self.prompts: list[tuple[str, tuple[int, ...]]] = []  # (request id, prompt) of every request
        self._stats = EngineStats()

    def add_request(self, rid, prompt, params) -> None:
        if not self.reqs:
            self.clock.runs += 1
            self.clock.order.append(self.name)
        self.reqs[rid] = [params.max_tokens, 0, params.exit_threshold]
        self.prompts.append((rid, tuple(prompt)))

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs)

    def step(self) -> list:
        q = next(iter(self.reqs.values()))[2]
        self.clock.t += self.step_s(q) * self.clock.drift
        outs = []
        for rid, r in list(self.reqs.items()):
            r[1] += 1
            self._stats.num_core_calls += self.calls_per_token(q)
            outs.append(SimpleNamespace(request_id=rid, finished=r[1] == r[0],
                                        outputs=[SimpleNamespace(token_ids=[0] * r[1])]))  # fmt: skip
            if r[1] == r[0]:
                del self.reqs[rid]
        return outs

    def stats(self) -> EngineStats:
        return self._stats


DRIFTS = [1.0, 3.0, 0.5, 2.0, 1.5]  # host speed per round: 6x between the fastest and the slowest


@pytest.fixture
def clock(monkeypatch):
    c = Clock(DRIFTS, per_round=3)
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=c))
    return c


def test_speedup_is_the_per_round_ratio_under_drift(clock):
    """Three engines (plain, 2x slower, 1.25x faster): the drift moves every mode's tok/s by 6x
    across rounds, yet each paired ratio is exact. Computing the ratio of unpaired runs (another
    round's plain run, or the runs of modes measured one after another) would not be."""
    cfg = BenchConfig(model="", input_len=4, output_len=10, runs=5)
    engines = [FakeEngine(n, clock, lambda q, s=s: s, lambda q: 4) for n, s in (("plain", 0.01), ("slow", 0.02),
                                                                                 ("fast", 0.008))]  # fmt: skip
    arms = [bench_depth.Arm(e.name, e, cfg.output_len) for e in engines]
    seen: list[int] = []
    rows = bench_depth.paired_runs("s", arms, cfg, [1, 4], settle=True, progress=lambda rs: seen.append(len(rs)))
    assert seen == [3, 6]  # progress after every concurrency
    by = {(r.concurrency, r.mode): r for r in rows}
    for c in (1, 4):
        for mode, want in (("plain", 1.0), ("slow", 0.5), ("fast", 1.25)):
            r = by[(c, mode)]
            assert r.round_speedup == pytest.approx([want] * 5), r
            assert r.speedup == pytest.approx(want)
            assert max(r.round_tps) / min(r.round_tps) == pytest.approx(6.0), r  # the drift is there, in every mode
            assert r.output_tps == pytest.approx(c / (0.01 / want) / 1.5)  # the median round's drift is 1.5
            assert r.core_calls_per_token == 4
    # Per concurrency: a settling wave of every mode, then 5 rounds, each starting one mode later.
    rounds = [clock.order[i : i + 3] for i in range(0, len(clock.order), 3)]
    assert rounds[0] == ["plain", "slow", "fast"] and rounds[1:6] == [
        ["plain", "slow", "fast"], ["slow", "fast", "plain"], ["fast", "plain", "slow"],
        ["plain", "slow", "fast"], ["slow", "fast", "plain"]]  # fmt: skip
    assert len(rounds) == 12


def test_unpaired_order_would_read_the_drift(clock):
    """The same engines measured one mode after another (the old sweep) read the drift as speedup:
    the fake clock can tell the two methods apart."""
    clock.per_round = 2  # two modes
    cfg = BenchConfig(model="", input_len=4, output_len=10, runs=5)
    plain, same = (FakeEngine(n, clock, lambda q: 0.01, lambda q: 4) for n in ("plain", "same"))
    tps = {}
    for e in (plain, same):
        tps[e.name] = [bench.run_engine_once(e, [[1, 2, 3]], 10, f"{e.name}{r}").output_tps for r in range(5)]
    assert bench._median(tps["same"]) / bench._median(tps["plain"]) != pytest.approx(1.0)
    rows = bench_depth.paired_runs("s", [bench_depth.Arm(e.name, e, 10) for e in (plain, same)], cfg, [1], False)
    assert rows[1].speedup == pytest.approx(1.0)


def test_speedup_is_the_median_of_paired_ratios(clock):
    """A mode twice as slow as plain in three rounds of five and as fast in two: the median paired
    ratio is 0.5; the ratio of the two medians (runs taken from different rounds) would read 0.75."""
    clock.per_round = 2
    cfg = BenchConfig(model="", input_len=4, output_len=10, runs=5)
    plain = FakeEngine("plain", clock, lambda q: 0.01, lambda q: 4)
    mode = FakeEngine("mode", clock, lambda q: 0.01 * [2, 2, 1, 1, 2][clock.round], lambda q: 4)
    rows = bench_depth.paired_runs("s", [bench_depth.Arm(e.name, e, 10) for e in (plain, mode)], cfg, [1], False)
    assert rows[1].round_speedup == pytest.approx([0.5, 0.5, 1.0, 1.0, 0.5])
    assert rows[1].speedup == pytest.approx(0.5)
    assert bench._median(rows[1].round_tps) / bench._median(rows[0].round_tps) == pytest.approx(0.75)


def test_arms_sharing_an_engine_get_their_own_prompts(clock):
    """Early exit: thresholds share one engine, so each gets fresh prompts (no prefix-cache hits);
    separate engines get the same prompts in a round. Depth counters are per arm."""
    cfg = BenchConfig(model="", input_len=6, output_len=5, runs=2)
    shared = FakeEngine("exit", clock, lambda q: 0.01 if q == 1.0 else 0.004, lambda q: 4 if q == 1.0 else 2)
    other = FakeEngine("other", clock, lambda q: 0.01, lambda q: 3)
    arms = [bench_depth.Arm("q=1", shared, 5, 1.0), bench_depth.Arm("q=0.5", shared, 3, 0.5),
            bench_depth.Arm("other", other, 5)]  # fmt: skip
    rows = bench_depth.paired_runs("s", arms, cfg, [2], settle=False)
    by = {r.mode: r for r in rows}
    assert by["q=0.5"].speedup == pytest.approx(2.5) and by["q=0.5"].core_calls_per_token == 2
    assert by["q=1"].core_calls_per_token == 4 and by["other"].core_calls_per_token == 3
    assert by["q=0.5"].output_len == 3 and by["other"].output_len == 5
    prompts = dict(shared.prompts + other.prompts)  # request id "r{round}-{arm}-{i}" -> prompt
    for r in range(2):
        for j in range(2):
            assert prompts[f"r{r}-0-{j}"] == prompts[f"r{r}-2-{j}"] != prompts[f"r{r}-1-{j}"]
    assert len(prompts) == 12 and len(set(prompts.values())) == 8  # fresh every round


def test_speculation_engines_are_alive_together_with_bounded_pools(tmp_checkpoint):
    """Real engines on the CPU: one per mode at once, each with a pool that holds the largest
    concurrency at the longest mode and the same max_model_len; the sweep never preempts and every
    page comes back."""
    path = tmp_checkpoint("ouro", seed=17, update_scale=0.03)
    base = BenchConfig(model="", input_len=20, output_len=13, runs=2, dtype="float32", device="cpu", reference=False)
    modes = [("plain", {}, 13), ("K=4 d=2", dict(num_speculative_tokens=4, speculative_draft_depth=2), 7),
             ("adaptive K<=8", dict(num_speculative_tokens=8, speculative_adaptive=True), 13)]  # fmt: skip
    arms = bench_depth._spec_arms(path, base, 5, modes)
    assert {a.engine.max_model_len for a in arms} == {20 + 13 + 1 + 8}
    assert {a.engine.num_pages for a in arms} == {5 * 3}  # 42 tokens: 3 pages of 16 per request
    rows = bench_depth.paired_runs("0.03", arms, base, [1, 5], settle=True)
    for a in arms:
        st = a.engine.stats()
        assert st.num_preemptions == 0 and st.num_free_pages == st.num_pages and not a.engine.has_unfinished_requests()
    by = {(r.concurrency, r.mode): r for r in rows}
    assert by[(5, "K=4 d=2")].output_len == 7 and by[(5, "K=4 d=2")].acceptance_rate > 0
    assert all(len(r.round_speedup) == 2 for r in rows) and by[(5, "plain")].round_speedup == [1.0, 1.0]
