"""Errors the engine raises for bad requests (the API maps them to HTTP 400)."""

from __future__ import annotations


class RequestError(ValueError):
    """A request that can never be served as given; the message says why, with numbers."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class EngineDeadError(RuntimeError):
    """The engine loop stopped; no further request can be served."""
