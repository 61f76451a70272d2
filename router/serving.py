"""`/v1/completions` and `/v1/chat/completions`: run a Generation, answer as JSON or SSE.

A streaming response starts only once the request is admitted and its first token is out, so
admission (429), refusals by the engine (400) and a dead worker (503) are still real HTTP
errors; after that an error becomes a final `data: {"error": ...}` event, which the official
client raises. A client that goes away at any point cancels the work, and `Generation.close()`
in a `finally` aborts the worker requests and returns the credits.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rlt_serve.tokenizer import Tokenizer
from router import openai_protocol as oai
from router.admission import Admission
from router.errors import APIError
from router.generation import Choice, ChoiceEvent, Generation
from router.metrics import RouterMetrics
from router.pd import PDRouter
from router.openai_protocol import ChatCompletionRequest, CompletionRequest
from router.preprocess import Preprocessor, served_model_check
from router.worker_pool import WorkerPool
from workers.protocol import TokenLogprob

T = TypeVar("T")
_LP_FLOOR = -9999.0  # JSON has no -Infinity


class ClientGone(Exception):
    pass


def _lp(x: float) -> float:
    return _LP_FLOOR if x != x or x < _LP_FLOOR else x


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


@dataclass
class _ChoiceAcc:
    """What a non-streaming response needs of one choice."""

    text: list[str] = field(default_factory=list)
    lp_tokens: list[int] = field(default_factory=list)
    lp_entries: list[list[TokenLogprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class _Format:
    """Shapes of one endpoint: chunk per event, and the final JSON."""

    object_name: str
    chunk_object: str

    def __init__(self, tok_str, logprobs: int | None) -> None:
        self.tok_str = tok_str
        self.k = logprobs
        self.offsets: dict[int, int] = {}

    def logprobs(self, index: int, token_ids: list[int], entries: list[list[TokenLogprob]] | None) -> dict | None:
        raise NotImplementedError

    def choice(self, index: int, acc: _ChoiceAcc) -> dict:
        raise NotImplementedError

    def chunk_choices(self, ev: ChoiceEvent) -> list[dict]:
        raise NotImplementedError

    def start_chunks(self, n: int) -> list[dict]:
        return []


class _CompletionFormat(_Format):
    object_name = chunk_object = "text_completion"

    def logprobs(self, index, token_ids, entries):
        if self.k is None or entries is None:
            return None
        offset = self.offsets.get(index, 0)
        tokens, offsets = [], []
        for t in token_ids:
            s = self.tok_str(t)
            tokens.append(s)
            offsets.append(offset)
            offset += len(s)
        self.offsets[index] = offset
        return {
            "text_offset": offsets,
            "token_logprobs": [_lp(e[0].logprob) for e in entries],
            "tokens": tokens,
            # OpenAI: the k most likely tokens plus the sampled one (up to k + 1 entries).
            "top_logprobs": [{self.tok_str(x.token_id): _lp(x.logprob) for x in e} for e in entries],
        }

    def choice(self, index, acc):
        lp = self.logprobs(index, acc.lp_tokens, acc.lp_entries) if self.k is not None else None
        return oai.completion_choice(index, "".join(acc.text), lp, acc.finish_reason, acc.stop_reason)

    def chunk_choices(self, ev):
        lp = self.logprobs(ev.index, ev.token_ids, ev.logprobs) if ev.token_ids else None
        if not ev.text and ev.finish_reason is None and lp is None:
            return []
        return [oai.completion_choice(ev.index, ev.text, lp, ev.finish_reason, ev.stop_reason)]


class _ChatFormat(_Format):
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def _entry(self, x: TokenLogprob) -> dict:
        s = self.tok_str(x.token_id)
        return {"token": s, "logprob": _lp(x.logprob), "bytes": list(s.encode("utf-8"))}

    def logprobs(self, index, token_ids, entries):
        if self.k is None or entries is None:
            return None
        content = []
        for e in entries:
            top = sorted((x for x in e if x.rank is not None and x.rank <= self.k), key=lambda x: x.rank)[: self.k]
            content.append({**self._entry(e[0]), "top_logprobs": [self._entry(x) for x in top]})
        return {"content": content}

    def choice(self, index, acc):
        lp = self.logprobs(index, acc.lp_tokens, acc.lp_entries) if self.k is not None else None
        return oai.chat_choice(index, "".join(acc.text), lp, acc.finish_reason, acc.stop_reason)

    def start_chunks(self, n):
        return [oai.chat_chunk_choice(i, {"role": "assistant", "content": ""}, None, None, None) for i in range(n)]

    def chunk_choices(self, ev):
        lp = self.logprobs(ev.index, ev.token_ids, ev.logprobs) if ev.token_ids else None
        if not ev.text and ev.finish_reason is None and lp is None:
            return []
        delta = {"content": ev.text} if ev.text or ev.finish_reason is None else {}
        return [oai.chat_chunk_choice(ev.index, delta, lp, ev.finish_reason, ev.stop_reason)]


class Serving:
    def __init__(
        self,
        served_model_name: str,
        pre: Preprocessor,
        tokenizer: Tokenizer,
        pool: WorkerPool,
        admission: Admission,
        metrics: RouterMetrics,
        request_timeout: float,
        pd: PDRouter | None = None,
    ) -> None:
        self.model = served_model_name
        self.pd = pd
        self.pre = pre
        self.tokenizer = tokenizer
        self.pool, self.admission, self.metrics = pool, admission, metrics
        self.request_timeout = request_timeout
        self._tok_strs: dict[int, str] = {}

    def tok_str(self, token_id: int) -> str:
        s = self._tok_strs.get(token_id)
        if s is None:
            s = self._tok_strs[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return s

    def max_model_len(self) -> int:
        lens = [w.ready.max_model_len for w in self.pool.serving_workers() if w.ready is not None]
        if not lens:
            raise APIError(503, "no worker is ready to serve requests", code="no_worker")
        return min(lens)

    # -- endpoints ------------------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        try:
            served_model_check(req.model, self.model)
            if req.echo:
                raise APIError(400, "echo: not supported by this server", param="echo")
            if req.suffix:
                raise APIError(400, "suffix: not supported by this server", param="suffix")
            if req.best_of is not None and req.best_of != req.n:
                raise APIError(400, "best_of: only best_of == n is supported", param="best_of")
            prompts = self.pre.completion_prompts(req)
            choices = self.pre.choices(req, prompts, req.max_tokens, req.logprobs, self.max_model_len(), "prompt")
        except APIError as e:
            self.metrics.count(e.status)
            raise
        fmt = _CompletionFormat(self.tok_str, req.logprobs)
        return await self._serve(request, req, f"cmpl-{uuid.uuid4().hex}", choices, prompts, fmt, arrival)

    async def chat(self, req: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        try:
            served_model_check(req.model, self.model)
            if req.echo:
                raise APIError(400, "echo: not supported by this server", param="echo")
            if req.top_logprobs is not None and not req.logprobs:
                raise APIError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
            ids = self.pre.chat_prompt(req)
            k = (req.top_logprobs or 0) if req.logprobs else None
            max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            choices = self.pre.choices(req, [ids], max_tokens, k, self.max_model_len(), "messages")
        except APIError as e:
            self.metrics.count(e.status)
            raise
        fmt = _ChatFormat(self.tok_str, k)
        return await self._serve(request, req, f"chatcmpl-{uuid.uuid4().hex}", choices, [ids], fmt, arrival)

    # -- running ----------------------------------------------------------------------------------
    async def _serve(self, request, req, rid: str, choices: list[Choice], prompts, fmt: _Format, arrival: float):
        gen = Generation(
            rid, choices, self.pool, self.admission, self.metrics, self.tokenizer,
            deadline=time.time() + self.request_timeout, priority=req.priority, arrival=arrival, pd=self.pd,
        )  # fmt: skip
        created = oai.now()
        num_prompt = sum(len(p) for p in prompts)
        streaming = False
        status = 200
        try:
            if req.stream:
                events = gen.events()
                first = await self._unless_gone(request, self._first(gen, events))
                opts = req.stream_options or oai.StreamOptions()
                body = self._stream(gen, events, first, fmt, rid, created, num_prompt, len(choices), opts)
                streaming = True
                return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            result = await self._unless_gone(request, self._collect(gen, fmt, rid, created, num_prompt))
            return JSONResponse(result)
        except APIError as e:
            status = e.status
            raise
        except ClientGone:
            status = 499
            return Response(status_code=499)
        finally:
            if not streaming:
                gen.close()
                self.metrics.count(status)

    @staticmethod
    async def _first(gen: Generation, events: AsyncIterator[ChoiceEvent]) -> ChoiceEvent:
        await gen.start()
        return await anext(events)

    async def _collect(self, gen: Generation, fmt: _Format, rid: str, created: int, num_prompt: int) -> dict:
        await gen.start()
        accs = {c.index: _ChoiceAcc() for c in gen.choices}
        async for ev in gen.events():
            acc = accs[ev.index]
            acc.text.append(ev.text)
            if ev.logprobs is not None:
                acc.lp_tokens.extend(ev.token_ids)
                acc.lp_entries.extend(ev.logprobs)
            if ev.finish_reason is not None:
                acc.finish_reason, acc.stop_reason = ev.finish_reason, ev.stop_reason
        completion_tokens = sum(len(c.token_ids) for c in gen.choices)
        choices = [fmt.choice(i, accs[i]) for i in sorted(accs)]
        return oai.envelope(
            rid, fmt.object_name, created, self.model, choices, oai.usage(num_prompt, completion_tokens)
        )

    async def _stream(
        self,
        gen: Generation,
        events: AsyncIterator[ChoiceEvent],
        first: ChoiceEvent,
        fmt: _Format,
        rid: str,
        created: int,
        num_prompt: int,
        n: int,
        opts: oai.StreamOptions,
    ) -> AsyncIterator[str]:
        status = 200

        def chunk(choices: list[dict]) -> str:
            u: Any = None
            if opts.continuous_usage_stats:
                u = oai.usage(num_prompt, sum(len(c.token_ids) for c in gen.choices))
            obj = oai.envelope(rid, fmt.chunk_object, created, self.model, choices, u)
            if not (opts.include_usage or opts.continuous_usage_stats):
                del obj["usage"]
            return _sse(obj)

        try:
            start = fmt.start_chunks(n)
            if start:
                yield chunk(start)
            pending: ChoiceEvent | None = first
            while True:
                if pending is None:
                    pending = await anext(events, None)
                    if pending is None:
                        break
                parts = fmt.chunk_choices(pending)
                pending = None
                if parts:
                    yield chunk(parts)
            if opts.include_usage:
                total = oai.usage(num_prompt, sum(len(c.token_ids) for c in gen.choices))
                yield _sse(oai.envelope(rid, fmt.chunk_object, created, self.model, [], total))
            yield "data: [DONE]\n\n"
        except APIError as e:
            status = e.status
            yield _sse(e.body())
            yield "data: [DONE]\n\n"
        except BaseException:
            status = 499  # cancelled: the client went away
            raise
        finally:
            gen.close()
            self.metrics.count(status)

    @staticmethod
    async def _unless_gone(request: Request, work: Awaitable[T]) -> T:
        """Run `work` unless the client disconnects first (then cancel it: ClientGone)."""
        task = asyncio.ensure_future(work)
        watch = asyncio.ensure_future(_wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                return task.result()
            raise ClientGone()
        finally:
            watch.cancel()
            if not task.done():
                task.cancel()
                task.add_done_callback(lambda t: t.cancelled() or t.exception())


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return
