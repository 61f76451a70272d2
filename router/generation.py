"""One HTTP request's engine requests, from admission to the last token.

An OpenAI request with several prompts or `n` > 1 becomes one engine request per choice (the
engine only runs n=1; choice i of a seeded request gets seed + i). `Generation` reserves
credits for all of them in one grant before any is dispatched, so a request is either wholly
admitted or refused (429; 400 when its choices could never run at once), never half-run; it
then merges their deltas into one stream of `ChoiceEvent`s with text already detokenised and
stop strings applied.

With prefill/decode disaggregation (`pd` given) each choice takes a decode ticket and then a
prefill ticket, and is dispatched through `router.pd.PDRouter`, which owns the prefill ticket
from then on; deltas still arrive from the decode worker exactly as from a `both` worker.

`close()` is synchronous and idempotent: it aborts every choice still running in a worker and
returns every ticket. Callers put it in a `finally`, which therefore also covers client
disconnects (task cancellation), deadlines and failures: a request ends exactly once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from rlt_serve.sampling_params import SamplingParams
from rlt_serve.tokenizer import Tokenizer
from router.admission import Admission, GroupTooLarge, NoCapacity, Overloaded, Ticket
from router.errors import APIError, invalid
from router.metrics import RouterMetrics
from router.pd import PDRouter
from router.text_stream import TextStream
from router.worker_pool import WorkerPool
from workers.protocol import Delta, Submit, TokenLogprob

# SamplingParams fields a worker needs; stop strings stay here (the router applies them) and the
# worker does not detokenise (the router does).
_WORKER_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "ignore_eos", "max_tokens",
    "min_tokens", "logprobs", "skip_special_tokens", "num_loops", "min_loops", "exit_threshold", "exit_criterion",
    "exit_check_interval",
)  # fmt: skip


@dataclass
class Choice:
    """One engine request: a prompt, its sampling parameters, and what came back so far."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str = ""
    ticket: Ticket | None = None  # the worker that generates (`both` or decode)
    prefill_ticket: Ticket | None = None  # PD, until handed to the PD driver
    text: TextStream | None = None
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None

    @property
    def footprint(self) -> int:
        return len(self.prompt_ids) + (self.params.max_tokens or 0)


