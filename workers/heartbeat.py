"""The worker's heartbeat, sent from its own thread and socket.

The router declares a worker dead after a few silent seconds. The main loop is silent while an
engine step runs, and one step can legitimately take longer than that (the first CUDA step
compiling kernels, a long prompt chunk on CPU), so liveness is proven by a thread instead. A step
that truly hangs is caught by request deadlines on the router side and by the launcher's
process monitor, not by this.
"""

from __future__ import annotations

import threading

import zmq

from workers.protocol import Health, encode


class Heartbeat:
    def __init__(self, ctx: zmq.Context, out_addr: str, worker_id: str, interval: float) -> None:
        self._ctx, self._addr, self._worker_id, self._interval = ctx, out_addr, worker_id, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        sock = self._ctx.socket(zmq.PUSH)  # sockets are not thread-safe: this thread owns its own
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self._addr)
        try:
            msg = encode(Health(self._worker_id, ok=True))
            while True:
                try:
                    sock.send(msg, zmq.NOBLOCK)
                except zmq.Again:  # nobody is reading; a later beat will do
                    pass
                if self._stop.wait(self._interval):
                    return
        finally:
            sock.close()
