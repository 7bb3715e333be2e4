"""ASGI middleware: API key, request ids, client identity, body size limit, request logs.

The request id (the client's X-Request-Id, or a fresh one) is echoed in the response's
headers and bound to the request's context (``server.log.request_context``): every line
logged while it is served, uvicorn's access line included, and its error bodies carry it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import uuid
from typing import Any

from server.api.errors import error_body
from server.api.request_log import RequestLog, RequestRecord
from server.config import FairShare
from server.log import request_context

Scope = dict[str, Any]


async def _reply(send: Any, status: int, message: str, close: bool = False) -> None:
    body = json.dumps(error_body(status, message)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:  # the client may still be sending the body we will not read: end the connection
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# Paths behind --api-key: the OpenAI API, the cache administration and the traffic shape
# telemetry (it reveals prompt lengths and load).
# /tokenize and /detokenize cost CPU in proportion to their input: behind the key as well.
PROTECTED = ("/v1", "/reset_prefix_cache", "/buckets", "/tokenize", "/detokenize",
             "/sleep", "/wake_up", "/is_sleeping", "/reload_weights")


def _key_matches(headers: dict[str, str], api_key: str) -> bool:
    """OpenAI's clients send ``Authorization: Bearer KEY``, Anthropic's ``x-api-key: KEY``
    (and ``anthropic-version``, which needs nothing): either header may carry the key."""
    bearer = hmac.compare_digest(headers.get("authorization", "").encode(),
                                 f"Bearer {api_key}".encode())
    x_api_key = hmac.compare_digest(headers.get("x-api-key", "").encode(), api_key.encode())
    return bearer or x_api_key


def client_key(scope: Scope, headers: dict[str, str], fair_share: FairShare) -> str:
    """Who sent the request, for fair admission and per-client limits: the key's digest
    (never the key itself: it ends up in metrics and logs) or the peer's address."""
    if fair_share is FairShare.API_KEY:
        key = headers.get("authorization", "") or \
            ("Bearer " + headers["x-api-key"] if headers.get("x-api-key") else "")
        if key:
            return "key:" + hashlib.sha256(key.encode("latin-1")).hexdigest()[:16]
    client = scope.get("client")
    return f"addr:{client[0]}" if client else "addr:unknown"


def route_path(scope: Scope) -> str:
    """The path the routes see: without ``--root-path`` when the request came with it (a
    proxy that does not strip its prefix), so that /llm/v1/... is guarded as /v1/... is."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root + "/") else path


class GuardMiddleware:
    """Checks the API key (bearer or x-api-key) on /v1/*, caps body size, tags responses
    and logs with X-Request-Id, names the client (``scope["state"]["client"]``) for fair admission and,
    given a ``request_log`` (``--enable-log-requests``), writes each request's line.

    Plain ASGI (not BaseHTTPMiddleware) so streaming responses pass through untouched.
    """

    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int,
                 fair_share: FairShare = FairShare.ADDRESS,
                 max_request_id_length: int = 256,
                 request_log: RequestLog | None = None) -> None:
        self.app = app
        self.request_log = request_log
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.fair_share = fair_share
        self.max_request_id_length = max_request_id_length

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        request_id = headers.get("x-request-id") or uuid.uuid4().hex
        too_long = len(request_id) > self.max_request_id_length
        if too_long:  # echoed in every header and SSE chunk: never repeat a huge one
            request_id = uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        state["client"] = client_key(scope, headers, self.fair_share)
        with request_context(request_id):
            if self.request_log is None:
                await self._guarded(scope, receive, send, headers, request_id, too_long, None)
                return
            with self.request_log.logged(request_id, scope["method"], route_path(scope)) \
                    as record:
                await self._guarded(scope, receive, send, headers, request_id, too_long,
                                    record)

    async def _guarded(self, scope: Scope, receive: Any, send: Any, headers: dict[str, str],
                       request_id: str, too_long: bool, record: RequestRecord | None) -> None:
        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = list(message["headers"]) + [
                    (b"x-request-id", request_id.encode("latin-1"))]
                if record is not None:
                    record.status = message["status"]
            elif record is not None and message["type"] == "http.response.body":
                record.answered(message.get("body", b""))
            await send(message)

        if too_long:
            await _reply(send_with_id, 400, "X-Request-Id is longer than "
                         f"{self.max_request_id_length} characters")
            return
        if self.api_key and route_path(scope).startswith(PROTECTED) and \
                scope["method"] != "OPTIONS":
            if not _key_matches(headers, self.api_key):
                await _reply(send_with_id, 401, "invalid or missing API key")
                return
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await _reply(send_with_id, 413, f"request body exceeds {self.max_body_bytes} bytes",
                         close=True)
            return
        await self._capped(scope, receive, send_with_id)

    async def _capped(self, scope: Scope, receive: Any, send: Any) -> None:
        """Counts a body without a length up front (chunked) as it arrives. Once it passes the
        cap, reading stops with BodyTooLarge and the answer is 413, whatever the app makes
        of the exception (FastAPI turns any body-reading error into its own 400)."""
        seen = 0
        too_large = False
        started = False

        async def capped_receive() -> dict:
            nonlocal seen, too_large
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    too_large = True
                    raise BodyTooLarge(self.max_body_bytes)
            return message

        async def guarded_send(message: dict) -> None:
            nonlocal started
            if too_large and not started:
                return  # the app's answer to the aborted read; the 413 below replaces it
            started = True
            await send(message)

        try:
            await self.app(scope, capped_receive, guarded_send)
        except BodyTooLarge:
            pass  # an app that let it propagate: answered below like the others
        if too_large and not started:
            await _reply(send, 413, f"request body exceeds {self.max_body_bytes} bytes",
                         close=True)


class BodyTooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"request body exceeds {limit} bytes")
