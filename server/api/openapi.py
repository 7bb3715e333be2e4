"""The server's OpenAPI document, made to say what the server really answers.

FastAPI derives it from the routes but declares 422 for invalid bodies (this server answers
400 with OpenAI's error body), cannot know the JSON-or-SSE answers of the generation routes
(their handlers return a ``Response``), and lists none of the errors the server sends. This
module rewrites those parts from the same pydantic models the server uses, so that a
schema-driven client (or fuzzer) checks the real contract.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from server.api.pooling.protocol import BODIES as POOLING_BODIES
from server.api.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    ErrorResponse,
    HealthResponse,
    InvocationRequest,
    TokenizeRequest,
)
from server.api.responses.protocol import ResponseObject, ResponsesRequest

_REF = "#/components/schemas/{model}"


def _sse(chunk: type[BaseModel]) -> dict[str, Any]:
    """With ``stream``: one event per chunk (JSON), an error event if the request fails
    mid-stream, then ``data: [DONE]``. Before OpenAPI 3.2, ``schema`` of an event stream
    describes one event, whose ``data`` carries the JSON."""
    data = {"type": "string", "anyOf": [
        {"const": "[DONE]"},
        {"contentMediaType": "application/json", "contentSchema": {"anyOf": [
            {"$ref": _REF.format(model=chunk.__name__)},
            {"$ref": _REF.format(model="ErrorResponse")}]}},
    ]}
    event = {"type": "object", "required": ["data"], "properties": {"data": data}}
    return {"text/event-stream": {"schema": event}}


# Success bodies the route annotations cannot express: (method, path) -> content
_SUCCESS: Mapping[tuple[str, str], tuple[type[BaseModel] | None, dict[str, Any]]] = {
    ("post", "/v1/chat/completions"): (ChatCompletionResponse, _sse(ChatCompletionChunk)),
    ("post", "/v1/completions"): (CompletionResponse, _sse(CompletionResponse)),
    # a Responses stream's events are typed by their "event:" line (no JSON schema here)
    ("post", "/v1/responses"): (ResponseObject, {"text/event-stream": {"schema": {
        "type": "object"}}}),
    ("get", "/v1/responses/{response_id}"): (ResponseObject, {}),
    ("post", "/v1/responses/{response_id}/cancel"): (ResponseObject, {}),
    # SageMaker's route answers as the chat or completions route it dispatches to: JSON,
    # or with "stream": true their event streams
    ("post", "/invocations"): (None, {
        "application/json": {"schema": {"anyOf": [
            {"$ref": _REF.format(model=m.__name__)}
            for m in (ChatCompletionResponse, CompletionResponse)]}},
        "text/event-stream": {"schema": {"anyOf": [
            _sse(ChatCompletionChunk)["text/event-stream"]["schema"],
            _sse(CompletionResponse)["text/event-stream"]["schema"]]}}}),
    ("get", "/health"): (HealthResponse, {}),
    ("get", "/ping"): (HealthResponse, {}),
    ("post", "/ping"): (HealthResponse, {}),
    ("get", "/metrics"): (None, {"text/plain": {"schema": {"type": "string"}}}),
}
_WHY = {
    400: "invalid request (the message names the field)",
    401: "missing or wrong API key (with --api-key)",
    404: "unknown model, or unknown or evicted stored response",
    408: "request headers or body not received in time",
    413: "request body over --max-request-body-bytes",
    500: "this request failed inside the engine (the message names the request id)",
    503: "overloaded (--max-waiting-requests, --limit-concurrency) or the engine is down",
}


def _errors(method: str, path: str, has_body: bool) -> list[int]:
    statuses = [503]  # the connection cap answers any route
    if has_body:
        statuses += [400, 408, 413]
    if path.startswith("/v1/"):
        statuses.append(401)
    if has_body or "{model_id}" in path or "{response_id}" in path:
        statuses.append(404)  # every body names a model, and so do these paths
    if path == "/v1/responses/{response_id}/cancel":
        statuses.append(400)  # not a background response, or already finished
    if (method, path) in (("post", "/v1/chat/completions"), ("post", "/v1/completions"),
                          ("post", "/invocations"), ("post", "/v1/responses"),
                          ("post", "/v1/messages")):
        statuses.append(500)
    return sorted(statuses)


def register_models(app: FastAPI, bodies: list[type[BaseModel]],
                    answers: list[type[BaseModel]]) -> None:
    """Adds the schemas of routes added elsewhere (a package of its own, such as the
    Anthropic API) to the document's components: ``bodies`` their ``parse_body`` reads,
    ``answers`` they send. Such a route may declare its own 200 content and, with
    ``x-error-schema`` in its ``openapi_extra``, its error body's schema; both are kept."""
    registered = app.state.__dict__.setdefault("openapi_models", ([], []))
    registered[0].extend(bodies)
    registered[1].extend(answers)


def build_openapi(app: FastAPI) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    extra_bodies, extra_answers = app.state.__dict__.get("openapi_models", ([], []))
    models: list[type[BaseModel]] = [ErrorResponse, ChatCompletionResponse, ChatCompletionChunk,
                                     CompletionResponse, HealthResponse, ResponseObject,
                                     *extra_answers]
    # bodies the routes parse on a worker (server/api/request_body.py), not through FastAPI
    bodies: list[type[BaseModel]] = [ChatCompletionRequest, CompletionRequest, TokenizeRequest,
                                     DetokenizeRequest, InvocationRequest, ResponsesRequest,
                                     *POOLING_BODIES, *extra_bodies]
    _, defs = models_json_schema([(m, "validation") for m in bodies]
                                 + [(m, "serialization") for m in models], ref_template=_REF)
    components.update(defs.get("$defs", {}))
    for path, item in schema["paths"].items():
        for method, operation in item.items():
            responses = operation["responses"]
            error_ref = operation.pop("x-error-schema", _REF.format(model="ErrorResponse"))
            error_content = {"application/json": {"schema": {"$ref": error_ref}}}
            responses.pop("422", None)
            success = _SUCCESS.get((method, path))
            if success is not None:
                model, extra = success
                content = dict(extra)
                if model is not None:
                    content["application/json"] = {
                        "schema": {"$ref": _REF.format(model=model.__name__)}}
                responses["200"]["content"] = content
            for status in _errors(method, path, "requestBody" in operation):
                responses[str(status)] = {"description": _WHY[status], "content": error_content}
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    ctx = getattr(app.state, "ctx", None)
    if ctx is not None:  # the one model served: any other name is a 404
        for name in ("ChatCompletionRequest", "CompletionRequest", "TokenizeRequest",
                     "DetokenizeRequest", "ResponsesRequest",
                     *(m.__name__ for m in extra_bodies)):
            properties = components.get(name, {}).get("properties", {})
            if "model" in properties:
                properties["model"]["anyOf"] = [{"const": ctx.model_name}, {"type": "null"}]
    return schema


def install_openapi(app: FastAPI) -> None:
    """``app.openapi()`` (served at /openapi.json) returns the rewritten document."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
