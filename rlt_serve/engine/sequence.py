"""A request's token state and its in-flight rows.

The unit of work is a row `(request, span [start, end), depth)`. A sequence keeps its in-flight
spans in chunk order; each span carries its hidden state between core calls while it climbs
depths 0..num_loops-1, and is retired when its last depth is done (its KV is then valid in every
plane). Without wavefront prefill at most one span is in flight.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from rlt_serve.engine.exit_policy import ExitState
from rlt_serve.outputs import PositionLogprobs
from rlt_serve.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self not in (SequenceStatus.WAITING, SequenceStatus.RUNNING)


@dataclass
class Span:
    start: int
    end: int
    depth: int = 0
    hidden: torch.Tensor | None = None  # [end - start, H] state entering `depth`
    injected: torch.Tensor | None = None  # prelude output re-injected at every depth (Huginn)
    exit: ExitState | None = None  # per-token early-exit accumulators (adaptive depth)
    finished: bool = False  # every token has left the core; set by the runner
    pending_done: tuple | None = None  # async/delayed exit: (ExitReadback, row index) of the last call
    kind: str = "normal"  # "draft": a shallow speculative row; "verify": drafts resumed to full depth
    stop_depth: int | None = None  # leave the core after this many loops (None: the request's)

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass
class SwapState:
    """A preempted request's device state, parked in (pinned) CPU memory."""

    k: torch.Tensor  # [num_planes, num_pages, page_size, kv_heads, head_dim]
    v: torch.Tensor
    rng_state: torch.Tensor
    nbytes: int


_arrival = itertools.count()
PLACEHOLDER_TOKEN = -1  # an output token still on the device (async scheduling); never embedded


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    num_loops: int
    generator: torch.Generator
    prompt: str | None = None
    priority: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    arrival: int = field(default_factory=lambda: next(_arrival))
    page_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is written at every depth
    spans: list[Span] = field(default_factory=list)
    swapped: SwapState | None = None
    page_hashes: list[bytes] = field(default_factory=list)  # chain hashes of full pages (prefix cache)
    num_registered_pages: int = 0
    drafts: list[int] = field(default_factory=list)  # speculative tokens not yet verified
    draft_spans: list[Span] = field(default_factory=list)  # their shallow rows, stopped at the draft depth
    draft_probs: list[torch.Tensor] = field(default_factory=list)  # the distribution each draft came from
    spec_rng_state: torch.Tensor | None = None  # generator state before this round's first draft
    spec_round: tuple[int, int] | None = None  # (K, draft depth) of the round in flight
    logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    cumulative_logprob: float = 0.0
    text: str = ""
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    detokenizer: object | None = None
    # Prefix-cache salt for what besides tokens and params decides this request's K/V (Huginn's
    # seeded random initial state).
    cache_salt: bytes = b""
    # Huginn exit criteria: the depth at which each generated position (prompt length + i) left the
    # core, replayed when the request is recomputed after preemption. None: nothing to replay.
    exit_depths: list[int] | None = None
    # Prefill/decode disaggregation (rlt_serve.engine.handoff): "prefill" computes the prompt and
    # samples nothing; "decode" continues from received KV. `transfer_pinned`: pages are being read
    # by a transfer, so the request must not be preempted (its pages would be reused under it).
    pd_role: str | None = None
    kv_generation: int = 0
    transfer_pinned: bool = False
    # Async scheduling (rlt_serve.engine.async_step): trailing output tokens drawn on the device but
    # not yet read back; they hold PLACEHOLDER_TOKEN on the host until the step is resolved.
    num_pending_tokens: int = 0

    def __post_init__(self) -> None:
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]  # the first prompt token has no distribution

    @property
    def order_key(self) -> tuple[int, int]:
        """Lower runs first: priority, then arrival (vLLM's semantics)."""
        return (self.priority, self.arrival)

    @property
    def adaptive(self) -> bool:
        """Early exit is on (Ouro's Q-exit or a Huginn criterion): tokens may leave before `num_loops`."""
        p = self.params
        return p.exit_criterion is not None or (p.exit_threshold is not None and p.exit_threshold < 1.0)

    @property
    def replays_exits(self) -> bool:
        """Recomputing generated positions whose exit depths were decided earlier (and recorded)."""
        return self.exit_depths is not None and bool(self.output_token_ids)

    @property
    def prefill_end(self) -> int:
        """Where prompt-style spans stop. A replaying request leaves its last (undecided) token to a
        decode row, so its exit criterion runs exactly as it would have without preemption."""
        return self.num_tokens - 1 if self.replays_exits else self.num_tokens

    @property
    def shareable_tokens(self) -> int:
        """Computed positions whose pages may be shared: with recorded exits only prompt positions,
        since a generated position's depth is this request's decision, not a function of tokens."""
        known = min(self.num_computed, self.num_tokens - self.num_pending_tokens)  # a pending token has no hash yet
        return min(known, self.num_prompt_tokens) if self.exit_depths is not None else known

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def frontier(self) -> int:
        """First position not yet in any row: where the next span starts."""
        return self.spans[-1].end if self.spans else self.num_computed

    @property
    def decoding(self) -> bool:
        """The only uncomputed token is the last sampled one."""
        return self.num_computed == self.num_tokens - 1 and self.num_computed >= self.num_prompt_tokens

    def token_ids(self, start: int, end: int) -> list[int]:
        p = self.num_prompt_tokens
        if end <= p:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids + self.drafts)[start:end]

    def wants_prompt_logprobs(self) -> bool:
        """True while prompt positions still need their distributions recorded."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def append_token(self, token: int, logprobs: PositionLogprobs | None, logprob: float) -> None:
        self.output_token_ids.append(token)
        self.cumulative_logprob += logprob
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(logprobs)

    def drop_speculation(self) -> None:
        """Forget unverified drafts and their rows: decoding restarts from the committed tokens with
        the RNG as it was before the round, so a preempted request samples what it would have."""
        if self.drafts and self.spec_rng_state is not None:
            self.generator.set_state(self.spec_rng_state)
        self.drafts.clear()
        self.draft_probs.clear()
        self.draft_spans.clear()
        self.spec_round = None
        if self.spans and self.spans[0].kind != "normal":
            self.spans.clear()

    def reset_for_recompute(self) -> None:
        """Preemption by recomputation: forget KV and in-flight rows, keep tokens and RNG."""
        self.drop_speculation()
        self.spans.clear()
        self.num_computed = 0
        self.num_registered_pages = 0
