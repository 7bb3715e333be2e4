"""Running the app under uvicorn, with a shutdown that drains in-flight requests."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import resource
import signal
import socket
import ssl
import threading
from collections.abc import Callable, Iterator

import uvicorn
from fastapi import FastAPI
from uvicorn.config import LOGGING_CONFIG

from server.api.connections import ConnectionBook, ConnectionLimits, protocol_factory
from server.config import ServerConfig
from server.log import uvicorn_log_config

logger = logging.getLogger(__name__)


# After the drain deadline, how long the aborted streams get to send their last chunk.
FLUSH_SECONDS = 5.0


class GracefulServer(uvicorn.Server):
    """On SIGTERM/SIGINT uvicorn stops accepting and lets in-flight requests finish. At the
    drain deadline ``on_deadline`` aborts what is still running, so that every stream ends
    properly (a last chunk with ``finish_reason`` "abort", then ``[DONE]``) within
    ``FLUSH_SECONDS``; only then would uvicorn cancel what is left. Stock uvicorn re-raises
    the signal afterwards, so the process would die by it; a drained shutdown exits 0 here."""

    def __init__(self, config: uvicorn.Config, drain_seconds: float,
                 on_deadline: Callable[[], None] | None,
                 stop_when: threading.Event | None = None) -> None:
        super().__init__(config)
        self.drain_seconds = drain_seconds
        self.on_deadline = on_deadline
        self.stop_when = stop_when

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's main loop asks this ten times a second whether to exit: also once
        ``stop_when`` is set (from any thread: the engine's, when it dies)."""
        if self.stop_when is not None and self.stop_when.is_set():
            return True
        return await super().on_tick(counter)

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

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        deadline = asyncio.create_task(self._abort_at_deadline())
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

    async def _abort_at_deadline(self) -> None:
        await asyncio.sleep(self.drain_seconds)
        if self.server_state.connections and self.on_deadline is not None:
            logger.warning("Drain deadline (%.0f s) reached: aborting the requests still "
                           "running", self.drain_seconds)
            self.on_deadline()


class HttpServer:
    """The uvicorn server of one app. It stops once ``stop_when`` is set, from any thread
    (the engine thread sets it when the engine dies, so the process exits and is restarted)."""

    def __init__(self, app: FastAPI, cfg: ServerConfig,
                 on_deadline: Callable[[], None] | None = None,
                 stop_when: threading.Event | None = None) -> None:
        limits = ConnectionLimits(header_timeout=cfg.timeout_request_header,
                                  body_timeout=cfg.timeout_request_body,
                                  max_requests=cfg.limit_concurrency,
                                  idle_timeout=cfg.timeout_idle_connection,
                                  max_idle_per_address=cfg.max_idle_connections_per_address)
        config = uvicorn.Config(
            app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
            access_log=not cfg.disable_access_log,
            # --log-format json: uvicorn's lines through the same JSON formatter
            log_config=uvicorn_log_config(cfg.logging.log_format, LOGGING_CONFIG),
            timeout_graceful_shutdown=math.ceil(cfg.shutdown_timeout + FLUSH_SECONDS),
            timeout_keep_alive=cfg.timeout_keep_alive,
            # h11 with idle and request deadlines and a JSON 503 cap on requests in flight
            # (server/api/connections.py); uvicorn's own limit_concurrency, which counts
            # silent connections too, stays off
            http=protocol_factory(ConnectionBook(limits)),
            # --ssl-*: uvicorn's own TLS (vLLM passes the same four through)
            ssl_keyfile=cfg.ssl_keyfile, ssl_certfile=cfg.ssl_certfile,
            ssl_ca_certs=cfg.ssl_ca_certs, ssl_cert_reqs=cfg.ssl_cert_reqs,
        )
        self._server = GracefulServer(config, cfg.shutdown_timeout, on_deadline, stop_when)

    def run(self) -> None:
        """Binds the port (only now: the engine is loaded and warmed up) and serves."""
        raise_fd_limit()
        asyncio.run(self._server.serve())


def check_tls(cfg: ServerConfig) -> None:
    """Loads the --ssl-* files once as uvicorn will, so that a bad key, a certificate that
    does not match it or an unreadable CA file stops start-up in one line (ValueError) before
    the model loads, not with a traceback once it has."""
    if cfg.ssl_certfile is None:
        return
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cfg.ssl_certfile, cfg.ssl_keyfile)
    except (ssl.SSLError, OSError) as exc:
        key = f" with --ssl-keyfile {cfg.ssl_keyfile}" if cfg.ssl_keyfile else ""
        raise ValueError(f"--ssl-certfile {cfg.ssl_certfile}{key}: cannot load the "
                         f"certificate and its key ({exc})") from None
    if cfg.ssl_ca_certs:
        try:
            context.load_verify_locations(cfg.ssl_ca_certs)
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(f"--ssl-ca-certs {cfg.ssl_ca_certs}: cannot load the CA "
                             f"certificates ({exc})") from None


def raise_fd_limit() -> None:
    """Lifts the soft limit on open files to the hard one: every connection, a silent one
    included, holds a descriptor, and the usual soft limit (1,024) is what a thousand idle
    connections need by themselves."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:
        logger.debug("Open files limit: %s (already the hard limit)", _limit(soft))
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:  # e.g. macOS refuses an unlimited soft limit
        logger.debug("Open files limit stays at %s (hard %s): %s", _limit(soft), _limit(hard),
                     exc)
        return
    logger.debug("Open files limit raised from %s to the hard limit, %s", _limit(soft),
                 _limit(hard))


def _limit(value: int) -> str:
    return "unlimited" if value == resource.RLIM_INFINITY else str(value)
