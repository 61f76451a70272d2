"""PD lifecycle and failures over real processes: cancellation in every phase, timeouts, crashes.

A 2 prefill + 2 decode server (ZMQ transport) takes a client that goes away in each phase of a
handoff: queued for credits, reserving (decode worker frozen with SIGSTOP), prefilling (prefill
workers frozen), transferring (decode frozen while the prefill worker's writes are in flight),
decoding. A second, 2 + 1 server runs with injected faults (`workers.faults`): activations held
back (received, not activated); for one prompt length the final-state write never posted (the
decode side must time out instead of waiting forever); for another the prefill worker stalls past
the decode side's reservation timeout (the reservation is freed once, the late writes refused as
stale); and a prefill worker killed before it was sent its prompt (another one takes it). Last, a prefill worker is killed with writes in flight and a
decode worker mid-stream: only their requests fail, with an error naming the worker, the others
complete and new requests are served. After every scenario each surviving process is back to its
initial counts (pages, slots, state slots, reservations, transfer handles, registrations, credits,
tickets). Frozen workers keep their heartbeats' silence under `--heartbeat-timeout`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlparse

import httpx
import pytest
from pd_support import ENGINE, Server, launch, make_checkpoint, vocab_of

PD = ("--kv-transport", "zmq", "--heartbeat-timeout", "30", "--kv-transfer-timeout", "3", "--request-timeout", "60")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_checkpoint(tmp_path_factory.mktemp("pd-faults"), "ouro")


@pytest.fixture(scope="module")
def server(model: str) -> Iterator[Server]:
    with launch(model, "--prefill", "2", "--decode", "2", *PD, *ENGINE) as s:
        yield s


def _prompt(model: str, n: int, salt: int) -> list[int]:
    vocab = vocab_of(model)
    return [3 + (salt * 7919 + i * 31) % (vocab - 3) for i in range(n)]


class RawRequest:
    """A completion request on a bare socket, so the test decides when the client goes away."""

    def __init__(self, server: Server, body: dict) -> None:
        url = urlparse(server.base_url)
        data = json.dumps(body).encode()
        self.sock = socket.create_connection((url.hostname, url.port))
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\n\r\n").encode()  # fmt: skip
        self.sock.sendall(head + data)

    def close(self) -> None:
        self.sock.close()


@contextmanager
def frozen(server: Server, *workers: str) -> Iterator[None]:
    """SIGSTOP the workers for the block (they resume however it ends)."""
    pids = [server.pid(w) for w in workers]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def _phase(server: Server, phase: str) -> float:
    return server.metrics().get(f'rlt:pd_requests{{phase="{phase}"}}', 0.0)


def _body(model: str, n: int, salt: int, max_tokens: int = 4, **extra) -> dict:
    return {"model": "m", "prompt": _prompt(model, n, salt), "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, **extra}  # fmt: skip


# -- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"prompt": [10**6]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"temperature": -1.0}, "temperature"),
        ({"exit_threshold": 0.5}, "exit_threshold"),  # refused by the decode worker's reservation
        ({"num_loops": 64}, "num_loops"),  # likewise (more loops than the engine's depth slots)
        ({"max_tokens": 100000}, None),
    ],
)
def test_bad_input_is_an_openai_4xx(server: Server, model: str, extra: dict, param: str | None) -> None:
    r = server.http.post("/v1/completions", json={**_body(model, 5, 0), **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert param in err["message"]
    server.assert_idle()


# -- cancellation in every phase --------------------------------------------------------------------


def test_abort_while_queued(server: Server, model: str) -> None:
    # Each blocker takes most of one decode worker's pages; the third request cannot be placed.
    blockers = [RawRequest(server, {**_body(model, 12, i, max_tokens=490), "stream": True}) for i in range(2)]
    server.wait_for(lambda: server.metrics()["rlt:router_streams"] == 2, 30, "blockers admitted")
    queued = RawRequest(server, _body(model, 8, 9, max_tokens=200))
    server.wait_for(lambda: server.metrics()["rlt:router_queue_length"] == 1, 10, "a queued request")
    queued.close()
    server.wait_for(lambda: server.metrics()["rlt:router_queue_length"] == 0, 10, "queue empty")
    for b in blockers:
        b.close()
    server.assert_idle()


def test_abort_while_reserving(server: Server, model: str) -> None:
    with frozen(server, "d0", "d1"):
        req = RawRequest(server, _body(model, 9, 1))
        server.wait_for(lambda: _phase(server, "reserving") == 1, 10, "reserving")
        req.close()
        server.wait_for(lambda: _phase(server, "reserving") == 0, 10, "handoff torn down")
    server.assert_idle()


def test_abort_while_prefilling(server: Server, model: str) -> None:
    with frozen(server, "p0", "p1"):
        req = RawRequest(server, _body(model, 9, 2))
        server.wait_for(lambda: _phase(server, "prefilling") == 1, 10, "prefilling")
        req.close()
        server.wait_for(lambda: server.metrics()["rlt:router_streams"] == 0, 10, "stream dropped")
    server.assert_idle()
    assert all(server.workers()[w]["status"] == "ready" for w in ("p0", "p1"))  # they confirmed in time


def test_abort_while_transferring(server: Server, model: str) -> None:
    """Decode frozen mid-prefill: the prefill worker's ZMQ writes stay in flight, unacknowledged."""
    for attempt in range(3):
        req = RawRequest(server, _body(model, 400, 3 + attempt))
        server.wait_for(lambda: _phase(server, "prefilling") == 1, 10, "prefilling")
        with frozen(server, "d0", "d1"):
            try:
                server.wait_for(lambda: any(w["transfers"] for w in server.workers().values()), 5, "writes in flight")
            except AssertionError:
                req.close()  # the prefill outran the freeze: try a fresh prompt
                continue
            req.close()
            server.wait_for(lambda: server.metrics()["rlt:router_streams"] == 0, 10, "stream dropped")
        break
    else:
        pytest.fail("never caught a write in flight")
    server.assert_idle()