@dataclass
class ChoiceEvent:
    index: int
    text: str  # new text that may be sent
    token_ids: list[int]  # new token ids (after a stop string: up to the one that completed it)
    logprobs: list[list[TokenLogprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class Generation:
    def __init__(
        self,
        request_id: str,
        choices: list[Choice],
        pool: WorkerPool,
        admission: Admission,
        metrics: RouterMetrics,
        tokenizer: Tokenizer,
        deadline: float,
        priority: int = 0,
        arrival: float | None = None,
        worker_id: str | None = None,
        pd: PDRouter | None = None,
        prefill_worker_id: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.choices = choices
        self.pool, self.admission, self.metrics, self.tokenizer = pool, admission, metrics, tokenizer
        self.deadline = deadline  # unix time
        self.priority = priority
        self.arrival = arrival if arrival is not None else time.monotonic()
        self.worker_id = worker_id  # pin (warm-up); with PD, of the decode worker
        self.pd = pd
        self.prefill_worker_id = prefill_worker_id  # PD pin (warm-up)
        self._sink: asyncio.Queue[Delta] = asyncio.Queue()
        self._by_id: dict[str, Choice] = {}
        self._running: set[str] = set()
        self._closed = False
        for c in choices:
            c.request_id = f"{request_id}-{c.index}"
            self._by_id[c.request_id] = c
            p = c.params
            c.text = TextStream(
                tokenizer, list(p.stop), p.include_stop_str_in_output, p.min_tokens, p.skip_special_tokens
            )

    # -- admission and dispatch -------------------------------------------------------------
    async def start(self) -> None:
        """Reserve every choice's credits, then dispatch them all.

        Each ticket is stored on its choice the moment it is granted, so `close()` returns it
        even when the caller is cancelled between the grant and this coroutine resuming; one
        granted after `close()` is returned at once, and a closed generation dispatches nothing."""
        role = "decode" if self.pd is not None else None
        failure = await self._acquire_all("ticket", [c.footprint for c in self.choices], self.worker_id, role)
        if failure is None and self.pd is not None and not self._closed:  # decode first, then prefill: no cyclic wait
            failure = await self._acquire_all("prefill_ticket", [len(c.prompt_ids) for c in self.choices],
                                              self.prefill_worker_id, "prefill")  # fmt: skip
        if failure is not None:
            self.close()
            if isinstance(failure, Overloaded):
                raise APIError(429, str(failure), code="rate_limit_exceeded",
                               headers={"Retry-After": str(max(1, round(failure.retry_after)))})  # fmt: skip
            if isinstance(failure, GroupTooLarge):
                several_prompts = len({tuple(c.prompt_ids) for c in self.choices}) > 1
                raise invalid(str(failure), param="prompt" if several_prompts else "n")
            if isinstance(failure, NoCapacity):
                raise APIError(503, str(failure), code="no_worker")
            raise failure
        if self._closed:  # closed while it waited: every ticket has been returned
            return
        queued = time.monotonic() - self.arrival
        for c in self.choices:
            self.metrics.queue_time.observe(queued)
            assert c.ticket is not None
            sampling = {name: getattr(c.params, name) for name in _WORKER_FIELDS}
            sampling["detokenize"] = False
            self._running.add(c.request_id)
            if self.pd is not None:
                assert c.prefill_ticket is not None
                ticket, c.prefill_ticket = c.prefill_ticket, None  # the driver releases it
                self.pd.start(c.request_id, c.prompt_ids, sampling, self.deadline, self.priority, c.ticket, ticket,
                              self._sink)  # fmt: skip
                continue
            msg = Submit(c.request_id, c.prompt_ids, sampling, deadline=self.deadline, priority=self.priority)
            self.pool.submit(c.ticket.worker_id, msg, self._sink)

    async def _acquire_all(
        self, slot: str, num_tokens: list[int], worker_id: str | None, role: str | None
    ) -> BaseException | None:
        """One ticket per choice (for `num_tokens[i]` tokens) into `choice.<slot>`, all granted
        together; the failure, or None."""

        async def take_all() -> None:
            tickets = await self.admission.acquire_group(
                [c.request_id for c in self.choices], num_tokens, self.priority, worker_id,
                self.deadline - time.time(), role,
            )  # fmt: skip
            for c, ticket in zip(self.choices, tickets):
                if self._closed:
                    self.admission.release(ticket)
                else:
                    setattr(c, slot, ticket)

        # gather: a cancelled caller is cancelled even when the grant lands in the same tick
        # (the tickets are then on the choices, for close())
        (result,) = await asyncio.gather(take_all(), return_exceptions=True)
        return result

    # -- the stream -------------------------------------------------------------------------
    async def events(self) -> AsyncIterator[ChoiceEvent]:
        """Choice events until every choice has finished; raises APIError on failure or deadline."""
        while self._running:
            left = self.deadline - time.time()
            if left <= 0:
                raise APIError(504, "request timed out (request_timeout)", code="timeout")
            try:
                delta = await asyncio.wait_for(self._sink.get(), left)
            except asyncio.TimeoutError:
                raise APIError(504, "request timed out (request_timeout)", code="timeout") from None
            event = self._apply(delta)
            if event is not None:
                yield event

    def _apply(self, d: Delta) -> ChoiceEvent | None:
        c = self._by_id.get(d.request_id)
        if c is None or d.request_id not in self._running:
            return None
        text = c.text
        assert text is not None
        if d.finish_reason == "error":
            self._end(c)
            raise self._worker_error(c, d.error or "worker error")
        now = time.monotonic()
        kept: list[int] = []
        for tok in d.token_ids:
            kept.append(tok)
            if text.push(tok):
                break
        if kept:
            if c.first_token_at is None:
                c.first_token_at = now
                self.metrics.ttft.observe(now - self.arrival)
            elif c.last_token_at is not None:
                gap = (now - c.last_token_at) / len(kept)
                for _ in kept:
                    self.metrics.itl.observe(gap)
            c.last_token_at = now
            c.token_ids.extend(kept)
        logprobs = d.logprobs[: len(kept)] if d.logprobs is not None else None
        if text.finished and text.stop_reason is not None:  # a stop string: the worker may still run
            c.finish_reason, c.stop_reason = "stop", text.stop_reason
            self._abort(c.request_id)
            self._end(c)
        elif d.finish_reason is not None:
            text.finish()
            c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
            if d.finish_reason == "abort" and d.error:  # the worker gave up on it (deadline, shutdown)
                self._end(c)
                raise APIError(504 if "deadline" in d.error else 503, f"request aborted by the worker: {d.error}")
            self._end(c)
        return ChoiceEvent(c.index, text.take(), kept, logprobs, c.finish_reason, c.stop_reason)

    def _worker_error(self, c: Choice, error: str) -> APIError:
        # A submit the engine refused names the field ("prompt: ..."): the client's mistake.
        if not c.token_ids and not error.startswith("worker "):
            err = invalid(error)
            if err.param is not None:
                return err
        if error.startswith("worker ") and "timed out" in error:
            return APIError(504, error, code="timeout")
        return APIError(503 if error.startswith("worker ") else 500, error, code="worker_error")

    def _end(self, c: Choice) -> None:
        self._running.discard(c.request_id)
        if self.pd is not None:  # however it ended, the handoff's other side lets go
            self.pd.cancel(c.request_id)
        if c.ticket is not None:
            self.admission.release(c.ticket)
        now = time.monotonic()
        self.metrics.e2e.observe(now - self.arrival)
        self.metrics.prompt_tokens.observe(len(c.prompt_ids))
        self.metrics.generation_tokens.observe(len(c.token_ids))

    def close(self) -> None:
        """Abort what still runs and return every credit; safe to call any number of times."""
        if self._closed:
            return
        self._closed = True
        for rid in list(self._running):
            self._abort(rid)
        self._running.clear()
        for c in self.choices:
            if c.ticket is not None:
                self.admission.release(c.ticket)
            if c.prefill_ticket is not None:
                self.admission.release(c.prefill_ticket)
            self.pool.forget(c.request_id)

    def _abort(self, request_id: str) -> None:
        if self.pd is not None:
            self.pd.cancel(request_id)
        else:
            self.pool.abort(request_id)
