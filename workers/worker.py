"""A worker process: one `LLMEngine`, driven by the router over ZMQ.

    python -m workers.worker --worker-id W --role both --model DIR --in-addr ADDR --out-addr ADDR

It binds a PULL socket on --in-addr (Submit, Abort, Shutdown from the router) and connects a
PUSH to --out-addr (Delta, Capacity, Health, Metrics to the router). With --join it is not the
launcher's child but joins a running router: --in-addr may be `tcp://HOST:0` (a free port), and
Ready names the address the router should connect to. Roles `prefill` and `decode` add a KV
transport agent and the PD messages (`workers.prefill`, `workers.decode`). Start-up progress also goes
to stdout as status lines (`workers.protocol.status_line`), because the launcher waits for every
worker before the router listens. The loop never blocks while the engine has work: it drains the
inbox without waiting, runs one engine step, sends one Delta per request that got a token, and
publishes capacity and metrics on their own clocks (heartbeats come from a thread, see
`workers.heartbeat`, so a long step is not mistaken for a dead worker). A request that errors fails
alone; an engine step that raises fails every request and ends the process non-zero, since the
engine's state can no longer be trusted.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from typing import Any

import zmq

from workers.faults import fault
from workers.protocol import (
    Abort,
    Activate,
    Capacity,
    Delta,
    Health,
    Loading,
    Metrics,
    PeerInfo,
    PeerTable,
    Prefill,
    Ready,
    Release,
    Reserve,
    Shutdown,
    Submit,
    ToRouter,
    decode_to_worker,
    encode,
    status_line,
)

IDLE_POLL_S = 0.02
PD_POLL_S = 0.001  # while a PD request is held: writes land (ZMQ) only when the receiver polls
CAPACITY_MIN_INTERVAL_S = 0.05
HEARTBEAT_S = 0.5
METRICS_S = 1.0
EXIT_ENGINE_FAILED = 3
_STEP_DELAY = fault("step_delay")  # tests only (workers/faults.py)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m workers.worker", description="rlt-serve worker process")
    p.add_argument("--worker-id", required=True)
    p.add_argument("--role", choices=["both", "prefill", "decode"], default="both")
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--in-addr", required=True, help="zmq address this worker binds (router -> worker)")
    p.add_argument("--out-addr", required=True, help="zmq address of the router's PULL (worker -> router)")
    p.add_argument("--join", action="store_true", help="join a running router (not started by `launch`)")
    p.add_argument("--advertise-host", default=None,
                   help="with --join: the host the router connects back to (default: this host's address "
                        "on the route to the router)")  # fmt: skip
    p.add_argument("--kv-transport", default="nixl", choices=["nixl", "zmq"], help="PD roles: the KV transport")
    p.add_argument("--kv-transfer-budget-bytes", type=int, default=256 << 20,
                   help="prefill: KV bytes in flight at once (at least one write always proceeds)")  # fmt: skip
    p.add_argument("--kv-transfer-timeout", type=float, default=30.0,
                   help="seconds one KV write may take before its request fails")  # fmt: skip
    p.add_argument("--kv-reservation-timeout", type=float, default=None,
                   help="decode: seconds a reservation may wait for its activation before it is freed (default "
                        "660: past the router's default request timeout and teardown)")  # fmt: skip
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--engine-args", default="{}", help="JSON object of EngineConfig fields")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds a graceful shutdown may take")
    return p.parse_args(argv)


def _say(msg: Loading | Ready) -> None:
    print(status_line(msg), flush=True)


class Worker:
    def __init__(
        self, worker_id: str, engine: Any, pull: zmq.Socket, push: zmq.Socket, out_addr: str, drain_timeout: float
    ) -> None:
        from workers.heartbeat import Heartbeat
        from workers.metrics import WorkerMetrics
        from workers.tracker import RequestTracker

        self.worker_id = worker_id
        self.engine = engine
        self.pull = pull
        self.push = push
        self.drain_timeout = drain_timeout
        self.metrics = WorkerMetrics()
        self.tracker = RequestTracker()
        self.heartbeat = Heartbeat(push.context, out_addr, worker_id, HEARTBEAT_S)
        self.max_num_seqs = engine.engine_config.max_num_seqs
        self.stopping = False
        self.stop_by: float | None = None  # monotonic; past it, remaining requests are aborted
        self.role: Any = None  # PrefillRole | DecodeRole for the PD roles
        self.agent: Any = None  # their KV transport agent
        self._poller = zmq.Poller()
        self._poller.register(pull, zmq.POLLIN)
        self._parent: int | None = os.getppid()  # None: joined, nobody's child
        self._last_capacity: tuple[int, ...] | None = None
        self._capacity_at = self._parent_checked_at = self._metrics_at = 0.0

    # -- messages in ---------------------------------------------------------------------
    def _drain_inbox(self, timeout_s: float) -> None:
        if not self._poller.poll(int(timeout_s * 1000)):
            return
        while True:
            try:
                data = self.pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = decode_to_worker(data)
            except Exception as e:  # a bad frame must not take the worker down
                print(f"worker {self.worker_id}: dropped an undecodable message: {e}", file=sys.stderr)
                continue
            try:
                self._handle(msg)
            except Exception:  # one bad message must not take the worker down either
                traceback.print_exc()

    def _handle(self, msg) -> None:
        role = self.role
        if isinstance(msg, Submit):
            if role is not None:
                self._fail(msg.request_id, "this worker serves prefill/decode handoffs, not whole requests")
            else:
                self._submit(msg)
        elif isinstance(msg, Abort):
            if role is None or not role.on_abort(msg.request_id):
                self._abort(msg.request_id, None)
        elif isinstance(msg, Shutdown):
            if msg.reason:
                print(f"worker {self.worker_id}: the router refused it: {msg.reason}", file=sys.stderr, flush=True)
            self.begin_shutdown(msg.drain)
        elif role is None:
            print(f"worker {self.worker_id}: ignored {type(msg).__name__} (role both)", file=sys.stderr)
        elif isinstance(msg, PeerTable):
            role.on_peers(msg)
        elif isinstance(msg, Reserve):
            role.on_reserve(msg, self.stopping)
        elif isinstance(msg, Activate):
            role.on_activate(msg)
        elif isinstance(msg, Prefill):
            if self.stopping:
                from workers.protocol import PrefillDone

                self.send(PrefillDone(msg.request_id, self.worker_id, msg.generation, error="worker is shutting down"))
            else:
                role.on_prefill(msg)
        elif isinstance(msg, Release):
            role.on_release(msg.request_id)

    def _submit(self, msg: Submit) -> None:
        from rlt_serve.sampling_params import SamplingParams

        if self.stopping:
            self._fail(msg.request_id, "worker is shutting down")
            return
        try:
            try:
                params = SamplingParams(**msg.sampling)
            except TypeError as e:  # unknown field names
                raise ValueError(f"sampling: {e}") from None
            self.engine.add_request(msg.request_id, msg.prompt_token_ids, params, priority=msg.priority)
        except Exception as e:
            self._fail(msg.request_id, str(e))
            return
        self.tracker.add(msg.request_id, msg.deadline, params.prompt_logprobs is not None)

    def _abort(self, request_id: str, error: str | None) -> None:
        """Abort in the engine; the final Delta comes out of the next step."""
        if request_id not in self.tracker:
            return
        if error is not None and not self.tracker.mark_aborted(request_id, error):
            return
        self.engine.abort_request(request_id)

    def begin_shutdown(self, drain: bool) -> None:
        if not self.stopping:
            self.stopping = True
            self.stop_by = time.monotonic() + self.drain_timeout
        if not drain:
            self.stop_by = time.monotonic()

    # -- messages out --------------------------------------------------------------------
    def send(self, msg: ToRouter) -> None:
        self.push.send(encode(msg))

    def _fail(self, request_id: str, error: str) -> None:
        self.metrics.count_error()
        self.send(Delta(request_id=request_id, token_ids=[], finish_reason="error", error=error))

    def _publish(self, force: bool = False) -> None:
        now = time.monotonic()
        st = self.engine.stats()
        self.metrics.update_stats(st)
        slots = max(0, self.max_num_seqs - st.num_running - st.num_waiting)
        cap = (st.num_free_pages, st.num_pages, slots, st.num_running, st.num_waiting)
        changed = cap != self._last_capacity and now - self._capacity_at >= CAPACITY_MIN_INTERVAL_S
        pd = self._pd_counts()
        cap = cap + pd
        changed = cap != self._last_capacity and now - self._capacity_at >= CAPACITY_MIN_INTERVAL_S
        if force or changed or now - self._capacity_at >= HEARTBEAT_S:
            self.send(Capacity(self.worker_id, cap[0], cap[1], slots, self.max_num_seqs, cap[3], cap[4], *pd))
            self._last_capacity, self._capacity_at = cap, now
        if now - self._parent_checked_at >= HEARTBEAT_S and self._parent is not None:
            self._parent_checked_at = now
            if os.getppid() != self._parent:  # the launcher is gone: nobody will read us
                print(f"worker {self.worker_id}: parent exited, shutting down", file=sys.stderr)
                self.push.setsockopt(zmq.LINGER, 0)
                self.begin_shutdown(drain=False)
        if force or now - self._metrics_at >= METRICS_S:
            self.send(Metrics(self.worker_id, self.metrics.render()))
            self._metrics_at = now

    def _pd_counts(self) -> tuple[int, int, int]:
        """(held requests, open handles, registered buffers) for Capacity."""
        if self.role is None:
            return (0, 0, 0)
        if self.agent is None:  # closed after an engine failure
            return (0, 0, 0)
        held, regs = self.role.counts(), self.agent.num_registered
        self.metrics.set_pd_counts(held, regs, self.engine.handoff.num_free_state_slots)
        return (held, self.agent.num_handles, regs)

    # -- the loop ------------------------------------------------------------------------
    def _idle_timeout(self) -> float:
        """How long the inbox may be waited on: not at all with work, briefly while KV may be
        arriving (the transport has no socket of ours to wake the poll), else the idle poll."""
        if self._busy():
            return 0.0
        return PD_POLL_S if self.role is not None and self.role.counts() else IDLE_POLL_S

    def _busy(self) -> bool:
        return self.engine.has_unfinished_requests() or (self.role is not None and self.role.busy)

    def _pd_work(self) -> None:
        """Transport work between steps: post and reap writes (prefill), notifications (decode)."""
        if self.role is None:
            return
        if hasattr(self.role, "pump"):
            self.role.pump()
        else:
            self.role.poll()

    def _step(self) -> None:
        before = self.engine.stats().num_core_calls
        t0 = time.perf_counter()
        outputs = self.engine.step()
        if self.role is not None and hasattr(self.role, "after_step"):
            self.role.after_step()
        elapsed = time.perf_counter() - t0
        st = self.engine.stats()
        if st.num_core_calls != before:
            self.metrics.observe_core_call(st, elapsed)
        now = time.monotonic()
        for out in outputs:
            made = self.tracker.delta(out)
            if made is None:
                continue
            delta, req = made
            if delta.token_ids and req.num_sent == len(delta.token_ids):  # this delta holds the first token
                self.metrics.prefill_seconds.observe(now - req.submitted)
            if delta.finish_reason is not None and req.first_token is not None:
                self.metrics.decode_seconds.observe(now - req.first_token)
            self.send(delta)
        if outputs and _STEP_DELAY:
            time.sleep(_STEP_DELAY)

    def _enforce_deadlines(self) -> None:
        for rid in self.tracker.expired(time.time()):
            self._abort(rid, "deadline exceeded")
        if self.stop_by is not None and time.monotonic() >= self.stop_by:
            if self.role is not None:
                self.role.begin_shutdown()
            for rid in self.tracker.ids():
                self._abort(rid, "worker is shutting down")

    def run(self) -> int:
        """Serve until shut down; the exit status for the process."""
        self.heartbeat.start()
        try:
            return self._loop()
        finally:
            self.heartbeat.stop()

    def _loop(self) -> int:
        self._publish(force=True)
        while True:
            self._drain_inbox(self._idle_timeout())
            self._enforce_deadlines()
            try:
                self._pd_work()
                needs_step = self.role is not None and getattr(self.role, "needs_step", False)
                if self.engine.has_unfinished_requests() or needs_step:
                    if needs_step:
                        self.role.needs_step = False
                    self._step()
                    self._pd_work()
            except Exception as e:
                self._engine_failed(e)
                return EXIT_ENGINE_FAILED
            self._publish()
            if self.stopping and not self._busy() and not (self.role is not None and self.role.counts()):
                for rid in self.tracker.ids():  # the engine lost them: still end each exactly once
                    self.tracker.pop(rid)
                    self._fail(rid, "worker is shutting down")
                self._publish(force=True)
                self.heartbeat.stop()
                self.send(Health(self.worker_id, ok=False, detail="shut down"))
                return 0

    def close_transport(self) -> None:
        """Stop every KV write of this process (idempotent)."""
        if self.agent is not None:
            agent, self.agent = self.agent, None
            agent.close()

    def _engine_failed(self, exc: Exception) -> None:
        traceback.print_exc()
        detail = f"engine step failed: {type(exc).__name__}: {exc}"
        self.close_transport()  # the writer stops before anyone is told (and frees what they target)
        self.heartbeat.stop()
        for rid in self.tracker.ids():  # each request's own error first, then the worker's
            self.tracker.pop(rid)
            self._fail(rid, detail)
        self.send(Health(self.worker_id, ok=False, detail=detail))


def _bind(sock: zmq.Socket, addr: str) -> str:
    """Bind `addr`; `tcp://HOST:0` takes a free port. The address actually bound."""
    if addr.startswith("tcp://") and addr.endswith(":0"):
        host = addr[len("tcp://") : -len(":0")]
        port = sock.bind_to_random_port(f"tcp://{host}")
        return f"tcp://{host}:{port}"
    sock.bind(addr)
    return addr


def _advertised(in_addr: str, router_addr: str, host: str | None) -> str:
    """The inbox address as the router must dial it: a wildcard host becomes a reachable one."""
    if not in_addr.startswith("tcp://"):
        return in_addr
    bound_host, port = in_addr[len("tcp://") :].rsplit(":", 1)
    if host is None and bound_host in ("*", "0.0.0.0", "::", "[::]"):
        host = _route_host(router_addr)
    return f"tcp://{host or bound_host}:{port}"


def _route_host(router_addr: str) -> str:
    """This host's address on the route to the router (what the router can dial back)."""
    import socket

    target = router_addr[len("tcp://") :].rsplit(":", 1)[0] if router_addr.startswith("tcp://") else "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((target, 9))  # no packet is sent: this only picks the outgoing interface
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def _make_agent(kind: str, worker_id: str, engine: Any, timeout_s: float, host: str | None) -> Any:
    """The KV transport agent with the engine's K, V and final-state buffers registered.

    `host`: where a joined worker's ZMQ transport listens (its advertised host), so peers on
    other hosts can reach it; NIXL carries its own addressing in its metadata."""
    from workers.transfer import make_agent

    buffers = [engine.runner.kv.k, engine.runner.kv.v, engine.handoff.state_buffer]
    return make_agent(kind, worker_id, buffers, timeout_s=timeout_s, **({"host": host} if host else {}))


