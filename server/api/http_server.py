"""Running the app under uvicorn, with a shutdown that drains in-flight requests."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

from server.api.connections import ConnectionLimits, protocol_factory
from server.config import ServerConfig


class GracefulServer(uvicorn.Server):
    """On SIGTERM/SIGINT uvicorn stops accepting, lets in-flight requests finish within
    ``timeout_graceful_shutdown`` and then cancels the rest. Stock uvicorn re-raises the
    signal afterwards, so the process would die by it; a drained shutdown exits 0 here."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit)
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


class HttpServer:
    """The uvicorn server of one app; ``stop()`` may be called from any thread (the engine
    thread calls it when the engine dies, so the process exits and is restarted)."""

    def __init__(self, app: FastAPI, cfg: ServerConfig) -> None:
        limits = ConnectionLimits(header_timeout=cfg.timeout_request_header,
                                  body_timeout=cfg.timeout_request_body,
                                  max_connections=cfg.limit_concurrency)
        config = uvicorn.Config(
            app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
            access_log=not cfg.disable_access_log,
            timeout_graceful_shutdown=max(1, round(cfg.shutdown_timeout)),
            timeout_keep_alive=cfg.timeout_keep_alive,
            # h11 with request deadlines and a JSON 503 connection cap (server/api/
            # connections.py); uvicorn's own limit_concurrency stays off
            http=protocol_factory(limits),
        )
        self._server = GracefulServer(config)

    def stop(self) -> None:
        self._server.should_exit = True  # uvicorn's main loop polls it

    def run(self) -> None:
        """Binds the port (only now: the engine is loaded and warmed up) and serves."""
        asyncio.run(self._server.serve())
