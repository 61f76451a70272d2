"""Ouro's learned-gate early exit (Q-exit), applied per token at every recurrence boundary.

After loop t the gate gives λ_t = sigmoid(g_t); the exit pdf is p_t = λ_t ∏_{u<t}(1-λ_u), so the
CDF after loop t is 1 - ∏_{u≤t}(1-λ_u). A token leaves the core at the first t with
t + 1 >= min_loops and CDF(t) >= q (the last allowed loop otherwise), and its logits come from
that loop's normalised state. Unlike the official code, an exited token stops: its row stops
consuming compute, and later tokens read its deeper KV through the `last_exited` layout.
Everything is fp32, so exit depths do not depend on the model dtype's rounding of the CDF.

Delayed exit (`delay=True`) is a different policy, not a different schedule: a decision taken
after loop t is applied after loop t+1, so the token leaves at min(t+1, max_loops-1). That extra
loop is a real one: its K/V is written (later tokens read it, and `last_exited` fills deeper
slots from it) and its state feeds the logits. The host then learns "every token of the row has
exited after this loop" one call ahead, so no loop is wasted and nobody waits on the gate.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from rlt_serve.host_copy import to_device


@dataclass
class ExitState:
    """Per-token accumulators of one span, kept on the device between core calls."""

    remaining: torch.Tensor  # [n] fp32 ∏(1-λ) so far
    exited: torch.Tensor  # [n] bool
    depth: torch.Tensor  # [n] long, exit depth (valid where exited)
    hidden: torch.Tensor  # [n, H] state at the exit depth (what the coda reads)
    decided: torch.Tensor  # [n] bool, delayed exit: the rule fired, the token leaves after the next loop

    @classmethod
    def new(cls, hidden: torch.Tensor) -> "ExitState":
        n = hidden.shape[0]
        dev = hidden.device
        return cls(
            remaining=torch.ones(n, dtype=torch.float32, device=dev),
            exited=torch.zeros(n, dtype=torch.bool, device=dev),
            depth=torch.zeros(n, dtype=torch.long, device=dev),
            hidden=torch.empty_like(hidden),
            decided=torch.zeros(n, dtype=torch.bool, device=dev),
        )

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self)]

    def to(self, device: torch.device | str) -> "ExitState":
        return ExitState(*(t.to(device) for t in self.tensors()))


def q_exit_step(
    state: ExitState, gate_logits: torch.Tensor, hidden: torch.Tensor, depth: int | torch.Tensor,
    threshold: float | torch.Tensor, min_loops: int | torch.Tensor, max_loops: int | torch.Tensor,
    delay: bool = False,
) -> torch.Tensor:
    """Update `state` after loop `depth`; returns the mask of tokens that exit at this depth.
    Elementwise: depth, threshold and loop bounds may be per-token tensors (`q_exit_rows`)."""
    lam = torch.sigmoid(gate_logits.float())
    cdf = 1.0 - state.remaining * (1.0 - lam)
    allowed = depth + 1 >= min_loops
    last = depth + 1 >= max_loops
    rule = (cdf >= threshold) & allowed
    if delay:
        new = ~state.exited & (state.decided | last)
        state.decided |= ~state.exited & ~new & rule
    else:
        new = ~state.exited & (rule | last)
    state.remaining = state.remaining * (1.0 - lam)
    state.exited |= new
    state.depth = torch.where(new, depth, state.depth)
    state.hidden = torch.where(new[:, None], hidden, state.hidden)  # no boolean indexing: no host sync
    return new


def q_exit_rows(
    states: list[ExitState], gate_logits: torch.Tensor, hidden: torch.Tensor, depths: list[int],
    thresholds: list[float], min_loops: list[int], max_loops: list[int], delay: bool = False,
) -> tuple[list[ExitState], list[torch.Tensor], torch.Tensor]:
    """`q_exit_step` for many rows in one pass (the rule is elementwise, so this is exact): per
    row its new state and exit mask, and [rows] bool done flags (`row_done_flag`). A step of 128
    early-exit rows launches a dozen kernels instead of 128 times that."""
    sizes = [st.exited.shape[0] for st in states]
    merged = ExitState(*(torch.cat(parts) for parts in zip(*(st.tensors() for st in states))))
    dev, rep = hidden.device, lambda xs: [x for x, n in zip(xs, sizes) for _ in range(n)]
    ints = to_device(rep(depths) + rep(min_loops) + rep(max_loops), torch.long, dev).view(3, -1)
    thr = to_device(rep(thresholds), torch.float32, dev)
    new = q_exit_step(merged, gate_logits, hidden, ints[0], thr, ints[1], ints[2], delay)
    gone = merged.exited | merged.decided if delay else merged.exited
    row = to_device(rep(range(len(states))), torch.long, dev)
    left = torch.zeros(len(states), dtype=torch.long, device=dev).index_add_(0, row, (~gone).long())
    split = [ExitState(*parts) for parts in zip(*(t.split(sizes) for t in merged.tensors()))]
    return split, list(new.split(sizes)), left == 0


def row_done_flag(state: ExitState, delay: bool) -> torch.Tensor:
    """[] bool on the device: every token of the row has left the core after this loop (delayed
    exit: will have left after the next one, since every decided token leaves then)."""
    return (state.exited | state.decided).all() if delay else state.exited.all()


class ExitReadback:
    """One core call's per-row done flags on their way to the host without a blocking read.

    On CUDA the flags are copied non-blocking into pinned memory and an event marks the copy;
    `get` waits on that event only, which a call later has long completed, never on work enqueued
    after it (a plain `.item()` would wait for the whole stream, i.e. the call just launched)."""

    def __init__(self, flags: torch.Tensor) -> None:
        self._event = None
        self._values: list[bool] | None = None
        if flags.is_cuda:
            self._host = torch.empty(flags.shape, dtype=torch.bool, pin_memory=True)
            self._host.copy_(flags, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = flags

    def get(self, i: int) -> bool:
        if self._values is None:
            if self._event is not None:
                self._event.synchronize()
            self._values = self._host.tolist()
        return self._values[i]