def _layout(engine: Any) -> dict[str, int | str]:
    from workers.transfer.regions import KVLayout

    lay = KVLayout.of(engine.runner.kv.k, engine.handoff.state_buffer)
    return {f: getattr(lay, f) for f in lay.__struct_fields__}


def _attach_role(worker: Worker, args: argparse.Namespace, agent: Any) -> None:
    from workers.transfer.regions import KVLayout

    worker.agent = agent
    if args.role == "prefill":
        from workers.prefill import PrefillRole

        worker.role = PrefillRole(worker.worker_id, worker.engine, agent, worker.send, worker.metrics,
                                  args.kv_transfer_budget_bytes, args.kv_transfer_timeout,
                                  KVLayout(**_layout(worker.engine)))  # fmt: skip
    else:
        from workers.decode import RESERVATION_TIMEOUT_S, DecodeRole

        timeout = RESERVATION_TIMEOUT_S if args.kv_reservation_timeout is None else args.kv_reservation_timeout
        worker.role = DecodeRole(worker.worker_id, worker.engine, agent, worker.send, worker.metrics, worker.tracker,
                                 timeout)  # fmt: skip
        agent.accept = worker.role.accept


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    wid = args.worker_id
    _say(Loading(wid, "starting", 0.0))
    # While loading there is nothing to drain: a signal ends the process at once. Once the loop
    # runs, it asks for a graceful drain instead.
    signal.signal(signal.SIGINT, signal.SIG_DFL)

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    in_addr = _bind(pull, args.in_addr)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)  # never drop a delta; the router is the only reader
    push.setsockopt(zmq.LINGER, 2000)  # flush the last deltas on exit, but do not hang
    push.connect(args.out_addr)
    try:
        _say(Loading(wid, "loading", time.monotonic() - t0, args.model))
        from rlt_serve.engine.llm_engine import LLMEngine

        engine_args = json.loads(args.engine_args)
        if not isinstance(engine_args, dict):
            raise ValueError("--engine-args must be a JSON object")
        engine = LLMEngine(args.model, dtype=args.dtype, device=args.device, **engine_args)
        host = _advertised(in_addr, args.out_addr, args.advertise_host) if args.join else None
        host = host[len("tcp://") :].rsplit(":", 1)[0] if host and host.startswith("tcp://") else None
        agent = _make_agent(args.kv_transport, wid, engine, args.kv_transfer_timeout, host) if args.role != "both" else None
    except Exception as e:
        traceback.print_exc()
        _say(Loading(wid, "failed", time.monotonic() - t0, f"{type(e).__name__}: {e}"))
        push.send(encode(Health(wid, ok=False, detail=f"loading failed: {e}")))
        pull.close(linger=0)
        push.close()
        ctx.term()
        return 1
    print(f"worker {wid}: {engine.kv_capacity_report()}", file=sys.stderr, flush=True)
    ready = Ready(
        worker_id=wid,
        role=args.role,
        pid=os.getpid(),
        model=args.model,
        page_size=engine.engine_config.page_size,
        total_pages=engine.num_pages,
        max_num_seqs=engine.engine_config.max_num_seqs,
        max_model_len=engine.max_model_len,
        in_addr=_advertised(in_addr, args.out_addr, args.advertise_host) if args.join else "",
        kv_transport=args.kv_transport if args.role != "both" else "",
    )
    worker = Worker(wid, engine, pull, push, args.out_addr, args.drain_timeout)
    if args.join:
        worker._parent = None
    if agent is not None:
        _attach_role(worker, args, agent)
    worker.send(ready)
    if agent is not None:
        worker.send(PeerInfo(wid, args.role, args.kv_transport, agent.metadata(), _layout(engine)))
    _say(ready)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, f: worker.begin_shutdown(drain=True))
    try:
        code = worker.run()
    finally:
        worker.close_transport()
    pull.close(linger=0)
    push.close()
    ctx.term()
    return code


if __name__ == "__main__":
    sys.exit(main())