def test_abort_while_decoding(server: Server, model: str) -> None:
    with httpx.stream("POST", server.base_url + "/v1/completions", timeout=60,
                      json={**_body(model, 20, 4, max_tokens=400), "stream": True}) as r:  # fmt: skip
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert _phase(server, "decoding") + server.metrics()["rlt:router_streams"] >= 1
    server.assert_idle()


# -- injected faults: received-not-activated, a write that never posts --------------------------------


RESERVATION_S, HOLD_S = 4.0, 7.0


@pytest.fixture(scope="module")
def faulty(model: str) -> Iterator[Server]:
    env = {"RLT_FAULT_INJECT": f"skip_state_write=31,hold_activate=1.5,hold_prefill=33,hold_prefill_s={HOLD_S}"}
    pd = ("--prefill", "2", "--decode", "1", "--kv-reservation-timeout", str(RESERVATION_S))
    with launch(model, *pd, *PD, *ENGINE, env=env, ready_timeout=120) as s:
        yield s


def test_abort_received_not_activated(faulty: Server, model: str) -> None:
    req = RawRequest(faulty, _body(model, 30, 5))
    faulty.wait_for(lambda: _phase(faulty, "activating") == 1, 20, "received, activation held")
    req.close()
    faulty.assert_idle()


def test_transfer_that_never_completes_times_out(faulty: Server, model: str) -> None:
    t0 = time.monotonic()
    r = faulty.http.post("/v1/completions", json=_body(model, 31, 6))  # its final-state write is lost
    assert r.status_code == 504, r.text
    assert "KV transfer timed out" in r.json()["error"]["message"] and "worker d0" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 20
    key = 'rlt:kv_transfer_failures_total{reason="timeout",worker="d0"}'
    faulty.wait_for(lambda: faulty.metrics().get(key, 0) >= 1, 10, "the timeout counted")
    faulty.assert_idle()


def test_reservation_never_activated_expires(faulty: Server, model: str) -> None:
    """The prefill worker stalls (and ignores the router's abort): the decode side frees the
    reservation at its own deadline, once; the stalled writer's late write is refused as stale."""
    m0 = faulty.metrics()
    stale, expired = (f'rlt:kv_transfer_failures_total{{reason="{r}",worker="d0"}}'
                      for r in ("stale", "reservation_timeout"))  # fmt: skip
    t0 = time.monotonic()
    r = faulty.http.post("/v1/completions", json=_body(model, 33, 7))  # its prefill is held back HOLD_S
    assert r.status_code == 504, r.text
    msg = r.json()["error"]["message"]
    assert "worker d0" in msg and "KV reservation timed out" in msg, msg
    assert RESERVATION_S - 0.5 < time.monotonic() - t0 < HOLD_S, "expired at the reservation deadline"
    faulty.wait_for(lambda: faulty.metrics().get(stale, 0) > m0.get(stale, 0), 30, "the late write refused")

    def writer_told() -> bool:
        return any(v for k, v in faulty.metrics().items()
                   if k.startswith('rlt:kv_transfer_failures_total{reason="stale",worker="p'))  # fmt: skip

    faulty.wait_for(writer_told, 10, "the stalled prefill worker heard its write was refused")
    assert faulty.metrics()[expired] == m0.get(expired, 0) + 1  # freed exactly once
    faulty.assert_idle()
    r = faulty.http.post("/v1/completions", json=_body(model, 32, 7))  # the freed pages serve again
    assert r.status_code == 200, r.text
    faulty.assert_idle()


