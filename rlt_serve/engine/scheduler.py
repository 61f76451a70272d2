"""Loop-level continuous batching: which rows run in the next core call.

The batch is rebuilt at every recurrence boundary, in (priority, arrival) order:
- decode rows first (one token each), then prompt rows fill the remaining token budget
  (mixed batching); with mixed batching off a call holds prompt rows or decode rows, prompt first;
- a prompt is split into spans under the budget (chunked prefill); with wavefront prefill span c
  may run at depth d once (c, d-1) and (c-1, d) are done, so one request's chunks climb together;
- waiting requests are admitted last, reusing cached prefix pages when prefix caching is on.
Pages are taken only for the span being started. When the pool runs dry the lowest-priority,
latest-arrived request that is not in this call is preempted: snapshotted to swap space when it
fits, else reset for recomputation. Its tokens and RNG are kept, so nothing is lost.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch

from rlt_serve.config import EngineConfig
from rlt_serve.engine.block_manager import BlockManager, chain_hash
from rlt_serve.engine.sequence import Sequence, SequenceStatus, Span
from rlt_serve.engine.spec_controller import SpecController
from rlt_serve.engine.swap import SwapSpace

Row = tuple[Sequence, Span]


@dataclass
class SchedulerOutput:
    rows: list[Row] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(span.num_tokens for _, span in self.rows)


class _Pass:
    """State of one schedule() call."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.num_decoding = 0  # decoding requests running: the batch a speculative round joins
        self.out = SchedulerOutput()
        self.scheduled: set[int] = set()

    def add(self, seq: Sequence, span: Span) -> None:
        self.out.rows.append((seq, span))
        self.scheduled.add(id(seq))
        self.budget -= span.num_tokens


