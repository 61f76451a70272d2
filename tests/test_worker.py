"""A real worker subprocess driven over ZMQ, as the router drives it.

One worker serves most tests (start-up costs seconds on CPU); each test uses its own request
ids and waits for its own final deltas, so they do not interfere.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from rlt_serve import LLM, SamplingParams
from rlt_serve.demo import make_demo
from workers.metrics import METRIC_NAMES
from workers.protocol import (
    Abort,
    Capacity,
    Delta,
    Health,
    Metrics,
    Ready,
    Shutdown,
    Submit,
    ToRouter,
    decode_to_router,
    encode,
    parse_status_line,
)

REPO = Path(__file__).resolve().parent.parent
ENGINE_ARGS = {"num_kv_pages": 64, "max_num_seqs": 8, "swap_space_bytes": 0}


class WorkerClient:
    """The router's half of the protocol, plus the process handle."""

    def __init__(self, model: str, run_dir: Path, name: str = "w0", drain_timeout: float = 10.0) -> None:
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        out_addr = f"ipc://{run_dir}/{name}-out.sock"
        in_addr = f"ipc://{run_dir}/{name}-in.sock"
        self.inbox.bind(out_addr)
        self.outbox = self.ctx.socket(zmq.PUSH)
        self.outbox.setsockopt(zmq.LINGER, 0)
        self.outbox.connect(in_addr)
        cmd = [sys.executable, "-m", "workers.worker", "--worker-id", name, "--model", model,
               "--in-addr", in_addr, "--out-addr", out_addr, "--device", "cpu",
               "--engine-args", json.dumps(ENGINE_ARGS), "--drain-timeout", str(drain_timeout)]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one core per engine, as launch gives it
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
        self.capacity: Capacity | None = None
        self.health: Health | None = None
        self.metrics: Metrics | None = None
        self.ready = self._wait_ready()

    def _wait_ready(self) -> Ready:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # status lines come before Ready on the socket
            msg = parse_status_line(line)
            if isinstance(msg, Ready):
                return msg
            assert msg is None or msg.stage != "failed", msg
        raise AssertionError(f"worker exited with {self.proc.wait()} before Ready")

    def send(self, msg: Submit | Abort | Shutdown) -> None:
        self.outbox.send(encode(msg))

    def messages(self, timeout: float) -> Iterator[ToRouter]:
        """Every message until `timeout` seconds pass; remembers the latest state messages."""
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0:
            if not self.inbox.poll(int(left * 1000)):
                break
            msg = decode_to_router(self.inbox.recv())
            if isinstance(msg, Capacity):
                self.capacity = msg
            elif isinstance(msg, Health):
                self.health = msg
            elif isinstance(msg, Metrics):
                self.metrics = msg
            yield msg

    def collect(self, request_ids: set[str], timeout: float = 30.0) -> dict[str, list[Delta]]:
        """All deltas of these requests, until each has its final one."""
        out: dict[str, list[Delta]] = {rid: [] for rid in request_ids}
        pending = set(request_ids)
        for msg in self.messages(timeout):
            if isinstance(msg, Delta) and msg.request_id in out:
                assert msg.request_id in pending, f"delta after the final one: {msg}"
                out[msg.request_id].append(msg)
                if msg.finish_reason is not None:
                    pending.discard(msg.request_id)
                    if not pending:
                        return out
        raise AssertionError(f"no final delta for {sorted(pending)} within {timeout}s")

    def wait_capacity(self, pred, timeout: float = 5.0) -> Capacity:
        if self.capacity is not None and pred(self.capacity):
            return self.capacity
        for msg in self.messages(timeout):
            if isinstance(msg, Capacity) and pred(msg):
                return msg
        raise AssertionError(f"capacity never matched; last {self.capacity}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.inbox.close(linger=0)
        self.outbox.close(linger=0)
        self.ctx.term()


def submit(rid: str, prompt: list[int], deadline: float | None = None, **sampling) -> Submit:
    return Submit(rid, prompt, sampling, deadline if deadline is not None else time.time() + 60)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_demo(str(tmp_path_factory.mktemp("demo")))


@pytest.fixture(scope="module")
def worker(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerClient]:
    client = WorkerClient(model_dir, tmp_path_factory.mktemp("run"))
    yield client
    client.close()


PROMPTS = [[1, 17, 42, 99, 7], [3, 5, 8, 13, 21, 34, 55, 89, 144]]


def test_deltas_equal_offline_generate(worker: WorkerClient, model_dir: str) -> None:
    params = [
        dict(max_tokens=12, temperature=0.0, logprobs=2),
        dict(max_tokens=12, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True),
    ]
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        worker.send(submit(f"gen-{i}", prompt, **p))
    got = worker.collect({"gen-0", "gen-1"})
    llm = LLM(model_dir, device="cpu", **ENGINE_ARGS)
    want = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], [SamplingParams(**p) for p in params])
    for i, ref in enumerate(want):
        deltas = got[f"gen-{i}"]
        ids = [t for d in deltas for t in d.token_ids]
        assert ids == ref.outputs[0].token_ids
        assert deltas[-1].finish_reason == ref.outputs[0].finish_reason
        assert all(d.finish_reason is None for d in deltas[:-1])
        assert all(d.num_prompt_tokens == len(PROMPTS[i]) for d in deltas)
    # Logprobs: one list per new token, the chosen token first, values as offline.
    lps = [entry for d in got["gen-0"] for entry in d.logprobs]
    ref = want[0].outputs[0]
    assert len(lps) == len(ref.token_ids)
    for entries, tok, table in zip(lps, ref.token_ids, ref.logprobs):
        assert entries[0].token_id == tok
        assert entries[0].logprob == pytest.approx(table[tok].logprob, abs=1e-5)
        assert {e.token_id for e in entries} == set(table)


