"""Prefill/decode handoff, router side: one driver task per PD request, phase by phase.

    reserving   Reserve sent to the decode worker, waiting for its Reserved (pages, generation)
    prefilling  Prefill sent to the prefill worker: it computes and writes KV into those pages
    activating  PrefillDone arrived (every write completed); Activate sent, waiting for Committed
    decoding    the decode worker streams deltas; Release sent, the prefill side frees its pages

The decode worker is reserved before any prefill worker computes, so a prompt is never computed
for KV nobody can receive. Whatever ends a request early (the client, a deadline, a phase
timeout, a worker that dies or reports an error), the teardown is one ordered path: first the
prefill worker is told to abort and must confirm that no write is in flight (`PrefillReleased`);
only then is the decode worker told to free the pages the writes targeted. A prefill worker that
cannot confirm within `stop` seconds is declared dead (its writes can no longer be trusted), which
also stops it receiving work. A prefill worker that dies before it was sent the prompt has computed
and written nothing: the request takes a ticket on another prefill worker and keeps its decode
reservation (up to `prefill_attempts` workers); once `Prefill` went out, a death fails the request.
Every request ends exactly once: the driver puts at most one error delta into the request's stream
(`WorkerPool.fail_stream` pops it), and each prefill ticket is released exactly once (a dead
worker's when it is replaced, the last when the driver ends; the decode ticket stays with the
`Generation`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from router.admission import Admission, Ticket
from router.worker_pool import WorkerPool
from workers.protocol import (
    Abort,
    Activate,
    Committed,
    PDReply,
    Prefill,
    PrefillDone,
    PrefillReleased,
    Release,
    Reserve,
    Reserved,
)

log = logging.getLogger("rlt_serve.router")

PHASES = ("reserving", "prefilling", "activating", "decoding")


@dataclass
class PDTimeouts:
    """Bounds on each phase, seconds (the request's own deadline bounds them all too)."""

    reserve: float = 30.0
    prefill: float = 300.0  # compute and every KV write
    transfer: float = 30.0  # the decode side's bound on the writes' notifications after Activate
    activate: float = 35.0  # Committed after Activate (longer: the decode side reports first)
    stop: float = 10.0  # a prefill worker confirming that its writes stopped
    prefill_attempts: int = 3  # prefill workers tried when one dies before it was sent the prompt


class _Cancelled(Exception):
    pass


class _Failed(Exception):
    pass


@dataclass
class _Dead:
    worker_id: str
    reason: str


_CANCEL = object()


@dataclass(eq=False)
class PDRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]
    deadline: float  # unix time
    priority: int
    decode: Ticket
    prefill: Ticket
    phase: str = "reserving"
    generation: int = 0
    inbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    prefill_sent: bool = False
    prefill_done: bool = False  # its writes completed (or it failed and released everything)
    prefill_released: bool = False
    decode_sent: bool = False
    dead: set[str] = field(default_factory=set)
    started: float = field(default_factory=time.monotonic)
    task: asyncio.Task | None = None
    acquiring: asyncio.Future | None = None  # a replacement prefill ticket being acquired
    prefill_attempts: int = 1

    @property
    def decode_worker(self) -> str:
        return self.decode.worker_id

    @property
    def prefill_worker(self) -> str:
        return self.prefill.worker_id


