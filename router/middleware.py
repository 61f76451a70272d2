"""ASGI middleware that must run before FastAPI parses anything: body limit and API key.

The body is read here, bounded, and replayed to the app, so an oversize request is refused with
413 without being buffered whole, whether or not it declared a Content-Length.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.errors import APIError


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        too_large = APIError(413, f"request body exceeds {self.max_bytes} bytes", code="request_too_large")
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await too_large.response()(scope, receive, send)
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body = msg.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await too_large.response()(scope, receive, send)
                return
            chunks.append(body)
            if not msg.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class ApiKey:
    """vLLM's --api-key: `Authorization: Bearer KEY` on the API paths; health and metrics stay open."""

    PROTECTED = ("/v1/", "/tokenize", "/detokenize")

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.expected is None or scope["type"] != "http" or not scope["path"].startswith(self.PROTECTED):
            await self.app(scope, receive, send)
            return
        got = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(got, self.expected):
            err = APIError(401, "invalid or missing API key (Authorization: Bearer ...)", code="invalid_api_key")
            err.headers["WWW-Authenticate"] = "Bearer"
            await err.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)
