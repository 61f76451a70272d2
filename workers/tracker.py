"""The worker's book of in-flight requests: what was already sent, deadlines, timings.

`RequestOutput`s are cumulative; the router wants only what is new, so each request remembers
how many tokens went out and a delta is the slice after that. A request the worker aborts on its
own (deadline, shutdown) remembers why, and its final delta carries that reason as `error`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from rlt_serve.outputs import PositionLogprobs, RequestOutput
from workers.protocol import Delta, TokenLogprob


@dataclass
class Tracked:
    request_id: str
    deadline: float  # unix time; <= 0: none
    want_prompt_logprobs: bool
    submitted: float  # monotonic
    num_sent: int = 0
    first_token: float | None = None  # monotonic
    abort_error: str | None = None  # set when the worker itself aborted the request


def logprob_entries(table: PositionLogprobs) -> list[TokenLogprob]:
    """One position's table as the wire list; the engine inserts the chosen token first."""
    return [TokenLogprob(tok, lp.logprob, lp.rank) for tok, lp in table.items()]


class RequestTracker:
    def __init__(self) -> None:
        self._reqs: dict[str, Tracked] = {}

    def __len__(self) -> int:
        return len(self._reqs)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._reqs

    def ids(self) -> list[str]:
        return list(self._reqs)

    def add(self, request_id: str, deadline: float, want_prompt_logprobs: bool) -> None:
        self._reqs[request_id] = Tracked(request_id, deadline, want_prompt_logprobs, time.monotonic())

    def set_deadline(self, request_id: str, deadline: float) -> None:
        req = self._reqs.get(request_id)
        if req is not None:
            req.deadline = deadline

    def mark_aborted(self, request_id: str, error: str) -> bool:
        """Note why the worker aborts a request; False if unknown or already being aborted."""
        req = self._reqs.get(request_id)
        if req is None or req.abort_error is not None:
            return False
        req.abort_error = error
        return True

    def expired(self, now: float) -> list[str]:
        """Requests past their deadline that are not already being aborted."""
        return [r.request_id for r in self._reqs.values() if 0 < r.deadline <= now and r.abort_error is None]

    def delta(self, out: RequestOutput) -> tuple[Delta, Tracked] | None:
        """The new part of `out`; the request is forgotten once its final delta is built."""
        req = self._reqs.get(out.request_id)
        if req is None:
            return None
        comp = out.outputs[0]
        new_ids = comp.token_ids[req.num_sent :]
        logprobs = None
        if comp.logprobs is not None:
            logprobs = [logprob_entries(t) for t in comp.logprobs[req.num_sent : len(comp.token_ids)]]
        prompt_logprobs = None
        if req.num_sent == 0 and req.first_token is None and req.want_prompt_logprobs and out.prompt_logprobs:
            prompt_logprobs = [None if t is None else logprob_entries(t) for t in out.prompt_logprobs]
        if new_ids and req.first_token is None:
            req.first_token = time.monotonic()
        req.num_sent = len(comp.token_ids)
        delta = Delta(
            request_id=out.request_id,
            token_ids=new_ids,
            logprobs=logprobs,
            num_prompt_tokens=len(out.prompt_token_ids),
            prompt_logprobs=prompt_logprobs,
        )
        if out.finished:
            del self._reqs[out.request_id]
            delta.finish_reason = comp.finish_reason
            delta.stop_reason = comp.stop_reason
            delta.error = req.abort_error
        return delta, req

    def pop(self, request_id: str) -> Tracked | None:
        return self._reqs.pop(request_id, None)
