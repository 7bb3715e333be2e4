"""OpenAI tool calling: what ``tools`` / ``tool_choice`` ask of a chat request, and how a
forced call's output (``required`` or a named function) becomes ``tool_calls``.

``auto`` lets the model decide and reads its calls back with the ``--tool-call-parser``.
``required`` and a named function are enforced with structured outputs, so the model can
only write valid calls: a named function's output is its arguments object (the function's
``parameters`` schema); ``required`` writes a JSON array of ``{"name", "parameters"}``
objects, one per call (at most one without ``parallel_tool_calls``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from server.api.errors import APIError
from server.api.protocol import ChatCompletionRequest, NamedToolChoice
from server.api.tool_parsers import StreamDelta, ToolCall, ToolCallDelta, ToolParser
from server.api.tool_parsers._json import _Json
from server.config import ChatOptions
from server.engine.sampling_params import StructuredOutputsParams

ToolMode = Literal["none", "auto", "required", "named"]

# A function without ``parameters`` takes none (OpenAI's reading).
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How one chat request uses its tools."""

    mode: ToolMode = "none"
    tools: list[dict[str, Any]] | None = None  # for the chat template
    forced_name: str | None = None  # the named function
    constraint: StructuredOutputsParams | None = None  # required / named
    parser: type[ToolParser] | None = None  # auto
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


def plan_tools(req: ChatCompletionRequest, options: ChatOptions,
               parser: type[ToolParser] | None) -> ToolPlan:
    """The request's :class:`ToolPlan`; 400 naming ``tool_choice`` / ``tools`` for a choice
    that cannot be served."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"  # OpenAI's default
    if not tools:
        if choice in ("none", "auto"):
            return ToolPlan()
        raise APIError(400, "tool_choice needs tools: the request defines none", "tool_choice")
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, "tools: function names must be unique", "tools")
    if choice == "none":
        return ToolPlan(tools=tools)  # the template still sees them, as vLLM does
    if choice == "auto":
        if not options.enable_auto_tool_choice or parser is None:
            raise APIError(400, 'tool_choice "auto" needs the server started with '
                                "--enable-auto-tool-choice and --tool-call-parser; send "
                                'tool_choice "required", a named function or "none"',
                           "tool_choice")
        return ToolPlan("auto", tools, parser=parser, parallel=req.parallel_tool_calls)
    params = {t["function"]["name"]: t["function"].get("parameters") or _NO_PARAMETERS
              for t in tools}
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in params:
            raise APIError(400, f"tool_choice names function {name!r}, which is not among "
                                "the request's tools", "tool_choice")
        return ToolPlan("named", tools, forced_name=name,
                        constraint=_constraint(params[name]), parallel=False)
    calls: dict[str, Any] = {
        "type": "array", "minItems": 1,
        "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"const": name},
                                              "parameters": schema},
             "required": ["name", "parameters"], "additionalProperties": False}
            for name, schema in params.items()]},
    }
    if not req.parallel_tool_calls:
        calls["maxItems"] = 1
    return ToolPlan("required", tools, constraint=_constraint(calls),
                    parallel=req.parallel_tool_calls)


def _constraint(schema: dict[str, Any]) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=schema, field="tools")


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: a call's ``arguments`` as an object (OpenAI
    sends JSON text; templates write ``arguments | tojson``)."""
    out = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if calls:
            converted = []
            for j, call in enumerate(calls):
                function = dict(call["function"])
                try:
                    function["arguments"] = json.loads(function.get("arguments") or "{}")
                except json.JSONDecodeError:
                    raise APIError(400, "a tool call's arguments must be JSON text",
                                   f"messages.{i}.tool_calls.{j}.function.arguments") from None
                converted.append({**call, "function": function})
            message = {**message, "tool_calls": converted}
        out.append(message)
    return out


def forced_calls(plan: ToolPlan, text: str) -> list[ToolCall]:
    """The calls in a forced choice's output; none when it is not valid (cut by max_tokens)."""
    if plan.mode == "named":
        assert plan.forced_name is not None
        return [ToolCall(plan.forced_name, text.strip())]
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return []
    return [ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False))
            for item in items]


@dataclass(slots=True)
class ForcedCallStream:
    """Streams a forced choice's calls as OpenAI ``delta.tool_calls``: a named function's
    arguments fragment by fragment as the model writes them; ``required`` calls one by one,
    each as soon as its object in the array is complete (the tool parsers' JSON scanner
    finds where)."""

    plan: ToolPlan
    _text: str = ""
    _scanner: _Json = field(default_factory=_Json)
    _count: int = 0
    _broken: bool = False

    def feed(self, delta: str) -> StreamDelta:
        if self.plan.mode == "named":
            out = []
            if self._count == 0:
                self._count = 1
                assert self.plan.forced_name is not None
                call = ToolCall(self.plan.forced_name, "")
                out.append(ToolCallDelta(0, call.id, call.name, ""))
            if delta:
                out.append(ToolCallDelta(0, arguments=delta))
            return StreamDelta(tool_calls=out)
        out = []
        for ch in delta:
            if self._broken:
                break
            if not self._scanner.push(ch):  # not JSON (the grammar rules it out): stop
                self._broken = True
                break
            self._text += ch  # the scanner's offsets count the characters it took
            if self._scanner.ended is not None:  # an item of the array just closed
                start, end = self._scanner.ended
                self._scanner.ended = None
                item = json.loads(self._text[start:end])
                call = ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False))
                out.append(ToolCallDelta(self._count, call.id, call.name, call.arguments))
                self._count += 1
        return StreamDelta(tool_calls=out)

    def finish(self) -> StreamDelta:
        return self.feed("")

    @property
    def called(self) -> bool:
        return self._count > 0
