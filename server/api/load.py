"""Server load (vLLM's ``--enable-server-load-tracking`` and ``GET /load``): how many requests
that occupy the model are in flight, for a load balancer that routes to the least busy
replica. A request counts from its arrival until its response's last byte (a stream: until
it ends or the client leaves)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from server.api.middleware import Scope, route_path

# The routes whose requests run the model (vLLM's list, under the names served here or by
# the endpoints still to come); a path counts when it is one of them or below one.
MODEL_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                "/v1/embeddings", "/v1/score", "/v1/rerank", "/v2/rerank", "/pooling",
                "/classify", "/score", "/rerank", "/invocations")


def runs_the_model(path: str) -> bool:
    return any(path == route or path.startswith(route + "/") for route in MODEL_ROUTES)


class ServerLoad:
    """The in-flight count ``GET /load`` reports (0 while tracking is off, as in vLLM)."""

    def __init__(self) -> None:
        self.in_flight = 0


class LoadTrackingMiddleware:
    """Counts each request to a model route while it is served. Plain ASGI, so that a
    streamed answer counts until its end, not only until its headers went out."""

    def __init__(self, app: Any, load: ServerLoad) -> None:
        self.app = app
        self.load = load

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not runs_the_model(route_path(scope)):
            await self.app(scope, receive, send)
            return
        self.load.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:  # answered, failed or abandoned: it no longer occupies the model
            self.load.in_flight -= 1


def install_load_tracking(app: FastAPI, enabled: bool) -> None:
    """``GET /load`` on ``app``, and with ``enabled`` the counting middleware; call it
    before the guard middleware is added, so that a request refused at the door (a wrong
    API key, an oversized body) never counts."""
    load = ServerLoad()
    if enabled:
        app.add_middleware(LoadTrackingMiddleware, load=load)

    @app.get("/load")
    async def server_load() -> dict[str, int]:
        """Requests running the model right now (--enable-server-load-tracking; else 0)."""
        return {"server_load": load.in_flight}
