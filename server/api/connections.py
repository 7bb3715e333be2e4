"""uvicorn's h11 protocol with the connection limits uvicorn lacks.

uvicorn closes an idle keep-alive connection after ``timeout_keep_alive``, but only once a
response has been sent: a client that connects and sends half a request header, or a body
that stops arriving, holds its connection (and a file descriptor) forever. This subclass adds

- a header deadline: the request line and headers must be complete within
  ``header_timeout`` seconds of the connection (or of the first byte of a later request on
  a kept-alive connection); a client dribbling a byte at a time gains nothing;
- a body pause limit: while a body is being received, at most ``body_timeout`` seconds may
  pass without a byte (a slow upload is fine, a stalled one is not);
- a connection cap: with more than ``max_connections`` open, a request is answered with
  OpenAI's JSON 503 and the connection closed (uvicorn's own ``limit_concurrency`` answers
  plain text); /health is always served, so a busy server is not restarted as dead.

A timed-out client gets ``408`` with OpenAI's error body, then the connection is closed.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from server.api.errors import error_body

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    header_timeout: float
    body_timeout: float
    max_connections: int  # 0: unbounded


class GuardedH11Protocol(H11Protocol):
    """One connection; see the module docstring."""

    def __init__(self, *args: Any, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._deadline: asyncio.TimerHandle | None = None
        self._phase: str | None = None  # "headers" or "body" while a deadline runs
        self.app = self._capped(self.app)

    # -- deadlines ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm("headers", self.limits.header_timeout)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.IDLE:  # part of a request line / headers, still incomplete
            if self._phase != "headers":  # a total deadline: later bytes do not extend it
                self._arm("headers", self.limits.header_timeout)
        elif state is h11.SEND_BODY:  # each chunk of body restarts the pause limit
            self._arm("body", self.limits.body_timeout)
        else:  # the whole request is in: the response may take as long as it takes
            self._disarm()

    def on_response_complete(self) -> None:
        self._disarm()  # until the next request's first byte, uvicorn's keep-alive rules
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self, phase: str, seconds: float) -> None:
        self._disarm()
        self._phase = phase
        self._deadline = self.loop.call_later(seconds, self._expired, phase, seconds)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = None
        self._phase = None

    def _expired(self, phase: str, seconds: float) -> None:
        self._deadline = None
        self._phase = None
        if self.transport.is_closing():
            return
        if phase == "body" and self.flow.read_paused:
            # We stopped reading (the app has not consumed the body yet): not the client's
            # stall, so wait again.
            self._arm(phase, seconds)
            return
        what = "request headers" if phase == "headers" else "request body data"
        message = f"no complete {what} received within {seconds:g} s; closing the connection"
        logger.info("%s: %s", _peer(self.client), message)
        if self.cycle is None or self.cycle.response_complete or not self.cycle.response_started:
            self.transport.write(_raw_response(408, "Request Timeout", message))
        self.transport.close()  # the app, if any, sees the client disconnect

    # -- connection cap -----------------------------------------------------------------
    def _capped(self, app: Any) -> Any:
        limit = self.limits.max_connections

        async def capped_app(scope: dict, receive: Any, send: Any) -> None:
            over = limit and (len(self.connections) > limit or len(self.tasks) > limit)
            if not over or scope.get("path") == "/health":
                await app(scope, receive, send)
                return
            message = (f"the server is at its connection limit ({limit}, --limit-concurrency); "
                       "retry later")
            body = json.dumps(error_body(503, message, code="too_many_connections")).encode()
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode()),
                                    (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})

        return capped_app


def _raw_response(status: int, reason: str, message: str) -> bytes:
    """A whole response written around h11 (whose state machine allows no response before
    a request has been parsed); the connection is closed right after."""
    body = json.dumps(error_body(status, message)).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("ascii") + body


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "client"


def protocol_factory(limits: ConnectionLimits) -> Any:
    """What ``uvicorn.Config(http=...)`` takes: a callable building one protocol per
    connection."""
    return functools.partial(GuardedH11Protocol, limits=limits)
