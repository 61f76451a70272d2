"""Typed messages between the router and worker processes, serialised in one place.

One msgspec Struct per message kind, tagged so a single decoder reads any of them. Token deltas
carry ids only: the router detokenises.

Prefill/decode disaggregation (PD) adds messages rather than changing these. The router is the
coordinator and every PD control message goes through it, so it always knows a request's phase:

    router -> decode   Reserve            decode -> router  Reserved (pages, cached prefix, generation)
    router -> prefill  Prefill            prefill -> router PrefillDone (final state; KV went over the transport)
    router -> decode   Activate           decode -> router  Committed, then Deltas as a `both` worker
    router -> prefill  Release | Abort    prefill -> router PrefillReleased (no write in flight, pages freed)

Transport identities travel the same way: each PD worker sends `PeerInfo` after `Ready`, and the
router sends every worker the whole `PeerTable` whenever it changes (late joiners included).
"""

from __future__ import annotations

from typing import Any, Literal, Union

import msgspec

Role = Literal["both", "prefill", "decode"]


class Submit(msgspec.Struct, tag="submit"):
    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]  # SamplingParams fields
    deadline: float  # unix time after which the worker aborts the request
    priority: int = 0


class Abort(msgspec.Struct, tag="abort"):
    request_id: str


class Shutdown(msgspec.Struct, tag="shutdown"):
    drain: bool = True
    reason: str = ""  # set when the router refuses a worker that tried to join


class Ready(msgspec.Struct, tag="ready"):
    worker_id: str
    role: Role
    pid: int
    model: str
    page_size: int
    total_pages: int
    max_num_seqs: int
    max_model_len: int
    # Where the router reaches this worker's inbox. Launched workers leave it empty (the launcher
    # chose the address); a worker that joins a running router (`rlt-serve worker`) names it here.
    in_addr: str = ""
    kv_transport: str = ""  # PD roles: "nixl" | "zmq"


class PeerInfo(msgspec.Struct, tag="peer_info"):
    """A PD worker's transport identity (e.g. NIXL agent metadata), for its peers."""

    worker_id: str
    role: Role
    transport: str
    metadata: bytes
    layout: dict[str, int | str] = {}  # workers.transfer.regions.KVLayout fields: how to address its KV


class PeerTable(msgspec.Struct, tag="peer_table"):
    """Every live PD worker's identity; sent whole to every worker whenever it changes."""

    peers: list[PeerInfo]


# -- PD control (see the module docstring for the order) --------------------------------------


class Reserve(msgspec.Struct, tag="reserve"):
    """Router -> decode: hold receiving pages and a slot for a request before anyone computes."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]
    deadline: float
    priority: int = 0


class Reserved(msgspec.Struct, tag="reserved"):
    """Decode -> router: the reservation, or why there is none (`error`)."""

    request_id: str
    worker_id: str
    generation: int = 0
    page_ids: list[int] = []
    num_cached_tokens: int = 0  # decode-side prefix-cache hit: not sent again
    seed: int = 0  # the prefill runs with the decode side's seed (Huginn's state depends on it)
    state_slot: int = 0  # row of the decode side's final-state buffer the last write fills
    error: str | None = None


class Prefill(msgspec.Struct, tag="prefill"):
    """Router -> prefill: compute the prompt and push its KV into `decode_worker`'s pages."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]
    deadline: float
    decode_worker: str
    page_ids: list[int]
    num_cached_tokens: int
    generation: int
    seed: int
    state_slot: int
    priority: int = 0


class PrefillDone(msgspec.Struct, tag="prefill_done"):
    """Prefill -> router: every KV write completed; `state` is what decode needs to continue."""

    request_id: str
    worker_id: str
    generation: int
    model_state: dict[str, Any] = {}  # per-request model state (Huginn's), checked on decode
    chunks: list[tuple[int, int]] = []  # (first_page, num_pages) of every KV write, for the commit
    num_writes: int = 0  # writes (each with one notification), the final-state one included
    num_bytes: int = 0
    error: str | None = None  # the prefill failed; it has released everything (no PrefillReleased)


