"""Errors in Anthropic's shape on the Messages API's routes.

Every failure of the server is written once, as OpenAI's body (server/api/errors.py, the
API key and body size checks of server/api/middleware.py). On /v1/messages* this ASGI layer
rewrites that body as Anthropic's ``{"type": "error", "error": {"type", "message"}}``, with
the same status (the anthropic SDK picks its exception class from it), so each check and
handler stays written once for both APIs.
"""

from __future__ import annotations

import json
from typing import Any

from server.api.anthropic.protocol import AnthropicErrorDetail, AnthropicErrorResponse
from server.api.middleware import route_path
from server.log import current_request_id

# Anthropic's error types by status (its API reference); others are "api_error".
_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
    429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error",
}
PATH = "/v1/messages"


def anthropic_error_body(status: int, message: str, request_id: str | None = None
                         ) -> dict[str, Any]:
    kind = _TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")
    return AnthropicErrorResponse(error=AnthropicErrorDetail(type=kind, message=message),
                         request_id=request_id or current_request_id()).model_dump()


def _translated(status: int, body: bytes) -> bytes:
    try:
        error = json.loads(body)["error"]
        message, request_id = str(error["message"]), error.get("request_id")
        param = error.get("param")
    except (ValueError, KeyError, TypeError):  # not OpenAI's error body: said as it is
        message, request_id, param = body.decode("utf-8", "replace"), None, None
    if isinstance(param, str) and param and param not in message:
        # Anthropic's body has no param: its messages open with the field's path instead
        message = f"{param}: {message}"
    return json.dumps(anthropic_error_body(status, message, request_id),
                      ensure_ascii=False).encode("utf-8")


class AnthropicErrors:
    """ASGI middleware: JSON error answers on /v1/messages* in Anthropic's shape, and
    every answer there with Anthropic's ``request-id`` header (the X-Request-Id; the SDK
    reads it as ``_request_id`` and ``error.request_id``). It sits
    outside the API key check, so a 401 is rewritten as well. Error bodies are small; the
    answers of other routes, and successful ones, pass through untouched."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not _ours(route_path(scope)):
            await self.app(scope, receive, send)
            return
        start: dict[str, Any] | None = None
        chunks: list[bytes] = []

        async def rewrite(message: dict[str, Any]) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                message = _with_request_id(message)
                if message["status"] >= 400 and _is_json(message.get("headers", [])):
                    start = message  # held until the body is whole
                    return
            elif message["type"] == "http.response.body" and start is not None:
                chunks.append(message.get("body", b""))
                if message.get("more_body"):
                    return
                body = _translated(start["status"], b"".join(chunks))
                headers = [(k, v) for k, v in start.get("headers", [])
                           if k.lower() != b"content-length"]
                headers.append((b"content-length", str(len(body)).encode()))
                await send({**start, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
            await send(message)

        await self.app(scope, receive, rewrite)


def _is_json(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"application/json")
               for k, v in headers)


def _ours(path: str) -> bool:
    return path == PATH or path.startswith(PATH + "/")


def _with_request_id(start: dict[str, Any]) -> dict[str, Any]:
    headers = list(start.get("headers", []))
    given = [v for k, v in headers if k.lower() == b"x-request-id"]
    return {**start, "headers": headers + [(b"request-id", given[0])]} if given else start
