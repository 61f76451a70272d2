"""Resource-credit admission: a request runs only once its whole footprint is reserved.

A worker's credits are its KV pages and request slots. Before dispatch the router reserves
`ceil((prompt + max_tokens) / page_size)` pages and one slot on one worker, so a dispatched
request never waits inside the engine for memory and never forces a preemption; the engine
still allocates incrementally, the credits are the router's promise. A `Ticket` is returned
exactly once whatever the ending: `release` is idempotent and only the first call counts.

Reported `Capacity` is the reconciliation: free credits are the smaller of what the router's
own book leaves and what the worker says is free, so pages a worker still holds for a request
the router already released (an abort in flight) are not promised twice.

What does not fit waits in one bounded queue, ordered by priority (lower first) then arrival,
served strictly from the head so a large request is not starved by a stream of small ones. When
the queue is full, the last waiter in that order is refused (a new urgent request displaces a
queued lax one); past the queue deadline a waiter is refused too: `Overloaded`, HTTP 429.

With prefill/decode disaggregation every worker has a role and a request takes two tickets, one
on a decode worker (prompt + max_tokens: it receives the prompt's KV and generates) and then one
on a prefill worker (the prompt only). Decode is always taken first and nobody holds prefill
credits while waiting for decode ones, so the two pools cannot deadlock.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from dataclasses import dataclass, field


class Overloaded(Exception):
    """The queue is full or the request waited past its queue deadline (429)."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class NoCapacity(Exception):
    """No live worker exists that could ever hold the request (503)."""


@dataclass
class WorkerCredits:
    worker_id: str
    page_size: int
    total_pages: int
    total_slots: int
    role: str = "both"
    reserved_pages: int = 0
    reserved_slots: int = 0
    reported_free_pages: int | None = None
    reported_free_slots: int | None = None
    accepting: bool = True

    @property
    def free_pages(self) -> int:
        own = self.total_pages - self.reserved_pages
        return own if self.reported_free_pages is None else max(0, min(own, self.reported_free_pages))

    @property
    def free_slots(self) -> int:
        own = self.total_slots - self.reserved_slots
        return own if self.reported_free_slots is None else max(0, min(own, self.reported_free_slots))

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)


@dataclass
class Ticket:
    request_id: str
    worker_id: str
    pages: int
    slots: int = 1
    released: bool = False


@dataclass(order=True)
class _Waiter:
    priority: int
    seq: int
    num_tokens: int = field(compare=False)
    request_id: str = field(compare=False)
    worker_id: str | None = field(compare=False)
    future: asyncio.Future = field(compare=False)
    role: str | None = field(default=None, compare=False)