class Scheduler:
    def __init__(
        self,
        cfg: EngineConfig,
        block_manager: BlockManager,
        swap: SwapSpace | None = None,
        salt: bytes = b"",
        max_model_len: int = 1 << 30,
    ) -> None:
        self.cfg = cfg
        self.block_manager = block_manager
        self.swap = swap
        self.salt = salt
        self.max_model_len = max_model_len
        self.spec: SpecController | None = None  # set by the engine when self-speculation is on
        self.spec_paused = False  # set around asynchronous steps: they decode plainly (see wants_speculation)
        self.waiting: list[Sequence] = []  # sorted by order_key
        self.running: list[Sequence] = []
        self.num_swap_preemptions = 0
        self.num_recompute_preemptions = 0

    @property
    def num_preemptions(self) -> int:
        return self.num_swap_preemptions + self.num_recompute_preemptions

    def add(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=lambda s: s.order_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one call -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.running.sort(key=lambda s: s.order_key)
        p = _Pass(self.cfg.max_num_batched_tokens)
        if self.cfg.enable_mixed_batching:
            self._schedule_decode(p)
            self._schedule_prefill(p, self.running)
            self._admit(p)
        else:  # phase-separated: prompt rows first, decode only in calls without them
            self._schedule_prefill(p, self.running)
            self._admit(p)
            if not p.out.rows:
                self._schedule_decode(p)
        return p.out

    def _schedule_decode(self, p: _Pass) -> None:
        p.num_decoding = sum(1 for seq in self.running if seq.decoding)
        for seq in list(self.running):
            if p.budget == 0:
                return
            if seq.status is not SequenceStatus.RUNNING or not seq.decoding or id(seq) in p.scheduled:
                continue
            if not seq.spans:
                span = self._next_decode_span(seq, p)
                if span is None:
                    continue
                seq.spans.append(span)
            if seq.spans[0].num_tokens <= p.budget:
                p.add(seq, seq.spans[0])

    def _next_decode_span(self, seq: Sequence, p: _Pass) -> Span | None:
        """A plain decode row, or with self-speculation the next shallow draft row or the verify row."""
        k, depth = self._spec_round(seq, p.num_decoding)
        if k == 0:
            pos = seq.frontier
            return Span(pos, pos + 1) if self._make_room(seq, pos + 1, p, admitting=False) else None
        if len(seq.draft_spans) < k:
            pos = seq.num_computed + len(seq.draft_spans)
            if not self._make_room(seq, pos + 1, p, admitting=False):
                return None
            return Span(pos, pos + 1, kind="draft", stop_depth=depth)
        hidden = torch.cat([span.hidden for span in seq.draft_spans])
        injected = None  # Huginn re-injects the prelude output at every step: the verify row resumes it too
        if seq.draft_spans[0].injected is not None:
            injected = torch.cat([span.injected for span in seq.draft_spans])
        seq.draft_spans.clear()
        start = seq.num_computed
        return Span(start, start + k, depth=depth, hidden=hidden, injected=injected, kind="verify")

    def wants_speculation(self) -> bool:
        """Whether the next step may draft or verify: a round is under way, or the controller
        would start one at this batch size. Otherwise it is plain decoding, which asynchronous
        scheduling can pipeline even with (adaptive) speculation configured."""
        if self.spec is None:
            return False
        if any(seq.spec_round is not None or seq.drafts or seq.draft_spans for seq in self.running):
            return True
        return self.spec.choose(sum(1 for seq in self.running if seq.decoding))[0] > 0

    def _spec_round(self, seq: Sequence, batch: int) -> tuple[int, int]:
        """(K, draft depth) for `seq`: fixed for a round once its first draft starts; K = 0 turns
        speculation off (no controller, adaptive depth, paused for an asynchronous step, no tokens
        left, or not worth it)."""
        if seq.spec_round is not None:
            return seq.spec_round
        if self.spec is None or seq.adaptive or self.spec_paused:
            return 0, 0
        k, depth = self.spec.choose(batch)
        left = (seq.params.max_tokens or self.max_model_len) - len(seq.output_token_ids)
        k = max(0, min(k, left, self.max_model_len - seq.num_tokens))
        if k == 0 or depth >= seq.num_loops:
            return 0, 0
        seq.spec_round = (k, depth)
        return seq.spec_round

    def _schedule_prefill(self, p: _Pass, seqs: list[Sequence]) -> None:
        for seq in list(seqs):
            if p.budget == 0:
                return
            if seq.status is not SequenceStatus.RUNNING or seq.decoding:
                continue
            for i, span in enumerate(seq.spans):
                # (c-1, d) is done. An early-exited chunk waits to retire in chunk order without
                # running again; its tokens' deeper planes are already filled (last_exited).
                ready = i == 0 or seq.spans[i - 1].finished or seq.spans[i - 1].depth > span.depth
                if ready and not span.finished and span.num_tokens <= p.budget:
                    p.add(seq, span)
            # A replay of recorded exits runs its spans in order: a span's coda reads the coda K/V
            # of the spans before it, which exist only once those have left the core.
            wavefront = self.cfg.enable_wavefront_prefill and not seq.replays_exits
            can_start = not seq.spans or (wavefront and seq.spans[-1].depth >= 1)
            if can_start and seq.frontier < seq.prefill_end and p.budget > 0:
                n = min(seq.prefill_end - seq.frontier, self.cfg.long_prefill_token_threshold, p.budget)
                if self._make_room(seq, seq.frontier + n, p, admitting=False):
                    span = Span(seq.frontier, seq.frontier + n)
                    seq.spans.append(span)
                    p.add(seq, span)

    def _admit(self, p: _Pass) -> None:
        bm = self.block_manager
        while self.waiting and p.budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            if seq.swapped is not None:
                n_pages = seq.swapped.k.shape[1]
                if not self._make_room(seq, n_pages * bm.page_size, p, admitting=True):
                    return
                self.swap.swap_in(seq)
            else:
                self._match_prefix(seq)
                n = min(seq.prefill_end - seq.frontier, self.cfg.long_prefill_token_threshold, p.budget)
                # A prefill-only request (PD) takes its whole prompt now: it is never preempted (its
                # pages may be under transfer), so growing it later could deadlock pinned requests.
                need = seq.num_tokens if seq.pd_role == "prefill" else seq.frontier + n
                if not self._make_room(seq, need, p, admitting=True):
                    bm.release(seq.page_table)  # undo the prefix match; retried next call
                    seq.num_computed = seq.num_registered_pages = 0
                    return
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if seq.decoding:
                self._schedule_decode(p)
            else:
                self._schedule_prefill(p, [seq])

    # -- pages, prefix cache, preemption ----------------------------------------------------
    def _match_prefix(self, seq: Sequence) -> None:
        bm = self.block_manager
        if not bm.enable_prefix_caching or seq.wants_prompt_logprobs() or seq.num_computed:
            return
        # The last token is always computed: its logits give the next token.
        full = (seq.num_tokens - 1) // bm.page_size
        pages = bm.match_prefix(self._page_hashes(seq, full), seq.num_tokens)
        seq.page_table = pages
        seq.num_computed = len(pages) * bm.page_size
        seq.num_registered_pages = len(pages)

    def _page_hashes(self, seq: Sequence, n: int) -> list[bytes]:
        ps, hashes = self.block_manager.page_size, seq.page_hashes
        p = seq.params
        salt = self.salt + seq.cache_salt
        salt += f"|{seq.num_loops}|{p.exit_threshold}|{p.min_loops}|{p.exit_criterion}|{p.exit_check_interval}".encode()
        while len(hashes) < n:
            i = len(hashes)
            hashes.append(chain_hash(hashes[-1] if hashes else b"", seq.token_ids(i * ps, (i + 1) * ps), salt))
        return hashes[:n]

    def register_full_pages(self, seq: Sequence) -> None:
        bm = self.block_manager
        full = seq.shareable_tokens // bm.page_size
        if full > seq.num_registered_pages:
            for i, h in enumerate(self._page_hashes(seq, full)[seq.num_registered_pages :], seq.num_registered_pages):
                bm.register(seq.page_table[i], h)
            seq.num_registered_pages = full

    def _make_room(self, seq: Sequence, num_tokens: int, p: _Pass, admitting: bool) -> bool:
        """Grow `seq`'s page table to `num_tokens`, preempting lower-ordered requests if needed."""
        bm = self.block_manager
        while not bm.can_ensure(seq.page_table, num_tokens):
            victim = self._victim(seq, p, admitting)
            if victim is None:
                return False
            self._preempt(victim, p)
        bm.ensure(seq.page_table, num_tokens)
        return True

    def _victim(self, seq: Sequence, p: _Pass, admitting: bool) -> Sequence | None:
        """The lowest-priority, latest-arrived running request ordered after `seq`, not in this call.

        Admission only evicts strictly lower priority, so equal-priority arrivals never thrash."""
        for cand in reversed(self.running):  # sorted by order_key; worst last
            if cand is seq or id(cand) in p.scheduled or not cand.page_table or cand.transfer_pinned:
                continue
            worse = cand.priority > seq.priority if admitting else cand.order_key > seq.order_key
            return cand if worse else None
        return None

    def _preempt(self, seq: Sequence, p: _Pass) -> None:
        self.running.remove(seq)
        seq.drop_speculation()  # drafts are recomputed after restore; committed tokens are kept
        if self.swap is not None and self.swap.can_swap_out(seq):
            self.swap.swap_out(seq)
            self.block_manager.release(seq.page_table)
            seq.num_registered_pages = 0  # restored pages are private copies until re-registered
            self.num_swap_preemptions += 1
        else:
            self.block_manager.release(seq.page_table)
            seq.reset_for_recompute()
            self.num_recompute_preemptions += 1
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.add(seq)
        p.out.preempted.append(seq)

    # -- after a call -----------------------------------------------------------------------
    def advance(self, out: SchedulerOutput) -> list[Row]:
        """Each row is one depth deeper; spans done with every depth retire, in chunk order."""
        done: list[Row] = []
        for seq, span in out.rows:
            span.depth += 1
        for seq in {id(s): s for s, _ in out.rows}.values():
            while seq.spans and seq.spans[0].finished:
                span = seq.spans.pop(0)
                if span.kind == "draft":
                    seq.draft_spans.append(span)
                elif span.kind == "normal":  # a verify row's valid prefix is set by its acceptance
                    seq.num_computed = span.end
                done.append((seq, span))
            if self.block_manager.enable_prefix_caching:
                self.register_full_pages(seq)
        return done

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End a request exactly once and give back its pages and swap space."""
        if seq.status.finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if self.swap is not None:
            self.swap.discard(seq)
        self.block_manager.release(seq.page_table)
        seq.spans.clear()
        seq.status = status
