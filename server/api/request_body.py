"""Request bodies parsed and validated on a worker, not on the event loop.

FastAPI parses a declared body on the loop: 300,000 chat messages (10 MB) took 1.6 s there.
The routes that take big bodies read the bytes instead and hand them to ``parse_body``,
which answers exactly as FastAPI would (the same 400s through the same handlers). Their
OpenAPI schema is declared with ``body_schema``.
"""

from __future__ import annotations

import email.message
import json
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, RootModel, ValidationError

from server.api.workers import BIG_REQUEST_BYTES, PreprocessPool

M = TypeVar("M", bound=BaseModel)
# A body this small parses on the loop: at most ~0.2 ms (50 chat messages took 0.06 ms), less
# than the hop to a worker costs, and it leaves a request one hop (its prompt's build and
# the engine's checks, see server/engine/inputs.py). Anything larger goes to the pool.
INLINE_PARSE_BYTES = 8 << 10
_REF = "#/components/schemas/{model}"


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` of a route whose body ``parse_body`` reads (the model's schema is
    added to the document's components by server/api/openapi.py)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": _REF.format(model=model.__name__)}}}}}


def _is_json(content_type: str | None) -> bool:
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json"))


def _decode(raw: bytes, model: type[M], precheck: Callable[[Any], None] | None) -> M:
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", exc.pos),
                                       "msg": "JSON decode error", "input": {},
                                       "ctx": {"error": exc.msg}}]) from None
    except UnicodeDecodeError:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", 0),
                                       "msg": "JSON decode error", "input": {},
                                       "ctx": {"error": "invalid UTF-8"}}]) from None
    if precheck is not None:
        precheck(data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        # a root model's errors start with the union member's tag (InvocationRequest: "chat"
        # or "completion"): the client's field comes after it
        skip = 1 if issubclass(model, RootModel) else 0
        raise RequestValidationError(
            [dict(e, loc=("body", *e["loc"][skip:])) for e in exc.errors()]) from None


async def parse_body(request: Request, model: type[M], pool: PreprocessPool, client: str,
                     precheck: Callable[[Any], None] | None = None) -> M:
    """The body as ``model``, parsed on a worker of ``pool`` in ``client``'s share (on the
    loop when it is under ``INLINE_PARSE_BYTES``).
    ``precheck`` sees the parsed JSON first: a cheap refusal (too many messages) before the
    expensive validation."""
    raw = await request.body()
    if not raw:
        raise RequestValidationError([{"type": "missing", "loc": ("body",),
                                       "msg": "Field required", "input": None}])
    if not _is_json(request.headers.get("content-type")):
        raise RequestValidationError([{
            "type": "model_attributes_type", "loc": ("body",),
            "msg": "Input should be a valid dictionary or object to extract fields from",
            "input": "<bytes>"}])
    if len(raw) < INLINE_PARSE_BYTES:
        return _decode(raw, model, precheck)
    try:
        return await pool.run(client, _decode, raw, model, precheck)
    finally:
        if len(raw) >= BIG_REQUEST_BYTES:
            pool.trim_soon()
