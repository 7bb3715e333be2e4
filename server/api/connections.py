"""uvicorn's h11 protocol with the connection limits uvicorn lacks.

uvicorn closes an idle keep-alive connection after ``timeout_keep_alive``, but only once a
response has been sent: a client that connects and sends nothing, half a request header, or
a body that stops arriving, holds its connection (and a file descriptor) forever. This
subclass adds

- an idle deadline for a connection that has not sent a byte: it is closed, without a
  response (there is no request to answer), after ``idle_timeout`` seconds; and one address
  may hold at most ``max_idle_per_address`` such silent connections: a new one beyond that
  closes that address's oldest ones, once silent for a second;
- a header deadline: once the first byte of a request has arrived, the request line and
  headers must be complete within ``header_timeout`` seconds; a client dribbling a byte at a
  time gains nothing;
- a body pause limit: while a body is being received, at most ``body_timeout`` seconds may
  pass without a byte (a slow upload is fine, a stalled one is not);
- a cap on requests in flight: with ``max_requests`` requests running, one more is answered
  with OpenAI's JSON 503 and the connection closed (uvicorn's own ``limit_concurrency``
  counts every open connection, silent ones included, and answers plain text); /health is
  always served and not counted, so a busy server is not restarted as dead.

A header or body timeout gets ``408`` with OpenAI's error body, then the connection is
closed. What the connections of one server share lives in one ``ConnectionBook``, handed to
each protocol by ``protocol_factory``.

uvicorn's h11 protocol allows this cleanly: every hook used here (``connection_made``,
``data_received``, ``on_response_complete``, ``connection_lost``) is one it calls itself,
and h11's ``their_state`` says which part of a request is being received.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from server.api.errors import error_body

logger = logging.getLogger(__name__)

HEALTH_PATH = "/health"
# At most one warning per this many seconds about silent connections closed for an address
# over its limit (an attack would otherwise write a line per connection).
EVICTION_WARNING_INTERVAL = 10.0
# How long a connection may stay silent before it counts towards its address's surplus:
# a burst of connections opened at once sends its requests within this (measured: 500
# connections opened at once by one client lost 436 to an immediate eviction).
SILENT_GRACE_S = 1.0


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    header_timeout: float
    body_timeout: float
    max_requests: int  # requests in flight; 0: unbounded
    idle_timeout: float  # a connection that has sent no byte
    max_idle_per_address: int


class Phase(enum.Enum):
    """What a connection's running deadline waits for."""
    FIRST_BYTE = "first byte"
    HEADERS = "request headers"
    BODY = "request body data"