def test_abort_frees_pages_and_slots(worker: WorkerClient) -> None:
    total = worker.ready.total_pages
    worker.wait_capacity(lambda c: c.free_pages == total)
    worker.send(submit("abort-me", PROMPTS[1], max_tokens=2000, ignore_eos=True, temperature=0.0))
    for msg in worker.messages(10):
        if isinstance(msg, Delta) and msg.request_id == "abort-me":
            assert msg.finish_reason is None
            break
    busy = worker.wait_capacity(lambda c: c.free_pages < total)
    assert busy.running == 1 and busy.free_slots == busy.total_slots - 1
    worker.send(Abort("abort-me"))
    final = worker.collect({"abort-me"}, timeout=5)["abort-me"][-1]
    assert final.finish_reason == "abort" and final.error is None
    cap = worker.wait_capacity(lambda c: c.free_pages == total and c.running == 0)
    assert cap.free_slots == cap.total_slots == worker.ready.max_num_seqs


def test_deadline_aborts_request(worker: WorkerClient) -> None:
    start = time.time()
    worker.send(submit("late", PROMPTS[0], deadline=start + 0.3, max_tokens=2000, ignore_eos=True))
    final = worker.collect({"late"}, timeout=10)["late"][-1]
    assert final.finish_reason == "abort" and final.error == "deadline exceeded"
    assert time.time() - start < 5
    worker.wait_capacity(lambda c: c.free_pages == worker.ready.total_pages)


@pytest.mark.parametrize(
    "prompt, sampling, field",
    [
        (PROMPTS[0], {"temperature": -1.0}, "temperature"),
        (PROMPTS[0], {"no_such_field": 1}, "no_such_field"),
        ([10**6], {}, "prompt_token_ids"),
        ([], {}, "prompt"),
        (PROMPTS[0], {"logprobs": 10**4}, "logprobs"),
    ],
)
def test_bad_request_fails_alone(worker: WorkerClient, prompt: list[int], sampling: dict, field: str) -> None:
    worker.send(submit("bad", prompt, **sampling))
    worker.send(submit("good", PROMPTS[0], max_tokens=3))
    got = worker.collect({"bad", "good"})
    (bad,) = got["bad"]
    assert bad.finish_reason == "error" and field in bad.error
    assert got["good"][-1].finish_reason == "length"
    assert sum(len(d.token_ids) for d in got["good"]) == 3


