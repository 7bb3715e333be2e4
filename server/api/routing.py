"""What every generation route does around its handler: who asked (the request's tag),
cancelling the work when the client leaves, and turning the handler's result into a
response (JSON, or SSE through ``guarded_sse``). Shared by app.py and the routers of
server/api/responses/."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from server.api.serving import RequestTag, guarded_sse
from server.api.tracing import trace_headers_of


class JSONBytes(Response):
    """A JSON body already serialized (on a worker)."""

    media_type = "application/json"


def tag_of(request: Request) -> RequestTag:
    state = request.scope.get("state", {})
    return RequestTag(str(state.get("request_id")), str(state.get("client", "addr:unknown")),
                      trace_headers=trace_headers_of(request.headers))


async def until_disconnect(request: Request, work: Awaitable[object]) -> object:
    """Runs a handler but cancels it if the client goes away first: the cancelled iteration
    aborts the engine request, so an abandoned non-streaming request stops using KV blocks."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return Response(status_code=499)  # nobody is listening any more
    return task.result()


def respond(result: object) -> Response:
    if isinstance(result, Response):
        return result
    if isinstance(result, AsyncIterator):
        return StreamingResponse(guarded_sse(result), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    assert isinstance(result, BaseModel), type(result)
    return JSONResponse(result.model_dump())
