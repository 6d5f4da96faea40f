"""The API's ASGI middleware."""

from __future__ import annotations

from typing import Any

from tiered.api.errors import APIError, reply


def needs_key(path: str, metrics_require_key: bool) -> bool:
    """vLLM's rule: the API key guards the OpenAI routes, /v1/...; /health, /version, /tokenize,
    /detokenize and /metrics stay open (probes and monitoring carry no key, and tokenizing never
    reaches the engine). Two exceptions: /metrics when server.metrics_require_key, and
    /generative_scoring, the unversioned twin of /v1/generative-scores, which computes as it does."""
    if path.startswith(("/v1", "/generative_scoring")):
        return True
    return metrics_require_key and path == "/metrics"


class Guard:
    """Pure ASGI middleware (cheaper than BaseHTTPMiddleware, and leaves disconnects visible):
    the API key where `needs_key` says (401), the body size limit (413), and the client's
    X-Request-Id echoed on the response (as vLLM does)."""

    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int, metrics_require_key: bool) -> None:
        self.app, self.api_key, self.max_body = app, api_key, max_body_bytes
        self.metrics_require_key = metrics_require_key

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        request_id = headers.get(b"x-request-id")
        if request_id is not None:
            inner_send = send

            async def send(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id)]}
                await inner_send(message)

        if self.api_key and needs_key(scope["path"], self.metrics_require_key):
            if headers.get(b"authorization", b"") != f"Bearer {self.api_key}".encode():
                return await reply(send, 401, "Incorrect API key provided.", "invalid_request_error")
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            return await reply(
                send, 413, f"the request body is over server.max_body_bytes={self.max_body}", "invalid_request_error"
            )
        seen = 0

        async def counted() -> dict[str, Any]:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_body:  # a chunked body without content-length
                raise APIError(413, f"the request body is over server.max_body_bytes={self.max_body}")
            return message

        return await self.app(scope, counted, send)
