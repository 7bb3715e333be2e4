"""Errors the engine raises: bad requests (HTTP 400), one request's own failure (500),
and a dead engine (503)."""

from __future__ import annotations


class RequestError(ValueError):
    """A request that can never be served as given; the message says why, with numbers."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class EngineDeadError(RuntimeError):
    """The engine loop stopped; no further request can be served."""


class RequestFailedError(RuntimeError):
    """A fault while serving one request (its own inputs, its own output processing): that
    request ends with this error, its KV blocks are freed and every other request goes on."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(f"request {request_id} failed: {message}")
        self.request_id = request_id
        self.message = message


class EngineFaultError(RuntimeError):
    """A fault that is not tied to one request (steps keep failing whatever they run): the
    engine stops, and the server exits non-zero so that its orchestrator restarts it."""


class EngineSleepingError(RuntimeError):
    """The engine is asleep (``POST /sleep``): no request is served until ``/wake_up``
    (HTTP 503 with ``Retry-After``)."""
