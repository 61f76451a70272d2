"""The router's side of the ZMQ control plane: worker state and per-request delta streams.

One PULL socket (bound at `router_addr`) receives every worker's messages; one PUSH per worker
(connected to its `in_addr`) carries Submit and Abort. Sends are synchronous and non-blocking
(unbounded high-water mark), so an abort can be sent from a `finally` block of a cancelled
task, where awaiting is not possible.

A worker is dead once the launcher says so (`mark_dead`), it reports itself unhealthy, or no
message arrived for `heartbeat_timeout` seconds (longer before its warm-up succeeded); death is
final. Its in-flight requests then get a synthetic error delta at once, so no request waits for a
worker that will never answer.

Workers need not be known in advance: a `Ready` from an unknown worker that names its own inbox
(`rlt-serve worker --router tcp://...`) registers it, provided its role fits the router's mode
(`both` workers without PD; `prefill`/`decode` with it). PD workers become eligible for admission
only once their transport identity (`PeerInfo`) arrived and the peer table naming it went out to
every worker: a Prefill naming a decode worker always reaches a prefill worker after the table.
PD replies are handed to the per-request handler that `router.pd` registers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from router.admission import Admission
from workers.protocol import (
    Abort,
    Capacity,
    Delta,
    Health,
    Metrics,
    PDReply,
    PeerInfo,
    PeerTable,
    Ready,
    Role,
    Shutdown,
    Submit,
    ToWorker,
    decode_to_router,
    encode,
)

log = logging.getLogger("rlt_serve.router")


@dataclass
class WorkerSpec:
    worker_id: str
    role: Role
    in_addr: str
    pid: int | None = None


@dataclass
class WorkerState:
    spec: WorkerSpec
    started: float = field(default_factory=time.monotonic)
    ready: Ready | None = None
    alive: bool = True
    dead_reason: str | None = None
    last_seen: float | None = None
    capacity: Capacity | None = None
    metrics_text: str = ""
    warm: bool = False  # a real generation succeeded here
    peer: PeerInfo | None = None  # PD roles: transport identity
    joined: bool = False  # registered itself (remote join) rather than launched

    @property
    def serving(self) -> bool:
        return self.alive and self.ready is not None

    def describe(self) -> dict:
        status = "dead" if not self.alive else "ready" if self.warm else "warming" if self.ready else "starting"
        out: dict = {"status": status, "role": self.spec.role, "pid": self.ready.pid if self.ready else self.spec.pid}
        if self.joined:
            out["joined"] = True
        if self.dead_reason:
            out["reason"] = self.dead_reason
        if self.capacity is not None:
            c = self.capacity
            out.update(free_pages=c.free_pages, total_pages=c.total_pages, running=c.running, waiting=c.waiting,
                       free_slots=c.free_slots, total_slots=c.total_slots, reservations=c.reservations,
                       transfers=c.transfers, registrations=c.registrations)  # fmt: skip
        return out


class WorkerPool:
    def __init__(
        self,
        router_addr: str,
        workers: list[WorkerSpec],
        admission: Admission,
        heartbeat_timeout: float = 3.0,
        startup_timeout: float = 600.0,
        warmup_grace: float = 120.0,
        pd: bool = False,
        extra_addrs: tuple[str, ...] = (),
    ) -> None:
        self.router_addr = router_addr
        self.extra_addrs = extra_addrs  # more endpoints to bind (a TCP port for joining workers)
        self.pd = pd
        self.admission = admission
        self.heartbeat_timeout = heartbeat_timeout
        self.startup_timeout = startup_timeout
        # A worker's first steps may compile kernels for seconds without a heartbeat (its loop is
        # single-threaded); until its warm-up succeeded it gets this much silence instead.
        self.warmup_grace = warmup_grace
        self.workers: dict[str, WorkerState] = {w.worker_id: WorkerState(w) for w in workers}
        self.on_ready: Callable[[str], None] | None = None  # called once per worker, when admissible
        self.on_dead: list[Callable[[str, str], None]] = []  # (worker_id, reason), once per death
        self._pd_handlers: dict[str, Callable[[PDReply], None]] = {}  # request_id -> PD driver
        self._streams: dict[str, tuple[str, asyncio.Queue]] = {}  # request_id -> (worker_id, sink)
        self._actx: zmq.asyncio.Context | None = None
        self._ctx: zmq.Context | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._push: dict[str, zmq.Socket] = {}
        self._tasks: list[asyncio.Task] = []

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        self._actx = zmq.asyncio.Context()
        self._ctx = zmq.Context()
        self._pull = self._actx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.bind(self.router_addr)
        for addr in self.extra_addrs:
            self._pull.bind(addr)
        for wid, st in self.workers.items():
            self._connect(wid, st.spec.in_addr)
            st.started = time.monotonic()
        self._tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._watch())]

    def _connect(self, worker_id: str, in_addr: str) -> None:
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(in_addr)
        self._push[worker_id] = sock

    def bound_addrs(self) -> list[str]:
        """The endpoints actually bound (a `tcp://host:0` request shows its real port here)."""
        assert self._pull is not None
        return [self._pull.getsockopt_string(zmq.LAST_ENDPOINT)] if self.extra_addrs else []

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        for wid in list(self._streams):
            self._fail_stream(wid, "the router is shutting down")
        for sock in self._push.values():
            sock.close(linger=0)
        if self._pull is not None:
            self._pull.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
        if self._actx is not None:
            self._actx.term()

    # -- requests ---------------------------------------------------------------------------
    def submit(self, worker_id: str, msg: Submit, sink: asyncio.Queue) -> None:
        """Send a request; its deltas (and a synthetic error one if the worker dies) go to `sink`."""
        st = self.workers.get(worker_id)
        if st is None or not st.alive:
            sink.put_nowait(self._error_delta(msg.request_id, f"worker {worker_id} is not available"))
            return
        self._streams[msg.request_id] = (worker_id, sink)
        self._push[worker_id].send(encode(msg), zmq.NOBLOCK)

    def abort(self, request_id: str) -> None:
        """Stop a request the caller no longer wants; no more deltas are delivered for it."""
        entry = self._streams.pop(request_id, None)
        if entry is None:
            return
        wid = entry[0]
        if self.workers[wid].alive:
            self._push[wid].send(encode(Abort(request_id)), zmq.NOBLOCK)

    def forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    # -- PD ---------------------------------------------------------------------------------
    def send(self, worker_id: str, msg: ToWorker) -> bool:
        """Send to a live worker; False (nothing sent) if it is dead or unknown."""
        st = self.workers.get(worker_id)
        if st is None or not st.alive or worker_id not in self._push:
            return False
        self._push[worker_id].send(encode(msg), zmq.NOBLOCK)
        return True

    def open_stream(self, request_id: str, worker_id: str, sink: asyncio.Queue) -> None:
        """Route `worker_id`'s deltas for `request_id` to `sink` (PD: the decode worker)."""
        self._streams[request_id] = (worker_id, sink)

    def fail_stream(self, request_id: str, error: str) -> bool:
        """End a stream with an error delta; False if it had ended already."""
        return self._fail_stream(request_id, error)

    def set_pd_handler(self, request_id: str, handler: Callable[[PDReply], None] | None) -> None:
        if handler is None:
            self._pd_handlers.pop(request_id, None)
        else:
            self._pd_handlers[request_id] = handler

    @property
    def num_pd_handlers(self) -> int:
        return len(self._pd_handlers)

    def peer_table(self) -> PeerTable:
        return PeerTable([st.peer for st in self.workers.values() if st.alive and st.peer is not None])

    def _broadcast_peers(self) -> None:
        table = encode(self.peer_table())
        for wid, st in self.workers.items():
            if st.alive and st.ready is not None and wid in self._push:
                self._push[wid].send(table, zmq.NOBLOCK)

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    # -- worker state -----------------------------------------------------------------------
    def serving_workers(self) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.serving]

    def mark_dead(self, worker_id: str, reason: str) -> None:
        st = self.workers.get(worker_id)
        if st is None or not st.alive:
            return
        st.alive = False
        st.dead_reason = reason
        st.metrics_text = ""  # its gauges would go on claiming running requests
        log.error("worker %s is dead: %s", worker_id, reason)
        self.admission.remove_worker(worker_id)
        for rid, (wid, _) in list(self._streams.items()):
            if wid == worker_id:
                self._fail_stream(rid, f"worker {worker_id} failed: {reason}")
        for hook in self.on_dead:
            hook(worker_id, reason)
        if st.peer is not None:
            self._broadcast_peers()

    def _fail_stream(self, request_id: str, error: str) -> bool:
        entry = self._streams.pop(request_id, None)
        if entry is None:
            return False
        entry[1].put_nowait(self._error_delta(request_id, error))
        return True

    @staticmethod
    def _error_delta(request_id: str, error: str) -> Delta:
        return Delta(request_id=request_id, token_ids=[], finish_reason="error", error=error)

    # -- the receive loop -------------------------------------------------------------------
    async def _receive(self) -> None:
        assert self._pull is not None
        while True:
            data = await self._pull.recv()
            try:
                msg = decode_to_router(data)
            except msgspec.DecodeError as e:
                log.warning("dropped an undecodable worker message: %s", e)
                continue
            try:
                self._handle(msg)
            except Exception:  # one bad message must not stop every stream
                log.exception("error handling %s", type(msg).__name__)

    def _handle(self, msg) -> None:
        if isinstance(msg, Delta):
            entry = self._streams.get(msg.request_id)
            if entry is None:
                return  # aborted or failed already
            st = self.workers.get(entry[0])
            if st is not None:
                st.last_seen = time.monotonic()
            if msg.finish_reason is not None:
                del self._streams[msg.request_id]
            entry[1].put_nowait(msg)
            return
        if isinstance(msg, Ready) and msg.in_addr:
            old = self.workers.get(msg.worker_id)
            if old is None or (not old.alive and old.ready is not None and old.ready.pid != msg.pid):
                self._join(msg)  # new, or a restarted incarnation of a dead one
        st = self.workers.get(msg.worker_id)
        if st is None or not st.alive:
            return
        if isinstance(msg, PDReply.__args__):  # type: ignore[attr-defined]
            st.last_seen = time.monotonic()
            handler = self._pd_handlers.get(msg.request_id)
            if handler is not None:
                handler(msg)
            return
        st.last_seen = time.monotonic()
        if isinstance(msg, Capacity):
            st.capacity = msg
            self.admission.update_capacity(
                msg.worker_id, msg.free_pages, msg.total_pages, msg.free_slots, msg.total_slots
            )
        elif isinstance(msg, Health):
            if not msg.ok:
                self.mark_dead(msg.worker_id, msg.detail or "reported unhealthy")
        elif isinstance(msg, Metrics):
            st.metrics_text = msg.text
        elif isinstance(msg, Ready) and st.ready is None:
            st.ready = msg
            if msg.role == "both":
                self._admit_worker(st)
            elif st.peer is not None:  # PeerInfo overtook Ready (two sockets? not today, but cheap)
                self._admit_worker(st)
        elif isinstance(msg, PeerInfo) and st.peer is None:
            why = self._incompatible(msg)
            if why is not None:
                self.mark_dead(msg.worker_id, f"refused: {why}")
                self.send_shutdown(msg.worker_id, why)
                return
            st.peer = msg
            if st.ready is not None:
                self._admit_worker(st)

    def _incompatible(self, peer: PeerInfo) -> str | None:
        """Why a PD worker cannot exchange KV with the live ones (model, dtype, page size, transport)."""
        shape = {k: v for k, v in peer.layout.items() if k != "num_pages"}
        for other in self.workers.values():
            o = other.peer
            if o is None or not other.alive or o.worker_id == peer.worker_id:
                continue
            if o.transport != peer.transport:
                return f"its KV transport is {peer.transport!r}, worker {o.worker_id}'s is {o.transport!r}"
            theirs = {k: v for k, v in o.layout.items() if k != "num_pages"}
            if theirs != shape:
                return (f"its KV layout {shape} differs from worker {o.worker_id}'s {theirs} "
                        "(same model, dtype, kv_cache_dtype and page size needed)")  # fmt: skip
        return None

    def send_shutdown(self, worker_id: str, reason: str) -> None:
        sock = self._push.get(worker_id)
        if sock is not None:
            sock.send(encode(Shutdown(drain=False, reason=reason)), zmq.NOBLOCK)

    def _admit_worker(self, st: WorkerState) -> None:
        """Make a worker eligible for requests (PD: after every peer knows its identity)."""
        msg = st.ready
        assert msg is not None
        if st.peer is not None:
            self._broadcast_peers()
        self.admission.add_worker(msg.worker_id, msg.page_size, msg.total_pages, msg.max_num_seqs, msg.role)
        if st.capacity is not None:
            c = st.capacity
            self.admission.update_capacity(c.worker_id, c.free_pages, c.total_pages, c.free_slots, c.total_slots)
        if self.on_ready is not None:
            self.on_ready(msg.worker_id)

    def _join(self, msg: Ready) -> None:
        """A worker the launcher did not start registers itself (remote join)."""
        if not msg.in_addr:
            log.warning("worker %s sent Ready without an address; ignored", msg.worker_id)
            return
        fits = msg.role != "both" if self.pd else msg.role == "both"
        spec = WorkerSpec(msg.worker_id, msg.role, msg.in_addr, msg.pid)
        if not fits:
            mode = "prefill/decode workers" if self.pd else "workers in role 'both'"
            reason = f"this router serves {mode}; a worker in role {msg.role!r} cannot join"
            log.error("refused worker %s: %s", msg.worker_id, reason)
            assert self._ctx is not None
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)  # let the refusal reach it
            sock.connect(msg.in_addr)
            sock.send(encode(Shutdown(drain=False, reason=reason)))
            sock.close()
            return
        log.info("worker %s (%s, pid %d) joined from %s", msg.worker_id, msg.role, msg.pid, msg.in_addr)
        st = self.workers[msg.worker_id] = WorkerState(spec, joined=True)
        old = self._push.pop(msg.worker_id, None)
        if old is not None:
            old.close(linger=0)
        self._connect(msg.worker_id, msg.in_addr)
        st.last_seen = time.monotonic()

    async def _watch(self) -> None:
        """Declare silent workers dead: missed heartbeats, or never heard from at all."""
        tick = time.monotonic()
        while True:
            await asyncio.sleep(0.25)
            now = time.monotonic()
            lagged, tick = now - tick > 1.0, now
            if lagged:  # this loop was starved: let the receiver catch up before judging anyone
                continue
            for wid, st in self.workers.items():
                if not st.alive:
                    continue
                if st.last_seen is None:
                    if now - st.started > self.startup_timeout:
                        self.mark_dead(wid, f"not heard from within {self.startup_timeout:g}s of start")
                elif now - st.last_seen > (self.heartbeat_timeout if st.warm else self.warmup_grace):
                    self.mark_dead(wid, f"no heartbeat for {now - st.last_seen:.1f}s")