class Activate(msgspec.Struct, tag="activate"):
    """Router -> decode: the KV is written (after `num_writes` notifications); start decoding."""

    request_id: str
    generation: int
    model_state: dict[str, Any]
    chunks: list[tuple[int, int]]
    num_writes: int
    deadline: float = 0.0  # unix time by which the writes' notifications must have arrived


class Committed(msgspec.Struct, tag="committed"):
    """Decode -> router: the request is active; the prefill side may release its pages."""

    request_id: str
    worker_id: str
    generation: int


class Release(msgspec.Struct, tag="release"):
    """Router -> prefill: the decode side committed; free the request's pages."""

    request_id: str


class PrefillReleased(msgspec.Struct, tag="prefill_released"):
    """Prefill -> router: no write of this request is in flight and its pages are free."""

    request_id: str
    worker_id: str

class TokenLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float
    rank: int | None


class Delta(msgspec.Struct, tag="delta"):
    """New tokens of one request since the last delta; `finish_reason` set on the last one."""

    request_id: str
    token_ids: list[int]
    logprobs: list[list[TokenLogprob]] | None = None  # per new token: chosen first, then top-k
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: int | str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    # On the first delta of a request that asked for prompt_logprobs: one entry per prompt
    # position (None for the first, which has no distribution), chosen token first.
    prompt_logprobs: list[list[TokenLogprob] | None] | None = None


class Capacity(msgspec.Struct, tag="capacity"):
    """What the router's credits are reconciled against."""

    worker_id: str
    free_pages: int
    total_pages: int
    free_slots: int
    total_slots: int
    running: int
    waiting: int
    # PD bookkeeping, so tests and operators can check that everything came back.
    reservations: int = 0  # PD requests held: decode, reserved not yet activated; prefill, not yet released
    transfers: int = 0  # open transport handles (writes not yet reaped)
    registrations: int = 0  # transport: registered buffers


class Health(msgspec.Struct, tag="health"):
    worker_id: str
    ok: bool
    detail: str = ""


class Metrics(msgspec.Struct, tag="metrics"):
    """A worker's Prometheus exposition text, relabelled and merged into the router's /metrics."""

    worker_id: str
    text: str


class Loading(msgspec.Struct, tag="loading"):
    """Start-up progress, written on the worker's stdout only (see `status_line`)."""

    worker_id: str
    stage: str  # starting | loading | failed (success is the Ready message)
    elapsed: float
    detail: str = ""


ToWorker = Union[Submit, Abort, Shutdown, PeerTable, Reserve, Prefill, Activate, Release]
ToRouter = Union[Ready, Delta, Capacity, Health, Metrics, PeerInfo, Reserved, PrefillDone, Committed, PrefillReleased]
PDReply = Union[Reserved, PrefillDone, Committed, PrefillReleased]

_encoder = msgspec.msgpack.Encoder()
_to_worker = msgspec.msgpack.Decoder(ToWorker)
_to_router = msgspec.msgpack.Decoder(ToRouter)


# Before the router can hear a worker (and while the launcher waits for all of them), a worker
# reports start-up on stdout as single lines: this prefix, then a JSON Loading or Ready message.
STATUS_PREFIX = "@rlt-worker "
_status_decoder = msgspec.json.Decoder(Union[Loading, Ready])


def status_line(msg: Loading | Ready) -> str:
    return STATUS_PREFIX + msgspec.json.encode(msg).decode()


def parse_status_line(line: str) -> Loading | Ready | None:
    """The message on a status line, or None for any other output."""
    if not line.startswith(STATUS_PREFIX):
        return None
    try:
        return _status_decoder.decode(line[len(STATUS_PREFIX) :].strip())
    except msgspec.DecodeError:
        return None


def encode(msg: ToWorker | ToRouter) -> bytes:
    return _encoder.encode(msg)


def decode_to_worker(data: bytes) -> ToWorker:
    return _to_worker.decode(data)


def decode_to_router(data: bytes) -> ToRouter:
    return _to_router.decode(data)
