"""KV transfer with NIXL (UCX backend): one-sided WRITEs of registered KV memory, device memory on
GPU and host memory on CPU (selected with `--kv-transport nixl`).

The data path never touches Python: the writer posts a put from its registered pages into the
peer's registered pages and NIXL delivers the notification after the data. A put cannot be refused
by the receiver, so a stale generation is refused at commit (its notification is dropped and the
writer told `refused`); keeping the pages of an aborted reservation unused until the writer is
quiet (or removed as a peer) is the worker's part, see workers/transfer/API.md. NIXL keys notifications by the
agent name as str, while `add_remote_agent()` returns it as bytes: names are decoded once here.
"""

from __future__ import annotations

import msgspec
import torch

from workers.transfer.base import NOTIFY_TAG, WRITE_TAG, Acceptor, KVTransferAgent, Status, TransferError, _Handle
from workers.transfer.regions import Region


def import_nixl():
    """The `nixl_agent` module of the installed NIXL wheel (nixl-cu13 or nixl-cu12), or raise."""
    try:
        import nixl_cu13._api as api
    except ImportError:
        try:
            import nixl_cu12._api as api
        except ImportError:
            import nixl._api as api
    return api


def nixl_unavailable() -> str | None:
    """Why NIXL cannot be used here, or None."""
    try:
        import_nixl()
    except Exception as e:  # a missing wheel or a broken native library
        return f"NIXL is not importable ({type(e).__name__}: {e}); install the 'pd' extra (nixl-cu13)"
    return None


class _Meta(msgspec.Struct):
    name: str
    agent: bytes  # nixl agent metadata
    mem: str  # DRAM | VRAM
    buffers: list[tuple[int, int, int]]  # (address, bytes, device id) per registered buffer


class NixlTransferAgent(KVTransferAgent):
    kind = "nixl"

    def __init__(self, name: str, buffers: list[torch.Tensor], accept: Acceptor | None = None,
                 timeout_s: float = 30.0, backends: tuple[str, ...] = ("UCX",)) -> None:
        super().__init__(name, buffers, accept, timeout_s)
        api = import_nixl()
        self._agent = api.nixl_agent(name, api.nixl_agent_config(backends=list(backends)))
        if any(b.device != buffers[0].device for b in buffers):
            raise ValueError("all registered buffers must live on one device")
        self._mem = "VRAM" if buffers[0].is_cuda else "DRAM"
        self._dev = (buffers[0].device.index or 0) if buffers[0].is_cuda else 0
        for b in buffers:
            if not b.is_contiguous():
                raise ValueError("registered buffers must be contiguous")
        self._local = [(b.data_ptr(), b.numel() * b.element_size()) for b in buffers]
        self._regs = [self._agent.register_memory(b) for b in buffers]
        self._peers: dict[str, _Meta] = {}

    def metadata(self) -> bytes:
        bufs = [(addr, n, self._dev) for addr, n in self._local]
        return msgspec.msgpack.encode(_Meta(self.name, self._agent.get_agent_metadata(), self._mem, bufs))

    def add_peer(self, name: str, metadata: bytes) -> None:
        meta = msgspec.msgpack.decode(metadata, type=_Meta)
        if meta.name != name:
            raise ValueError(f"metadata is for agent {meta.name!r}, not {name!r}")
        if name in self._peers:  # a restarted peer: forget the old incarnation first
            self.remove_peer(name)
        if meta.mem != self._mem:
            raise ValueError(f"peer {name!r} registered {meta.mem} memory, this agent {self._mem}")
        loaded = self._agent.add_remote_agent(meta.agent)
        loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
        if loaded != name:
            raise ValueError(f"NIXL loaded agent {loaded!r} for peer {name!r}")
        self._peers[name] = meta

    def remove_peer(self, name: str) -> None:
        self._fail_peer(name)
        if self._peers.pop(name, None) is not None:
            self._agent.remove_remote_agent(name)

    def _descs(self, regions: list[Region], bases: list[tuple[int, int, int]]):
        return self._agent.get_xfer_descs([(bases[r.buf][0] + r.offset, r.nbytes, bases[r.buf][2]) for r in regions],
                                          self._mem)

    def _post(self, h: int, peer: str, local: list[Region], remote: list[Region], notif: bytes) -> object:
        meta = self._peers.get(peer)
        if meta is None:
            raise TransferError(f"unknown peer {peer!r}")
        for r in remote:
            if r.buf >= len(meta.buffers) or r.offset < 0 or r.offset + r.nbytes > meta.buffers[r.buf][1]:
                raise ValueError(f"region {r} is outside {peer!r}'s buffer {r.buf}")
        local_bases = [(addr, n, self._dev) for addr, n in self._local]
        try:
            xfer = self._agent.initialize_xfer("WRITE", self._descs(local, local_bases), self._descs(remote, meta.buffers),
                                               peer, notif)
        except Exception as e:  # nixl raises its own error types from the bindings
            raise TransferError(f"write to {peer!r} could not be prepared: {e}") from e
        try:
            state = self._agent.transfer(xfer)
        except Exception as e:  # e.g. nixlRemoteDisconnectError: the peer died
            state = f"ERR ({type(e).__name__})"
        if state.startswith("ERR"):
            self._release(xfer)
            raise TransferError(f"write to {peer!r} failed to post: {state}")
        return xfer

    def _poll(self, h: int, handle: _Handle) -> Status:
        try:
            state = self._agent.check_xfer_state(handle.native)
        except Exception:  # the bindings raise for a broken connection
            state = "ERR"
        return "done" if state == "DONE" else "failed" if state == "ERR" else "pending"

    def _release(self, xfer) -> None:
        try:
            self._agent.release_xfer_handle(xfer)
        except Exception:  # a put that cannot be cancelled: NIXL frees it with the agent
            pass

    def _discard(self, handle: _Handle) -> None:
        if handle.native is not None:
            self._release(handle.native)
            handle.native = None

    def notify(self, peer: str, msg: bytes) -> None:
        if peer in self._peers:
            self._agent.send_notif(peer, NOTIFY_TAG + msg)

    def _notifications(self) -> list[tuple[str, bytes]]:
        out: list[tuple[str, bytes]] = []
        for peer, msgs in self._agent.get_new_notifs().items():
            peer = peer.decode() if isinstance(peer, bytes) else peer
            for m in msgs:
                tag, body = m[:1], m[1:]
                if tag == NOTIFY_TAG or (tag == WRITE_TAG and self._accepts(peer, body)):
                    out.append((peer, body))
        return out

    def _close(self) -> None:
        for name in list(self._peers):
            self.remove_peer(name)
        for reg in self._regs:
            self._agent.deregister_memory(reg)
        self._regs.clear()
        self.buffers.clear()
        self._agent = None  # the native agent (and its UCX workers/threads) goes with the last reference

    @property
    def num_registered(self) -> int:
        return len(self._regs)

    @property
    def num_peers(self) -> int:
        return len(self._peers)
