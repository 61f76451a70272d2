"""Typed messages between the router and worker processes, serialised in one place.

One msgspec Struct per message kind, tagged so a single decoder reads any of them. The protocol
already names roles (`prefill`, `decode`, `both`) so PD disaggregation adds messages rather than
changing these. Token deltas carry ids only: the router detokenises.
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


class Ready(msgspec.Struct, tag="ready"):
    worker_id: str
    role: Role
    pid: int
    model: str
    page_size: int
    total_pages: int
    max_num_seqs: int
    max_model_len: int


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


ToWorker = Union[Submit, Abort, Shutdown]
ToRouter = Union[Ready, Delta, Capacity, Health, Metrics]

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