class PDRouter:
    def __init__(self, pool: WorkerPool, admission: Admission, timeouts: PDTimeouts | None = None) -> None:
        self.pool, self.admission = pool, admission
        self.timeouts = timeouts or PDTimeouts()
        self.requests: dict[str, PDRequest] = {}
        self.failures: Counter[str] = Counter()  # phase -> requests that failed in it
        self.on_handoff: Callable[[float], None] | None = None  # seconds from admission to commit
        pool.on_dead.append(self._worker_dead)

    # -- the Generation's side ----------------------------------------------------------------
    def start(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: dict[str, Any],
        deadline: float,
        priority: int,
        decode: Ticket,
        prefill: Ticket,
        sink: asyncio.Queue,
    ) -> None:
        """Take over `prefill` (released when the driver ends) and run the handoff."""
        r = PDRequest(request_id, prompt_token_ids, sampling, deadline, priority, decode, prefill)
        self.requests[request_id] = r
        self.pool.open_stream(request_id, decode.worker_id, sink)
        self.pool.set_pd_handler(request_id, r.inbox.put_nowait)
        r.task = asyncio.create_task(self._drive(r), name=f"pd-{request_id}")

    def cancel(self, request_id: str) -> None:
        """The request is no longer wanted (synchronous, idempotent): tear down in order."""
        r = self.requests.get(request_id)
        if r is None:  # the handoff is over: only the decode worker holds it
            self.pool.abort(request_id)
        else:
            self.pool.forget(request_id)
            r.inbox.put_nowait(_CANCEL)
            if r.acquiring is not None:
                r.acquiring.cancel()

    def phase_counts(self) -> dict[str, int]:
        counts = dict.fromkeys(PHASES, 0)
        for r in self.requests.values():
            counts[r.phase] = counts.get(r.phase, 0) + 1
        return counts

    async def stop(self) -> None:
        tasks = [r.task for r in self.requests.values() if r.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _worker_dead(self, worker_id: str, reason: str) -> None:
        for r in self.requests.values():
            if worker_id in (r.decode_worker, r.prefill_worker):
                r.inbox.put_nowait(_Dead(worker_id, reason))

    # -- the driver ---------------------------------------------------------------------------
    async def _drive(self, r: PDRequest) -> None:
        rid, d, p, t = r.request_id, r.decode_worker, r.prefill_worker, self.timeouts
        try:
            try:
                self._send(r, d, Reserve(rid, r.prompt_token_ids, r.sampling, r.deadline, r.priority))
                r.decode_sent = True
                res = await self._expect(r, Reserved, d, t.reserve)
                if res.error is not None:  # refused (e.g. validation): the request's own error
                    raise _Failed(res.error)
                r.generation = res.generation
                r.phase = "prefilling"
                msg = Prefill(rid, r.prompt_token_ids, r.sampling, r.deadline, d, res.page_ids,
                              res.num_cached_tokens, res.generation, res.seed, res.state_slot, r.priority)  # fmt: skip
                while p in r.dead or not self.pool.send(p, msg):
                    r.dead.add(p)
                    p = await self._replace_prefill(r)
                r.prefill_sent = True
                done = await self._expect(r, PrefillDone, p, t.prefill)
                r.prefill_done = True
                if done.error is not None:
                    r.prefill_released = True  # a failed prefill has released everything
                    raise _Failed(f"worker {p} (prefill): {done.error}")
                r.phase = "activating"
                self._send(r, d, Activate(rid, r.generation, done.model_state, done.chunks, done.num_writes,
                                          deadline=time.time() + t.transfer))  # fmt: skip
                await self._expect(r, Committed, d, t.activate)
                r.phase = "decoding"
                if self.on_handoff is not None:
                    self.on_handoff(time.monotonic() - r.started)
                await self._release_prefill(r)
            except _Failed as e:
                self.failures[r.phase] += 1
                log.warning("PD request %s failed while %s: %s", rid, r.phase, e)
                self.pool.fail_stream(rid, str(e))
                await self._teardown(r)
            except _Cancelled:
                await self._teardown(r)
        except asyncio.CancelledError:  # the router is stopping: nothing more can be awaited
            if r.prefill_sent and not r.prefill_released:
                self.pool.send(p, Abort(rid))
            if r.decode_sent:
                self.pool.send(d, Abort(rid))
            raise
        finally:
            self.admission.release(r.prefill)
            self.pool.set_pd_handler(rid, None)
            self.requests.pop(rid, None)

    async def _replace_prefill(self, r: PDRequest) -> str:
        """The prefill worker died before it was sent the prompt: nothing was computed or
        written, so the prompt goes to another prefill worker (the decode reservation stays)."""
        dead = r.prefill_worker
        if r.prefill_attempts >= self.timeouts.prefill_attempts:
            raise _Failed(f"worker {dead} (prefill) is not available ({r.prefill_attempts} prefill workers tried)")
        self.admission.release(r.prefill)
        fut = asyncio.ensure_future(self.admission.acquire(r.request_id, len(r.prompt_token_ids), r.priority, None,
                                                           r.deadline - time.time(), "prefill"))  # fmt: skip
        r.acquiring = fut
        try:
            await asyncio.wait({fut})
        finally:
            r.acquiring = None
            if not fut.done():  # the router is stopping
                fut.cancel()
        if fut.cancelled():  # the client went away meanwhile
            raise _Cancelled()
        if fut.exception() is not None:
            raise _Failed(f"worker {dead} (prefill) failed and no other prefill worker took the prompt: "
                          f"{fut.exception()}")  # fmt: skip
        r.prefill = fut.result()
        r.prefill_attempts += 1
        r.prefill_released = False  # it was about the dead worker; the new one holds nothing yet either
        log.warning("PD request %s: prefill worker %s died before it was sent the prompt; retrying on %s",
                    r.request_id, dead, r.prefill_worker)  # fmt: skip
        return r.prefill_worker

    def _send(self, r: PDRequest, worker_id: str, msg: Any) -> None:
        if worker_id in r.dead or not self.pool.send(worker_id, msg):
            r.dead.add(worker_id)
            role = "decode" if worker_id == r.decode_worker else "prefill"
            raise _Failed(f"worker {worker_id} ({role}) is not available")

    async def _next(self, r: PDRequest, until: float) -> Any:
        left = until - time.monotonic()
        if left <= 0:
            raise asyncio.TimeoutError
        return await asyncio.wait_for(r.inbox.get(), left)

    async def _expect(self, r: PDRequest, kind: type, worker_id: str, timeout: float) -> Any:
        """The next `kind` reply from `worker_id`; raises on cancel, a death, or the deadline."""
        until = time.monotonic() + max(0.0, min(timeout, r.deadline - time.time()))
        while True:
            try:
                item = await self._next(r, until)
            except asyncio.TimeoutError:
                raise _Failed(f"worker {worker_id}: PD handoff timed out while {r.phase} (no {kind.__name__} "
                              f"within the phase deadline)") from None  # fmt: skip
            if item is _CANCEL:
                raise _Cancelled()
            if isinstance(item, _Dead):  # before decoding, either side's death ends the request...
                self._note_dead(r, item)
                if item.worker_id == r.prefill_worker and not r.prefill_sent:
                    continue  # ...except a prefill worker's before it got the prompt: another takes it
                role = "decode" if item.worker_id == r.decode_worker else "prefill"
                raise _Failed(f"worker {item.worker_id} ({role}) failed: {item.reason}")
            if isinstance(item, kind) and item.worker_id == worker_id:
                if isinstance(item, (Reserved, PrefillDone, Committed)) and kind is not Reserved:
                    if item.generation != r.generation:
                        log.warning("stale %s for %s (generation %d, expected %d)", kind.__name__,
                                    r.request_id, item.generation, r.generation)  # fmt: skip
                        continue
                return item
            self._note_reply(r, item)

    async def _release_prefill(self, r: PDRequest) -> None:
        """Decoding: the prefill side frees its pages. Nothing here can fail the request any more."""
        rid, p, d = r.request_id, r.prefill_worker, r.decode_worker
        cancelled = False
        if p not in r.dead and self.pool.send(p, Release(rid)):
            until = time.monotonic() + self.timeouts.stop
            while not r.prefill_released and p not in r.dead:
                try:
                    item = await self._next(r, until)
                except asyncio.TimeoutError:
                    log.error("prefill worker %s did not confirm releasing %s within %gs", p, rid, self.timeouts.stop)
                    break
                if item is _CANCEL:
                    cancelled = True
                elif isinstance(item, _Dead):
                    self._note_dead(r, item)
                else:
                    self._note_reply(r, item)
        if cancelled and d not in r.dead:
            self.pool.send(d, Abort(rid))

    def _note_dead(self, r: PDRequest, dead: _Dead) -> None:
        r.dead.add(dead.worker_id)
        if dead.worker_id == r.prefill_worker:
            r.prefill_released = True  # a dead process writes nothing more and holds nothing

    @staticmethod
    def _note_reply(r: PDRequest, item: PDReply) -> None:
        """A reply that is not the one awaited, but may still change what teardown must do."""
        if isinstance(item, PrefillReleased) and item.worker_id == r.prefill_worker:
            r.prefill_released = True
        elif isinstance(item, PrefillDone) and item.worker_id == r.prefill_worker:
            r.prefill_done = True
            if item.error is not None:
                r.prefill_released = True

    async def _teardown(self, r: PDRequest) -> None:
        """Writer before receiver: the prefill side confirms it stopped, then decode frees."""
        rid, p, d = r.request_id, r.prefill_worker, r.decode_worker
        self.pool.forget(rid)
        if r.prefill_sent and not r.prefill_released and p not in r.dead:
            self.pool.send(p, Abort(rid))
            until = time.monotonic() + self.timeouts.stop
            while not r.prefill_released and p not in r.dead:
                try:
                    item = await self._next(r, until)
                except asyncio.TimeoutError:
                    self.pool.mark_dead(
                        p, f"did not confirm within {self.timeouts.stop:g}s that it stopped writing KV of {rid}"
                    )
                    r.dead.add(p)
                    break
                if isinstance(item, _Dead):
                    self._note_dead(r, item)
                elif item is not _CANCEL:
                    self._note_reply(r, item)
        if r.decode_sent and d not in r.dead:
            self.pool.send(d, Abort(rid))
