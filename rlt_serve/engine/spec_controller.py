"""Chooses the draft length K and draft depth for self-speculation from measured acceptance.

Cost model (decode at small batch is bound by reading the weights once per core call): a plain
token costs D core calls; a round of K drafts at depth d costs K*d + (D - d) calls and commits
E = (1 - a^(K+1)) / (1 - a) tokens in expectation when each draft is kept with probability a
(the accepted prefix plus one correction, capped at K). The controller keeps an exponential
moving average of a per depth, picks the (K, d) with the best D*E / cost, and switches
speculation off when nothing beats plain decoding, probing again now and then so a changed
workload can switch it back on.
"""

from __future__ import annotations


class SpecController:
    def __init__(self, num_loops: int, max_k: int, fixed_depth: int | None, adaptive: bool,
                 ema: float = 0.1, probe_every: int = 64) -> None:
        self.num_loops = num_loops
        self.max_k = max_k
        self.adaptive = adaptive
        self.depths = [fixed_depth] if fixed_depth is not None and not adaptive else list(range(1, num_loops))
        self.accept_rate = {d: 0.5 for d in self.depths}  # optimistic prior so every depth is tried
        self.ema = ema
        self.probe_every = probe_every
        self._rounds_off = 0
        self._fixed = (max_k, fixed_depth)

    def expected_speedup(self, k: int, depth: int) -> float:
        a = min(self.accept_rate[depth], 0.999)
        tokens = min((1 - a ** (k + 1)) / (1 - a), float(k))
        return self.num_loops * tokens / (k * depth + self.num_loops - depth)

    def choose(self) -> tuple[int, int]:
        """(K, depth) for the next round; K = 0 means decode without speculation."""
        if not self.adaptive:
            return self._fixed
        ks = [k for k in (1, 2, 4, 8, 16) if k <= self.max_k] or [self.max_k]
        best = max(((self.expected_speedup(k, d), k, d) for k in ks for d in self.depths), default=(0, 0, 1))
        if best[0] > 1.0:
            return best[1], best[2]
        self._rounds_off += 1
        if self._rounds_off % self.probe_every == 0:  # probe: measure again at the most promising point
            return best[1], best[2]
        return 0, 1

    def record(self, depth: int, drafted: int, accepted: int) -> None:
        if drafted and depth in self.accept_rate:
            rate = accepted / drafted
            self.accept_rate[depth] += self.ema * (rate - self.accept_rate[depth])
