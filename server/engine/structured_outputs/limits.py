"""What a request may ask the server to compile: a constraint's text, checked against the caps
of ``--max-grammar-bytes`` and ``--max-grammar-alternatives`` before any compilation, and the
grammar library's errors made fit for a client (no internal source paths).

Torch-free and xgrammar-free: the compile workers (``compile_worker``) import it too.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from server.engine.errors import RequestError

if TYPE_CHECKING:
    from server.config import StructuredOutputsConfig
    from server.engine.sampling_params import StructuredOutputsParams

# OpenAI's json_object mode: an object (xgrammar's builtin JSON grammar would allow any value)
JSON_OBJECT_SCHEMA = '{"type": "object"}'
# Schema keywords whose list items are alternatives to each other (each adds a branch to
# the grammar, and enum values make the widest token masks)
ALTERNATIVE_KEYWORDS = ("enum", "anyOf", "oneOf")
# Longest error text passed on from the grammar library (it may echo a whole schema)
MAX_ERROR_CHARS = 400


class GrammarKind(str, enum.Enum):
    """Which xgrammar entry point compiles a source."""

    JSON_SCHEMA = "JSON schema"
    REGEX = "regex"
    EBNF = "grammar"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class GrammarSource:
    """One constraint as text: what is compiled, and the key of the compiled-grammar cache
    (a choice list is a regex, json_object a fixed schema)."""

    kind: GrammarKind
    text: str


def source_of(spec: StructuredOutputsParams) -> GrammarSource:
    """The text to compile for ``spec`` (no checks: see :func:`checked_source`)."""
    if spec.json_schema is not None:
        schema = spec.json_schema
        return GrammarSource(GrammarKind.JSON_SCHEMA,
                             schema if isinstance(schema, str) else json.dumps(schema))
    if spec.json_object:
        return GrammarSource(GrammarKind.JSON_SCHEMA, JSON_OBJECT_SCHEMA)
    if spec.regex is not None:
        return GrammarSource(GrammarKind.REGEX, spec.regex)
    if spec.choice is not None:
        return GrammarSource(GrammarKind.REGEX, "|".join(re.escape(c) for c in spec.choice))
    assert spec.grammar is not None
    return GrammarSource(GrammarKind.EBNF, spec.grammar)


def checked_source(spec: StructuredOutputsParams,
                   limits: StructuredOutputsConfig) -> GrammarSource:
    """The text to compile, once ``spec`` is within the caps and parses: else a
    :class:`RequestError` naming the request field and the flag. Cost: linear in the size of
    the constraint, and the size is checked first where it is known without parsing."""
    field = spec.field
    if spec.choice is not None:
        _check_count(field, "choice", len(spec.choice), limits)
        # the choices as they arrived (the regex adds escapes the client did not write)
        _check_bytes(field, "choice list",
                     sum(len(c.encode()) for c in spec.choice), limits)
    elif isinstance(spec.json_schema, str):
        _check_bytes(field, "JSON schema", len(spec.json_schema.encode()), limits)
        try:
            _check_count(field, "JSON schema", count_alternatives(json.loads(spec.json_schema)),
                         limits)
        except json.JSONDecodeError as exc:
            raise RequestError(f"{field}: invalid JSON schema: {exc}", field) from None
        except RecursionError:
            raise RequestError(f"{field}: the JSON schema is nested too deeply", field) from None
    elif spec.json_schema is not None:
        _check_count(field, "JSON schema", count_alternatives(spec.json_schema), limits)
    try:
        source = source_of(spec)
    except RecursionError:  # json.dumps of a dict nested thousands deep
        raise RequestError(f"{field}: the JSON schema is nested too deeply", field) from None
    if spec.choice is None:
        _check_bytes(field, str(source.kind), len(source.text.encode()), limits)
    if source.kind is GrammarKind.REGEX and spec.regex is not None:
        try:
            re.compile(spec.regex)  # Python's message is clearer than the compiler's
        except (re.error, RecursionError, OverflowError) as exc:
            raise RequestError(f"{field}: invalid regex: {exc}", field) from None
    return source


def count_alternatives(schema: Any) -> int:
    """Enum values and anyOf/oneOf branches over the whole schema, definitions included
    (iterative: a deeply nested schema must not exhaust the Python stack)."""
    total = 0
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ALTERNATIVE_KEYWORDS and isinstance(value, list):
                    total += len(value)
                if isinstance(value, (dict, list)):
                    stack.append(value)
        elif isinstance(node, list):
            stack.extend(item for item in node if isinstance(item, (dict, list)))
    return total


def _check_bytes(field: str, what: str, size: int, limits: StructuredOutputsConfig) -> None:
    if size > limits.max_bytes:
        raise RequestError(
            f"{field}: the {what} is {size} bytes, more than the server's limit of "
            f"{limits.max_bytes} (--max-grammar-bytes)", field)


def _check_count(field: str, what: str, count: int, limits: StructuredOutputsConfig) -> None:
    if count > limits.max_alternatives:
        items = "entries" if what == "choice" else "alternatives (enum values, anyOf/oneOf branches)"
        raise RequestError(
            f"{field}: the {what} has {count} {items}, more than the server's limit of "
            f"{limits.max_alternatives} (--max-grammar-alternatives)", field)


# "[12:54:35] /project/cpp/json_schema_converter.cc:4944: " and the like: where in the
# library's C++ the error was raised, which tells a client nothing
_SOURCE_LOCATION = re.compile(r"\[\d{1,2}:\d{2}:\d{2}\]\s*|(?:[\w.-]*[/\\])+[\w.-]+\.\w+:\d+:?\s*")
_CHECK_FAILED = re.compile(r"Check failed: \(.*?\) is false:\s*")


def client_message(error: BaseException | str) -> str:
    """A grammar library error for a client: no source locations, no traceback, one line,
    bounded length; the library's own explanation kept."""
    text = str(error)
    if "Traceback" in text:  # keep what the library said, not where it said it
        text = text.strip().splitlines()[-1]
    text = _CHECK_FAILED.sub("", _SOURCE_LOCATION.sub("", text))
    text = " ".join(text.split())
    if len(text) > MAX_ERROR_CHARS:
        text = text[:MAX_ERROR_CHARS] + "..."
    if not text:
        return type(error).__name__ if isinstance(error, BaseException) else "invalid"
    return text
