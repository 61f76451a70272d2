"""The prefill role: compute prompts through every depth and push their KV to decode workers.

Each engine step may finish some pages of some prompts (`LLMEngine.pop_kv_chunks`); each chunk
becomes one transport write into the decode worker's reserved pages, posted at once so the
transfer overlaps the next chunks' compute, but only while the bytes in flight stay under the
budget (a long prompt must not pin every buffer of the link at once). The last chunk also writes
the final state into the decode side's state slot. When every write of a request completed, the
router hears `PrefillDone`; the pages stay held until the router says `Release` (the decode side
committed) or `Abort`.

Stopping a request (abort, a failed or timed-out write) never frees pages under a write: the
request stops posting, waits until each posted write completed, failed or was released, and only
then frees its pages and tells the router (`PrefillReleased`, or `PrefillDone` with `error`),
which in turn lets the decode worker free the pages the writes targeted.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from workers.faults import fault
from workers.protocol import PeerTable, Prefill, PrefillDone, PrefillReleased
from workers.transfer import KVLayout, TransferNotif, decode_notif, encode_notif, kv_regions, state_regions


@dataclass
class _Write:
    handle: Any
    nbytes: int
    posted: float  # monotonic


@dataclass
class _Job:
    msg: Prefill
    chunks: deque = field(default_factory=deque)  # KVChunks not yet posted
    writes: list[_Write] = field(default_factory=list)  # posted, not yet complete
    last_seen: bool = False
    model_state: dict = field(default_factory=dict)
    pages: list[tuple[int, int]] = field(default_factory=list)  # (first_page, num_pages) written
    num_writes: int = 0
    num_bytes: int = 0
    done_sent: bool = False  # PrefillDone went out: pages held for Release
    stopping: str | None = None  # "abort" | an error message: drain writes, then free
    started: float = field(default_factory=time.monotonic)


class PrefillRole:
    def __init__(self, worker_id: str, engine: Any, agent: Any, send, metrics, budget_bytes: int,
                 transfer_timeout: float, local_layout: KVLayout) -> None:  # fmt: skip
        self.worker_id = worker_id
        self.engine = engine
        self.agent = agent
        self.send = send  # ToRouter -> None
        self.metrics = metrics
        self.budget_bytes = budget_bytes
        self.transfer_timeout = transfer_timeout
        self.layout = local_layout
        self.peers: dict[str, KVLayout] = {}  # decode worker -> its KV layout
        self.jobs: dict[str, _Job] = {}
        self.in_flight_bytes = 0
        self.held: list[tuple[float, Prefill]] = []  # (start at, monotonic): fault injection only

    # -- messages ---------------------------------------------------------------------------
    def on_peers(self, table: PeerTable) -> None:
        live = {p.worker_id for p in table.peers if p.role == "decode"}
        for name in set(self.peers) - live:  # gone: its pending writes fail
            self.agent.remove_peer(name)
            del self.peers[name]
        for p in table.peers:
            if p.role == "decode" and p.worker_id not in self.peers:
                self.agent.add_peer(p.worker_id, p.metadata)
                self.peers[p.worker_id] = KVLayout(**p.layout)

    def on_prefill(self, msg: Prefill, held: bool = False) -> None:
        from rlt_serve.sampling_params import SamplingParams

        if not held and fault("hold_prefill") == len(msg.prompt_token_ids):  # a stalled writer (tests)
            self.held.append((time.monotonic() + (fault("hold_prefill_s") or 0.0), msg))
            return
        rid = msg.request_id
        try:
            if msg.decode_worker not in self.peers:
                raise ValueError(f"decode worker {msg.decode_worker} is not a known transport peer")
            try:
                params = SamplingParams(**msg.sampling)
            except TypeError as e:
                raise ValueError(f"sampling: {e}") from None
            self.engine.add_prefill_request(rid, msg.prompt_token_ids, params, skip_tokens=msg.num_cached_tokens,
                                            seed=msg.seed, priority=msg.priority)  # fmt: skip
        except Exception as e:
            self.send(PrefillDone(rid, self.worker_id, msg.generation, error=str(e)))
            return
        self.jobs[rid] = _Job(msg)

    def on_release(self, request_id: str) -> None:
        job = self.jobs.get(request_id)
        if job is None:
            self.send(PrefillReleased(request_id, self.worker_id))  # already gone: still acknowledge
            return
        job.stopping = job.stopping or "release"
        self._finish_if_quiet(job)

    def on_abort(self, request_id: str) -> bool:
        """Stop a prefill; one that is not held here is acknowledged at once (nothing to stop), so
        the router's teardown never waits for an answer that cannot come."""
        job = self.jobs.get(request_id)
        if job is None:
            self.send(PrefillReleased(request_id, self.worker_id))
            return True
        job.stopping = job.stopping or "abort"
        self._finish_if_quiet(job)
        return True

    def begin_shutdown(self) -> None:
        for job in list(self.jobs.values()):
            if job.stopping is None:
                job.stopping = "worker is shutting down"
            self._finish_if_quiet(job)

    # -- the loop ---------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return any(j.writes or j.chunks for j in self.jobs.values())

    def after_step(self) -> None:
        for chunk in self.engine.pop_kv_chunks():
            job = self.jobs.get(chunk.request_id)
            if job is not None and job.stopping is None:
                job.chunks.append(chunk)

    def pump(self) -> None:
        """Post what the budget allows, reap completed writes, finish requests."""
        now = time.monotonic()
        for item in [h for h in self.held if h[0] <= now]:
            self.held.remove(item)
            self.on_prefill(item[1], held=True)
        for _peer, data in self.agent.notifications():
            n = decode_notif(data)
            if n is None or n.kind != "refused":
                continue
            # Counted even when the job is gone: a write is posted and forgotten, so the refusal of
            # a job's last chunk can arrive after the job finished.
            self.metrics.count_transfer_failure("stale")
            job = self.jobs.get(n.request_id)
            if job is not None and n.generation == job.msg.generation:
                self._fail(job, f"worker {job.msg.decode_worker} refused the KV write (allocation generation "
                                f"{n.generation} is no longer live there)")  # fmt: skip
        for job in list(self.jobs.values()):
            self._reap(job, now)
        for job in list(self.jobs.values()):
            while job.chunks and job.stopping is None:
                chunk = job.chunks[0]
                if self.in_flight_bytes and self.in_flight_bytes + self._chunk_bytes(chunk) > self.budget_bytes:
                    break  # at least one write is always allowed, however large
                job.chunks.popleft()
                try:
                    self._post(job, chunk)
                except Exception as e:
                    self._fail(job, f"KV transfer to worker {job.msg.decode_worker} could not start: {e}")
            if job.stopping is None and job.last_seen and not job.chunks and not job.writes and not job.done_sent:
                job.done_sent = True
                self.metrics.observe_prefill_transfer(now - job.started)
                self.send(PrefillDone(job.msg.request_id, self.worker_id, job.msg.generation, job.model_state,
                                      job.pages, job.num_writes, job.num_bytes))  # fmt: skip
            self._finish_if_quiet(job)
        self.metrics.set_in_flight(self.in_flight_bytes, sum(len(j.writes) for j in self.jobs.values()))

    def _chunk_bytes(self, chunk) -> int:
        return 2 * self.layout.num_planes * self.layout.page_bytes * len(chunk.page_ids)

    def _post(self, job: _Job, chunk) -> None:
        msg = job.msg
        remote = self.peers[msg.decode_worker]
        if chunk.ready is not None:
            chunk.ready.synchronize()  # the pages' contents are final on the device
        if chunk.page_ids:
            dst_pages = msg.page_ids[chunk.first_page : chunk.first_page + len(chunk.page_ids)]
            src, dst = kv_regions(self.layout, remote, chunk.page_ids, dst_pages)
            self._write(job, src, dst, last=False)
            job.pages.append((chunk.first_page, len(chunk.page_ids)))
        if chunk.last:
            src, dst = state_regions(self.layout, remote, chunk.state_slot, msg.state_slot)
            self._write(job, src, dst, last=True)
            job.model_state = dict(chunk.model_state or {})
            job.last_seen = True

    def _write(self, job: _Job, src, dst, last: bool) -> None:
        """One write; its notification names the reservation and the write's index."""
        nbytes = sum(r.nbytes for r in src)
        if last and fault("skip_state_write") == len(job.msg.prompt_token_ids):  # a lost write (tests)
            job.num_writes += 1
            return
        notif = TransferNotif("chunk", job.msg.request_id, job.msg.generation, job.num_writes, last)
        handle = self.agent.write(job.msg.decode_worker, src, dst, encode_notif(notif), self.transfer_timeout)
        job.writes.append(_Write(handle, nbytes, time.monotonic()))
        job.num_writes += 1
        job.num_bytes += nbytes
        self.in_flight_bytes += nbytes

    def _reap(self, job: _Job, now: float) -> None:
        keep: list[_Write] = []
        for w in job.writes:
            state = self.agent.status(w.handle)  # a write past its timeout reads "failed"
            if state == "pending":
                keep.append(w)
                continue
            self._drop(w)
            if state == "done":
                self.metrics.observe_write(w.nbytes, now - w.posted)
            elif now - w.posted >= self.transfer_timeout:
                self.metrics.count_transfer_failure("timeout")
                self._fail(job, f"KV transfer to worker {job.msg.decode_worker} timed out after "
                                f"{self.transfer_timeout:g}s")  # fmt: skip
            else:
                self.metrics.count_transfer_failure("error")
                self._fail(job, f"KV transfer to worker {job.msg.decode_worker} failed")
        job.writes = keep

    def _drop(self, w: _Write) -> None:
        self.in_flight_bytes -= w.nbytes
        self.agent.release(w.handle)

    def _fail(self, job: _Job, error: str) -> None:
        if job.stopping is None or job.stopping == "release":
            job.stopping = error
        job.chunks.clear()

    def _finish_if_quiet(self, job: _Job) -> None:
        """Once no write is in flight, a stopping request frees its pages and says so."""
        if job.stopping is None or job.writes:
            return
        rid = job.msg.request_id
        del self.jobs[rid]
        if job.stopping == "release" and job.done_sent:
            self.engine.release_prefill(rid)
        else:
            self.engine.abort_request(rid)
        if job.stopping in ("release", "abort") or job.done_sent:
            self.send(PrefillReleased(rid, self.worker_id))
        else:
            self.send(PrefillDone(rid, self.worker_id, job.msg.generation, error=job.stopping))

    def counts(self) -> int:
        return len(self.jobs) + len(self.held)

