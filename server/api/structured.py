"""Request fields that constrain the output, in OpenAI's and vLLM's forms, turned into the
engine's one :class:`StructuredOutputsParams`.

OpenAI: ``response_format`` ``{"type": "text" | "json_object" | "json_schema"}``. vLLM:
``structured_outputs`` ``{"json" | "json_object" | "regex" | "choice" | "grammar"}`` and the
older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``. At most one
may be given; an invalid schema, regex or grammar is a 400 naming the field (the engine
compiles it).
"""

from __future__ import annotations

from typing import Any

from server.api.errors import APIError
from server.api.protocol import ResponseFormat, StructuredOutputsRequest
from server.engine.sampling_params import StructuredOutputsParams


def structured_outputs_of(req: Any) -> StructuredOutputsParams | None:
    """The request's one constraint, or None; 400 when several are given or one is empty."""
    given: list[tuple[str, dict[str, Any]]] = []
    fmt: ResponseFormat | None = getattr(req, "response_format", None)
    if fmt is not None and fmt.type == "json_object":
        given.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise APIError(400, "response_format: json_schema needs a schema",
                           "response_format.json_schema")
        given.append(("response_format", {"json_schema": fmt.json_schema.json_schema}))
    legacy = (("guided_json", "json_schema"), ("guided_regex", "regex"),
              ("guided_choice", "choice"), ("guided_grammar", "grammar"))
    for name, key in legacy:
        value = getattr(req, name, None)
        if value is not None:
            given.append((name, {key: value}))
    so: StructuredOutputsRequest | None = getattr(req, "structured_outputs", None)
    if so is not None:
        spec = so.model_dump(exclude_none=True)
        if spec.get("json_object") is False:
            del spec["json_object"]
        if spec:
            given.append(("structured_outputs", spec))
    if not given:
        return None
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise APIError(400, f"at most one output constraint per request, got {names}",
                       given[1][0])
    field, spec = given[0]
    try:
        return StructuredOutputsParams(field=field, **spec)
    except ValueError as exc:
        raise APIError(400, f"{field}: {_first_error(exc)}", field) from None


def _first_error(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        first = errors()[0]
        return str(first.get("msg", exc))
    return str(exc)
