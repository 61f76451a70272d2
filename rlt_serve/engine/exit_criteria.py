"""Huginn's training-free exit criteria, checked per row at recurrence boundaries.

The rules are the official evaluators (`*ExitEvaluator` in raven_modeling_minimal.py, MODELS.md
§3.4) with their "auto" thresholds, computed in fp32:
- kl: KL(p_prev || p_t) of the next-token distributions, p_prev uniform before the first check;
- minp-kl: the same after min-p filtering (p < 0.1 max p set to 1/V, renormalised);
- entropy-diff: |H_t - H_prev|, H_prev = 100 before the first check;
- latent-diff: ||x_t - x_prev|| / ||x_t|| of the raw core state, x_prev = the initial state;
- cosine: 1 - cos(x_t, x_prev); argmax-stability: consecutive checks with an unchanged argmax.
A token exits when the value is below the threshold (argmax: at least the threshold). It checks
after step d (0-based) when d >= min_loops - 1 and (d - min_loops + 1) % exit_check_interval == 0
(official min_steps = min_loops - 1), and always leaves after num_loops steps, its logits taken
from the state it left with. The previous value updates only at checks, as officially.

Who decides: a generated token, as its own one-token decode row (the official decode step at
batch 1). Prompt positions run every step (official `do_not_exit_in_prefill`, for every prompt
position): their K/V then do not depend on chunking, batching or prefix sharing. The depth each
generated position left at is recorded on the sequence and replayed when it is recomputed after
preemption, so a recomputed request continues exactly as it would have.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from rlt_serve.engine.exit_policy import ExitState
from rlt_serve.engine.sequence import Sequence, Span

DEFAULT_THRESHOLDS = {
    "kl": 1e-3,
    "minp-kl": 1e-5,
    "entropy-diff": 1e-3,
    "latent-diff": 0.03,
    "cosine": 1e-3,
    "argmax-stability": 5,
}
# Criteria that read the next-token distribution, so a check runs the coda and the head.
DISTRIBUTION_CRITERIA = frozenset({"kl", "minp-kl", "entropy-diff", "argmax-stability"})


@dataclass
class CriterionExit:
    """Exit state of one row under a Huginn criterion; shaped like `ExitState` where the runner reads it."""

    exited: torch.Tensor  # [n] bool
    depth: torch.Tensor  # [n] long, exit depth (valid where exited)
    hidden: torch.Tensor  # [n, H] raw state at the exit depth (what the coda reads)
    target: torch.Tensor  # [n] long: forced exit depth (prompt or replayed position), -1: the criterion decides
    prev: torch.Tensor | None  # what the next check compares against; None: uniform (KL rules)
    stable: torch.Tensor  # argmax-stability: checks in a row with an unchanged argmax
    decides: bool

    def to(self, device: torch.device | str) -> "CriterionExit":
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return CriterionExit(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in moved.items()})


def new_exit_state(seq: Sequence, span: Span, hidden: torch.Tensor) -> ExitState | CriterionExit | None:
    """The exit state a span starts with: Ouro's Q-exit accumulators, or for a Huginn criterion
    the forced depths of known positions (None when the span is all prompt: it runs every step)."""
    p = seq.params
    if p.exit_criterion is None:
        return ExitState.new(hidden)
    n_prompt, depths = seq.num_prompt_tokens, seq.exit_depths or []
    if span.end <= n_prompt:
        return None
    targets = []
    for pos in range(span.start, span.end):
        i = pos - n_prompt
        targets.append(seq.num_loops - 1 if i < 0 else depths[i] if i < len(depths) else -1)
    decides = targets[-1] == -1
    if decides and (span.num_tokens != 1 or -1 in targets[:-1]):
        raise RuntimeError(f"{seq.request_id}: an undecided position must run as its own row ({span.start}:{span.end})")
    dev = hidden.device
    prev: torch.Tensor | None = None
    if p.exit_criterion == "entropy-diff":
        prev = torch.tensor(100.0, device=dev)
    elif p.exit_criterion in ("latent-diff", "cosine"):
        prev = hidden.float().clone()
    elif p.exit_criterion == "argmax-stability":
        prev = torch.tensor(-1, device=dev)
    n = span.num_tokens
    return CriterionExit(
        exited=torch.zeros(n, dtype=torch.bool, device=dev),
        depth=torch.zeros(n, dtype=torch.long, device=dev),
        hidden=torch.empty_like(hidden),
        target=torch.tensor(targets, dtype=torch.long, device=dev),
        prev=prev,
        stable=torch.zeros((), dtype=torch.long, device=dev),
        decides=decides,
    )


def is_check_step(seq: Sequence, depth: int) -> bool:
    """Whether the criterion runs after step `depth` (never after the last: the token leaves anyway)."""
    p = seq.params
    first = (p.min_loops or 1) - 1
    return depth + 1 < seq.num_loops and depth >= first and (depth - first) % p.exit_check_interval == 0


def needs_distribution(seq: Sequence, span: Span) -> bool:
    st = span.exit
    return (
        isinstance(st, CriterionExit) and st.decides and seq.params.exit_criterion in DISTRIBUTION_CRITERIA
        and is_check_step(seq, span.depth)
    )


def exit_step(seq: Sequence, span: Span, hidden: torch.Tensor, logits: torch.Tensor | None) -> torch.Tensor:
    """Update a Huginn criterion row's exit state after step `span.depth`; the mask of tokens
    leaving now. (Ouro's Q-exit rows are decided together, by `exit_policy.q_exit_rows`.)"""
    st, d = span.exit, span.depth
    want = st.target == d
    if st.decides and is_check_step(seq, d):
        want = want | _criterion_met(seq, st, hidden, logits)
    if d + 1 >= seq.num_loops:
        want = torch.ones_like(want)
    new = ~st.exited & want
    st.exited |= new
    st.depth = torch.where(new, d, st.depth)
    st.hidden = torch.where(new[:, None], hidden, st.hidden)  # no boolean indexing: no host sync
    return new


def _criterion_met(seq: Sequence, st: CriterionExit, hidden: torch.Tensor, logits: torch.Tensor | None) -> torch.Tensor:
    """One check of the official evaluator on a one-token row: updates `st.prev`, returns [1] bool."""
    name = seq.params.exit_criterion
    thr = seq.params.exit_threshold if seq.params.exit_threshold is not None else DEFAULT_THRESHOLDS[name]
    if name in ("latent-diff", "cosine"):
        x, prev = hidden.float(), st.prev
        if name == "latent-diff":
            value = ((x - prev).norm(dim=-1) / x.norm(dim=-1)).mean()
        else:
            value = 1 - ((x * prev).sum(-1) / x.norm(dim=-1) / prev.norm(dim=-1)).mean()
        st.prev = x
        return (value < thr).reshape(1)
    logits = logits.float()
    if name == "argmax-stability":
        top = logits.argmax()
        st.stable = torch.where(top == st.prev, st.stable + 1, torch.zeros_like(st.stable))
        st.prev = top
        return (st.stable >= int(thr)).reshape(1)
    if name == "entropy-diff":
        probs = torch.softmax(logits, dim=-1)
        entropy = -(probs * torch.log(probs + 1e-10)).sum()
        value, st.prev = (entropy - st.prev).abs(), entropy
        return (value < thr).reshape(1)
    log_p = torch.log_softmax(logits, dim=-1) if name == "kl" else minp_log_probs(logits)
    prev = st.prev if st.prev is not None else torch.full_like(log_p, -math.log(log_p.shape[-1]))
    value = F.kl_div(log_p, prev, reduction="none", log_target=True).sum()
    st.prev = log_p
    return (value < thr).reshape(1)


def minp_log_probs(logits: torch.Tensor) -> torch.Tensor:
    """minp-kl's distribution: probabilities below 0.1 of the largest become 1/V, then renormalised."""
    probs = torch.softmax(logits, dim=-1)
    probs = torch.where(probs < 0.1 * probs.max(), torch.full_like(probs, 1.0 / probs.shape[-1]), probs)
    return (probs / probs.sum()).log()


def record_exit_depths(seq: Sequence, span: Span, depths: list[int]) -> None:
    """Remember the depth of each newly computed generated position (replayed on recompute)."""
    if seq.exit_depths is None:
        return
    for pos, depth in zip(range(span.start, span.end), depths):
        if pos - seq.num_prompt_tokens == len(seq.exit_depths):
            seq.exit_depths.append(depth)
