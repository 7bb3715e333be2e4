"""Routes of the pooling endpoints, behind the same guards as chat (the app's middleware:
API key, request ids, admission; the request log and tracing through ``submit``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel
from starlette.responses import Response

from server.api.pooling.protocol import (
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingResponse,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
)
from server.api.pooling.serving import (
    create_classification,
    create_embedding,
    create_pooling,
    create_rerank,
    create_score,
)
from server.api.request_body import body_schema, parse_body
from server.api.routing import tag_of, until_disconnect
from server.api.serving import RequestTag, ServingContext

Handler = Callable[[ServingContext, Any, RequestTag], Awaitable[Response]]

# path(s), body schema, answer schema, handler
ROUTES: tuple[tuple[tuple[str, ...], type[BaseModel], type[BaseModel], Handler], ...] = (
    (("/v1/embeddings",), EmbeddingRequest, EmbeddingResponse, create_embedding),
    (("/pooling",), EmbeddingRequest, PoolingResponse, create_pooling),
    (("/classify",), ClassificationRequest, ClassificationResponse, create_classification),
    (("/score", "/v1/score"), ScoreRequest, ScoreResponse, create_score),
    (("/rerank", "/v1/rerank", "/v2/rerank"), RerankRequest, RerankResponse, create_rerank),
)


def add_pooling_routes(app: FastAPI, ctx: ServingContext) -> None:
    """The pooling endpoints, through the same guards as chat (request ids, admission, the
    abort of a client that went away)."""
    for paths, body_type, answer_type, handler in ROUTES:
        def endpoint(body_type: type[BaseModel] = body_type,
                     handler: Handler = handler) -> Callable[[Request], Awaitable[Response]]:
            async def route(request: Request) -> Response:
                tag = tag_of(request)
                body = await parse_body(request, body_type, ctx.workers, tag.client)
                result = await until_disconnect(request, handler(ctx, body, tag))
                assert isinstance(result, Response)
                return result
            return route

        route = endpoint()
        for path in paths:
            app.add_api_route(path, route, methods=["POST"], response_model=answer_type,
                              openapi_extra=body_schema(body_type))
