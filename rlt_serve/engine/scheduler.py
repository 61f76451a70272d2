"""Loop-level continuous batching: which rows run in the next core call.

The batch is rebuilt at every recurrence boundary. Rows already in flight climb one depth per
call (oldest request first); then idle running requests start their next span (a decode token or
a prompt chunk) under the token budget; then waiting requests are admitted. Pages are taken only
for the span being started. When the pool runs dry the newest unscheduled request is preempted by
recomputation (its tokens and RNG are kept, its pages freed), so the engine cannot wedge.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from rlt_serve.config import EngineConfig
from rlt_serve.engine.block_manager import BlockManager
from rlt_serve.engine.sequence import Sequence, SequenceStatus, Span


@dataclass
class SchedulerOutput:
    rows: list[Sequence]  # each scheduled sequence's `span` is the row, at `span.depth`
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(seq.span.num_tokens for seq in self.rows)


class Scheduler:
    def __init__(self, cfg: EngineConfig, block_manager: BlockManager) -> None:
        self.cfg = cfg
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.cfg.max_num_batched_tokens
        out = SchedulerOutput(rows=[])
        scheduled: set[int] = set()
        # 1. Rows in flight climb one depth.
        for seq in self.running:
            if seq.span is not None and seq.span.num_tokens <= budget:
                budget -= seq.span.num_tokens
                out.rows.append(seq)
                scheduled.add(id(seq))
        # 2. Idle running requests start their next span.
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.span is None and seq.status is SequenceStatus.RUNNING:
                budget -= self._start_span(seq, budget, out, scheduled)
        # 3. Admit waiting requests.
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            if not self._fits(seq, budget, out, scheduled, admitting=True):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            budget -= self._start_span(seq, budget, out, scheduled)
        return out

    def _span_len(self, seq: Sequence, budget: int) -> int:
        remaining = seq.num_tokens - seq.num_computed
        return min(remaining, self.cfg.long_prefill_token_threshold, budget)

    def _fits(self, seq: Sequence, budget: int, out: SchedulerOutput, scheduled: set[int], admitting: bool) -> bool:
        """Make room for `seq`'s next span, preempting newer unscheduled requests if needed."""
        n = self._span_len(seq, budget)
        bm = self.block_manager
        while not bm.can_ensure(seq.page_table, seq.num_computed + n):
            victim = None if admitting else self._preemption_victim(seq, scheduled)
            if victim is None:  # admission never evicts running work
                return False
            self._preempt(victim, out)
        return True

    def _start_span(self, seq: Sequence, budget: int, out: SchedulerOutput, scheduled: set[int]) -> int:
        if not self._fits(seq, budget, out, scheduled, admitting=False):
            return 0
        n = self._span_len(seq, budget)
        self.block_manager.ensure(seq.page_table, seq.num_computed + n)
        seq.span = Span(seq.num_computed, seq.num_computed + n)
        out.rows.append(seq)
        scheduled.add(id(seq))
        return n

    def _preemption_victim(self, seq: Sequence, scheduled: set[int]) -> Sequence | None:
        """The newest request that arrived after `seq`, holds pages and is not in this call."""
        cands = [c for c in self.running if c.arrival > seq.arrival and id(c) not in scheduled and c.page_table]
        return max(cands, key=lambda c: c.arrival, default=None)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.release(seq.page_table)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        self.num_preemptions += 1

    def advance(self, out: SchedulerOutput) -> list[Sequence]:
        """After a core call: each row is one depth deeper. Returns rows that left the core."""
        done = []
        for seq in out.rows:
            span = seq.span
            span.depth += 1
            if span.depth == seq.num_loops:
                seq.num_computed = span.end
                seq.span = None
                done.append(seq)
        return done

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End a request exactly once and give its pages back."""
        if seq.status.finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.release(seq.page_table)
        seq.span = None
        seq.status = status
