"""`rlt-serve launch` as a real process tree on CPU with the demo model, over real HTTP.

One server (two workers) serves the whole file: health, a dying worker, then SIGTERM. The
worker pids come from the launcher's own output, and "no child left" is checked in /proc.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parent.parent
ENGINE = ["--num-kv-pages", "128", "--max-num-seqs", "8", "--swap-space-bytes", "0"]


class Launched:
    def __init__(self, tmp: Path) -> None:
        env = {**os.environ, "RLT_SERVE_CACHE": str(tmp / "cache")}
        cmd = [sys.executable, "-m", "rlt_serve.cli", "launch", "--port", "0", "--device", "cpu",
               "--workers", "2", "--request-timeout", "30", "--shutdown-timeout", "5", *ENGINE]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.worker_pids: dict[str, int] = {}
        self.base = self._wait_for_url(timeout=60)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line)
            self.lines.put(line)

    def _wait_for_url(self, timeout: float) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                assert self.proc.poll() is None, "launch exited:\n" + "".join(self.log)
                continue
            if m := re.search(r"worker (\d+) ready \(pid (\d+)\)", line):
                self.worker_pids[m.group(1)] = int(m.group(2))
            if m := re.search(r" at (http://\S+)$", line.strip()):
                return m.group(1)
        raise AssertionError("launch never printed its address:\n" + "".join(self.log))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in self.worker_pids.values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launched]:
    launched = Launched(tmp_path_factory.mktemp("launch"))
    yield launched
    launched.stop()


def completion(base: str, max_tokens: int, stream: bool = False, **extra) -> httpx.Response:
    body = {"model": "demo-ouro-v1", "prompt": "Once upon a time", "max_tokens": max_tokens,
            "temperature": 0.0, "stream": stream, **extra}  # fmt: skip
    return httpx.post(f"{base}/v1/completions", json=body, timeout=60)


def test_health_becomes_ok(server: Launched) -> None:
    assert set(server.worker_pids) == {"0", "1"}
    assert all(alive(pid) for pid in server.worker_pids.values())
    end = time.monotonic() + 30
    while (r := httpx.get(f"{server.base}/health", timeout=5)).status_code != 200:
        assert time.monotonic() < end, r.text
        time.sleep(0.2)
    r = completion(server.base, 4)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


def test_unseeded_choices_differ_across_workers(server: Launched) -> None:
    """n unseeded samples of one prompt are independent draws, whichever worker runs each: with
    every worker on the same engine seed, the choices sent to different workers came back equal."""
    r = completion(server.base, 12, n=4, temperature=1.0, ignore_eos=True)
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in r.json()["choices"]]
    assert len(set(texts)) == len(texts), texts


def _stream(base: str, results: queue.Queue) -> None:
    """A long streaming request; reports (first chunk seen) then (how it ended, seconds)."""
    body = {"model": "demo-ouro-v1", "prompt": "The quick brown fox", "max_tokens": 400,
            "ignore_eos": True, "stream": True}  # fmt: skip
    start = time.monotonic()
    outcome = "no end"
    try:
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
            first = True
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if first:
                    results.put(("started", 0.0))
                    first = False
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    outcome = "error"
                    break
                reason = chunk["choices"][0].get("finish_reason")
                if reason:
                    outcome = reason
    except httpx.HTTPError as e:
        outcome = f"transport error {type(e).__name__}"
    results.put((outcome, time.monotonic() - start))


def test_killed_worker_fails_its_requests(server: Launched) -> None:
    results: queue.Queue = queue.Queue()
    threads = [threading.Thread(target=_stream, args=(server.base, results), daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    for _ in threads:
        kind, _ = results.get(timeout=30)
        assert kind == "started", kind
    victim = server.worker_pids["0"]
    os.kill(victim, signal.SIGKILL)
    ends = [results.get(timeout=40) for _ in threads]
    outcomes = sorted(kind for kind, _ in ends)
    assert "error" in outcomes, outcomes  # the requests on worker 0 failed instead of hanging
    assert all(kind in ("error", "length") for kind in outcomes), outcomes
    # The router stays up, reports the dead worker, and serves on the other one.
    health = httpx.get(f"{server.base}/health", timeout=5)
    assert "dead" in health.text, health.text
    metrics = httpx.get(f"{server.base}/metrics", timeout=5).text
    assert "rlt:" in metrics
    r = completion(server.base, 3)
    assert r.status_code == 200, r.text
    assert any("worker 0" in line and "SIGKILL" in line for line in server.log), "".join(server.log[-20:])


def test_sigterm_exits_cleanly_without_children(server: Launched) -> None:
    pids = list(server.worker_pids.values())
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=30) == 0, "".join(server.log[-30:])
    deadline = time.monotonic() + 5
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids), [p for p in pids if alive(p)]


def _launch_rc(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "RLT_SERVE_CACHE": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "rlt_serve.cli", "launch", "--port", "0", "--device", "cpu", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    "args, message",
    [
        (("--prefill", "1"), "needs --prefill >= 1 and --decode >= 1"),
        (("--prefill", "1", "--decode", "1", "--workers", "2"), "cannot be combined with --prefill/--decode"),
        (("--workers", "0"), "--workers must be >= 1"),
    ],
)
def test_unsupported_worker_plans_are_refused(tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    r = _launch_rc(tmp_path, *args)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_worker_of_the_wrong_role_is_refused_when_joining(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode worker cannot join a router that serves `both` workers: it exits, saying why."""
    env = {**os.environ, "RLT_SERVE_CACHE": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "rlt_serve.cli", "launch", "--port", "0", "--device", "cpu", "--workers", "0",
           "--worker-port", "0", *ENGINE]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        endpoint = None
        for line in proc.stdout:  # type: ignore[union-attr]
            if m := re.search(r"workers join at: (tcp://\S+)", line):
                endpoint = m.group(1)
                break
        assert endpoint, "no worker endpoint announced"
        from rlt_serve.demo import ensure_demo

        monkeypatch.setenv("RLT_SERVE_CACHE", str(tmp_path / "cache"))
        worker = subprocess.run(
            [sys.executable, "-m", "rlt_serve.cli", "worker", "--role", "decode", "--router", endpoint, "--model",
             ensure_demo(), "--device", "cpu", "--kv-transport", "zmq", *ENGINE],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert worker.returncode == 0
        assert "refused it: this router serves workers in role 'both'" in worker.stderr, worker.stderr[-2000:]
    finally:
        proc.terminate()
        proc.wait(30)


def test_worker_that_fails_to_load_is_reported(tmp_path: Path) -> None:
    r = _launch_rc(tmp_path, "--model", str(tmp_path / "no-such-checkpoint"))
    assert r.returncode == 1
    assert "worker 0" in r.stderr and "while loading" in r.stderr, r.stderr[-2000:]
    pids = [int(p) for p in re.findall(r"pids ([\d, ]+)", r.stdout)[0].split(", ")]
    assert not any(alive(p) for p in pids)
