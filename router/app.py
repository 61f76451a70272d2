"""The router's FastAPI app: configuration, wiring, and the small endpoints.

`create_app` builds everything that needs no event loop (tokenizer, admission book, metrics,
the pool object); the lifespan binds the ZMQ sockets, and each worker's Ready starts its
warm-up. The generation endpoints live in `router.serving`.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from rlt_serve.config import ModelConfig
from rlt_serve.loader import load_generation_config
from rlt_serve.tokenizer import Tokenizer, TokenizerError
from router import errors, health
from router.admission import Admission
from router.errors import APIError, invalid
from router.metrics import RouterMetrics
from router.middleware import ApiKey, BodyLimit
from router.openai_protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, now
from router.pd import PDRouter, PDTimeouts
from router.preprocess import Preprocessor, served_model_check
from router.serving import Serving
from router.worker_pool import WorkerPool, WorkerSpec

__all__ = ["RouterConfig", "WorkerSpec", "create_app"]


@dataclass
class RouterConfig:
    model_dir: str
    served_model_name: str
    router_addr: str
    workers: list[WorkerSpec] = field(default_factory=list)
    api_key: str | None = None
    max_queue: int = 256
    request_timeout: float = 600.0
    max_body_bytes: int = 4 << 20
    queue_timeout: float = 30.0
    heartbeat_timeout: float = 3.0
    pd: bool = False  # prefill/decode disaggregation: workers in roles prefill and decode
    worker_addrs: tuple[str, ...] = ()  # more endpoints for workers that join (tcp://HOST:PORT)
    pd_timeouts: PDTimeouts = field(default_factory=PDTimeouts)


def create_app(config: RouterConfig) -> FastAPI:
    tokenizer = Tokenizer.from_pretrained(config.model_dir)
    model_config = ModelConfig.from_pretrained(config.model_dir)
    pre = Preprocessor(tokenizer, model_config, load_generation_config(config.model_dir))
    admission = Admission(config.max_queue, config.queue_timeout)
    pool = WorkerPool(
        config.router_addr, config.workers, admission, heartbeat_timeout=config.heartbeat_timeout, pd=config.pd,
        extra_addrs=config.worker_addrs,
    )  # fmt: skip
    pd = PDRouter(pool, admission, config.pd_timeouts) if config.pd else None
    metrics = RouterMetrics(pool, admission, pd)
    serving = Serving(config.served_model_name, pre, tokenizer, pool, admission, metrics, config.request_timeout, pd)
    warmups: set[asyncio.Task] = set()

    def on_ready(worker_id: str) -> None:
        task = asyncio.create_task(health.warm_up(worker_id, pool, admission, tokenizer, pd))
        warmups.add(task)
        task.add_done_callback(warmups.discard)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        pool.on_ready = on_ready
        await pool.start()
        try:
            yield
        finally:
            for t in list(warmups):
                t.cancel()
            if pd is not None:
                await pd.stop()
            await pool.stop()

    app = FastAPI(title="rlt-serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.config = config
    app.state.pool = pool
    app.state.admission = admission
    app.state.metrics = metrics
    app.state.serving = serving
    app.state.pd = pd
    generation_paths = ("/v1/completions", "/v1/chat/completions")
    errors.install(app, on_invalid=lambda r: metrics.count(400) if r.url.path in generation_paths else None)
    app.add_middleware(ApiKey, api_key=config.api_key)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)  # outermost: runs first

    def max_model_len() -> int:
        lens = [w.ready.max_model_len for w in pool.serving_workers() if w.ready is not None]
        return min(lens) if lens else model_config.max_position_embeddings

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving.chat(body, request)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": config.served_model_name,
            "object": "model",
            "created": now(),
            "owned_by": "rlt-serve",
            "root": config.model_dir,
            "parent": None,
            "max_model_len": max_model_len(),
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health_endpoint() -> JSONResponse:
        status, body = health.report(pool)
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        served_model_check(body.model, config.served_model_name)
        if (body.prompt is None) == (body.messages is None):
            raise invalid("prompt: give exactly one of prompt or messages", "prompt")
        if body.prompt is not None:
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            text = pre.render_chat(
                pre.messages(body.messages or []),
                body.add_generation_prompt,
                body.continue_final_message,
                body.chat_template_kwargs,
            )
            # A rendered chat holds its special tokens already (LLM.chat encodes it the same way).
            add = body.add_special_tokens if "add_special_tokens" in body.model_fields_set else False
            ids = tokenizer.encode(text, add_special_tokens=add)
        strs = [serving.tok_str(t) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": max_model_len(), "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        served_model_check(body.model, config.served_model_name)
        vocab = model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise invalid(f"tokens: token id {bad[0]} is outside the vocabulary [0, {vocab})", "tokens")
        try:
            return {"prompt": tokenizer.decode(body.tokens)}
        except TokenizerError as e:
            raise APIError(400, f"tokens: {e}", param="tokens") from None

    return app
