"""Ouro's learned-gate early exit (Q-exit), applied per token at every recurrence boundary.

After loop t the gate gives λ_t = sigmoid(g_t); the exit pdf is p_t = λ_t ∏_{u<t}(1-λ_u), so the
CDF after loop t is 1 - ∏_{u≤t}(1-λ_u). A token leaves the core at the first t with
t + 1 >= min_loops and CDF(t) >= q (the last allowed loop otherwise), and its logits come from
that loop's normalised state. Unlike the official code, an exited token stops: its row stops
consuming compute, and later tokens read its deeper KV through the `last_exited` layout.
Everything is fp32, so exit depths do not depend on the model dtype's rounding of the CDF.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ExitState:
    """Per-token accumulators of one span, kept on the device between core calls."""

    remaining: torch.Tensor  # [n] fp32 ∏(1-λ) so far
    exited: torch.Tensor  # [n] bool
    depth: torch.Tensor  # [n] long, exit depth (valid where exited)
    hidden: torch.Tensor  # [n, H] state at the exit depth (what the coda reads)

    @classmethod
    def new(cls, hidden: torch.Tensor) -> "ExitState":
        n = hidden.shape[0]
        dev = hidden.device
        return cls(
            remaining=torch.ones(n, dtype=torch.float32, device=dev),
            exited=torch.zeros(n, dtype=torch.bool, device=dev),
            depth=torch.zeros(n, dtype=torch.long, device=dev),
            hidden=torch.empty_like(hidden),
        )

    def to(self, device: torch.device | str) -> "ExitState":
        return ExitState(*(t.to(device) for t in (self.remaining, self.exited, self.depth, self.hidden)))


def q_exit_step(
    state: ExitState, gate_logits: torch.Tensor, hidden: torch.Tensor, depth: int, threshold: float,
    min_loops: int, max_loops: int,
) -> torch.Tensor:
    """Update `state` after loop `depth`; returns the mask of tokens that exit at this depth."""
    lam = torch.sigmoid(gate_logits.float())
    cdf = 1.0 - state.remaining * (1.0 - lam)
    allowed = depth + 1 >= min_loops
    last = depth + 1 >= max_loops
    new = ~state.exited & ((cdf >= threshold) & allowed | last)
    state.remaining = state.remaining * (1.0 - lam)
    state.exited |= new
    state.depth = torch.where(new, depth, state.depth)
    state.hidden[new] = hidden[new]
    return new