class ConnectionBook:
    """What the connections of one server share: the requests in flight and, per address,
    the silent connections in the order they were opened. The event loop's thread is the
    only one to touch it."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.in_flight = 0
        # a dict per address, used as an ordered set: the first key is the oldest
        self._silent: dict[str, dict[GuardedH11Protocol, float]] = {}  # -> opened at
        self._evicted_since_warning = 0
        self._last_warning = -EVICTION_WARNING_INTERVAL

    def add_silent(self, conn: GuardedH11Protocol, address: str) -> list[GuardedH11Protocol]:
        """Registers a new silent connection; returns those to close if ``address`` now holds
        more than its share. The oldest go, not the new one: the new one is the likeliest to
        carry a request (a client behind the same NAT as the flooder still gets in), and the
        oldest the likeliest to be abandoned. Only connections silent for ``SILENT_GRACE_S``
        go: a client opening hundreds of connections at once (a load generator, a gateway's
        pool) sends on each a moment later, and must not lose them to its own burst."""
        now = time.monotonic()
        conns = self._silent.setdefault(address, {})
        conns[conn] = now
        surplus = len(conns) - self.limits.max_idle_per_address
        evicted = []
        for oldest, opened in list(conns.items())[:max(surplus, 0)]:
            if now - opened < SILENT_GRACE_S:
                break  # in opening order: the rest are younger still
            del conns[oldest]
            evicted.append(oldest)
        if evicted:
            self._note_eviction(address, len(evicted))
        return evicted

    def remove_silent(self, conn: GuardedH11Protocol, address: str) -> None:
        conns = self._silent.get(address)
        if conns is None:
            return
        conns.pop(conn, None)
        if not conns:  # the book does not grow with every address ever seen
            del self._silent[address]

    def _note_eviction(self, address: str, count: int) -> None:
        self._evicted_since_warning += count
        now = time.monotonic()
        if now - self._last_warning >= EVICTION_WARNING_INTERVAL:
            logger.warning("%s holds more than %d connections that sent nothing "
                           "(--max-idle-connections-per-address); closed its oldest "
                           "(%d such closes since the last warning)", address,
                           self.limits.max_idle_per_address, self._evicted_since_warning)
            self._last_warning = now
            self._evicted_since_warning = 0


class GuardedH11Protocol(H11Protocol):
    """One connection; see the module docstring."""

    def __init__(self, *args: Any, book: ConnectionBook, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.book = book
        self.limits = book.limits
        self._deadline: asyncio.TimerHandle | None = None
        self._phase: Phase | None = None  # while a deadline runs
        self._address = ""
        self._silent = False
        self.app = self._capped(self.app)

    # -- silent connections -------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._address = self.client[0] if self.client else ""
        self._silent = True
        self._arm(Phase.FIRST_BYTE, self.limits.idle_timeout)
        for evicted in self.book.add_silent(self, self._address):
            evicted._close_silent("its address holds too many silent connections")

    def _close_silent(self, why: str) -> None:
        self._end_silence()
        self._disarm()
        logger.debug("%s: closing a connection that sent nothing: %s", _peer(self.client), why)
        self.transport.close()

    def _end_silence(self) -> None:
        if self._silent:
            self._silent = False
            self.book.remove_silent(self, self._address)

    # -- deadlines ----------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        self._end_silence()
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.IDLE:  # part of a request line / headers, still incomplete
            if self._phase is not Phase.HEADERS:  # a total deadline: later bytes do not
                self._arm(Phase.HEADERS, self.limits.header_timeout)  # extend it
        elif state is h11.SEND_BODY:  # each chunk of body restarts the pause limit
            self._arm(Phase.BODY, self.limits.body_timeout)
        else:  # the whole request is in: the response may take as long as it takes
            self._disarm()

    def on_response_complete(self) -> None:
        self._disarm()  # until the next request's first byte, uvicorn's keep-alive rules
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._end_silence()
        self._disarm()
        super().connection_lost(exc)

    def _arm(self, phase: Phase, seconds: float) -> None:
        self._disarm()
        self._phase = phase
        self._deadline = self.loop.call_later(seconds, self._expired, phase, seconds)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = None
        self._phase = None

    def _expired(self, phase: Phase, seconds: float) -> None:
        self._deadline = None
        self._phase = None
        if self.transport.is_closing():
            return
        if phase is Phase.FIRST_BYTE:
            self._close_silent(f"no byte within {seconds:g} s (--timeout-idle-connection)")
            return
        if phase is Phase.BODY and self.flow.read_paused:
            # We stopped reading (the app has not consumed the body yet): not the client's
            # stall, so wait again.
            self._arm(phase, seconds)
            return
        message = (f"no complete {phase.value} received within {seconds:g} s; "
                   "closing the connection")
        logger.info("%s: %s", _peer(self.client), message)
        if self.cycle is None or self.cycle.response_complete or not self.cycle.response_started:
            self.transport.write(_raw_response(408, "Request Timeout", message))
        self.transport.close()  # the app, if any, sees the client disconnect

    # -- cap on requests in flight ------------------------------------------------------
    def _capped(self, app: Any) -> Any:
        book = self.book
        limit = self.limits.max_requests

        async def capped_app(scope: dict, receive: Any, send: Any) -> None:
            if scope.get("path") == HEALTH_PATH:
                await app(scope, receive, send)
                return
            if limit and book.in_flight >= limit:
                await _refuse(send, limit)
                return
            book.in_flight += 1
            try:
                await app(scope, receive, send)
            finally:
                book.in_flight -= 1

        return capped_app


async def _refuse(send: Any, limit: int) -> None:
    message = (f"the server is at its limit of requests in flight ({limit}, "
               "--limit-concurrency); retry later")
    body = json.dumps(error_body(503, message, code="too_many_connections")).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def _raw_response(status: int, reason: str, message: str) -> bytes:
    """A whole response written around h11 (whose state machine allows no response before
    a request has been parsed); the connection is closed right after."""
    body = json.dumps(error_body(status, message)).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("ascii") + body


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "client"


def protocol_factory(book: ConnectionBook) -> Any:
    """What ``uvicorn.Config(http=...)`` takes: a callable building one protocol per
    connection, all of them sharing ``book``."""
    return functools.partial(GuardedH11Protocol, book=book)
