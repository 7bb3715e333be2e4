"""The Responses API's routes, behind the same guards as chat completions (the middleware's
API key, request ids and log; the handler's admission, tracing and error handlers)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from server.api.request_body import body_schema, parse_body
from server.api.request_checks import check_messages
from server.api.responses.protocol import ResponsesRequest
from server.api.responses.serving import ResponsesService
from server.api.responses.store import ResponseStore
from server.api.routing import respond, tag_of, until_disconnect
from server.api.serving import ServingContext
from server.config import ResponsesStoreConfig


def add_responses_routes(app: FastAPI, ctx: ServingContext,
                         config: ResponsesStoreConfig) -> None:
    service = ResponsesService(ctx, ResponseStore(config))

    def few_items(data: Any) -> None:  # before validating 300,000 of them
        if isinstance(data, dict) and isinstance(data.get("input"), list):
            check_messages(ctx.limits, len(data["input"]))

    @app.post("/v1/responses", openapi_extra=body_schema(ResponsesRequest))
    async def create_response(request: Request) -> Response:
        tag = tag_of(request)
        body = await parse_body(request, ResponsesRequest, ctx.workers, tag.client, few_items)
        work = service.create(body, tag)
        # a background response outlives its request: only its creation is cancelled
        return respond(await until_disconnect(request, work))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, request: Request) -> Response:
        """A stored response (a background one as far as it got)."""
        return await service.retrieve(response_id, tag_of(request))

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str, request: Request) -> Response:
        """Stops a background response; its KV blocks are freed."""
        return await service.cancel(response_id, tag_of(request))
