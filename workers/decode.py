"""The decode role: reserve pages for prompts computed elsewhere, then decode as a `both` worker.

`Reserve` allocates the receiving pages and a final-state slot (reusing prefix-cache hits) and
answers with their ids, the seed and the allocation generation. Writes land over the transport,
each followed by a notification naming (request, generation, pages); a notification for a
generation that is no longer live is refused (counted, never committed), so a late or duplicated
write can never make a reused allocation look complete. `Activate` arrives once the writer saw
every write complete; the request is activated when all its notifications are in (or fails at
the activation deadline), `Committed` goes to the router, and from the next step on its tokens
stream out as Deltas exactly as from a `both` worker (the first one sampled here, with the
request's own generator).

A reservation is aborted by the router (`Abort`), which first makes the prefill worker stop
writing into it: one-sided writes cannot be refused once posted, so the pages must not be reused
before the writer stopped. Only if the router never does (it lost track, or the writer stalls
past every bound the router has) does the reservation's own deadline free it: a reservation not
activated within `reservation_timeout` seconds is failed once, its generation retired, so a late
write's notification (and, over ZMQ, the write itself) is refused as stale. The default lies past
the router's own bounds (request timeout plus teardown), so in normal operation the router always
acts first and the expiry only catches what would otherwise leak.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from workers.faults import fault
from workers.protocol import Activate, Committed, Delta, PeerTable, Reserve, Reserved
from workers.transfer import TransferNotif, decode_notif


@dataclass
class _Receiving:
    generation: int
    deadline: float
    writes: set[int] = field(default_factory=set)  # indices of the writes whose data landed
    activate: Activate | None = None
    not_before: float = 0.0  # monotonic; fault injection only
    started: float = field(default_factory=time.monotonic)
    expires: float = float("inf")  # monotonic: the reservation's own deadline until Activate


RESERVATION_TIMEOUT_S = 660.0  # the router's default request timeout (600 s) plus its teardown bounds


class DecodeRole:
    def __init__(self, worker_id: str, engine: Any, agent: Any, send, metrics, tracker,
                 reservation_timeout: float = RESERVATION_TIMEOUT_S) -> None:  # fmt: skip
        self.worker_id = worker_id
        self.engine = engine
        self.agent = agent
        self.send = send
        self.metrics = metrics
        self.tracker = tracker
        self.reservation_timeout = reservation_timeout
        self.peers: set[str] = set()
        self.receiving: dict[str, _Receiving] = {}
        self.needs_step = False  # an aborted reservation's final output comes from the next step

    def on_peers(self, table: PeerTable) -> None:
        live = {p.worker_id for p in table.peers if p.role == "prefill"}
        for name in self.peers - live:  # gone: after this no write from it can land here
            self.agent.remove_peer(name)
        self.peers &= live
        for p in table.peers:
            if p.role == "prefill" and p.worker_id not in self.peers:
                self.agent.add_peer(p.worker_id, p.metadata)
                self.peers.add(p.worker_id)

    def accept(self, peer: str, n: TransferNotif) -> bool:
        """The transport's check before a write lands (ZMQ) or commits (NIXL): a live generation."""
        return n.kind != "chunk" or self.engine.check_generation(n.request_id, n.generation)

    def on_reserve(self, msg: Reserve, stopping: bool) -> None:
        from rlt_serve.sampling_params import SamplingParams

        rid = msg.request_id
        try:
            if stopping:
                raise RuntimeError("worker is shutting down")
            try:
                params = SamplingParams(**msg.sampling)
            except TypeError as e:
                raise ValueError(f"sampling: {e}") from None
            res = self.engine.reserve_remote_prefill(rid, msg.prompt_token_ids, params, priority=msg.priority)
        except Exception as e:
            self.metrics.count_error()
            self.send(Reserved(rid, self.worker_id, error=str(e)))
            return
        # The router enforces the deadline until activation (it must stop the writer first).
        self.tracker.add(rid, 0.0, False)
        self.receiving[rid] = _Receiving(res.generation, msg.deadline,
                                         expires=time.monotonic() + self.reservation_timeout)  # fmt: skip
        self.send(Reserved(rid, self.worker_id, res.generation, res.page_ids, res.num_cached_tokens, res.seed,
                           res.state_slot))  # fmt: skip

    def on_activate(self, msg: Activate) -> None:
        rec = self.receiving.get(msg.request_id)
        if rec is None or rec.generation != msg.generation:
            self.metrics.count_transfer_failure("stale")
            return  # aborted meanwhile, or a duplicate: the router's teardown already runs
        rec.activate = msg
        hold = fault("hold_activate")  # tests: keep it received-not-activated for a while
        rec.not_before = time.monotonic() + hold if hold is not None else 0.0

    def on_abort(self, request_id: str) -> bool:
        if request_id not in self.receiving:
            return False
        del self.receiving[request_id]
        self.engine.abort_request(request_id)
        self.needs_step = True
        return True

    def begin_shutdown(self) -> None:
        """Past the drain bound: the process is going away, its reservations with it."""
        for rid in list(self.receiving):
            self._fail(rid, "worker is shutting down")

    @property
    def busy(self) -> bool:
        return any(r.activate is not None for r in self.receiving.values())

    def poll(self) -> None:
        before = self.agent.num_refused
        for _peer, data in self.agent.notifications():
            n = decode_notif(data)
            if n is None:
                self.metrics.count_transfer_failure("bad_notification")
                continue
            if n.kind != "chunk":
                continue
            rec = self.receiving.get(n.request_id)
            if rec is None or rec.generation != n.generation:
                self.metrics.count_transfer_failure("stale")
                continue
            if n.chunk not in rec.writes:  # a duplicate notification counts once
                rec.writes.add(n.chunk)
                self.metrics.count_received(0)
        for _ in range(self.agent.num_refused - before):
            self.metrics.count_transfer_failure("stale")
        now, mono = time.time(), time.monotonic()
        for rid, rec in list(self.receiving.items()):
            act = rec.activate
            if act is None and mono > rec.expires:
                self.metrics.count_transfer_failure("reservation_timeout")
                self._fail(rid, f"KV reservation timed out: not activated within {self.reservation_timeout:g}s "
                                "(kv_reservation_timeout)")  # fmt: skip
                continue
            if act is None or time.monotonic() < rec.not_before:
                continue
            if len(rec.writes) >= act.num_writes:
                self._activate(rid, rec, act)
            elif act.deadline and now > act.deadline:
                # The writer reported every write complete, so nothing is in flight: safe to free.
                self.metrics.count_transfer_failure("timeout")
                self._fail(rid, f"KV transfer timed out: {len(rec.writes)} of {act.num_writes} writes arrived "
                                "before the activation deadline")  # fmt: skip

    def _activate(self, rid: str, rec: _Receiving, act: Activate) -> None:
        del self.receiving[rid]
        try:
            for first, n in act.chunks:
                if not self.engine.commit_kv_chunk(rid, act.generation, first, n):
                    raise ValueError(f"generation {act.generation} is no longer live")
            self.engine.activate_remote_prefill(rid, act.generation, None, act.model_state)
        except Exception as e:
            self.receiving[rid] = rec
            self._fail(rid, f"activation failed: {e}")
            return
        self.metrics.observe_receive(time.monotonic() - rec.started)
        self.send(Committed(rid, self.worker_id, act.generation))
        self.tracker.set_deadline(rid, rec.deadline)  # from here on, the worker enforces it itself

    def _fail(self, rid: str, error: str) -> None:
        self.receiving.pop(rid, None)
        self.tracker.pop(rid)
        self.engine.abort_request(rid)
        self.needs_step = True
        self.metrics.count_error()
        self.send(Delta(rid, [], finish_reason="error", error=f"worker {self.worker_id}: {error}"))

    def counts(self) -> int:
        return len(self.receiving)
