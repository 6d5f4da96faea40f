"""The API's errors: OpenAI's envelope {"error": {"message", "type", "param", "code"}} for every
failure, raised as APIError by the serving code and rendered by the handlers installed here."""

from __future__ import annotations

import json
import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error for the client: its HTTP status, message, the field at fault (`param`) and OpenAI's type."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type_: str = "invalid_request_error",
        retry_after: float | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type_
        # seconds, sent as a Retry-After header (whole seconds, at least 1)
        self.headers = None if retry_after is None else {"Retry-After": str(max(1, math.ceil(retry_after)))}


class ClientGone(Exception):
    """The HTTP client disconnected while its requests waited."""


def error_body(status: int, message: str, type_: str, param: str | None) -> dict[str, Any]:
    """OpenAI's error envelope for one failure."""
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


async def reply(send: Any, status: int, message: str, type_: str) -> None:
    """An error answered from ASGI middleware (before FastAPI's handlers)."""
    body = json.dumps(error_body(status, message, type_, None)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def install_handlers(app: FastAPI) -> None:
    """Every error in the envelope: ours, Starlette's (unknown route, wrong method, bad JSON), a
    body that fails its schema (400 naming the field), a client gone (499), a bug (500)."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        body = error_body(exc.status, exc.message, exc.type, exc.param)
        return JSONResponse(body, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        body = error_body(exc.status_code, str(exc.detail), "invalid_request_error", None)
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientGone)
    async def gone(_: Request, exc: ClientGone) -> JSONResponse:
        return JSONResponse(error_body(499, "the client disconnected", "cancelled", None), status_code=499)

    @app.exception_handler(Exception)
    async def bug(_: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")
        body = error_body(500, f"internal error: {type(exc).__name__}", "internal_server_error", None)
        return JSONResponse(body, status_code=500)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", []) if p != "body"]
        param = loc[0] if loc else None  # the request field; deeper parts name union members
        message = f"{param or 'body'}: {first.get('msg', 'invalid request')}"
        return JSONResponse(error_body(400, message, "invalid_request_error", param), status_code=400)
