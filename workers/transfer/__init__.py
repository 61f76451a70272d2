"""Moving KV pages and the final state between PD workers.

Why a package of its own: the engine only says which pages became final and where they must go
(`rlt_serve.engine.handoff`); how bytes cross a process or host boundary is a worker concern with
two answers. NIXL (UCX) moves registered memory directly, device to device on GPUs, without the
bytes passing through Python; ZMQ copies them through a socket where NIXL is not installed. Both
are chosen explicitly (`--kv-transport nixl|zmq`), never by silent fallback, because their
performance differs by orders of magnitude and an operator must know which one runs.

Both implement one small interface (`KVTransferAgent`): register buffers once (K, V, final
state), exchange `metadata()` over the control plane, `write()` region lists built by
`kv_regions()` with a notification naming (request, generation, chunk), and poll. Completion,
commit and release are separate acknowledged events (see `base`), and a receiver refuses writes
whose generation is stale, so a late or duplicated write cannot land in a reused reservation.
Progress is caller-driven: no background threads to shut down or race with the engine.
"""

from __future__ import annotations

import torch

from workers.transfer.base import (
    Acceptor,
    KVTransferAgent,
    Status,
    TransferError,
    TransferNotif,
    decode_notif,
    encode_notif,
)
from workers.transfer.regions import K, STATE, V, KVLayout, Region, chunk_regions, kv_regions, state_regions

KV_TRANSPORTS = ("nixl", "zmq")


def make_agent(kind: str, name: str, buffers: list[torch.Tensor], accept: Acceptor | None = None,
               timeout_s: float = 30.0, host: str = "127.0.0.1") -> KVTransferAgent:
    """The transport named by `--kv-transport`; a clear error if it cannot run here. `host`: the
    address the ZMQ transport binds and advertises (NIXL/UCX picks its own, see UCX_NET_DEVICES)."""
    if kind == "zmq":
        from workers.transfer.zmq_agent import ZmqTransferAgent

        return ZmqTransferAgent(name, buffers, accept, timeout_s, host)
    if kind == "nixl":
        from workers.transfer.nixl_agent import NixlTransferAgent, nixl_unavailable

        why = nixl_unavailable()
        if why is not None:
            raise RuntimeError(f"--kv-transport nixl: {why}; or choose --kv-transport zmq")
        return NixlTransferAgent(name, buffers, accept, timeout_s)
    raise ValueError(f"--kv-transport {kind!r}: choose one of {', '.join(KV_TRANSPORTS)}")


__all__ = [
    "KV_TRANSPORTS", "Acceptor", "K", "KVLayout", "KVTransferAgent", "Region", "STATE", "Status", "TransferError",
    "TransferNotif", "V", "chunk_regions", "decode_notif", "encode_notif", "kv_regions", "make_agent", "state_regions",
]
