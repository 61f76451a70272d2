"""The transport interface both implementations satisfy, and the notification they carry.

Three events per chunk, each acknowledged separately, because each frees something different:
- completion: the writer's handle is `done` (NIXL: the put finished; ZMQ: the receiver copied it)
  — the writer may reuse its staging, nothing else;
- commit: the receiver takes the write's notification (request id, generation, chunk) and records
  the pages as landed — only then may decode activate;
- release: the receiver's ack back to the writer — only then may the prefill side free its pages.
A write whose notification names a stale generation is refused by the receiver's `accept`
callback: the ZMQ receiver never copies it; the NIXL receiver (one-sided puts cannot be refused)
drops the commit. Either way the writer gets a `refused` notification back.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import msgspec
import torch

from workers.transfer.regions import Region

Status = Literal["pending", "done", "failed"]
WRITE_TAG, NOTIFY_TAG = b"W", b"N"  # first byte of every notification on the wire


class TransferNotif(msgspec.Struct, array_like=True, frozen=True):
    """What a write's notification says, and what acks/refusals say back."""

    kind: str  # "chunk" (with a write) | "refused" (auto, receiver -> writer) | app kinds ("ack", ...)
    request_id: str
    generation: int
    chunk: int = 0
    last: bool = False
    first_page: int = 0  # the chunk's pages in the reservation's page table, for the commit
    num_pages: int = 0


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(TransferNotif)


def encode_notif(n: TransferNotif) -> bytes:
    return _enc.encode(n)


def decode_notif(data: bytes) -> TransferNotif | None:
    try:
        return _dec.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


# accept(peer, notif) -> may this write land / commit? (the decode engine's check_generation)
Acceptor = Callable[[str, TransferNotif], bool]


class TransferError(RuntimeError):
    pass


@dataclass
class _Handle:
    peer: str
    deadline: float
    nbytes: int
    posted: float
    state: Status = "pending"
    native: object | None = None  # the implementation's handle


@dataclass
class TransferStats:
    """Cumulative counters a worker exports as metrics (rlt:kv_transfer_*)."""

    writes_posted: int = 0
    writes_done: int = 0
    writes_failed: int = 0  # errors, timeouts, dead peers, refusals (ZMQ)
    bytes_written: int = 0
    write_seconds: float = 0.0  # post -> done, summed over done writes
    refused: int = 0  # writes this agent refused as a receiver (stale generation)
    inflight_bytes: int = 0  # now


