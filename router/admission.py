"""Resource-credit admission: a request runs only once its whole footprint is reserved.

A worker's credits are its KV pages and request slots. Before dispatch the router reserves
`ceil((prompt + max_tokens) / page_size)` pages and one slot on one worker, so a dispatched
request never waits inside the engine for memory and never forces a preemption; the engine
still allocates incrementally, the credits are the router's promise. A `Ticket` is returned
exactly once whatever the ending: `release` is idempotent and only the first call counts.

Reported `Capacity` is the reconciliation: free credits are the smaller of what the router's
own book leaves and what the worker says is free, so pages a worker still holds for a request
the router already released (an abort in flight) are not promised twice.

A request with several choices (prompts x n) takes all of its tickets in one grant
(`acquire_group`): it never holds part of its credits while waiting for the rest, so two large
requests cannot each hold what the other waits for, and one that could never fit whole (more
choices than the live workers hold at once) is refused at once, not at the queue deadline.

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


class GroupTooLarge(NoCapacity):
    """Live workers exist, but too few to hold all of one request's choices at once (400)."""


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
    """One request's wait: a ticket per entry of `num_tokens`, granted together."""

    priority: int
    seq: int
    num_tokens: list[int] = field(compare=False)
    request_ids: list[str] = field(compare=False)
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
        return (await self.acquire_group([request_id], [num_tokens], priority, worker_id, timeout, role))[0]

    async def acquire_group(
        self,
        request_ids: list[str],
        num_tokens: list[int],
        priority: int = 0,
        worker_id: str | None = None,
        timeout: float | None = None,
        role: str | None = None,
    ) -> list[Ticket]:
        """`acquire` for every choice of one request at once: all of its tickets or none. Raises
        `GroupTooLarge` when the live workers could not hold them all even if idle."""
        if not self._could_ever_fit(num_tokens, worker_id, role):
            raise self._impossible(num_tokens, worker_id, role)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(priority, next(self._seq), list(num_tokens), list(request_ids), worker_id,
                         loop.create_future(), role)  # fmt: skip
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
                for ticket in waiter.future.result():
                    self.release(ticket)
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

    @staticmethod
    def _place(num_tokens: list[int], workers: list[WorkerCredits], idle: bool = False) -> list[WorkerCredits] | None:
        """A worker for each footprint (in `num_tokens`' order), or None: largest first, each goes
        to the least loaded worker (the largest free fraction of pages, then free slots) after the
        ones before it took their credits, so small choices do not strand a large one (first fit
        decreasing); `idle` places against total credits, as if nothing ran."""
        pages = {w.worker_id: w.total_pages if idle else w.free_pages for w in workers}
        slots = {w.worker_id: w.total_slots if idle else w.free_slots for w in workers}
        placement: list[WorkerCredits | None] = [None] * len(num_tokens)
        for i in sorted(range(len(num_tokens)), key=lambda i: -num_tokens[i]):
            n = num_tokens[i]
            fits = [w for w in workers if slots[w.worker_id] >= 1 and pages[w.worker_id] >= w.pages_for(n)]
            if not fits:
                return None
            best = max(fits, key=lambda w: (pages[w.worker_id] / max(1, w.total_pages), slots[w.worker_id]))
            pages[best.worker_id] -= best.pages_for(n)
            slots[best.worker_id] -= 1
            placement[i] = best
        return placement  # type: ignore[return-value]  (every entry set)

    def _placement(self, w: _Waiter) -> list[WorkerCredits] | None:
        """Where `w`'s tickets go with the credits free now, or None while they do not fit."""
        return self._place(w.num_tokens, self._candidates(w.worker_id, w.role))

    def _could_ever_fit(self, num_tokens: list[int], worker_id: str | None, role: str | None = None) -> bool:
        return self._place(num_tokens, self._candidates(worker_id, role), idle=True) is not None

    def _impossible(self, num_tokens: list[int], worker_id: str | None, role: str | None = None) -> NoCapacity:
        """Why `num_tokens` can never be placed."""
        kind = f"{role} worker" if role else "worker"
        workers = self._candidates(worker_id, role)
        if not workers:
            return NoCapacity(f"no live {kind} is available" + (f" (worker {worker_id})" if worker_id else ""))
        if self._place([max(num_tokens)], workers, idle=True) is None:
            return NoCapacity(f"a request of {max(num_tokens)} tokens does not fit in any live {kind}'s KV cache")
        return GroupTooLarge(
            f"the request's {len(num_tokens)} choices (prompts x n) run at once, but the live {kind}s hold at most "
            f"{sum(w.total_slots for w in workers)} requests and {sum(w.total_pages for w in workers)} KV pages in "
            "all; send fewer prompts or a smaller n per request"
        )

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
                placement = self._placement(head)
                if placement is None:
                    return
                heapq.heappop(self._queue)
                self._grant(head, placement)
            return
        blocked: set[tuple[str | None, str | None]] = set()
        kept: list[_Waiter] = []
        for w in sorted(self._queue):
            if w.future.done():
                continue
            key = (w.role, w.worker_id)
            placement = None if key in blocked else self._placement(w)
            if placement is None:
                blocked.add(key)
                kept.append(w)
            else:
                self._grant(w, placement)
        self._queue = kept  # sorted, hence a valid heap

    def _grant(self, w: _Waiter, placement: list[WorkerCredits]) -> None:
        self._queued -= 1
        tickets = []
        for request_id, n, chosen in zip(w.request_ids, w.num_tokens, placement):
            pages = chosen.pages_for(n)
            chosen.reserved_pages += pages
            chosen.reserved_slots += 1
            if chosen.reported_free_pages is not None:  # until the next report, count it as used
                chosen.reported_free_pages -= pages
            if chosen.reported_free_slots is not None:
                chosen.reported_free_slots -= 1
            ticket = Ticket(request_id, chosen.worker_id, pages)
            self._tickets[id(ticket)] = ticket
            tickets.append(ticket)
        w.future.set_result(tickets)

    def _drop(self, waiter: _Waiter) -> None:
        if not waiter.future.done():
            waiter.future.cancel()
            self._queued -= 1
        self._pump()

    def _fail_impossible(self) -> None:
        for w in self._queue:
            if not w.future.done() and not self._could_ever_fit(w.num_tokens, w.worker_id, w.role):
                w.future.set_exception(self._impossible(w.num_tokens, w.worker_id, w.role))
                self._queued -= 1

    def _retry_after(self) -> float:
        return 1.0 if self._queued < self.max_queue else 2.0