class Admission:
    def __init__(self, max_queue: int = 256, queue_timeout: float = 30.0) -> None:
        self.max_queue = max_queue
        self.queue_timeout = queue_timeout
        self.workers: dict[str, WorkerCredits] = {}
        self._queue: list[_Waiter] = []
        self._queued = 0  # waiters not yet served, cancelled or timed out
        self._seq = itertools.count()
        self._tickets: dict[int, Ticket] = {}  # id(ticket) -> ticket, for the exactly-once check

    # -- workers ----------------------------------------------------------------------------
    def add_worker(self, worker_id: str, page_size: int, total_pages: int, total_slots: int, role: str = "both") -> None:
        self.workers[worker_id] = WorkerCredits(worker_id, page_size, total_pages, total_slots, role)
        self._pump()

    def update_capacity(
        self, worker_id: str, free_pages: int, total_pages: int, free_slots: int, total_slots: int
    ) -> None:
        w = self.workers.get(worker_id)
        if w is None:
            return
        w.total_pages, w.total_slots = total_pages, total_slots
        w.reported_free_pages, w.reported_free_slots = free_pages, free_slots
        self._pump()

    def remove_worker(self, worker_id: str) -> None:
        """Stop placing work there; its tickets are released by their requests as they fail."""
        w = self.workers.get(worker_id)
        if w is not None:
            w.accepting = False
        self._fail_impossible()
        self._pump()

    # -- reserve / release ------------------------------------------------------------------
    @property
    def queue_length(self) -> int:
        return self._queued

    def outstanding(self) -> list[Ticket]:
        return list(self._tickets.values())

    async def acquire(
        self,
        request_id: str,
        num_tokens: int,
        priority: int = 0,
        worker_id: str | None = None,
        timeout: float | None = None,
        role: str | None = None,
    ) -> Ticket:
        """Reserve credits for `num_tokens` tokens (prompt + max_tokens) on one worker.

        `worker_id` pins the worker (warm-up), `role` limits the choice to workers of that role;
        `timeout` bounds the wait below the queue deadline. Raises `Overloaded` or `NoCapacity`; a
        cancelled wait leaves nothing reserved.
        """
        if not self._could_ever_fit(num_tokens, worker_id, role):
            raise NoCapacity(self._no_capacity_message(num_tokens, worker_id, role))
        loop = asyncio.get_running_loop()
        waiter = _Waiter(priority, next(self._seq), num_tokens, request_id, worker_id, loop.create_future(), role)
        heapq.heappush(self._queue, waiter)
        self._queued += 1
        self._pump()
        if waiter.future.done():
            return waiter.future.result()
        if self._queued > self.max_queue:  # no room: the last in (priority, arrival) order is refused
            worst = max(w for w in self._queue if not w.future.done())
            full = Overloaded(f"the router queue is full ({self.max_queue} requests waiting)", self._retry_after())
            if worst is waiter:
                self._drop(waiter)
                raise full
            worst.future.set_exception(full)
            self._queued -= 1
        limit = self.queue_timeout if timeout is None else min(timeout, self.queue_timeout)
        start = time.monotonic()
        try:
            return await asyncio.wait_for(asyncio.shield(waiter.future), max(0.0, limit))
        except asyncio.TimeoutError:
            if waiter.future.done() and not waiter.future.exception():
                return waiter.future.result()  # served in the same tick as the timeout
            self._drop(waiter)
            raise Overloaded(
                f"request waited {time.monotonic() - start:.1f}s for capacity (queue deadline {limit:g}s)",
                self._retry_after(),
            ) from None
        except asyncio.CancelledError:
            self._drop(waiter)
            if waiter.future.done() and not waiter.future.cancelled() and not waiter.future.exception():
                self.release(waiter.future.result())
            raise

    def release(self, ticket: Ticket) -> bool:
        """Return a ticket's credits; True the first time, False (a no-op) after."""
        if ticket.released:
            return False
        ticket.released = True
        self._tickets.pop(id(ticket), None)
        w = self.workers.get(ticket.worker_id)
        if w is not None:
            w.reserved_pages -= ticket.pages
            w.reserved_slots -= ticket.slots
            assert w.reserved_pages >= 0 and w.reserved_slots >= 0, "credits returned twice"
        self._pump()
        return True

    # -- internals --------------------------------------------------------------------------
    def _candidates(self, worker_id: str | None, role: str | None = None) -> list[WorkerCredits]:
        ws = (
            [self.workers[worker_id]] if worker_id in self.workers else [] if worker_id else list(self.workers.values())
        )
        return [w for w in ws if w.accepting and (role is None or w.role == role)]

    def _could_ever_fit(self, num_tokens: int, worker_id: str | None, role: str | None = None) -> bool:
        return any(
            w.pages_for(num_tokens) <= w.total_pages and w.total_slots >= 1 for w in self._candidates(worker_id, role)
        )

    def _no_capacity_message(self, num_tokens: int, worker_id: str | None, role: str | None = None) -> str:
        kind = f"{role} worker" if role else "worker"
        if not self._candidates(worker_id, role):
            return f"no live {kind} is available" + (f" (worker {worker_id})" if worker_id else "")
        return f"a request of {num_tokens} tokens does not fit in any live {kind}'s KV cache"

    def _choose(self, w: _Waiter) -> WorkerCredits | None:
        """Least loaded by free credits: the largest free fraction of pages, then free slots."""
        best: WorkerCredits | None = None
        for c in self._candidates(w.worker_id, w.role):
            if c.free_slots < 1 or c.free_pages < c.pages_for(w.num_tokens):
                continue
            key = (c.free_pages / max(1, c.total_pages), c.free_slots)
            if best is None or key > (best.free_pages / max(1, best.total_pages), best.free_slots):
                best = c
        return best

    def _pump(self) -> None:
        """Serve waiters in order while the head fits somewhere.

        Each role (and each pinned worker) has its own head: a request holding decode credits
        while it waits for prefill ones must not queue behind a request waiting for decode."""
        if not self._queue:
            return
        if all(w.role is None and w.worker_id is None for w in self._queue):  # the common case
            while self._queue:
                head = self._queue[0]
                if head.future.done():  # cancelled or timed out: already uncounted
                    heapq.heappop(self._queue)
                    continue
                chosen = self._choose(head)
                if chosen is None:
                    return
                heapq.heappop(self._queue)
                self._grant(head, chosen)
            return
        blocked: set[tuple[str | None, str | None]] = set()
        kept: list[_Waiter] = []
        for w in sorted(self._queue):
            if w.future.done():
                continue
            key = (w.role, w.worker_id)
            chosen = None if key in blocked else self._choose(w)
            if chosen is None:
                blocked.add(key)
                kept.append(w)
            else:
                self._grant(w, chosen)
        self._queue = kept  # sorted, hence a valid heap

    def _grant(self, w: _Waiter, chosen: WorkerCredits) -> None:
        self._queued -= 1
        pages = chosen.pages_for(w.num_tokens)
        chosen.reserved_pages += pages
        chosen.reserved_slots += 1
        if chosen.reported_free_pages is not None:  # until the next report, count it as used
            chosen.reported_free_pages -= pages
        if chosen.reported_free_slots is not None:
            chosen.reported_free_slots -= 1
        ticket = Ticket(w.request_id, chosen.worker_id, pages)
        self._tickets[id(ticket)] = ticket
        w.future.set_result(ticket)

    def _drop(self, waiter: _Waiter) -> None:
        if not waiter.future.done():
            waiter.future.cancel()
            self._queued -= 1
        self._pump()

    def _fail_impossible(self) -> None:
        for w in self._queue:
            if not w.future.done() and not self._could_ever_fit(w.num_tokens, w.worker_id, w.role):
                w.future.set_exception(NoCapacity(self._no_capacity_message(w.num_tokens, w.worker_id, w.role)))
                self._queued -= 1

    def _retry_after(self) -> float:
        return 1.0 if self._queued < self.max_queue else 2.0
