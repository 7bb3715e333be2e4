"""One chat completion's text read back as OpenAI's assistant message: the reasoning
(``--reasoning-parser``) split from the answer, and tool calls (forced by ``tool_choice``, or
found by ``--tool-call-parser``) split from the content; whole or delta by delta.

Streaming and whole reading agree: the deltas of a completion concatenate to its whole
reading (the parsers guarantee it for any split of the text into deltas).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from server.api.reasoning_parsers import ReasoningParser, get_reasoning_parser
from server.api.tool_parsers import (
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    get_tool_parser,
)
from server.api.tools import ForcedCallStream, ToolPlan, forced_calls
from server.config import ChatOptions


def chat_parsers(options: ChatOptions
                 ) -> tuple[type[ToolParser] | None, type[ReasoningParser] | None]:
    """The parser classes ``--tool-call-parser`` and ``--reasoning-parser`` name;
    ``ValueError`` listing the known names for an unknown one (checked at start-up)."""
    tools = get_tool_parser(options.tool_call_parser) if options.tool_call_parser else None
    reasoning = (get_reasoning_parser(options.reasoning_parser) if options.reasoning_parser
                 else None)
    return tools, reasoning


@dataclass(slots=True)
class MessageParts:
    """What an assistant message (or one stream delta of it) carries."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(slots=True)
class DeltaParts:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class ChoiceReader:
    """Reads one completion (one choice of ``n``); stateful when streaming."""

    def __init__(self, plan: ToolPlan, reasoning: type[ReasoningParser] | None) -> None:
        self.plan = plan
        self._reasoning = reasoning() if reasoning is not None else None
        self._parser: ToolParser | None = plan.parser() if plan.mode == "auto" and \
            plan.parser is not None else None
        self._forced = ForcedCallStream(plan) if plan.forced else None
        self._called = False

    @property
    def called(self) -> bool:
        """Whether the completion called a tool (its finish_reason is then "tool_calls")."""
        return self._called

    def whole(self, text: str) -> MessageParts:
        reasoning, content = (self._reasoning.split(text) if self._reasoning is not None
                              else (None, text))
        parts = MessageParts(reasoning or "", content or "")
        if self.plan.forced:
            parts.tool_calls = forced_calls(self.plan, parts.content)
            if parts.tool_calls:
                parts.content = ""
        elif self._parser is not None:
            found = self._parser.extract(parts.content)
            parts.content = found.content or ""
            parts.tool_calls = found.tool_calls[:None if self.plan.parallel else 1]
        self._called = bool(parts.tool_calls)
        return parts

    def feed(self, delta: str) -> DeltaParts:
        reasoning, content = (self._reasoning.feed(delta) if self._reasoning is not None
                              else ("", delta))
        return self._tools(reasoning, content, final=False)

    def finish(self) -> DeltaParts:
        reasoning, content = (self._reasoning.finish() if self._reasoning is not None
                              else ("", ""))
        return self._tools(reasoning, content, final=True)

    def _tools(self, reasoning: str, content: str, final: bool) -> DeltaParts:
        if self._forced is not None:
            out = self._forced.feed(content) if content else StreamDelta()
            if final:  # a named call with empty output still gets its name sent
                out.tool_calls += self._forced.finish().tool_calls
            self._called = self._called or self._forced.called
            return DeltaParts(reasoning, "", out.tool_calls)
        if self._parser is None:
            return DeltaParts(reasoning, content)
        out = self._parser.feed(content) if content else StreamDelta()
        if final:
            tail = self._parser.finish()
            out = StreamDelta(out.content + tail.content, out.tool_calls + tail.tool_calls)
        calls = [c for c in out.tool_calls if self.plan.parallel or c.index == 0]
        self._called = self._called or bool(calls)
        return DeltaParts(reasoning, out.content, calls)
