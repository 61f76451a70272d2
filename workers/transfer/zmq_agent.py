"""KV transfer over ZMQ, for where NIXL is not available (selected with `--kv-transport zmq`).

The writer copies the regions' bytes into one multipart message; the receiver checks the
notification's generation *before* copying (so a stale write never lands), copies the bytes into
its registered buffers, and answers the writer, whose handle becomes done (or failed, if refused).
Each agent binds one ROUTER; it reaches each peer through a DEALER whose identity is its own name,
so every message says who sent it. Nothing runs in the background: receiving happens inside
`notifications()` and `status()`.
"""

from __future__ import annotations

import warnings

import msgspec
import torch
import zmq

from workers.transfer.base import NOTIFY_TAG, WRITE_TAG, Acceptor, KVTransferAgent, Status, TransferError, _Handle
from workers.transfer.regions import Region, byte_view

_ACK, _OK, _REFUSED = b"A", b"1", b"0"


class _Meta(msgspec.Struct):
    name: str
    address: str
    sizes: list[int]  # bytes of each registered buffer


class ZmqTransferAgent(KVTransferAgent):
    kind = "zmq"

    def __init__(self, name: str, buffers: list[torch.Tensor], accept: Acceptor | None = None,
                 timeout_s: float = 30.0, host: str = "127.0.0.1") -> None:
        super().__init__(name, buffers, accept, timeout_s)
        self._bytes = [byte_view(b) for b in buffers]
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        port = self._router.bind_to_random_port(f"tcp://{host}")
        self._address = f"tcp://{host}:{port}"
        self._peers: dict[str, tuple[zmq.Socket, list[int]]] = {}
        self._inbox: list[tuple[str, bytes]] = []
        self._acks: dict[int, Status] = {}

    def metadata(self) -> bytes:
        return msgspec.msgpack.encode(_Meta(self.name, self._address, [b.numel() for b in self._bytes]))

    def add_peer(self, name: str, metadata: bytes) -> None:
        meta = msgspec.msgpack.decode(metadata, type=_Meta)
        if meta.name != name:
            raise ValueError(f"metadata is for agent {meta.name!r}, not {name!r}")
        self.remove_peer(name)
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.name.encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(meta.address)
        self._peers[name] = (sock, meta.sizes)

    def remove_peer(self, name: str) -> None:
        entry = self._peers.pop(name, None)
        if entry is not None:
            entry[0].close(0)
        self._fail_peer(name)

    def _post(self, h: int, peer: str, local: list[Region], remote: list[Region], notif: bytes) -> object:
        if peer not in self._peers:
            raise TransferError(f"unknown peer {peer!r}")
        sock, sizes = self._peers[peer]
        for r in remote:
            if r.buf >= len(sizes) or r.offset < 0 or r.offset + r.nbytes > sizes[r.buf]:
                raise ValueError(f"region {r} is outside {peer!r}'s buffer {r.buf}")
        header = msgspec.msgpack.encode([h, remote])
        payload = [self._bytes[r.buf][r.offset : r.offset + r.nbytes].cpu().numpy() for r in local]
        try:
            sock.send_multipart([WRITE_TAG, header, notif[1:], *payload], flags=zmq.NOBLOCK)
        except zmq.Again as e:
            raise TransferError(f"{peer!r} is not taking messages") from e
        return None

    def _poll(self, h: int, handle: _Handle) -> Status:
        return self._acks.pop(h, "pending")

    def _discard(self, handle: _Handle) -> None:
        """A sent message cannot be recalled; a late one is still checked by the receiver."""

    def notify(self, peer: str, msg: bytes) -> None:
        entry = self._peers.get(peer)
        if entry is not None:
            try:
                entry[0].send_multipart([NOTIFY_TAG, msg], flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # the peer is gone or stuck; its writes time out

    def _notifications(self) -> list[tuple[str, bytes]]:
        self._progress()
        out, self._inbox = self._inbox, []
        return out

    def _progress(self) -> None:
        while self._router.poll(0):
            frames = self._router.recv_multipart(copy=False)
            peer, tag = frames[0].bytes.decode(), frames[1].bytes
            if tag == NOTIFY_TAG:
                self._inbox.append((peer, frames[2].bytes))
            elif tag == WRITE_TAG:
                self._receive(peer, frames)
        for name, (sock, _) in self._peers.items():
            while sock.poll(0):
                tag, h, ok = sock.recv_multipart()
                if tag == _ACK:
                    self._acks[int.from_bytes(h, "little")] = "done" if ok == _OK else "failed"

    def _receive(self, peer: str, frames: list) -> None:
        try:
            h, remote = msgspec.msgpack.decode(frames[2].bytes, type=tuple[int, list[Region]])
            notif, payload = frames[3].bytes, frames[4:]
        except (msgspec.DecodeError, msgspec.ValidationError, IndexError):
            return  # not from a ZmqTransferAgent: no handle to answer; its writer times out
        ok = len(payload) == len(remote) and all(
            r.buf < len(self._bytes) and r.offset >= 0 and r.offset + r.nbytes <= self._bytes[r.buf].numel()
            and len(f.buffer) == r.nbytes for r, f in zip(remote, payload)
        )
        ok = ok and self._accepts(peer, notif)  # refused: never copied
        if ok:
            with warnings.catch_warnings():  # read-only frames: copied out at once, never written
                warnings.simplefilter("ignore", UserWarning)
                for r, f in zip(remote, payload):
                    src = torch.frombuffer(f.buffer, dtype=torch.uint8)
                    self._bytes[r.buf][r.offset : r.offset + r.nbytes].copy_(src)
            self._inbox.append((peer, notif))
        self._router.send_multipart([frames[0].bytes, _ACK, h.to_bytes(8, "little"), _OK if ok else _REFUSED])

    def _close(self) -> None:
        for name in list(self._peers):
            self.remove_peer(name)
        self._router.close(0)
        self._ctx.term()
        self._bytes.clear()
        self.buffers.clear()

    @property
    def num_registered(self) -> int:
        return len(self._bytes)

    @property
    def num_peers(self) -> int:
        return len(self._peers)
