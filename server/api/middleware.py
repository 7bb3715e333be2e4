"""ASGI middleware: API key, request ids, body size limit."""

from __future__ import annotations

import hmac
import json
import uuid
from typing import Any

Scope = dict[str, Any]


def _json_error(status: int, message: str, type_: str) -> tuple[dict, bytes]:
    body = json.dumps({"error": {"message": message, "type": type_, "param": None,
                                 "code": status}}).encode()
    start = {"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}
    return start, body


async def _reply(send: Any, status: int, message: str, type_: str) -> None:
    start, body = _json_error(status, message, type_)
    await send(start)
    await send({"type": "http.response.body", "body": body})


class GuardMiddleware:
    """Checks the bearer key on /v1/*, caps body size, and tags responses with X-Request-Id.

    Plain ASGI (not BaseHTTPMiddleware) so streaming responses pass through untouched.
    """

    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        request_id = headers.get("x-request-id") or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = list(message["headers"]) + [
                    (b"x-request-id", request_id.encode("latin-1"))]
            await send(message)

        if self.api_key and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            given = headers.get("authorization", "")
            expected = f"Bearer {self.api_key}"
            if not hmac.compare_digest(given.encode(), expected.encode()):
                await _reply(send_with_id, 401, "invalid or missing API key", "AuthenticationError")
                return
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await _reply(send_with_id, 413, f"request body exceeds {self.max_body_bytes} bytes",
                         "RequestTooLargeError")
            return
        await self.app(scope, self._capped(receive), send_with_id)

    def _capped(self, receive: Any) -> Any:
        seen = 0
        limit = self.max_body_bytes

        async def wrapped() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:  # chunked bodies carry no length to check up front
                    raise BodyTooLarge(limit)
            return message

        return wrapped


class BodyTooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"request body exceeds {limit} bytes")
