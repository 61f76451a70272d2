"""Errors in OpenAI's JSON shape, so every client's error handling works unchanged.

Handlers raise `APIError`; FastAPI's own failures (validation, unknown route, bad JSON) are
mapped here too, so no response ever leaves the router in FastAPI's default `{"detail": ...}`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        err_type = _TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": err_type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


_FIELD_PREFIX = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*): ")


def invalid(message: str, param: str | None = None) -> APIError:
    """A 400; the engine's ValueErrors read `field: why`, so the field is taken from there."""
    if param is None:
        m = _FIELD_PREFIX.match(message)
        param = m.group(1) if m else None
    return APIError(400, message, param=param)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # Union members add their type name to the path (e.g. prompt.str); keep the field names only.
    loc = [p for p in loc if not re.fullmatch(r"(str|int|bool|float|list\[.*\]|dict\[.*\]|function-.*)", p)]
    param = ".".join(loc) if loc else None
    msg = first.get("msg", "invalid value")
    if param is None and first.get("type") == "missing":
        msg = "request body is missing"
    if param is None and first.get("type") in ("model_type", "model_attributes_type", "dict_type"):
        msg = "request body must be a JSON object"
    return (f"{param}: {msg}" if param else msg), param


def install(app: FastAPI, on_invalid: Callable[[Request], None] | None = None) -> None:
    """Register the handlers; `on_invalid` sees every request that failed validation (metrics)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        if on_invalid is not None:
            on_invalid(request)
        return APIError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code, headers=dict(exc.headers or {})).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()
