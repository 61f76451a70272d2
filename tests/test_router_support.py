"""A real `rlt-serve launch` for the router tests: a subprocess on a free port, CPU, demo model.

Not a test module of its own (it has no tests); the router test modules import `launch` and
`demo_checkpoint` from here and each keeps one server for the whole module, since starting one
costs seconds on CPU.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parent.parent
_URL = re.compile(r"serving .* at (http://\S+)")


def demo_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The demo checkpoint under a private RLT_SERVE_CACHE, shared by the whole session (it is
    built on first use and found on disk after that)."""
    from rlt_serve.demo import ensure_demo

    cache = tmp_path_factory.getbasetemp() / "rlt-serve-cache"
    os.environ["RLT_SERVE_CACHE"] = str(cache)
    return ensure_demo()


class Server:
    def __init__(self, proc: subprocess.Popen, base_url: str, log: list[str]) -> None:
        self.proc = proc
        self.base_url = base_url
        self.log = log
        # Idle connections are dropped before uvicorn's 5 s keep-alive closes them: reusing one the
        # server is closing at that moment fails as "Server disconnected without sending a response".
        self.http = httpx.Client(base_url=base_url, timeout=60.0, limits=httpx.Limits(keepalive_expiry=2.0))

    def metrics(self) -> dict[str, float]:
        """`name{labels}` -> value for every sample of one /metrics scrape."""
        out = {}
        for line in self.http.get("/metrics").text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def metric(self, name: str, **labels: str) -> float:
        wanted = [f'{k}="{v}"' for k, v in labels.items()]
        total = 0.0
        for key, value in self.metrics().items():
            base = key.split("{", 1)[0]
            if base == name and all(w in key for w in wanted):
                total += value
        return total

    wait_timeout, poll_s, log_tail = 20.0, 0.1, 30  # wait_for's default timeout, polling, log shown

    def workers(self) -> dict[str, dict]:
        return self.http.get("/health").json()["workers"]

    def wait_all_warm(self, timeout: float) -> None:
        self.wait_for(lambda: all(w["status"] == "ready" for w in self.workers().values()), timeout,
                      "every worker warmed up")  # fmt: skip

    def wait_for(self, predicate, timeout: float | None = None, what: str = "condition") -> None:
        end = time.monotonic() + (self.wait_timeout if timeout is None else timeout)
        while time.monotonic() < end:
            if predicate():
                return
            time.sleep(self.poll_s)
        raise AssertionError(f"timed out waiting for {what}; server log tail:\n" + "".join(self.log[-self.log_tail :]))


@contextmanager
def launch(
    model: str, *args: str, workers: int = 1, ready_timeout: float = 120.0, env: dict[str, str] | None = None
) -> Iterator[Server]:
    """`rlt-serve launch` on the demo model until every worker is warm (/health is 200 once one
    is: a request placed before the others warm up would wait on their warm-up)."""
    cmd = [sys.executable, "-m", "rlt_serve.cli", "launch", "--model", model, "--served-model-name", "demo",
           "--device", "cpu", "--port", "0", "--workers", str(workers), *args]  # fmt: skip
    with serve(cmd, Server, ready_timeout=ready_timeout, env={**os.environ, **env} if env else None) as server:
        server.wait_all_warm(ready_timeout)
        yield server


@contextmanager
def serve(
    cmd: list[str], server_cls: type[Server], ready_timeout: float = 120.0, ready_marker: str | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[Server]:
    """Run `rlt-serve launch` CMD until its URL is printed (and then a line holding `ready_marker`)
    and /health is 200; SIGTERM (then SIGKILL) after."""
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)  # fmt: skip
    log: list[str] = []
    found = threading.Event()
    url: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.append(line)
            m = _URL.search(line)
            if m and not url:
                url.append(m.group(1))
            if url and (ready_marker is None or ready_marker in line):
                found.set()
        found.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        if not found.wait(ready_timeout) or not url:
            raise RuntimeError("rlt-serve launch did not start:\n" + "".join(log))
        server = server_cls(proc, url[0], log)
        server.wait_for(lambda: server.http.get("/health").status_code == 200, ready_timeout, "/health 200")
        yield server
    finally:
        stop(proc)


def stop(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