class KVTransferAgent(ABC):
    """Moves byte regions of registered buffers to a peer's registered buffers.

    Buffers are registered once, in a fixed order (`regions.K`, `V`, `STATE`). Progress is driven by
    the caller (`status`, `notifications`), so a worker loop needs no extra thread; a receiver must
    call `notifications()` regularly for writes to land (ZMQ) and commits to be seen (both)."""

    kind: str = ""

    def __init__(self, name: str, buffers: list[torch.Tensor], accept: Acceptor | None = None,
                 timeout_s: float = 30.0) -> None:
        self.name = name
        self.accept = accept
        self.timeout_s = timeout_s
        self.buffers = list(buffers)
        self._handles: dict[int, _Handle] = {}
        self._next_handle = 1
        self._stats = TransferStats()

    # -- peers --------------------------------------------------------------------------
    @abstractmethod
    def metadata(self) -> bytes:
        """What a peer needs to write here (sent over the control plane)."""

    @abstractmethod
    def add_peer(self, name: str, metadata: bytes) -> None: ...

    @abstractmethod
    def remove_peer(self, name: str) -> None:
        """Forget a peer; pending writes to it fail. After this no write from it can land here."""

    # -- writes -------------------------------------------------------------------------
    def write(self, peer: str, local: list[Region], remote: list[Region], notif: bytes,
              timeout_s: float | None = None) -> int:
        """Post a write of `local` regions into the peer's `remote` regions; `notif` reaches the
        peer's `notifications()` once the data is there. Returns a handle for `status`."""
        if len(local) != len(remote) or any(a.nbytes != b.nbytes for a, b in zip(local, remote)):
            raise ValueError("local and remote regions must match one to one in size")
        self._check_local(local)
        h = self._next_handle
        self._next_handle += 1
        nbytes = sum(r.nbytes for r in local)
        now = time.monotonic()
        handle = _Handle(peer, now + (self.timeout_s if timeout_s is None else timeout_s), nbytes, now)
        self._handles[h] = handle
        self._stats.writes_posted += 1
        try:
            handle.native = self._post(h, peer, local, remote, WRITE_TAG + notif)
        except TransferError:
            handle.state = "failed"
            self._stats.writes_failed += 1
        return h

    def status(self, handle: int) -> Status:
        h = self._handles[handle]
        if h.state == "pending":
            self._progress()
            if h.state == "pending":
                h.state = self._poll(handle, h)
            if h.state == "pending" and time.monotonic() > h.deadline:
                self._discard(h)
                h.state = "failed"
            st = self._stats
            if h.state == "done":
                st.writes_done += 1
                st.bytes_written += h.nbytes
                st.write_seconds += time.monotonic() - h.posted
            elif h.state == "failed":
                st.writes_failed += 1
        return h.state

    def release(self, handle: int) -> None:
        """Forget a handle (cancelling it if still pending)."""
        h = self._handles.pop(handle, None)
        if h is not None:
            self._discard(h)

    @abstractmethod
    def notify(self, peer: str, msg: bytes) -> None:
        """A standalone notification (commit ack, cancel, ...), not tied to a write."""

    def notifications(self) -> list[tuple[str, bytes]]:
        """(peer, message) received since the last call: accepted writes' notifications and
        standalone ones; refused writes are not listed (the writer hears `refused`). Notifications
        of separate writes may arrive in any order. It also drives this agent's own pending writes
        (NIXL sends a write's notification only once the writer has seen it complete), so a worker
        calls it every loop iteration on both roles."""
        for h in list(self._handles):
            self.status(h)
        return self._notifications()

    @abstractmethod
    def _notifications(self) -> list[tuple[str, bytes]]: ...

    def close(self) -> None:
        for h in list(self._handles):
            self.release(h)
        self._close()

    # -- for tests and metrics -----------------------------------------------------------
    @property
    def num_handles(self) -> int:
        return len(self._handles)

    @property
    def num_refused(self) -> int:
        return self._stats.refused

    @property
    def bytes_written(self) -> int:
        return self._stats.bytes_written

    def stats(self) -> TransferStats:
        self._stats.inflight_bytes = sum(h.nbytes for h in self._handles.values() if h.state == "pending")
        return TransferStats(**vars(self._stats))

    @property
    @abstractmethod
    def num_registered(self) -> int: ...

    @property
    @abstractmethod
    def num_peers(self) -> int: ...

    # -- implementation hooks ------------------------------------------------------------
    def _check_local(self, regions: list[Region]) -> None:
        for r in regions:
            buf = self.buffers[r.buf]
            if r.offset < 0 or r.offset + r.nbytes > buf.numel() * buf.element_size():
                raise ValueError(f"region {r} is outside local buffer {r.buf}")

    def _accepts(self, peer: str, notif: bytes) -> bool:
        """Receiver side: may a write carrying `notif` land/commit? Tells the writer if not."""
        if self.accept is None:
            return True
        n = decode_notif(notif)
        if n is not None and self.accept(peer, n):
            return True
        self._stats.refused += 1
        if n is not None:
            self.notify(peer, encode_notif(TransferNotif("refused", n.request_id, n.generation, n.chunk, n.last, n.first_page, n.num_pages)))
        return False

    @abstractmethod
    def _post(self, h: int, peer: str, local: list[Region], remote: list[Region], notif: bytes) -> object: ...

    @abstractmethod
    def _poll(self, h: int, handle: _Handle) -> Status: ...

    def _progress(self) -> None:
        """Move incoming traffic along (ZMQ)."""

    @abstractmethod
    def _discard(self, handle: _Handle) -> None:
        """Free the implementation's handle, cancelling the write if it is still in flight."""

    def _fail_peer(self, peer: str) -> None:
        for h in self._handles.values():
            if h.peer == peer and h.state == "pending":
                self._discard(h)
                h.state = "failed"
                self._stats.writes_failed += 1

    @abstractmethod
    def _close(self) -> None: ...