def _prefill_holding(server: Server) -> list[str]:
    m = server.metrics()
    return [w for w in ("p0", "p1") if m.get(f'rlt:credits_reserved_slots{{worker="{w}"}}', 0) > 0]


def test_prefill_worker_dead_before_it_got_the_prompt_is_retried(faulty: Server, model: str) -> None:
    """Decode frozen: the request holds a prefill ticket but was not sent yet. Its prefill worker
    dies; the other prefill worker computes the prompt, and the output is unchanged."""
    body = _body(model, 26, 8, max_tokens=6, logprobs=1)
    want = faulty.http.post("/v1/completions", json=body)
    assert want.status_code == 200, want.text
    results, threads = _post_all(faulty, [body])
    with frozen(faulty, "d0"):
        faulty.wait_for(lambda: _phase(faulty, "reserving") == 1 and _prefill_holding(faulty), 10, "reserving")
        (victim,) = _prefill_holding(faulty)
        os.kill(faulty.pid(victim), signal.SIGKILL)
        faulty.wait_for(lambda: faulty.workers()[victim]["status"] == "dead", 10, f"{victim} reported dead")
    threads[0].join(60)
    code, got = results[0]
    assert code == 200, got
    retried = f"prefill worker {victim} died before it was sent the prompt; retrying on "
    assert any(retried in line for line in faulty.log), "the request went through the retry"
    assert got["choices"][0]["text"] == want.json()["choices"][0]["text"]
    assert got["choices"][0]["logprobs"] == want.json()["choices"][0]["logprobs"]
    assert faulty.metrics().get('rlt:pd_failures_total{phase="reserving"}', 0) == 0
    faulty.assert_idle()  # the survivors' pools, the decode reservation, every credit


# -- crashes ------------------------------------------------------------------------------------------


def _post_all(server: Server, bodies: list[dict]) -> tuple[list, list[threading.Thread]]:
    results: list = [None] * len(bodies)

    def one(i: int) -> None:
        r = httpx.post(server.base_url + "/v1/completions", json=bodies[i], timeout=60)
        results[i] = (r.status_code, r.json())

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(bodies))]
    for t in threads:
        t.start()
    return results, threads


def test_prefill_worker_killed_mid_transfer(server: Server, model: str) -> None:
    bodies = [_body(model, 300, 10 + i) for i in range(6)]
    results, threads = _post_all(server, bodies)
    server.wait_for(lambda: _phase(server, "prefilling") >= 2, 20, "prefills under way")
    with frozen(server, "d0", "d1"):  # holds the writes in flight
        server.wait_for(lambda: server.workers()["p0"]["transfers"] > 0, 10, "p0 writing")
        os.kill(server.pid("p0"), signal.SIGKILL)
        server.wait_for(lambda: server.workers()["p0"]["status"] == "dead", 10, "p0 reported dead")
    for t in threads:
        t.join(60)
    codes = [code for code, _ in results]
    failed = [body for code, body in results if code != 200]
    assert failed and all(code in (200, 503) for code in codes), results
    assert all("worker p0" in body["error"]["message"] for body in failed), failed
    assert len(failed) < len(results), "requests on p1 completed"
    # The router keeps admitting to the healthy workers.
    r = server.http.post("/v1/completions", json=_body(model, 40, 20))
    assert r.status_code == 200, r.text
    server.assert_idle()
    health = server.http.get("/health").json()
    assert health["status"] == "degraded" and health["workers"]["p0"]["status"] == "dead"


def test_decode_worker_killed_mid_stream(server: Server, model: str) -> None:
    results: dict[int, str] = {}

    def stream(i: int) -> None:
        body = {**_body(model, 10, 30 + i, max_tokens=480), "stream": True}
        outcome = "no end"
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                results.setdefault(i, "started")
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    outcome = "error: " + chunk["error"]["message"]
                elif chunk["choices"][0].get("finish_reason"):
                    outcome = chunk["choices"][0]["finish_reason"]
        results[i] = outcome

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    m_key = 'rlt:num_requests_running{worker="d0"}'
    # Kill d0 while it streams. Not waiting for all four to start: on a loaded 2-core CI machine the
    # first streams could finish before the last one started (seen); one not yet placed goes to d1.
    server.wait_for(lambda: results and server.metrics().get(m_key, 0) >= 1, 30, "a stream on d0")
    os.kill(server.pid("d0"), signal.SIGKILL)
    for t in threads:
        t.join(60)
    outcomes = list(results.values())
    errors = [o for o in outcomes if o.startswith("error")]
    assert errors and all("worker d0" in e for e in errors), outcomes
    assert all(o in ("length",) or o.startswith("error") for o in outcomes), outcomes
    assert "length" in outcomes, outcomes  # the streams on d1 finished
    r = server.http.post("/v1/completions", json=_body(model, 40, 40))
    assert r.status_code == 200, r.text
    server.assert_idle()