def test_heartbeat_and_metrics(worker: WorkerClient) -> None:
    for _ in worker.messages(1.2):
        pass
    assert worker.health is not None and worker.health.ok
    assert worker.metrics is not None
    text = worker.metrics.text
    for name in METRIC_NAMES:
        assert f"\n{name}" in text, name
    assert 'rlt:request_success_total{finished_reason="abort"}' in text
    assert "rlt:exit_depth_bucket" in text
    assert 'rlt:cuda_graph_replays_total{kind="loop"} 0.0' in text  # a CPU worker replays none


def test_shutdown_drains_and_exits_zero(model_dir: str, tmp_path: Path) -> None:
    client = WorkerClient(model_dir, tmp_path, name="w-shutdown")
    try:
        client.send(submit("inflight", PROMPTS[0], max_tokens=20, ignore_eos=True))
        client.send(Shutdown(drain=True))
        client.send(submit("refused", PROMPTS[0], max_tokens=2))
        got = client.collect({"inflight", "refused"})
        assert sum(len(d.token_ids) for d in got["inflight"]) == 20
        assert got["inflight"][-1].finish_reason == "length"
        assert got["refused"][-1].finish_reason == "error"
        assert client.proc.wait(timeout=10) == 0
    finally:
        client.close()


def test_sigterm_drains_within_its_bound(model_dir: str, tmp_path: Path) -> None:
    client = WorkerClient(model_dir, tmp_path, name="w-term", drain_timeout=1.0)
    try:
        client.send(submit("long", PROMPTS[0], max_tokens=5000, ignore_eos=True))
        next(m for m in client.messages(10) if isinstance(m, Delta))
        start = time.monotonic()
        client.proc.send_signal(signal.SIGTERM)
        final = client.collect({"long"}, timeout=10)["long"][-1]
        assert final.finish_reason == "abort" and final.error == "worker is shutting down"
        assert client.proc.wait(timeout=10) == 0
        assert time.monotonic() - start < 6
    finally:
        client.close()


class _BrokenEngine:
    """Accepts requests, then fails its first step: what a device fault looks like."""

    class model_config:
        num_loops = 4

    class engine_config:
        max_num_seqs = 2

    def __init__(self) -> None:
        from rlt_serve.engine.llm_engine import EngineStats

        self._stats = EngineStats(num_free_pages=8, num_pages=8)
        self._ids: list[str] = []

    def add_request(self, request_id, prompt_token_ids, params, priority=0) -> None:
        self._ids.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._ids)

    def stats(self):
        return self._stats

    def step(self):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_engine_failure_fails_requests_and_exits_nonzero(tmp_path: Path) -> None:
    from workers.worker import EXIT_ENGINE_FAILED, Worker

    ctx = zmq.Context()
    addr_in, addr_out = f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out"
    pull, push, router_in, router_out = (
        ctx.socket(zmq.PULL),
        ctx.socket(zmq.PUSH),
        ctx.socket(zmq.PULL),
        ctx.socket(zmq.PUSH),
    )
    try:
        router_in.bind(addr_out)
        pull.bind(addr_in)
        push.connect(addr_out)
        router_out.connect(addr_in)
        router_out.send(encode(submit("doomed", [1, 2, 3], max_tokens=4)))
        worker = Worker("w-broken", _BrokenEngine(), pull, push, addr_out, drain_timeout=1.0)
        assert worker.run() == EXIT_ENGINE_FAILED
        msgs = []
        while router_in.poll(500):
            msgs.append(decode_to_router(router_in.recv()))
        health = [m for m in msgs if isinstance(m, Health)]
        assert health and not health[-1].ok and "illegal memory access" in health[-1].detail
        (final,) = [m for m in msgs if isinstance(m, Delta)]
        assert final.request_id == "doomed" and final.finish_reason == "error" and "engine step failed" in final.error
    finally:
        for s in (pull, push, router_in, router_out):
            s.close(linger=0)
        ctx.term()
