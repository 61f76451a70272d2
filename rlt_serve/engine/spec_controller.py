"""Chooses the draft length K and draft depth for self-speculation from measured acceptance and
measured step times.

Cost model: a round of K drafts at depth d takes K*d draft steps and D - d verify steps (one loop
per step) and commits E = (1 - a^K) / (1 - a) tokens in expectation when each draft is kept with
probability a (the kept prefix, then the correction in place of the first rejected draft); a plain token takes one fused step (or D loop steps without
`fuse_decode_loops`). Counting core calls is not enough: a fused plain token is one CUDA-graph
replay while draft and verify rows run loop by loop, so the controller times every engine step
whose rows are all of one kind, per batch-size bucket, and compares seconds per committed token.

Exploration: plain steps are timed first; until a speculative step has been timed at some batch
size, a loop step is assumed to cost 1/D of a fused token (the optimistic, call-count view), so
speculation is tried once; afterwards unmeasured buckets borrow the measured cost ratio of the
nearest measured bucket. Speculation runs while its predicted speedup exceeds 1, and otherwise
is probed again (one round for the whole batch, at a doubling interval of steps) only if an
optimistic acceptance (an upper confidence bound) could pay, so a configuration where it cannot
pay stops paying for exploration.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from rlt_serve.engine.scheduler import Row
    from rlt_serve.engine.sequence import Sequence, Span

_KS = (1, 2, 4, 8, 16)
_MARGIN = 1.02  # predicted speedup needed to speculate (measured costs are noisy)


def draft_lengths(max_k: int, adaptive: bool) -> list[int]:
    """The K a round may use: max_k, or with adaptive K the powers of two up to it."""
    return ([k for k in _KS if k <= max_k] or [max_k]) if adaptive else [max_k]


def _bucket(batch: int) -> int:
    return 1 << max(0, batch - 1).bit_length()


class _Ema:
    """Exponential moving average that remembers whether it has seen a sample."""

    def __init__(self, weight: float) -> None:
        self.weight, self.value = weight, None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self.weight * (x - self.value)


class SpecController:
    def __init__(self, num_loops: int, max_k: int, fixed_depth: int | None, adaptive: bool,
                 fused_plain: bool = True, ema: float = 0.1, probe_every: int = 64,
                 max_probe_every: int = 4096, clock: Callable[[], float] = time.perf_counter) -> None:  # fmt: skip
        self.num_loops = num_loops
        self.max_k = max_k
        self.adaptive = adaptive
        self.depths = [fixed_depth] if fixed_depth is not None and not adaptive else list(range(1, num_loops))
        # Decayed counts of accepted and tested drafts per depth (a ratio of sums: the mean of
        # per-round ratios is biased low, since drafts after a rejection are never tested);
        # the prior of 1 in 2 is optimistic so every depth is tried.
        self._accepted = {d: 1.0 for d in self.depths}
        self._tested = {d: 2.0 for d in self.depths}
        self.ema = ema
        self.plain_steps_per_token = 1 if fused_plain else num_loops
        self._fixed = (max_k, fixed_depth)
        self._cost: dict[tuple[str, int, int], _Ema] = {}  # (kind, bucket, K) -> seconds per step
        self._probe_every0, self._max_probe_every = probe_every, max_probe_every
        self._probe_every: dict[int, int] = {}  # per bucket, in engine steps
        self._last_probe: dict[int, int] = {}
        self._decision: tuple[tuple[int, int], tuple[int, int]] = ((-1, 0), (0, 1))
        self._steps = 0  # engine steps so far (choose() runs while the next one is scheduled)
        self._step_key: tuple[str, int, int] | None = None
        self._step_start = 0.0
        self.clock = clock

    # -- the decision -------------------------------------------------------------------
    def choose(self, batch: int = 1) -> tuple[int, int]:
        """(K, depth) for a round starting now among `batch` decoding requests; K = 0 means
        decode without speculation."""
        if not self.adaptive:
            return self._fixed
        b = _bucket(batch)
        key = (self._steps, b)  # one decision per step and batch size: the batch moves together
        if self._decision[0] != key:
            self._decision = (key, self._decide(b))
        return self._decision[1]

    def _decide(self, b: int) -> tuple[int, int]:
        plain = self._plain_token_cost(b)
        if plain is None:  # time plain decoding here first: it is what speculation must beat
            return 0, 1
        speed, k, d = self._best(b, plain, self.accept_rate)
        if speed > _MARGIN:
            return k, d
        # Off. Probe where an optimistic reading of the evidence would pay (upper confidence
        # bound: a depth with few tested drafts gets the benefit of the doubt), so one unlucky
        # round does not rule a depth out for good.
        probe_speed, pk, pd = self._best(b, plain, self._optimistic_rate)
        if probe_speed <= _MARGIN:
            return 0, 1
        last = self._last_probe.setdefault(b, self._steps)
        every = self._probe_every.get(b, self._probe_every0)
        if self._steps - last >= every:  # probe one round, then back off
            self._last_probe[b], self._probe_every[b] = self._steps, min(2 * every, self._max_probe_every)
            return pk, pd
        return 0, 1

    def _best(self, b: int, plain: float, rate: Callable[[int], float]) -> tuple[float, int, int]:
        draft = self._step_cost("draft", b, 0, plain)
        return max(((self._speedup(b, plain, draft, k, d, rate(d)), k, d) for k in self._ks() for d in self.depths),
                   default=(0.0, 0, 1))  # fmt: skip

    def _optimistic_rate(self, depth: int) -> float:
        return min(1.0, self.accept_rate(depth) + self._tested[depth] ** -0.5)

    @staticmethod
    def expected_tokens(k: int, accept: float) -> float:
        """Tokens a round of k drafts commits when each is kept with probability `accept`."""
        a = min(accept, 0.999)
        return (1 - a**k) / (1 - a)

    def _ks(self) -> list[int]:
        return draft_lengths(self.max_k, True)

    def _speedup(self, b: int, plain: float, draft: float, k: int, depth: int, accept: float) -> float:
        verify = self._step_cost("verify", b, k, draft)
        rnd = k * depth * draft + (self.num_loops - depth) * verify
        return self.expected_tokens(k, accept) * plain / rnd

    def _plain_token_cost(self, b: int) -> float | None:
        c = self._cost.get(("plain", b, 0))
        return None if c is None else c.value * self.plain_steps_per_token

    def _step_cost(self, kind: str, b: int, k: int, fallback: float) -> float:
        """Measured seconds per step, else a prior: a draft loop step costs what the nearest
        measured bucket says relative to its plain token (1/D before anything is measured); a
        verify step costs a draft step."""
        c = self._cost.get((kind, b, k))
        if c is not None:
            return c.value
        if kind == "verify":
            return fallback
        ratios = [(abs(bb.bit_length() - b.bit_length()), c.value / self._plain_token_cost(bb))
                  for (kk, bb, _), c in self._cost.items() if kk == "draft" and self._plain_token_cost(bb)]  # fmt: skip
        return fallback * (min(ratios)[1] if ratios else 1.0 / self.num_loops)

    # -- measurements -------------------------------------------------------------------
    def accept_rate(self, depth: int) -> float:
        return self._accepted[depth] / self._tested[depth]

    def record(self, depth: int, tested: int, accepted: int) -> None:
        """A verify round at `depth`: `tested` drafts compared, `accepted` of them kept."""
        if tested and depth in self._tested:
            keep = 1 - self.ema
            self._accepted[depth] = keep * self._accepted[depth] + accepted
            self._tested[depth] = keep * self._tested[depth] + tested

    def start_step(self, rows: list["Row"], started: float) -> None:
        """Classify the step about to run (`started`: perf_counter() when the engine began
        scheduling it, so per-step host work counts): timed only if all its rows are one kind."""
        kinds = {_row_kind(seq, span) for seq, span in rows}
        self._steps += 1
        self._step_key, self._step_start = None, started
        if len(kinds) == 1 and None not in kinds:
            kind = kinds.pop()
            k = max(span.num_tokens for _, span in rows) if kind == "verify" else 0
            self._step_key = (kind, _bucket(len(rows)), k)

    def end_step(self) -> None:
        """File the step's wall time (the engine's steps end with a host read, so it is the
        device time too)."""
        if self._step_key is not None:
            self._cost.setdefault(self._step_key, _Ema(0.2)).add(self.clock() - self._step_start)
            self._step_key = None


def _row_kind(seq: "Sequence", span: "Span") -> str | None:
    """"draft", "verify", "plain" (a decode row outside speculation), or None (prompt rows)."""
    if span.kind != "normal":
        return span.kind
    return "plain" if seq.decoding and span.num_tokens == 1 else None
