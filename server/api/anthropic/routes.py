"""The Messages API's routes, behind the same guards as /v1/chat/completions (API key,
admission, request ids and logs, tracing, the preprocess pool)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from server.api.anthropic.errors import AnthropicErrors
from server.api.anthropic.events import guarded_events
from server.api.anthropic.protocol import (
    AnthropicErrorResponse,
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
)
from server.api.anthropic.serving import count_tokens, create_message
from server.api.openapi import register_models
from server.api.request_body import body_schema, parse_body
from server.api.request_checks import check_messages
from server.api.routing import respond, tag_of, until_disconnect
from server.api.serving import ServingContext


def add_anthropic_routes(app: FastAPI, ctx: ServingContext) -> None:
    """``POST /v1/messages`` and ``POST /v1/messages/count_tokens``; call it after the
    app's other middleware, so that Anthropic's error shape covers their refusals too."""

    def few_messages(data: Any) -> None:  # before validating 300,000 of them
        if isinstance(data, dict) and isinstance(data.get("messages"), list):
            check_messages(ctx.limits, len(data["messages"]))

    @app.post("/v1/messages", openapi_extra=_openapi(MessagesRequest, MessageResponse,
                                                     stream=True))
    async def messages(request: Request) -> Response:
        tag = tag_of(request)
        body = await parse_body(request, MessagesRequest, ctx.workers, tag.client,
                                few_messages)
        work = create_message(ctx, body, tag)
        return respond(await until_disconnect(request, work), guarded_events)

    @app.post("/v1/messages/count_tokens",
              openapi_extra=_openapi(CountTokensRequest, CountTokensResponse))
    async def messages_count_tokens(request: Request) -> Response:
        tag = tag_of(request)
        body = await parse_body(request, CountTokensRequest, ctx.workers, tag.client,
                                few_messages)
        return await count_tokens(ctx, body, tag)

    register_models(app, bodies=[MessagesRequest, CountTokensRequest],
                    answers=[MessageResponse, CountTokensResponse, AnthropicErrorResponse])
    app.add_middleware(AnthropicErrors)


def _openapi(body: type, answer: type, stream: bool = False) -> dict[str, Any]:
    """The route's body, and its answers: JSON (or Anthropic's events), errors in
    Anthropic's shape (server/api/openapi.py keeps what a route declares)."""
    ref = "#/components/schemas/{}".format
    success: dict[str, Any] = {"application/json": {"schema": {"$ref": ref(answer.__name__)}}}
    if stream:
        success["text/event-stream"] = {"schema": {"type": "object", "properties": {
            "event": {"type": "string"}, "data": {"type": "string"}}}}
    return {**body_schema(body), "x-error-schema": ref(AnthropicErrorResponse.__name__),
            "responses": {"200": {"description": "Successful Response", "content": success}}}
