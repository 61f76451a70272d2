"""A worker subprocess as its launcher sees it: spawn, start-up status, stop.

The worker reports loading progress and readiness as status lines on stdout, so the launcher
can wait for every worker before the router listens, and a worker that dies while loading is
reported with its own last words instead of a timeout. Workers run in their own session: a
Ctrl-C in the terminal reaches only the launcher, which then shuts them down in order.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import zmq

from workers.protocol import Loading, Ready, Role, Shutdown, encode, parse_status_line


@dataclass
class WorkerLaunch:
    worker_id: str
    role: Role
    model: str
    in_addr: str
    out_addr: str
    device: str = "auto"
    dtype: str = "auto"
    engine_args: dict = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # added to the launcher's environment
    pd_args: list[str] = field(default_factory=list)  # more worker options (PD roles)


class WorkerProcess:
    def __init__(self, spec: WorkerLaunch) -> None:
        self.spec = spec
        cmd = [
            sys.executable, "-m", "workers.worker",
            "--worker-id", spec.worker_id, "--role", spec.role, "--model", spec.model,
            "--in-addr", spec.in_addr, "--out-addr", spec.out_addr,
            "--device", spec.device, "--dtype", spec.dtype,
            "--engine-args", json.dumps(spec.engine_args), *spec.pd_args,
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **spec.env},
            start_new_session=True,
        )
        self.started = time.monotonic()
        self.ready: Ready | None = None
        self.last_status: Loading | None = None
        self.changed = threading.Event()  # set on every status line and at exit of stdout
        self._reader = threading.Thread(target=self._read_stdout, name=f"worker-{spec.worker_id}-stdout", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read_stdout(self) -> None:
        """Status lines update the state; anything else the worker prints is passed on."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            msg = parse_status_line(line)
            if msg is None:
                sys.stderr.write(f"[worker {self.spec.worker_id}] {line}")
                continue
            if isinstance(msg, Ready):
                self.ready = msg
            else:
                self.last_status = msg
            self.changed.set()
        self.changed.set()

    def exit_code(self) -> int | None:
        return self.proc.poll()

    def describe_exit(self) -> str:
        code = self.proc.poll()
        how = (
            f"was killed by {signal.Signals(-code).name}"
            if code is not None and code < 0
            else f"exited with code {code}"
        )
        detail = self.last_status.detail if self.last_status and self.last_status.stage == "failed" else ""
        return f"worker {self.spec.worker_id} (pid {self.pid}) {how}" + (f": {detail}" if detail else "")

    def request_shutdown(self, ctx: zmq.Context, drain: bool) -> None:
        """Ask over the worker's own inbox, so it finishes the last deltas before exiting."""
        if self.proc.poll() is not None:
            return
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(self.spec.in_addr)
        sock.send(encode(Shutdown(drain=drain)))
        sock.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()

    def reap(self) -> None:
        """Wait for the exit and for the last of its output."""
        self.proc.wait()
        self._reader.join(timeout=1.0)


def stop_all(procs: list[WorkerProcess], timeout: float, drain: bool = False) -> None:
    """Shut every worker down within `timeout` seconds: ask over ZMQ, then SIGKILL what is left."""
    ctx = zmq.Context()
    try:
        for p in procs:
            p.request_shutdown(ctx, drain)
        end = time.monotonic() + timeout
        for p in procs:
            try:
                p.proc.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in procs:
            if p.proc.poll() is None:
                print(
                    f"rlt-serve: worker {p.spec.worker_id} (pid {p.pid}) did not stop in time; killing it",
                    file=sys.stderr,
                )
                p.kill()
        for p in procs:
            p.reap()
    finally:
        ctx.term()
